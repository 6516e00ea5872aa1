"""Turn a solver's event sequence into a trace by replaying it through the concrete
spec (``model.spec.machine.apply``): the step records come from the spec, never from
the solver, and the violation is the spec's own finding."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from model.encoding.checks import Move
from model.spec.events import PAYLOAD, ROOM, Enqueue, Event, Fail, Fence, KvDone, Land, Step
from model.spec.invariants import bounded_wait, check_invariants
from model.spec.machine import apply
from model.spec.state import SystemState, initial_state
from model.spec.trace import TraceWriter
from model.spec.variants import DEFAULT_TIMEOUT_STEPS, Variant

_ENV = {"kv_done": KvDone, "fail": Fail, "fence": Fence}


class ReplayMismatch(Exception):
    """The concrete spec does not do what the encoding predicted (an encoding bug)."""


def to_events(steps: Sequence[Move | Event]) -> list[Event]:
    """The solver's moves as spec events (events, from the explicit-state search, pass)."""
    out: list[Event] = []
    for st in steps:
        if not isinstance(st, Move):
            out.append(st)
            continue
        a = st.args
        if st.action == "enqueue":
            out.append(Enqueue(a["req"], a["room"], a["payload"]))
        elif st.action == "step":
            out.append(Step())
        elif st.action.startswith("land_"):
            out.append(Land(a["rank"], a["req"], ROOM if st.action == "land_room" else PAYLOAD))
        else:
            out.append(_ENV[st.action](a["rank"], a["req"]))
    return out


def _without_ages(state: SystemState) -> tuple:
    return tuple(k[:2] + k[3:] for k in (rs.key() for rs in state.ranks))


class _Replay:
    def __init__(self, variant: Variant, ranks: int, slots: int, path: Path, note: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fp = open(path, "w", encoding="utf-8")
        self.state = initial_state(variant, ranks, slots)
        self.writer = TraceWriter(self.fp, variant.name, ranks, slots, "pdgate prove",
                                  variant.timeout_steps, note=note)

    def do(self, ev: Event) -> None:
        try:
            rec = apply(self.state, ev)
        except Exception as exc:
            raise ReplayMismatch(f"spec refuses {ev}: {exc}") from None
        if rec is None:
            self.writer.event(ev)
        else:
            self.writer.step(rec)

    def close(self) -> None:
        self.writer.end(self.state.steps)
        self.fp.close()


def export_violation(variant: Variant, ranks: int, slots: int, steps: Sequence[Move],
                     invariant: str, path: Path, note: str) -> str:
    """Replay; the invariant must break exactly after the last event. Returns its detail."""
    rp = _Replay(variant, ranks, slots, path, note)
    try:
        events = to_events(steps)
        for i, ev in enumerate(events):
            rp.do(ev)
            found = check_invariants(rp.state, [invariant])
            if found and i < len(events) - 1:
                raise ReplayMismatch(f"{invariant} already breaks after event {i}")
        if not found:
            raise ReplayMismatch(f"the spec state after the solver's events satisfies {invariant}")
        rp.writer.violation(found[0], max(rp.state.steps - 1, 0))
        return found[0].detail
    finally:
        rp.close()


def export_lasso(variant: Variant, ranks: int, slots: int, steps: Sequence[Move],
                 path: Path, note: str, bound: int = DEFAULT_TIMEOUT_STEPS) -> str:
    """Replay to the lasso state, then check concretely that a protocol step changes
    nothing but ages, and step until some request has waited more than ``bound`` steps
    (strict's bound): the bounded_wait report that validate confirms."""
    if variant.timeout_steps is not None:
        raise ReplayMismatch("a lasso needs a variant without timeout (ages decide nothing)")
    rp = _Replay(variant, ranks, slots, path, note)
    try:
        for ev in to_events(steps):
            rp.do(ev)
        for _ in range(bound + 1):
            before = _without_ages(rp.state)
            rp.do(Step())
            if _without_ages(rp.state) != before:
                raise ReplayMismatch("the protocol step at the lasso changed more than ages")
            found = bounded_wait(rp.state, bound)
            if found:
                rp.writer.violation(found[0], rp.state.steps - 1, bound=bound)
                return found[0].detail + " (the step repeats forever: only ages change)"
        raise ReplayMismatch("no request exceeded the bound")
    finally:
        rp.close()


def export_witness(variant: Variant, ranks: int, slots: int, steps: Sequence[Move],
                   path: Path, note: str) -> None:
    """A reachability witness (non-vacuity): just the replayed trace."""
    rp = _Replay(variant, ranks, slots, path, note)
    try:
        for ev in to_events(steps):
            rp.do(ev)
    finally:
        rp.close()
