"""The transition function: ``step(state, event) -> (state, effects)``.

``apply`` performs an event in place and returns its effects; ``step`` is the pure
version (copy, then apply). Every driver (proof export, simulator, impl replay,
``pdgate validate``) goes through one of these two.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from model.spec.events import PAYLOAD, ROOM, Enqueue, Event, Fail, Fence, KvDone, Land, Step
from model.spec.kernel import Decision, compare_index, gate_table, keep_regardless, pop_table
from model.spec.kvpoll import CollectiveMismatch, KVPoll, min_reduce
from model.spec.state import (ALL_FIELDS, PAYLOAD_BIT, ROOM_BIT, WAITING, RankState, Request,
                              SystemState)
from model.spec.variants import Admission, Deferral, FreeOrder, Variant

_LATCHED = (int(KVPoll.Success), int(KVPoll.Failed))
_FAILED, _SUCCESS = int(KVPoll.Failed), int(KVPoll.Success)
# A kept request ages (toward strict's timeout) only after a MIN of at least this: every
# rank's receiver latched Success and some gate held it (WaitingForInput is the receiver's
# own timeout, not the gate's).
_AGES_FROM = int(KVPoll.Transferring)
_FIELD_BIT = {ROOM: ROOM_BIT, PAYLOAD: PAYLOAD_BIT}
# Enum members the hot paths compare with, bound once: in CPython 3.11 ``Enum.MEMBER``
# is a descriptor call (~0.2 us), which per rank and request is much of a step's cost.
_KEEP, _COMMIT, _ABORT_FAILED = int(Decision.KEEP), int(Decision.COMMIT), int(Decision.ABORT_FAILED)
_NO_DEFERRAL, _LOCAL_DEFERRAL, _AGREED_DEFERRAL = Deferral.NONE, Deferral.LOCAL, Deferral.AGREED
_AGREED_ADMISSION, _QUEUE_ORDER = Admission.AGREED, FreeOrder.QUEUE


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

    @property
    def popped(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per rank, what it popped (as in StepPops)."""
        return tuple(r.popped for r in self.ranks)


class StepPops(NamedTuple):
    """A protocol step without the per-rank poll detail: ``apply(state, Step(),
    detail=False)`` returns it for drivers that write no trace (the transition is the
    same; only the record is smaller). A named tuple: one is made every step, and a
    frozen dataclass's constructor costs about four times as much."""
    step: int
    popped: tuple[tuple[tuple[int, int, int], ...], ...]   # per rank, as RankStep.popped
    hang: tuple[int, ...] | None = None


def _rank(state: SystemState, rank: int) -> RankState:
    ranks = state.ranks
    if not 0 <= rank < len(ranks):
        raise EventNotEnabled(f"rank {rank} out of range 0..{len(ranks) - 1}")
    return ranks[rank]


# The KV and metadata events of one request, as (kind, rank) pairs for ``_arrive``.
KV_DONE, KV_FAILED, PAYLOAD_LANDS, ROOM_LANDS = range(4)
_KIND_WHAT = ("kv_done", "fail", PAYLOAD, ROOM)
_KIND_VALUE = (_SUCCESS, _FAILED, PAYLOAD_BIT, ROOM_BIT)   # the latched poll, the landed bit


def _arrive(state: SystemState, req: int, events: Iterable[tuple[int, int]]) -> None:
    """Each (kind, rank) event of request ``req`` in order, ranks in range (the callers
    check): the one transition of KvDone, Fail and Land. ``apply`` performs one event
    through it, batch.deliver many (a request's events on eight ranks in one call). A
    refused event raises EventNotEnabled after the ones before it were performed.

    KV_DONE / KV_FAILED: the rank's receiver reports Success / Failed. It latches, except
    that a Failed still overrides a latched Success while the request is queued (the gate
    may be holding it: the failure is honoured, and the MIN aborts it on every rank).
    PAYLOAD_LANDS / ROOM_LANDS: that field of the request's metadata row becomes visible
    in its slot on the rank (the room only after the payload where the variant writes it
    after the payload completed); the last write of a popped request frees its
    quarantined slot."""
    ranks = state.ranks
    room_after_payload = state.variant.room_after_payload
    written: Request | None = None
    for kind, k in events:
        rs = ranks[k]
        value = _KIND_VALUE[kind]
        if kind < PAYLOAD_LANDS:
            recv = rs.recv
            current = recv.get(req)
            if current != WAITING and (current is None or current == _FAILED or (
                    current == _SUCCESS and kind == KV_DONE)):
                raise _refusal(state, req, kind, k)
            recv[req] = value
            continue
        landed = rs.landed.get(req)
        if landed is None or landed & value or req in rs.fenced or (
                room_after_payload and value == ROOM_BIT and not landed & PAYLOAD_BIT):
            raise _refusal(state, req, kind, k)
        if written is None:
            written = state.requests[req]
        if value == ROOM_BIT:
            rs.room_at[rs.slot_of[req]] = written.room
        else:
            rs.payload_at[rs.slot_of[req]] = written.payload
        rs.landed[req] = landed | value
        if req in rs.outcomes:      # still queued: quarantine and forgetting follow a pop
            _writes_done(state, rs, req)


def _refusal(state: SystemState, req: int, kind: int, k: int) -> EventNotEnabled:
    """Why ``_arrive`` refuses event (kind, k) of ``req``: its checks, one by one, for the
    message (``_arrive`` tests them as one condition, on the path of every event)."""
    rs, what = state.ranks[k], _KIND_WHAT[kind]
    if kind < PAYLOAD_LANDS:
        current = rs.recv.get(req)
        if current is None:
            return EventNotEnabled(f"{what}: request {req} is not in rank {k}'s transfer queue")
        return EventNotEnabled(f"{what}: request {req} on rank {k} already latched "
                               f"{KVPoll(current).name}")
    landed = rs.landed.get(req)
    if landed is None:
        return EventNotEnabled(f"land: request {req} has no write in flight to rank {k}")
    if landed & _KIND_VALUE[kind]:
        return EventNotEnabled(f"land: {what} of request {req} already landed on rank {k}")
    if req in rs.fenced:
        return EventNotEnabled(f"land: request {req} is fenced on rank {k}")
    if state.variant.room_after_payload and kind == ROOM_LANDS and not landed & PAYLOAD_BIT:
        return EventNotEnabled(f"land: room of request {req} before its payload on rank {k} "
                               f"(variant writes the room after the payload completed)")
    raise AssertionError(f"_refusal: event ({kind}, {k}) of request {req} is enabled")


def _latch(state: SystemState, rank: int, req: int, value: int) -> None:
    """One KvDone (``value`` Success) or Fail (Failed): see ``_arrive``."""
    _rank(state, rank)
    _arrive(state, req, ((KV_DONE if value == _SUCCESS else KV_FAILED, rank),))


def _free_slots(state: SystemState, freed: Iterable[tuple[RankState, int]]) -> None:
    """Each (rank, request)'s slot goes back to that rank's free list, in order (zeroed
    first where the variant does)."""
    clear = state.variant.clear_on_free
    for rs, req in freed:
        slot = rs.slot_of[req]
        if clear:
            rs.room_at[slot] = 0
        rs.free.append(slot)


def _forget_if_done(left: Iterable[tuple[RankState, int]]) -> None:
    """Drop a rank's bookkeeping of each (rank, request) that left and can receive no more
    writes there."""
    for rs, req in left:
        if req in rs.outcomes and req not in rs.held and (
                rs.landed.get(req, 0) == ALL_FIELDS or req in rs.fenced):
            rs.landed.pop(req, None)
            rs.slot_of.pop(req, None)
            rs.fenced.discard(req)


def _writes_done(state: SystemState, rs: RankState, req: int) -> None:
    """A write of ``req`` landed or was fenced: free its quarantined slot and forget it
    where that was all it waited for."""
    if req not in rs.outcomes:      # still queued (quarantine and forgetting follow a pop)
        return
    if req in rs.quarantined and (rs.landed[req] == ALL_FIELDS or req in rs.fenced):
        rs.quarantined.discard(req)
        _free_slots(state, ((rs, req),))
    _forget_if_done(((rs, req),))


def admitting(state: SystemState) -> list[int]:
    """The ranks that take the next request into their transfer queue. Agreed admission:
    every rank or none (the MIN over ranks of their free slots is at least 1). Local
    admission: each rank with a free slot of its own; a rank without one leaves the
    request in its prealloc queue, so the ranks' queues differ from here on."""
    ranks = state.ranks
    if state.variant.admission is _AGREED_ADMISSION:
        for rs in ranks:
            if not rs.free:
                return []
        return list(range(len(ranks)))
    return [k for k, rs in enumerate(ranks) if rs.free]


def _enqueue(state: SystemState, req: int, room: int, payload: int,
             slots: tuple[int, ...] | None = None) -> None:
    if req in state.requests:
        raise EventNotEnabled(f"enqueue: request {req} was already enqueued")
    if slots is not None:       # first: which request still holds a named slot says most
        _check_named_slots(state, slots)
    takers = admitting(state)
    if not takers:
        full = next(k for k, rs in enumerate(state.ranks) if not rs.free)
        raise EventNotEnabled(f"enqueue: rank {full} has no free metadata slot")
    state.requests[req] = Request(room, payload)
    ranks = state.ranks
    for k in takers:
        rs = ranks[k]
        if slots is None:
            slot = rs.free.pop(0)
        else:
            slot = slots[k]
            rs.free.remove(slot)
        rs.queue.append(req)
        rs.recv[req] = WAITING
        rs.age[req] = 0
        rs.slot_of[req] = slot
        rs.landed[req] = 0


def _check_named_slots(state: SystemState, slots: tuple[int, ...]) -> None:
    """Each rank's named slot must be free there (a real allocator handing out a slot
    the spec still holds, quarantines or queues is the reuse the spec forbids); then
    every rank has a free slot and takes the request, under either admission."""
    if len(slots) != len(state.ranks):
        raise EventNotEnabled(f"enqueue: {len(slots)} slots named for {len(state.ranks)} ranks")
    for k, (rs, slot) in enumerate(zip(state.ranks, slots)):
        if slot in rs.free:
            continue
        holders = [r for r, s in rs.slot_of.items() if s == slot]     # the last is its tenant
        why = ("out of range" if not 0 <= slot < state.n_slots else "not free" if not holders
               else f"still held by request {holders[-1]} ("
               + ("queued" if holders[-1] in rs.recv else "deferred release" if holders[-1]
                  in rs.held else "quarantined until its writes are fenced") + ")")
        raise EventNotEnabled(f"enqueue: slot {slot} on rank {k} is {why}")


def _land(state: SystemState, rank: int, req: int, field: str) -> None:
    """One Land of ``field``: see ``_arrive``."""
    bit = _FIELD_BIT.get(field)
    if bit is None:
        raise EventNotEnabled(f"land: unknown field {field!r} (room or payload)")
    _rank(state, rank)
    _arrive(state, req, ((ROOM_LANDS if bit == ROOM_BIT else PAYLOAD_LANDS, rank),))


def _fence(state: SystemState, ev: Fence) -> None:
    rs = _rank(state, ev.rank)
    if ev.req not in rs.outcomes:
        raise EventNotEnabled(f"fence: request {ev.req} has not left rank {ev.rank}'s queue")
    if ev.req not in rs.landed:
        raise EventNotEnabled(f"fence: request {ev.req} has no write in flight to rank {ev.rank}")
    if ev.req in rs.fenced:     # still tracked only while its deferred slot is held
        raise EventNotEnabled(f"fence: request {ev.req} is already fenced on rank {ev.rank}")
    rs.fenced.add(ev.req)
    defer = state.variant.defer_failed
    if ev.req in rs.held and defer is _LOCAL_DEFERRAL:
        del rs.held[ev.req]         # this rank releases on its own acknowledgement, at once
        _free_slots(state, ((rs, ev.req),))
    elif ev.req in rs.held and defer is _AGREED_DEFERRAL:
        # 0.5.23 resolves its holds before each admission: once every rank holding the
        # request can release it, it is released on all of them before the next enqueue
        holders = [o for o in state.ranks if ev.req in o.held]
        if all(_releasable(state.variant, o, ev.req) for o in holders):
            for o in holders:
                del o.held[ev.req]
            _free_slots(state, [(o, ev.req) for o in holders])
            _forget_if_done([(o, ev.req) for o in holders if o is not rs])
    _writes_done(state, rs, ev.req)


@lru_cache(maxsize=None)
def _tables(v: Variant) -> tuple[tuple, tuple, tuple]:
    """The kernel's tables for ``v``, looked up once per step (one hash of ``v``); the
    pop table's Decisions as plain ints (no IntEnum work per rank and request)."""
    return gate_table(v), tuple(None if d is None else int(d) for d in pop_table(v)), \
        keep_regardless(v)


def _polls(requests: dict[int, Request], rs: RankState, gate: tuple, timeout: int | None,
           local: list[int] | None) -> list[int]:
    """This rank's MIN contributions (gated_poll via the kernel table) for every queued
    request; its receiver polls go to ``local`` when the caller keeps them (the trace).
    One loop: queues are short, and a loop is cheaper than two comprehensions."""
    recv, room_at, slot_of, age = rs.recv, rs.room_at, rs.slot_of, rs.age
    gated = []
    for r in rs.queue:
        p = recv[r]
        i = p * 16 + compare_index(room_at[slot_of[r]], requests[r].room)
        if timeout is not None and age[r] >= timeout:
            i += 8
        if local is not None:
            local.append(p)
        gated.append(gate[i])
    return gated


def _pop(state: SystemState, group: Sequence[RankState], reduced: list[int], pop: tuple | None
         ) -> list[tuple[tuple[int, int, int], ...]]:
    """Apply the MIN on ranks that queue the same requests in the same order: one rank
    (``_protocol_step``), or every rank at once when their queues are equal (batch.py),
    so that what depends on the request alone (its expected room, whether it ages) is
    looked up once for the group. Pop decisions (``pop`` is None when every reduced
    value keeps regardless of the rooms), ages of the kept, outcomes and slot release;
    returns what each rank of the group popped."""
    queue = group[0].queue
    if pop is None:
        ageing = [r for red, r in zip(reduced, queue) if red >= _AGES_FROM]
        for rs in group:
            age = rs.age
            for r in ageing:
                age[r] += 1
        return [()] * len(group)
    requests = state.requests
    v = state.variant
    # per request: its position, its reduced value's row of the pop table, its room,
    # whether it ages if kept
    rows = [(pos, red * 8, r, requests[r].room, red >= _AGES_FROM)
            for pos, (red, r) in enumerate(zip(reduced, queue))]
    out = []
    leaving: list[tuple[RankState, list]] = []      # per rank that pops: its pops, release order
    queue_order = v.free_order is _QUEUE_ORDER
    for rs in group:
        kept: list[int] = []
        popped: list[tuple[int, int, int]] = []
        positions: list[int] = []
        room_at, slot_of, payload_at, age = rs.room_at, rs.slot_of, rs.payload_at, rs.age
        for pos, row, r, expected, ages in rows:
            slot = slot_of[r]
            d = pop[row + compare_index(room_at[slot], expected)]
            if d == _KEEP:
                kept.append(r)
                if ages:
                    age[r] += 1
                continue
            popped.append((r, d, payload_at[slot] if d == _COMMIT else 0))
            positions.append(pos)
        rs.queue = kept          # a new list: the one before the step stays intact
        if popped:
            leaving.append((rs, popped if queue_order else _set_order(popped, positions)))
        out.append(tuple(popped))
    if leaving:
        _leave(state, leaving)
    return out


def _leave(state: SystemState, leaving: Sequence[tuple[RankState, Sequence[tuple[int, int, int]]]]
           ) -> None:
    """Popped requests leave their ranks (per rank, in release order): the outcome is
    recorded, the receiver and age dropped, and the slot freed now, held (a failed
    request where the variant defers its release) or quarantined until its writes are
    fenced."""
    v = state.variant
    defer, quarantine = v.defer_failed is not _NO_DEFERRAL, v.fence_before_reuse
    freed: list[tuple[RankState, int]] = []
    for rs, popped in leaving:
        recv, age, outcomes = rs.recv, rs.age, rs.outcomes
        for r, d, payload in popped:
            del recv[r], age[r]
            if d == _COMMIT:
                outcomes[r] = ("commit", payload)
            else:
                outcomes[r] = ("abort", d)
                if defer and d == _ABORT_FAILED:
                    rs.held[r] = 0
                    continue
            if quarantine and rs.landed[r] != ALL_FIELDS and r not in rs.fenced:
                rs.quarantined.add(r)       # writes still pending: the slot waits for them
            else:
                freed.append((rs, r))
    _free_slots(state, freed)
    _forget_if_done(freed)


def _set_order(popped: list, positions: list[int]) -> list:
    """The popped requests in the order SGLang gives their slots back to the free list:
    the iteration order of ``set(positions)``, which CPython fixes for ints by their hash
    (the value) modulo the set's table size (the other order is the queue's)."""
    if len(popped) < 2:
        return popped
    by_pos = dict(zip(positions, popped))
    return [by_pos[pos] for pos in set(positions)]


def _releasable(v: Variant, rs: RankState, r: int) -> bool:
    """This rank may release its hold of ``r``: fenced, or held release_timeout_steps."""
    limit = v.release_timeout_steps
    return r in rs.fenced or (limit is not None and rs.held[r] >= limit)


def _release_held(state: SystemState) -> None:
    """Before a step's pops: every slot held since an earlier step counts this step, and
    is released where it has now been held ``release_timeout_steps`` steps or (agreed
    deferral) where every rank holding it is fenced or timed out (MAX to hold, MIN to
    release). A Fence already released what it made releasable (local: that rank's
    hold; agreed: every rank's, once all could). Released slots go back in enqueue
    order."""
    v = state.variant
    ranks = state.ranks
    for rs in ranks:
        for r in rs.held:
            rs.held[r] += 1
    if v.defer_failed is _AGREED_DEFERRAL:     # decided on the pre-step holds of every rank
        ok = {r for rs in ranks for r in rs.held
              if all(_releasable(v, o, r) for o in ranks if r in o.held)}
        release = [[r for r in rs.held if r in ok] for rs in ranks]
    else:
        release = [[r for r in rs.held if _releasable(v, rs, r)] for rs in ranks]
    for rs, out in zip(ranks, release):
        if len(out) > 1:
            order = {r: i for i, r in enumerate(state.requests)}     # enqueue order
            out.sort(key=order.__getitem__)
        for r in out:
            del rs.held[r]
        done = [(rs, r) for r in out]
        _free_slots(state, done)
        _forget_if_done(done)


def _protocol_step(state: SystemState, detail: bool) -> StepRecord | StepPops:
    # gate_table/pop_table are gated_poll/pop_decision tabulated on ints (kernel.py).
    gate, pop, keeps = _tables(state.variant)
    ranks = state.ranks
    requests, timeout = state.requests, state.variant.timeout_steps
    # The record's queues (before the step: _pop replaces them, never edits) and polls.
    queues = [rs.queue for rs in ranks] if detail else []
    locals_ = [[] for _ in ranks] if detail else [None] * len(ranks)
    gateds = [_polls(requests, rs, gate, timeout, local) for rs, local in zip(ranks, locals_)]
    try:
        reduced = min_reduce(gateds)
    except CollectiveMismatch as exc:
        state.hung = exc.lengths
        if not detail:
            return StepPops(state.steps, ((),) * len(ranks), exc.lengths)
        return StepRecord(state.steps, tuple(
            RankStep(k, tuple(queues[k]), tuple(locals_[k]), tuple(gateds[k]), (), ())
            for k in range(len(ranks))), exc.lengths)
    # Reduced values whose pop decision is KEEP whatever the rooms need no table lookup.
    rank_pop = None if all(keeps[red] for red in reduced) else pop
    if state.variant.defer_failed is not _NO_DEFERRAL:
        _release_held(state)
    popped = [_pop(state, (rs,), reduced, rank_pop)[0] for rs in ranks]
    step_no = state.steps
    state.steps += 1
    if not detail:
        return StepPops(step_no, tuple(popped))
    reduced_t = tuple(reduced)
    return StepRecord(step_no, tuple(
        RankStep(k, tuple(queues[k]), tuple(locals_[k]), tuple(gateds[k]), reduced_t, popped[k])
        for k in range(len(ranks))))


def _receiver(poll: KVPoll) -> Callable[[SystemState, int, int], None]:
    """The transition of KvDone / Fail on plain fields: the receiver latches ``poll``."""
    value = int(poll)

    def receive(state: SystemState, rank: int, req: int) -> None:
        _latch(state, rank, req, value)
    return receive


_kv_done = _receiver(KVPoll.Success)
_fail = _receiver(KVPoll.Failed)

# Environment events by type: one dict lookup instead of an isinstance chain per event.
# Each unpacks its event and calls the one implementation of its transition.
_ENV_HANDLERS: dict[type, Callable[[SystemState, Any], None]] = {
    Enqueue: lambda state, ev: _enqueue(state, ev.req, ev.room, ev.payload, ev.slots),
    KvDone: lambda state, ev: _kv_done(state, ev.rank, ev.req),
    Fail: lambda state, ev: _fail(state, ev.rank, ev.req),
    Land: lambda state, ev: _land(state, ev.rank, ev.req, ev.field),
    Fence: _fence}


def _require_live(state: SystemState) -> None:
    if state.hung is not None:
        raise EventNotEnabled(f"the ranks are hung in a mismatched collective "
                              f"(queue lengths {list(state.hung)})")


def apply(state: SystemState, event: Event, *, detail: bool = True) -> StepRecord | StepPops | None:
    """Perform ``event`` on ``state`` in place. Returns the StepRecord of a protocol step
    (a StepPops with ``detail=False``), None for environment events. Raises
    EventNotEnabled (state untouched) if not allowed."""
    _require_live(state)
    handler = _ENV_HANDLERS.get(type(event))
    if handler is not None:
        handler(state, event)
        return None
    if isinstance(event, Step):
        return _protocol_step(state, detail)
    for cls, handler in _ENV_HANDLERS.items():      # subclasses of the event types
        if isinstance(event, cls):
            handler(state, event)
            return None
    raise EventNotEnabled(f"unknown event {event!r}")


def enqueue(state: SystemState, req: int, room: int, payload: int) -> None:
    """``apply(state, Enqueue(req, room, payload))`` without building the event (as
    ``kv_done``)."""
    _require_live(state)
    _enqueue(state, req, room, payload)


def kv_done(state: SystemState, rank: int, req: int) -> None:
    """``apply(state, KvDone(rank, req))`` without building the event: for drivers that
    write no trace and deliver many events (the simulator). Same transition, same errors."""
    _require_live(state)
    _kv_done(state, rank, req)


def fail(state: SystemState, rank: int, req: int) -> None:
    """``apply(state, Fail(rank, req))`` without building the event (as ``kv_done``)."""
    _require_live(state)
    _fail(state, rank, req)


def land(state: SystemState, rank: int, req: int, field: str) -> None:
    """``apply(state, Land(rank, req, field))`` without building the event (as ``kv_done``)."""
    _require_live(state)
    _land(state, rank, req, field)


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
    if admitting(state):
        events.extend(e for e in new_requests if e.req not in state.requests)
    v = state.variant
    for k, rs in enumerate(state.ranks):
        for r in rs.queue:
            p = rs.recv[r]
            if p not in _LATCHED:
                events.append(KvDone(k, r))
            if p != _FAILED:
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
