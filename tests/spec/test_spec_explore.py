"""The explicit-state explorer (proofs/explore.py): the expected verdict per variant,
shortest counterexamples that replay through the spec and validate as traces, and its
reductions checked against a dumb BFS with none."""
from __future__ import annotations

import io
from collections import deque

import pytest

from model.spec.events import Step
from model.spec.invariants import INVARIANTS, bounded_wait, check_invariants
from model.spec.machine import apply, enabled, step
from model.spec.state import initial_state
from model.spec.trace import TraceWriter
from model.spec.validate import validate
from model.spec.variants import VARIANTS
from proofs.explore import explore, request_events

SAFE_UNDER_GATE = {"queues_identical", "exactly_once"}


def replay(variant: str, ranks: int, slots: int, events):
    s = initial_state(VARIANTS[variant], ranks, slots)
    states = [s.copy()]
    for ev in events:
        apply(s, ev)
        states.append(s.copy())
    return states


def test_strict_violates_nothing_and_is_live():
    for ranks, requests, steps, slots in [(2, 2, 4, 1), (2, 1, 6, 1), (2, 2, 2, 2), (3, 1, 5, 1)]:
        r = explore(VARIANTS["strict"], ranks, requests, steps, slots)
        assert r.complete and r.states > 50
        assert r.violations == {}, r.summary()
        assert r.liveness is None, r.summary()


@pytest.mark.parametrize("variant", ["gate", "gate-noclear"])
def test_gated_variants_keep_queues_but_not_outcomes_or_payloads(variant):
    r = explore(VARIANTS[variant], 2, 2, 2, 1)
    assert r.complete
    assert set(r.violations) == {"outcomes_agree", "no_corruption"}, r.summary()
    assert SAFE_UNDER_GATE.isdisjoint(r.violations)
    # The room is visible before the payload of the same write: 6 events on 2 ranks.
    assert len(r.violations["no_corruption"]) == 6
    final = replay(variant, 2, 1, r.violations["no_corruption"])[-1]
    (v,) = check_invariants(final, ["no_corruption"])[:1]
    assert "payload 0" in v.detail


def test_without_late_writes_only_the_noclear_gate_loses_agreement():
    """gate's disagreement needs a late write from a previous tenant; gate-noclear's
    stale room needs none (#27374)."""
    gate = explore(VARIANTS["gate"], 2, 2, 3, 1, late_writes=False)
    noclear = explore(VARIANTS["gate-noclear"], 2, 2, 3, 1, late_writes=False)
    assert "outcomes_agree" not in gate.violations, gate.summary()
    assert "outcomes_agree" in noclear.violations, noclear.summary()
    final = replay("gate-noclear", 2, 1, noclear.violations["outcomes_agree"])[-1]
    assert any("abort" in v.detail and "commit" in v.detail
               for v in check_invariants(final, ["outcomes_agree"]))


def test_ungated_diverges_in_five_events():
    r = explore(VARIANTS["ungated"], 2, 1, 2, 1)
    path = r.violations["queues_identical"]
    assert len(path) == 5 and isinstance(path[-1], Step)
    states = replay("ungated", 2, 1, path)
    assert check_invariants(states[-1], ["queues_identical"])
    assert not any(check_invariants(s, ["queues_identical"]) for s in states[:-1])


def test_gate_holds_a_request_forever_without_metadata_but_strict_times_it_out():
    gate = explore(VARIANTS["gate"], 2, 1, 6, 1)
    # enqueue, Success on both ranks, then 5 steps the gate holds it (age counts only those)
    assert gate.liveness is not None and len(gate.liveness) == 8
    last = replay("gate", 2, 1, gate.liveness)[-1]
    assert bounded_wait(last, gate.wait_bound)
    assert explore(VARIANTS["strict"], 2, 1, 8, 1).liveness is None


def test_genuine_room_zero():
    gate = explore(VARIANTS["gate"], 2, 1, 6, 1, room_zero=True)
    strict = explore(VARIANTS["strict"], 2, 1, 6, 1, room_zero=True)
    assert request_events(2, room_zero=True)[0].room == 0
    assert gate.liveness is not None
    assert strict.violations == {} and strict.liveness is None


@pytest.mark.parametrize("variant, invariant", [("ungated", "queues_identical"),
                                                ("gate", "outcomes_agree"),
                                                ("gate-noclear", "outcomes_agree"),
                                                ("gate", "no_corruption")])
def test_counterexamples_validate_as_traces(variant, invariant):
    r = explore(VARIANTS[variant], 2, 2, 2, 1, invariants=[invariant], check_liveness=False)
    assert list(r.violations) == [invariant] and r.liveness is None
    fp = io.StringIO()
    writer = TraceWriter(fp, variant, 2, 1, "explore")
    s = initial_state(VARIANTS[variant], 2, 1)
    for ev in r.violations[invariant]:
        rec = apply(s, ev)
        writer.step(rec) if rec is not None else writer.event(ev)
    (v,) = check_invariants(s, [invariant])[:1]
    writer.violation(v, s.steps - 1)
    writer.end(s.steps)
    result = validate(fp.getvalue().splitlines())
    assert result.ok, result.message
    assert [c.invariant for c in result.claims] == [invariant]


def test_max_states_cuts_the_search_short():
    r = explore(VARIANTS["gate"], 2, 2, 3, 2, max_states=500)
    assert not r.complete and r.states == 500


def test_unknown_invariant_is_an_error():
    with pytest.raises(ValueError, match="unknown invariant 'nope'"):
        explore(VARIANTS["gate"], 2, 1, 1, 1, invariants=["nope"])


def dumb_bfs(variant: str, ranks: int, requests: int, steps: int, slots: int):
    """No symmetry, no merging, no skipped events: (states, {invariant: shortest length})."""
    init = initial_state(VARIANTS[variant], ranks, slots)
    reqs = request_events(requests)
    seen = {(init.key(), 0)}
    frontier = deque([(init, 0)])
    shortest: dict[str, int] = {}
    live = None
    while frontier:
        s, depth = frontier.popleft()
        for name in INVARIANTS:
            if name not in shortest and INVARIANTS[name](s):
                shortest[name] = depth
        if live is None and bounded_wait(s, VARIANTS[variant].timeout_steps or 4):
            live = depth
        offer = [reqs[len(s.requests)]] if len(s.requests) < requests else []
        for ev in enabled(s, offer):
            if isinstance(ev, Step) and s.steps >= steps:
                continue
            nxt, _ = step(s, ev)
            if (nxt.key(), nxt.steps) not in seen:
                seen.add((nxt.key(), nxt.steps))
                frontier.append((nxt, depth + 1))
    return len(seen), shortest, live


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("size", [(2, 1, 5, 1), (1, 2, 3, 1)], ids=str)
def test_reductions_agree_with_a_dumb_bfs(variant, size):
    states, shortest, live = dumb_bfs(variant, *size)
    r = explore(VARIANTS[variant], *size)
    assert {k: len(v) for k, v in r.violations.items()} == shortest
    assert (None if r.liveness is None else len(r.liveness)) == live
    assert r.states <= states


def test_counterexamples_print_as_runnable_scenario_scripts():
    from model.spec.scenario import run_script, script_for
    r = explore(VARIANTS["gate-noclear"], 2, 2, 2, 1, invariants=["outcomes_agree"],
                check_liveness=False)
    out = run_script(script_for("gate-noclear", 2, 1, r.violations["outcomes_agree"]))
    assert "not enabled" not in out
    assert out.rstrip().splitlines()[-3].startswith("outcomes_agree: VIOLATED")


def test_explore_main(capsys):
    from proofs.explore import main
    assert main(["--variant", "ungated", "--ranks", "2", "--requests", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ungated: T=2 requests=1 steps=1 slots=1:")
    assert "# shortest queues_identical violation (5 events)" in out
    with pytest.raises(SystemExit) as err:
        main(["--variant", "gate", "--slots", "0"])
    assert err.value.code == 2
