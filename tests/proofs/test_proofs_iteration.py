"""The decode iteration's rows of ``pdgate prove`` (proofs/agreement.py): every verdict
as expected, each broken release refuted by a trace ``pdgate validate`` replays, strict
proved with the same queries that refute the releases, and its mutants killed."""
import json

import pytest

from tests.proofs.rows import prove_rows

from model.cli import main
from model.encoding.iteration import decides_agreed, preserves
from model.spec.iteration import ITER_VARIANTS
from model.spec.validate import validate_any
from proofs.agreement import BREAKS, iteration_obligations
from proofs.mutants import ITERATION_MUTANTS, run_all


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return prove_rows(tmp_path_factory.mktemp("iter"), ITER_VARIANTS)


def test_every_iteration_row_is_as_expected(rows):
    assert len(rows) == len(iteration_obligations())
    assert [r for r in rows if r["result"] != r["expected"]] == []


def test_strict_is_proved_whole_and_point_by_point(rows):
    strict = {r["obligation"]: r for r in rows if r["variant"] == "iter-strict"}
    assert strict["safety:collectives_agree"]["result"] == "proved" and strict["safety:collectives_agree"]["unbounded"]
    assert "by induction, every iteration" in strict["safety:collectives_agree"]["detail"]
    assert strict["safety:no_local_decision_after_min"]["result"] == "proved"
    assert all(strict[f"safety:point:{p.name}"]["result"] == "proved" for p in ITER_VARIANTS["iter-strict"].points)


def test_each_broken_point_has_a_cti_and_a_trace_whose_first_break_is_there(rows):
    by = {(r["obligation"], r["variant"]): r for r in rows}
    for variant, points in BREAKS.items():
        for p in points:
            neg = by[(f"induction:point:{p}", variant)]
            assert neg["result"] == "not inductive" and neg["detail"].startswith("CTI at T=")
            cex = by[(f"cex:point:{p}", variant)]
            lines = open(cex["trace"], encoding="utf-8").readlines()
            res = validate_any(lines, None)
            assert res.ok, res.message
            assert [c.invariant for c in res.claims][0] in ("collectives_agree", "stages_agree")


def test_every_counterexample_trace_replays_with_its_claim_confirmed(rows):
    traced = [r for r in rows if r.get("trace")]
    assert len(traced) >= 20
    for r in traced:
        lines = open(r["trace"], encoding="utf-8").readlines()
        res = validate_any(lines, None)
        assert res.ok, (r["trace"], res.message)
        claims = [json.loads(x)["invariant"] for x in lines if '"kind":"violation"' in x]
        assert [c.invariant for c in res.claims] == claims
        if r["obligation"] in ("cex:collectives_agree", "cex:no_local_decision_after_min"):
            assert claims == [r["obligation"].split(":")[1]]
        if r["expected"] == "proved":
            assert claims == [] and res.first_violation is None


def test_the_releases_break_collectives_agree_in_the_first_iteration_with_one_request(rows):
    for r in rows:
        if r["obligation"] == "cex:collectives_agree":
            header = json.loads(open(r["trace"], encoding="utf-8").readline())
            assert (header["ranks"], header["requests"]) == (2, 1)
            assert "T=2 N=1, 1 iterations" in r["detail"], r["detail"]


def test_the_same_queries_say_no_for_the_releases_and_yes_for_strict():
    """The non-vacuity sibling of every unbounded row: one query function, both answers."""
    strict, rel = ITER_VARIANTS["iter-strict"], ITER_VARIANTS["iter-0.5.23"]
    upto = lambda v: v.points[:[p.name for p in v.points].index("admission") + 1]
    assert preserves(strict, upto(strict)).result.status == "unsat"     # broadcast to admission
    assert preserves(rel, upto(rel), universe=(2, 1)).result.status == "sat"   # 0.5.23's is local
    hold = lambda v: [p for p in v.points if p.name == "defer_release"]
    assert preserves(rel, hold(rel)).result.status == "unsat"                  # 0.5.23's MAX agrees the holds
    v21 = ITER_VARIANTS["iter-0.5.21"]
    assert preserves(v21, hold(v21), universe=(2, 1)).result.status == "sat"
    transfer = lambda v: next(p for p in v.points if p.name == "transfer_poll")
    assert decides_agreed(strict, transfer(strict)).result.status == "unsat"
    assert decides_agreed(rel, transfer(rel), universe=(2, 1)).result.status == "sat"


def test_the_whole_iteration_rows_compose_the_points_and_name_the_first_breaking_one(rows):
    by = {(r["obligation"], r["variant"]): r for r in rows}
    n = len(ITER_VARIANTS["iter-strict"].points)
    assert by[("safety:collectives_agree", "iter-strict")]["detail"].startswith(f"every point ({n}), composed")
    for variant, first in (("iter-0.5.19", "deferred_release"), ("iter-0.5.23", "admission"),
                           ("prefill-0.5.18", "bootstrap_poll")):
        assert f", at {first}:" in by[("induction:collectives_agree", variant)]["detail"], variant
        assert first == BREAKS[variant][0]


def test_iteration_mutants_are_killed_by_the_rows_they_name():
    names = ["iter-strict-admission-local", "iter-encoding-min-no-witness", "iter-strict-hold-local",
             "agreement-local-flag-ignored", "iter-0.5.21-host-release-local", "iter-encoding-broadcast-own",
             "agreement-halt-ignored"]
    got = {r.name: r for r in run_all(names)}
    for m in ITERATION_MUTANTS:
        if m.name in names:
            assert got[m.name].killed and got[m.name].caught_by == list(m.first), got[m.name]


@pytest.mark.parametrize("variant", ["iter-strict", "iter-0.5.21", "prefill-0.5.12"])
def test_refinement_holds_on_more_samples_than_prove_runs(monkeypatch, tmp_path, variant):
    import proofs.agreement as agreement
    from proofs.obligations import Settings
    monkeypatch.setattr(agreement, "REFINE_SAMPLES", 8)
    ob = next(o for o in iteration_obligations() if o.obligation == "refines:iteration" and o.variant == variant)
    out = ob.check(ob, Settings(tmp_path))
    assert out.result == "proved" and out.detail.startswith("16 random states"), out.detail
