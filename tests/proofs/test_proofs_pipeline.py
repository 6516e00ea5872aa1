"""Pipeline parallel's rows of ``pdgate prove`` (proofs/pipeline.py): every verdict as
expected, each release's break exported as a minimal trace ``pdgate validate`` replays,
strict proved by the same queries that refute the releases, and the mutants killed."""
import json
import re

import pytest

from tests.proofs.rows import prove_rows

from model.cli import main
from model.encoding.pipeline import preserves_pp
from model.spec.pipeline import PP_VARIANTS
from model.spec.validate import validate_any
from proofs.mutants import PIPELINE_MUTANTS, run_all
from proofs.pipeline import BREAKS, pipeline_obligations


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return prove_rows(tmp_path_factory.mktemp("pp"), PP_VARIANTS)


def test_every_pipeline_row_is_as_expected(rows):
    assert len(rows) == len(pipeline_obligations()) >= 18
    assert [r for r in rows if r["result"] != r["expected"]] == []


def test_strict_is_proved_unbounded_and_the_releases_are_not(rows):
    by = {(r["obligation"], r["variant"]): r for r in rows}
    for name in ("pp-strict", "pp-prefill-strict"):
        row = by[("safety:pp_agree", name)]
        assert row["unbounded"] and "any number of stages, ranks and requests" in row["detail"]
    for name in ("pp-0.5.12", "pp-0.5.13"):
        assert by[("induction:pp_agree", name)]["detail"].startswith("CTI at stages=2")
    # only the ring's 'finished' breaks 0.5.12; the gated second MIN breaks 0.5.13 alone
    assert by[("safety:pp_agree_no_failure", "pp-0.5.12")]["result"] == "proved"
    assert "unlanded" in by[("induction:pp_agree_no_failure", "pp-0.5.13")]["detail"]


def test_every_trace_replays_with_its_claim_confirmed_and_is_minimal(rows):
    traced = [r for r in rows if r.get("trace")]
    assert len(traced) == sum(len(b) for b in BREAKS.values()) + 1 + 1 + 2   # + gated_min, shifted, 2 witnesses
    for r in traced:
        lines = open(r["trace"], encoding="utf-8").readlines()
        res = validate_any(lines, None)
        assert res.ok, (r["trace"], res.message)
        claims = [json.loads(x)["invariant"] for x in lines if '"kind":"violation"' in x]
        assert [c.invariant for c in res.claims] == claims
        header = json.loads(lines[0])
        assert header["stages"] == 2
        if r["expected"] == "proved":
            assert claims == [] and res.first_violation is None
    by = {(r["obligation"], r["variant"]): r for r in rows}
    for name in ("pp-0.5.12", "pp-0.5.13"):     # one stage-rank each, one request, one iteration
        assert "2 stages T=1 N=1, 1 iterations" in by[("cex:stages_agree", name)]["detail"]
    gated = open(by[("cex:gated_min", "pp-0.5.13")]["trace"], encoding="utf-8").readlines()
    polls = [x for line in gated[1:-2] for row in json.loads(line)["inputs"]["transfer"] for x in row]
    assert 0 not in polls
    shifted = by[("cex:positions_shifted", "pp-prefill-0.5.23")]["detail"]
    assert re.search(r"position \d is request \d on stage 0, request \d on stage 1", shifted), shifted


def test_the_same_query_says_no_for_the_releases_and_yes_for_strict():
    assert preserves_pp(PP_VARIANTS["pp-strict"]).result.status == "unsat"
    assert preserves_pp(PP_VARIANTS["pp-0.5.13"], universe=(2, 1, 1)).result.status == "sat"
    assert preserves_pp(PP_VARIANTS["pp-0.5.12"], no_failed="transfer").result.status == "unsat"
    assert preserves_pp(PP_VARIANTS["pp-0.5.13"], universe=(2, 1, 1), no_failed="transfer").result.status == "sat"


def test_the_pipeline_mutants_are_killed_by_the_rows_they_name():
    # the three whose unbounded query times out (~20 s) first run in test_proofs_mutants.py
    slow = ("pp-strict-per-stage", "pp-0.5.12-no-ring", "pp-prefill-strict-buffer-veto")
    quick = [m.name for m in PIPELINE_MUTANTS if m.name not in slow]
    got = {r.name: r for r in run_all(quick)}
    for m in PIPELINE_MUTANTS:
        if m.name in quick:
            assert got[m.name].killed and got[m.name].caught_by == list(m.first), got[m.name]


@pytest.mark.parametrize("variant", ["pp-0.5.13", "pp-strict"])
def test_refinement_holds_on_more_samples_than_prove_runs(monkeypatch, tmp_path, variant):
    import proofs.pipeline as pipeline
    from proofs.obligations import Settings
    monkeypatch.setattr(pipeline, "REFINE_SAMPLES", 6)
    ob = next(o for o in pipeline_obligations() if o.obligation == "refines:pipeline" and o.variant == variant)
    out = ob.check(ob, Settings(tmp_path))
    assert out.result == "proved" and out.detail.startswith("14 states"), out.detail
