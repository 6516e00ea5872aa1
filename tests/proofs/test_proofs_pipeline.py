"""Pipeline parallel's rows of ``pdgate prove`` (proofs/pipeline.py): every verdict as
expected, each release's break exported as a minimal trace ``pdgate validate`` replays,
strict proved by the same queries that refute the releases, and the mutants killed."""
import json
import re

import pytest

from tests.proofs.rows import prove_rows

from model.encoding.pipeline import preserves_pp
from model.spec.pipeline import PP_VARIANTS
from model.spec.validate import validate_any
from proofs.mutants import PIPELINE_MUTANTS, run_all
from proofs.pipeline import POINT_BREAKS, RESTRICTIONS, pipeline_obligations


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return prove_rows(tmp_path_factory.mktemp("pp"), PP_VARIANTS)


def test_every_pipeline_row_is_as_expected(rows):
    assert len(rows) == len(pipeline_obligations()) >= 56
    assert [r for r in rows if r["result"] != r["expected"]] == []


def test_strict_is_proved_unbounded_and_the_releases_are_not(rows):
    by = {(r["obligation"], r["variant"]): r for r in rows}
    for name in ("pp-strict", "pp-prefill-strict"):
        row = by[("safety:pp_agree", name)]
        assert row["unbounded"] and "any number of stages, ranks and requests" in row["detail"]
    releases = ("pp-0.5.12", "pp-0.5.13", "pp-0.5.23", "pp-prefill-0.5.12", "pp-prefill-0.5.18")
    for name in releases:
        assert by[("induction:pp_agree", name)]["detail"].startswith("CTI at stages=2")
    # with no poll Failed and every metadata row landed, each decode release agrees; a
    # late row alone breaks 0.5.12 (its commit) and 0.5.13 on (the gated second MIN)
    for name in releases[:3]:
        assert by[("safety:pp_agree_landed", name)]["result"] == "proved"
        assert "unlanded" in by[("induction:pp_agree_no_failure", name)]["detail"]
    # prefill with a buffer everywhere: the consensus applied (0.5.18) agrees, each
    # stage's own second poll (0.5.12) does not
    assert by[("safety:pp_agree_buffers", "pp-prefill-0.5.18")]["result"] == "proved"
    assert by[("induction:pp_agree_buffers", "pp-prefill-0.5.12")]["result"] == "not inductive"
    # where each release breaks, point by point: its pop on a stage's own value (and 0.5.18's
    # uncovered MIN if a poll turned Failed after the ring), never the ring or the hold MAX
    broken = {(r["obligation"].split(":")[-1], r["variant"]) for r in rows
              if r["obligation"].startswith("induction:point:")}
    assert broken == {(p, v) for v, ps in POINT_BREAKS.items() for p in ps}
    assert by[("safety:point:defer_release", "pp-0.5.23")]["result"] == "proved"


def test_every_trace_replays_with_its_claim_confirmed_and_is_minimal(rows):
    traced = [r for r in rows if r.get("trace")]
    assert len(traced) == len([o for o in pipeline_obligations() if o.obligation.split(":")[0] in ("cex", "nonvacuous")])
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
    for name in ("pp-0.5.12", "pp-0.5.13", "pp-0.5.23"):     # one stage-rank each, one request, one iteration
        assert "2 stages T=1 N=1, 1 iterations" in by[("cex:stages_agree", name)]["detail"]
    for cex, name in (("gated_min", "pp-0.5.13"), ("commit_veto", "pp-0.5.12")):
        lines = open(by[(f"cex:{cex}", name)]["trace"], encoding="utf-8").readlines()
        assert 0 not in [x for line in lines[1:-2] for row in json.loads(line)["inputs"]["transfer"] for x in row]
    # 0.5.12: the commit keeps the request on one TP rank, the next ring MINs 0 against 1
    empty = by[("cex:empty_min", "pp-0.5.12")]
    assert "2 stages T=2 N=1, 2 iterations" in empty["detail"]
    last = json.loads(open(empty["trace"], encoding="utf-8").readlines()[-3])["records"]
    assert {tuple(rec[0]) for rec in last} == {("transfer_consensus", "min", 0), ("transfer_consensus", "min", 1)}
    shifted = by[("cex:positions_shifted", "pp-prefill-0.5.23")]["detail"]
    assert re.search(r"position \d is request \d on stage 0, request \d on stage 1", shifted), shifted


def test_the_same_query_says_no_for_the_releases_and_yes_for_strict():
    assert preserves_pp(PP_VARIANTS["pp-strict"]).result.status == "unsat"
    assert preserves_pp(PP_VARIANTS["pp-0.5.13"], universe=(2, 1, 1)).result.status == "sat"
    assert preserves_pp(PP_VARIANTS["pp-0.5.13"], excluded=RESTRICTIONS["landed"]).result.status == "unsat"
    assert preserves_pp(PP_VARIANTS["pp-0.5.13"], universe=(2, 1, 1),
                        excluded=RESTRICTIONS["no_failure"]).result.status == "sat"
    assert preserves_pp(PP_VARIANTS["pp-prefill-0.5.18"], excluded=RESTRICTIONS["buffers"]).result.status == "unsat"
    assert preserves_pp(PP_VARIANTS["pp-prefill-0.5.12"], universe=(2, 1, 1),
                        excluded=RESTRICTIONS["buffers"]).result.status == "sat"


def test_the_pipeline_mutants_are_killed_by_the_rows_they_name():
    got = {r.name: r for r in run_all([m.name for m in PIPELINE_MUTANTS])}
    for m in PIPELINE_MUTANTS:
        assert got[m.name].killed and got[m.name].caught_by == list(m.first), got[m.name]
        assert got[m.name].checked == 1, got[m.name]          # the first row it tries


@pytest.mark.parametrize("variant", ["pp-0.5.13", "pp-strict", "pp-prefill-0.5.18"])
def test_refinement_holds_on_more_samples_than_prove_runs(monkeypatch, tmp_path, variant):
    import proofs.pipeline as pipeline
    from proofs.obligations import Settings
    monkeypatch.setattr(pipeline, "REFINE_SAMPLES", 6)
    ob = next(o for o in pipeline_obligations() if o.obligation == "refines:pipeline" and o.variant == variant)
    out = ob.check(ob, Settings(tmp_path))
    assert out.result == "proved" and out.detail.startswith("14 states"), out.detail
