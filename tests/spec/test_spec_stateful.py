"""Hypothesis stateful tests: random event programs through the spec, invariants
checked after every rule. The rules are the spec's events, their preconditions come
from ``machine.enabled``, so every program is one the spec allows."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from model.spec.events import PAYLOAD, ROOM, Enqueue, Fail, Fence, KvDone, Land, Step
from model.spec.kernel import Decision
from model.spec.invariants import bounded_wait, check_invariants
from model.spec.machine import apply, enabled
from model.spec.state import initial_state
from model.spec.variants import VARIANTS

RANKS, SLOTS, MAX_REQUESTS = 2, 2, 5
pick = st.integers(min_value=0, max_value=63)


def _matching(kind, field=None):
    def candidates(self) -> list:
        return [e for e in enabled(self.state) if isinstance(e, kind)
                and (field is None or e.field == field)]
    return candidates


def make_machine(variant: str, must_hold: list[str], wait_bound: int | None = None):
    """A RuleBasedStateMachine over ``variant`` asserting ``must_hold`` after each rule.
    ``Machine.program`` holds the rules of the latest run (after a failure: the shrunk one)."""

    class Machine(RuleBasedStateMachine):
        program: list = []
        outcomes: set = set()       # every pop decision seen over all runs (non-vacuity)

        def __init__(self) -> None:
            super().__init__()
            self.state = initial_state(VARIANTS[variant], RANKS, SLOTS)
            Machine.program = []

        def _do(self, candidates: list, i: int) -> None:
            event = candidates[i % len(candidates)]
            Machine.program.append(event)
            record = apply(self.state, event)
            if record is not None:
                Machine.outcomes.update(d for rs in record.ranks for _, d, _ in rs.popped)

        kv_dones, fails, fences = _matching(KvDone), _matching(Fail), _matching(Fence)
        rooms, payloads = _matching(Land, ROOM), _matching(Land, PAYLOAD)

        @precondition(lambda self: len(self.state.requests) < MAX_REQUESTS
                      and all(rs.free for rs in self.state.ranks))
        @rule(room_zero=st.booleans() if variant == "strict" else st.just(False))
        def enqueue(self, room_zero: bool) -> None:
            r = len(self.state.requests)
            # Fresh id, distinct non-zero room (strict also gets genuine room 0s).
            self._do([Enqueue(r, 0 if room_zero else 100 + r, 500 + r)], 0)

        @precondition(lambda self: self.kv_dones())
        @rule(i=pick)
        def kv_done(self, i: int) -> None:
            self._do(self.kv_dones(), i)

        @precondition(lambda self: self.fails())
        @rule(i=pick)
        def fail(self, i: int) -> None:
            self._do(self.fails(), i)

        @precondition(lambda self: self.rooms())
        @rule(i=pick)
        def land_room(self, i: int) -> None:
            self._do(self.rooms(), i)

        @precondition(lambda self: self.payloads())
        @rule(i=pick)
        def land_payload(self, i: int) -> None:
            self._do(self.payloads(), i)

        @precondition(lambda self: self.fences())
        @rule(i=pick)
        def fence(self, i: int) -> None:
            self._do(self.fences(), i)

        @precondition(lambda self: self.state.hung is None)
        @rule()
        def step(self) -> None:
            self._do([Step()], 0)

        @invariant()
        def invariants_hold(self) -> None:
            found = check_invariants(self.state, must_hold)
            assert not found, f"{found[0].invariant}: {found[0].detail}"
            if wait_bound is not None:
                late = bounded_wait(self.state, wait_bound)
                assert not late, f"bounded_wait: {late[0].detail}"

    Machine.__name__ = f"{variant.title().replace('-', '')}Machine"
    return Machine


SETTINGS = settings(max_examples=120, stateful_step_count=40, deadline=None, database=None,
                    derandomize=True, suppress_health_check=[HealthCheck.too_slow])

StrictMachine = make_machine("strict", ["queues_identical", "outcomes_agree", "no_corruption",
                                        "exactly_once"], VARIANTS["strict"].timeout_steps)
GateMachine = make_machine("gate", ["queues_identical", "exactly_once"])
GateNoclearMachine = make_machine("gate-noclear", ["queues_identical", "exactly_once"])


@pytest.mark.parametrize("machine", [StrictMachine, GateMachine, GateNoclearMachine],
                         ids=lambda m: m.__name__)
def test_invariants_hold_on_random_programs(machine):
    run_state_machine_as_test(machine, settings=SETTINGS)
    # Not vacuous: the runs committed requests and aborted some.
    assert Decision.COMMIT in machine.outcomes and Decision.ABORT_FAILED in machine.outcomes


def test_ungated_shrinks_to_a_short_divergence():
    machine = make_machine("ungated", ["queues_identical"])
    with pytest.raises(AssertionError, match="queues_identical") as err:
        run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=300,
                                                                stateful_step_count=15))
    program = machine.program            # the shrunk program, replayed last
    assert "queues_identical" in str(err.value)
    assert len(program) <= 8, program
    assert isinstance(program[0], Enqueue) and isinstance(program[-1], Step)
    # Replaying the shrunk program through the spec shows the divergence itself.
    s = initial_state(VARIANTS["ungated"], RANKS, SLOTS)
    for event in program:
        apply(s, event)
    assert len({tuple(rs.queue) for rs in s.ranks}) > 1
