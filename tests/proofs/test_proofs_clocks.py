"""Per-rank clocks' rows of ``pdgate prove`` (proofs/clocks.py): every verdict as
expected, strict proved by the queries that refute the releases, each refutation a
trace ``pdgate validate`` replays, the encoding refining the spec, the mutants killed."""
import json
import random

import pytest

from tests.proofs.rows import prove_rows

from model.encoding.clocks import bounded_wait_inductive, preserves_clocked, refines_clocked
from model.spec.clocks import CLOCK_VARIANTS, clock_step
from model.spec.validate import validate_any
from proofs.clocks import CLOCK_BREAKS, UNBOUNDED_WAIT, clock_obligations, random_case
from proofs.mutants import CLOCK_MUTANTS, run_all


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return prove_rows(tmp_path_factory.mktemp("clocks"), CLOCK_VARIANTS)


def test_every_clock_row_is_as_expected(rows):
    assert len(rows) == len(clock_obligations())
    assert [r for r in rows if r["result"] != r["expected"]] == []


def test_strict_is_proved_unbounded_agreement_and_bounded_wait(rows):
    strict = {r["obligation"]: r for r in rows if r["variant"] == "clocks-strict"}
    for name in ("safety:clocks_agree", "liveness:bounded_wait"):
        assert strict[name]["result"] == "proved" and strict[name]["unbounded"], name
    assert "composed" in strict["safety:clocks_agree"]["detail"]
    assert "symbolic limits, any skew" in strict["liveness:bounded_wait"]["detail"]
    assert all(strict[f"safety:point:{p.name}"]["result"] == "proved"
               for p in CLOCK_VARIANTS["clocks-strict"].iter.points)
    assert {(r["obligation"], r["result"]) for r in rows if r["variant"] == "clocks-0.5.23"} >= {
        ("safety:clocks_agree", "proved"), ("cex:bounded_wait", "counterexample")}


def test_each_break_has_a_cti_and_a_minimal_trace_that_validate_replays(rows):
    by = {(r["obligation"], r["variant"]): r for r in rows}
    wanted = [(f"point:{p}", v, ("collectives_agree", "stages_agree")) for v, ps in CLOCK_BREAKS.items() for p in ps]
    wanted += [("bounded_wait", v, ("bounded_wait",)) for v in UNBOUNDED_WAIT]
    for what, variant, claims in wanted:
        assert "CTI at T=" in by[(f"induction:{what}", variant)]["detail"]
        cex = by[(f"cex:{what}", variant)]
        res = validate_any(open(cex["trace"], encoding="utf-8").readlines(), None)
        assert res.ok, res.message
        assert res.claims and res.claims[0].invariant in claims
        assert res.iterations <= 2                 # minimal: within two steps of the start


def test_the_skew_witness_replays_clean_on_strict(rows):
    (w,) = [r for r in rows if r["obligation"] == "nonvacuous:clock-skew"]
    res = validate_any(open(w["trace"], encoding="utf-8").readlines(), None)
    assert res.ok and res.first_violation is None
    step = json.loads(open(w["trace"], encoding="utf-8").readlines()[-2])
    assert step["stages"] == [[1], [1]] and 0 not in sum(step["inputs"]["poll"], [])


def test_the_same_queries_refute_the_releases():
    for name in UNBOUNDED_WAIT:
        v = CLOCK_VARIANTS[name]
        assert bounded_wait_inductive(v, universe=(2, 1), agreed_after=True).result.status == "sat"
        want = "sat" if CLOCK_BREAKS[name] else "unsat"          # 0.5.23: agreed
        assert preserves_clocked(v, universe=(2, 1)).result.status == want, name
    strict = CLOCK_VARIANTS["clocks-strict"]
    assert bounded_wait_inductive(strict, universe=(2, 1), agreed_after=True).result.status == "unsat"


def test_the_unbounded_encoding_refines_the_spec_on_more_random_states():
    rng = random.Random(19)
    for name, v in CLOCK_VARIANTS.items():
        for ranks, reqs in ((2, 1), (2, 2), (3, 2)):
            state, dt, env, limits = random_case(v, rng, ranks, reqs)
            nxt, res = clock_step(v, state, dt, env, limits)
            q = refines_clocked(v, state, dt, env, limits, [(pr.after, pr.issued) for pr in res.points],
                                (nxt.elapsed, nxt.age))
            assert q.result.status == "unsat", (name, state, dt, env, limits)


def test_every_clock_mutant_is_killed_by_the_row_it_names():
    results = run_all([m.name for m in CLOCK_MUTANTS], jobs=2)
    assert [r.name for r in results] == [m.name for m in CLOCK_MUTANTS]
    for m, r in zip(CLOCK_MUTANTS, results):
        assert r.killed and r.caught_by == list(m.first), (m.name, r.detail)
