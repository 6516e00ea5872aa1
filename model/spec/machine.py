"""The transition function: ``step(state, event) -> (state, effects)``.

``apply`` performs an event in place and returns its effects; ``step`` is the pure
version (copy, then apply). Every driver (proof export, simulator, impl replay,
``pdgate validate``) goes through one of these two.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from model.spec.events import PAYLOAD, ROOM, Enqueue, Event, Fail, Fence, KvDone, Land, Step
from model.spec.kernel import Decision, compare_index, gate_table, keep_regardless, pop_table
from model.spec.kvpoll import CollectiveMismatch, KVPoll, min_reduce
from model.spec.state import (ALL_FIELDS, PAYLOAD_BIT, ROOM_BIT, WAITING, RankState, Request,
                              SystemState)

_LATCHED = (int(KVPoll.Success), int(KVPoll.Failed))
_FIELD_BIT = {ROOM: ROOM_BIT, PAYLOAD: PAYLOAD_BIT}


class EventNotEnabled(Exception):
    """The event is not allowed in this state (the message says why)."""


@dataclass(frozen=True)
class RankStep:
    """What one rank did in one protocol step (one line of a trace's step record)."""
    rank: int
    queue: tuple[int, ...]
    local: tuple[int, ...]
    gated: tuple[int, ...]
    reduced: tuple[int, ...]
    popped: tuple[tuple[int, int, int], ...]   # (request, Decision, payload read or 0)


@dataclass(frozen=True)
class StepRecord:
    step: int
    ranks: tuple[RankStep, ...]
    hang: tuple[int, ...] | None = None        # queue lengths if the MIN mismatched


def _rank(state: SystemState, rank: int) -> RankState:
    if not 0 <= rank < state.n_ranks:
        raise EventNotEnabled(f"rank {rank} out of range 0..{state.n_ranks - 1}")
    return state.ranks[rank]


def _check_receiver_event(state: SystemState, rank: int, req: int, what: str) -> RankState:
    rs = _rank(state, rank)
    if req not in rs.recv:
        raise EventNotEnabled(f"{what}: request {req} is not in rank {rank}'s transfer queue")
    if rs.recv[req] in _LATCHED:
        raise EventNotEnabled(f"{what}: request {req} on rank {rank} already latched "
                              f"{KVPoll(rs.recv[req]).name}")
    return rs


def _free_slot(state: SystemState, rs: RankState, req: int) -> None:
    """The request's slot goes back to the free list (zeroed first where the variant does)."""
    slot = rs.slot_of[req]
    if state.variant.clear_on_free:
        rs.room_at[slot] = 0
    rs.free.append(slot)


def _forget_if_done(rs: RankState, req: int) -> None:
    """Drop bookkeeping of a request that left and can receive no more writes here."""
    if req in rs.outcomes and (rs.landed.get(req, 0) == ALL_FIELDS or req in rs.fenced):
        rs.landed.pop(req, None)
        rs.slot_of.pop(req, None)
        rs.fenced.discard(req)


def _release(state: SystemState, rs: RankState, req: int) -> None:
    """After a pop: free the slot now, or quarantine it until its writes are fenced."""
    pending = rs.landed[req] != ALL_FIELDS and req not in rs.fenced
    if state.variant.fence_before_reuse and pending:
        rs.quarantined.add(req)
    else:
        _free_slot(state, rs, req)
    _forget_if_done(rs, req)


def _writes_done(state: SystemState, rs: RankState, req: int) -> None:
    if req in rs.quarantined and (rs.landed[req] == ALL_FIELDS or req in rs.fenced):
        rs.quarantined.discard(req)
        _free_slot(state, rs, req)
    _forget_if_done(rs, req)


def _enqueue(state: SystemState, ev: Enqueue) -> None:
    if ev.req in state.requests:
        raise EventNotEnabled(f"enqueue: request {ev.req} was already enqueued")
    for k, rs in enumerate(state.ranks):
        if not rs.free:
            raise EventNotEnabled(f"enqueue: rank {k} has no free metadata slot")
    state.requests[ev.req] = Request(ev.room, ev.payload)
    for rs in state.ranks:
        slot = rs.free.pop(0)
        rs.queue.append(ev.req)
        rs.recv[ev.req] = WAITING
        rs.age[ev.req] = 0
        rs.slot_of[ev.req] = slot
        rs.landed[ev.req] = 0


def _land(state: SystemState, ev: Land) -> None:
    rs = _rank(state, ev.rank)
    bit = _FIELD_BIT.get(ev.field)
    if bit is None:
        raise EventNotEnabled(f"land: unknown field {ev.field!r} (room or payload)")
    if ev.req not in rs.landed:
        raise EventNotEnabled(f"land: request {ev.req} has no write in flight to rank {ev.rank}")
    if rs.landed[ev.req] & bit:
        raise EventNotEnabled(f"land: {ev.field} of request {ev.req} already landed on rank {ev.rank}")
    if ev.req in rs.fenced:
        raise EventNotEnabled(f"land: request {ev.req} is fenced on rank {ev.rank}")
    if (state.variant.room_after_payload and bit == ROOM_BIT
            and not rs.landed[ev.req] & PAYLOAD_BIT):
        raise EventNotEnabled(f"land: room of request {ev.req} before its payload on rank "
                              f"{ev.rank} (variant writes the room after the payload completed)")
    req = state.requests[ev.req]
    slot = rs.slot_of[ev.req]
    if bit == ROOM_BIT:
        rs.room_at[slot] = req.room
    else:
        rs.payload_at[slot] = req.payload
    rs.landed[ev.req] |= bit
    _writes_done(state, rs, ev.req)


def _fence(state: SystemState, ev: Fence) -> None:
    rs = _rank(state, ev.rank)
    if ev.req not in rs.outcomes:
        raise EventNotEnabled(f"fence: request {ev.req} has not left rank {ev.rank}'s queue")
    if ev.req not in rs.landed:
        raise EventNotEnabled(f"fence: request {ev.req} has no write in flight to rank {ev.rank}")
    rs.fenced.add(ev.req)
    _writes_done(state, rs, ev.req)


def _protocol_step(state: SystemState) -> StepRecord:
    v = state.variant
    # gate_table/pop_table are gated_poll/pop_decision tabulated on ints (kernel.py).
    gate, pop, timeout = gate_table(v), pop_table(v), v.timeout_steps
    requests = state.requests
    locals_, gateds = [], []
    for rs in state.ranks:
        queue, room_at, slot_of = rs.queue, rs.room_at, rs.slot_of
        local = [rs.recv[r] for r in queue]
        if timeout is None:
            gated = [gate[p * 16 + compare_index(room_at[slot_of[r]], requests[r].room)]
                     for p, r in zip(local, queue)]
        else:
            age = rs.age
            gated = [gate[p * 16 + 8 * (age[r] >= timeout)
                          + compare_index(room_at[slot_of[r]], requests[r].room)]
                     for p, r in zip(local, queue)]
        locals_.append(local)
        gateds.append(gated)
    try:
        reduced = min_reduce(gateds)
    except CollectiveMismatch as exc:
        state.hung = exc.lengths
        ranks = tuple(RankStep(k, tuple(rs.queue), tuple(locals_[k]), tuple(gateds[k]), (), ())
                      for k, rs in enumerate(state.ranks))
        return StepRecord(state.steps, ranks, exc.lengths)
    reduced_t = tuple(reduced)
    # Reduced values whose pop decision is KEEP whatever the rooms (from the table).
    keeps = keep_regardless(v)
    nothing_pops = all(keeps[red] for red in reduced_t)
    records = []
    for k, rs in enumerate(state.ranks):
        queue_before = tuple(rs.queue)
        popped: list[tuple[int, int, int]] = []
        if nothing_pops:
            kept = rs.queue
        else:
            kept = []
            for red, r in zip(reduced_t, queue_before):
                slot = rs.slot_of[r]
                d = pop[red * 8 + compare_index(rs.room_at[slot], requests[r].room)]
                if d is Decision.KEEP:
                    kept.append(r)
                    continue
                payload = rs.payload_at[slot] if d is Decision.COMMIT else 0
                popped.append((r, int(d), payload))
            rs.queue = kept
        age = rs.age
        for r in kept:
            age[r] += 1
        for r, d, payload in popped:
            del rs.recv[r], age[r]
            rs.outcomes[r] = ("commit", payload) if d == Decision.COMMIT else ("abort", d)
            _release(state, rs, r)
        records.append(RankStep(k, queue_before, tuple(locals_[k]), tuple(gateds[k]),
                                reduced_t, tuple(popped)))
    record = StepRecord(state.steps, tuple(records))
    state.steps += 1
    return record


def apply(state: SystemState, event: Event) -> StepRecord | None:
    """Perform ``event`` on ``state`` in place. Returns the StepRecord of a protocol step,
    None for environment events. Raises EventNotEnabled (state untouched) if not allowed."""
    if state.hung is not None:
        raise EventNotEnabled(f"the ranks are hung in a mismatched collective "
                              f"(queue lengths {list(state.hung)})")
    if isinstance(event, Step):
        return _protocol_step(state)
    if isinstance(event, Enqueue):
        _enqueue(state, event)
    elif isinstance(event, KvDone):
        _check_receiver_event(state, event.rank, event.req, "kv_done")
        state.ranks[event.rank].recv[event.req] = int(KVPoll.Success)
    elif isinstance(event, Fail):
        _check_receiver_event(state, event.rank, event.req, "fail")
        state.ranks[event.rank].recv[event.req] = int(KVPoll.Failed)
    elif isinstance(event, Land):
        _land(state, event)
    elif isinstance(event, Fence):
        _fence(state, event)
    else:
        raise EventNotEnabled(f"unknown event {event!r}")
    return None


def forget(state: SystemState, req: int) -> None:
    """Drop the record of a request that has left every rank's queue and can receive no
    more writes anywhere (its outcome stays in the trace). Long-running drivers (the
    simulator) call it so memory follows the requests in flight, not all of history;
    no transition reads a forgotten request again, and the driver must not reuse its id."""
    if req not in state.requests:
        raise EventNotEnabled(f"forget: request {req} is not known")
    for k, rs in enumerate(state.ranks):
        if req not in rs.outcomes or req in rs.slot_of:
            raise EventNotEnabled(f"forget: request {req} is still queued or written on rank {k}")
    for rs in state.ranks:
        del rs.outcomes[req]
    del state.requests[req]


def step(state: SystemState, event: Event) -> tuple[SystemState, StepRecord | None]:
    """The pure transition function: the input state is never modified."""
    nxt = state.copy()
    return nxt, apply(nxt, event)


def enabled(state: SystemState, new_requests: Iterable[Enqueue] = ()) -> list[Event]:
    """Every enabled event, in a stable order (for exploration and Hypothesis).

    Enqueue needs fresh values, so the caller offers candidates in ``new_requests``.
    """
    if state.hung is not None:
        return []
    events: list[Event] = [Step()]
    if all(rs.free for rs in state.ranks):
        events.extend(e for e in new_requests if e.req not in state.requests)
    v = state.variant
    for k, rs in enumerate(state.ranks):
        for r in rs.queue:
            if rs.recv[r] not in _LATCHED:
                events.append(KvDone(k, r))
                events.append(Fail(k, r))
        for r, bits in sorted(rs.landed.items()):
            if r in rs.fenced:
                continue
            if not bits & PAYLOAD_BIT:
                events.append(Land(k, r, PAYLOAD))
            if not bits & ROOM_BIT and (not v.room_after_payload or bits & PAYLOAD_BIT):
                events.append(Land(k, r, ROOM))
            if r in rs.outcomes:
                events.append(Fence(k, r))
    return events
