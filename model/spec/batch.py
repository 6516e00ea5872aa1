"""The protocol step and a request's environment events over all ranks at once, for drivers that take many steps (the simulator).

``step_pops(state)`` is ``apply(state, Step(), detail=False)``: the same transition and
the same record (tests/spec/test_spec_batch.py checks them step for step on random
walks of every variant). It computes the gate and the MIN request by request over the
ranks with the kernel's tables (``kernel.gate_table`` / ``pop_table``), instead of one
list per rank and a ``min_reduce`` over them, and it does no per-rank work beyond the
age count when the MIN keeps every request (most steps). Whenever the ranks' queues
differ (a divergence in the making, or local admission) or the variant defers slot
releases, machine.py does the step. The pops (and the ages of the kept) are machine.py's
``_pop`` over the group of every rank, the function ``apply`` runs on each rank alone,
so the pop and release rules have one implementation.

``deliver(state, req, codes)`` performs one request's KV and metadata events on any
ranks, each encoded as ``kind * ranks + rank`` (kinds below): the same transitions as
``apply`` of KvDone / Fail / Land one by one, through machine.py's ``_arrive`` (the one
transition of those events, so the same rules and refusals) in one call, minus an
event object and a dispatch per event (also checked against apply in
tests/spec/test_spec_batch.py).
"""
from __future__ import annotations

import operator
from typing import Sequence

from model.spec.events import Step
from model.spec.machine import (_NO_DEFERRAL, KV_DONE, KV_FAILED, PAYLOAD_LANDS, ROOM_LANDS,  # noqa: F401
                                EventNotEnabled, StepPops, _arrive, _pop, _require_live, _tables,
                                apply)
from model.spec.state import SystemState

_STEP = Step()
_NO_POPS: dict[int, tuple[tuple, ...]] = {}     # ranks -> ((),) * ranks
_BY_ID: dict[int, tuple] = {}                   # id(variant) -> (variant, its tables)
_DECODE: dict[int, tuple[tuple[int, int], ...]] = {}   # ranks -> code -> (kind, rank)


def _tables_of(v) -> tuple:
    """machine._tables(v) without hashing ``v`` every step (the variant is kept alive in
    the entry, so its id cannot be reused while the entry exists)."""
    hit = _BY_ID.get(id(v))
    if hit is None or hit[0] is not v:
        hit = _BY_ID[id(v)] = (v, _tables(v))
    return hit[1]


def step_pops(state: SystemState) -> StepPops:
    """One protocol step on every rank; ``apply(state, Step(), detail=False)``."""
    return _step(state)[0]


def _step(state: SystemState) -> tuple[StepPops, list[int] | None]:
    """step_pops, and the reduced values when every rank's queue was the same and every
    request was kept (else None)."""
    ranks = state.ranks
    queue = ranks[0].queue
    if state.variant.defer_failed is not _NO_DEFERRAL:   # held slots count steps: general code
        return apply(state, _STEP, detail=False), None
    for rs in ranks:
        if rs.queue != queue:            # a MIN over different requests: the general code
            return apply(state, _STEP, detail=False), None
    _require_live(state)
    gate, pop, keeps = _tables_of(state.variant)
    timeout = state.variant.timeout_steps
    requests = state.requests
    reduced = []
    popping = False
    for r in queue:
        expected = requests[r].room
        zero_expected = (expected == 0) << 2
        low = 4                          # KVPoll.Success, the largest value
        for rs in ranks:
            seen = rs.room_at[rs.slot_of[r]]
            i = rs.recv[r] * 16 + ((seen == 0) | (seen == expected) << 1 | zero_expected)
            if timeout is not None and rs.age[r] >= timeout:
                i += 8
            g = gate[i]
            if g < low:
                low = g
        reduced.append(low)
        if not keeps[low]:
            popping = True
    step_no = state.steps
    state.steps += 1
    if popping:
        return StepPops(step_no, tuple(_pop(state, ranks, reduced, pop))), None
    return _all_kept(state, reduced, step_no), reduced


def _all_kept(state: SystemState, reduced: list[int], step_no: int) -> StepPops:
    """_pop's every-request-kept case on every rank (only the ages move), with the
    step's record shared between steps."""
    ranks = state.ranks
    _pop(state, ranks, reduced, None)
    empty = _NO_POPS.get(len(ranks))
    if empty is None:
        empty = _NO_POPS[len(ranks)] = ((),) * len(ranks)
    return StepPops(step_no, empty)


class Stepper:
    """``step_pops`` for a driver that knows when no event happened between two steps
    (the simulator counts every delivery). After a step that kept every request with
    every rank's queue the same, a step with no event in between finds the same
    receivers, rows and queues, so it reduces to the same values and keeps every request
    again: only the ages move, and strict's timeout is checked on them (a request whose
    age reached it takes the full step). ``quiet=False`` always takes the full step."""

    def __init__(self, state: SystemState):
        self.state = state
        self._kept: tuple[list[int], int, list[int]] | None = None   # queue, its length, reduced

    def step(self, quiet: bool) -> StepPops:
        state, kept = self.state, self._kept
        if quiet and kept is not None and state.hung is None:
            queue, n, reduced = kept
            timeout = state.variant.timeout_steps
            if state.ranks[0].queue is queue and len(queue) == n and (
                    timeout is None or all(rs.age[r] < timeout for rs in state.ranks for r in queue)):
                step_no = state.steps
                state.steps += 1
                return _all_kept(state, reduced, step_no)
        rec, reduced = _step(state)
        self._kept = None if reduced is None else (state.ranks[0].queue, len(reduced), reduced)
        return rec


def deliver(state: SystemState, req: int, codes: Sequence[int]) -> None:
    """``apply`` of each encoded event of request ``req`` in order (see the module doc);
    a refused event raises EventNotEnabled after the ones before it were performed, a
    code out of range before any is."""
    _require_live(state)
    _arrive(state, req, decode(len(state.ranks), codes))


def decode(n: int, codes: Sequence[int]) -> list[tuple[int, int]]:
    """The (kind, rank) of each event code at ``n`` ranks; EventNotEnabled naming the
    first code that is not one of them."""
    table = _DECODE.get(n)
    if table is None:
        table = _DECODE[n] = tuple(divmod(c, n) for c in range(4 * n))
    try:
        events = [table[c] for c in codes]
    except (IndexError, TypeError):
        events = None
    if events is None or min(codes, default=0) < 0:     # a negative index would wrap
        raise EventNotEnabled(f"deliver: event code {_bad_code(codes, 4 * n)} is not one of "
                              f"0..{4 * n - 1}")
    return events


def _bad_code(codes: Sequence[int], end: int) -> object:
    """The first code that is not an integer in 0..end-1."""
    for c in codes:
        try:
            if 0 <= operator.index(c) < end:
                continue
        except TypeError:
            pass
        return c
    raise AssertionError("no bad code")
