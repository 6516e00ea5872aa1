"""The system state held across ranks, for drivers that take millions of events (the
simulator): the same transitions as ``machine.apply``, with each request's per-rank
facts packed into rank bitmasks.

Where admission is agreed and no failed slot is held (``packs(variant)``), every rank
queues the same requests in the same order until the ranks decide a request
differently, so a request's receivers, landed fields, fences and quarantines are one
bit per rank and its age and outcome are one value: a step, an enqueue or a request's
batch of writes touches a few ints instead of a dict entry on every rank. Only the
metadata rows and the free lists stay per rank. The decisions are the kernel's own
tables (``machine._tables``), the refusal messages ``machine._refusal``'s (on a view
of the state: ``system()``).

The first step whose outcome the packed form cannot hold (ranks that pop differently,
or read different payloads: a divergence in the making) is taken by machine.py on
``system()``, and from then on every event goes to machine.py on that state, as it
does from the start for the other variants. ``system()`` is the SystemState ``apply``
would have built: tests/spec/test_spec_packed.py checks it after every event of random
walks of every variant, refusals, fallbacks and hangs included.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from model.spec import machine
from model.spec.batch import Stepper, decode, deliver
from model.spec.invariants import Violation, misread, step_violations
from model.spec.kernel import compare_index
from model.spec.events import Fence, Step
from model.spec.machine import (_AGES_FROM, _COMMIT, _FAILED, _KEEP, _NO_DEFERRAL, _SUCCESS,
                                KV_DONE, PAYLOAD_LANDS, ROOM_LANDS, EventNotEnabled,
                                StepPops, StepRecord, _refusal, _tables)
from model.spec.state import (ALL_FIELDS, PAYLOAD_BIT, ROOM_BIT, WAITING, RankState, Request,
                              SystemState, initial_state)
from model.spec.variants import Admission, FreeOrder, Variant

__all__ = ["PackedState", "packs"]
_STEP = Step()


def packs(v: Variant) -> bool:
    """The variants whose ranks keep equal queues by construction (until a divergence)."""
    return v.admission is Admission.AGREED and v.defer_failed is _NO_DEFERRAL


def _record(fields: tuple) -> StepPops:
    """StepPops(step, popped, hang) built in C (a named tuple's own constructor is a
    Python function, a noticeable part of a step that pops nothing)."""
    return tuple.__new__(StepPops, fields)


def _row_free(gate: tuple) -> tuple[tuple, tuple]:
    """From the gate table (index poll * 16 + 8 * timed + compare_index), per poll and
    (timed, expected room 0), i.e. per index // 4: the value where it is the same for
    every seen room (the gate reads no row there), else None; and per (timed, expected
    room 0) the least value a Success can give."""
    values = [{g for g in gate[i:i + 4] if g is not None} for i in range(0, len(gate), 4)]
    unread = tuple(next(iter(v)) if len(v) == 1 else None for v in values)
    return unread, tuple(min(v) for v in values[_SUCCESS * 4:_SUCCESS * 4 + 4])


def _put(rows: list[list[int]], slots: tuple[int, ...], value: int) -> None:
    """Every rank k's row in its slot ``slots[k]`` (rows by slot, then rank) := value."""
    first = slots[0]
    if slots.count(first) == len(slots):       # the same slot on every rank: one new row
        rows[first] = [value] * len(slots)
        return
    for k, slot in enumerate(slots):
        rows[slot][k] = value


def _seen(rows: list[list[int]], slots: tuple[int, ...]) -> list[int]:
    """Each rank's value in its slot."""
    first = slots[0]
    if slots.count(first) == len(slots):
        return rows[first]
    return [rows[slot][k] for k, slot in enumerate(slots)]


class _Req:
    """One request on every rank: bit k of a mask is rank k."""
    __slots__ = ("ok", "failed", "age", "slots", "payload", "room", "live", "fenced",
                 "quarantined", "outcome", "foreign", "reduced", "timed", "sent_room",
                 "sent_payload")

    def __init__(self, room: int, payload: int, slots: tuple[int, ...], live: int):
        self.sent_room, self.sent_payload = room, payload    # its metadata row, as written
        self.ok = self.failed = 0            # receivers latched Success / Failed
        self.age = 0
        self.slots = slots                   # its slot on each rank
        self.payload = self.room = 0         # fields landed
        self.live = live                     # ranks that keep its slot (writes may land)
        self.fenced = self.quarantined = 0
        self.outcome: tuple[str, int] | None = None    # once popped (the same on every rank)
        # ranks where another request's late write hit its slot while it held it: where
        # this bit is clear and its own field landed, the row holds its own value
        self.foreign = 0
        # its last MIN and whether the timeout had passed then; -1: an event changed an
        # input since (its receivers or rows), so the next step computes it again
        self.reduced, self.timed = -1, 0


class PackedState:
    """A SystemState in packed form (see the module doc); ``general=True`` starts on
    machine.py's form (a trace needs its step records)."""

    def __init__(self, variant: Variant, n_ranks: int, n_slots: int, general: bool = False):
        base = initial_state(variant, n_ranks, n_slots)
        self.variant, self.n_ranks, self.n_slots = variant, n_ranks, n_slots
        self.general: SystemState | None = base if general or not packs(variant) else None
        self._steps = 0
        self.reqs: dict[int, _Req] = {}      # enqueued and not forgotten
        self.queue: list[int] = []
        # the metadata rows by slot, then rank (a request mostly has the same slot on
        # every rank, so its rows are one list)
        self.rooms = [[0] * n_ranks for _ in range(n_slots)]
        self.payloads = [[0] * n_ranks for _ in range(n_slots)]
        self.free = [deque(rs.free) for rs in base.ranks]
        self.all_ranks = (1 << n_ranks) - 1
        self._no_pops = ((),) * n_ranks
        # the requests that age, after a step that could pop nothing, until an event
        self._kept: list[_Req] | None = None
        self._pow2 = tuple(1 << code for code in range(4 * n_ranks))
        self._codes = tuple((kind, k, 1 << k) for kind in range(4) for k in range(n_ranks))
        self._tables = _tables(variant)
        self._unread, self._success_floor = _row_free(self._tables[0])
        self._stepper = None if self.general is None else Stepper(self.general)

    # -- views -----------------------------------------------------------------------
    def system(self) -> SystemState:
        """The state as machine.py holds it (a new object, unless fallen back)."""
        if self.general is not None:
            return self.general
        ranks = []
        for k in range(self.n_ranks):
            bit = 1 << k
            rs = RankState(list(self.queue), {}, {}, {}, {}, set(), set(),
                           [row[k] for row in self.rooms], [row[k] for row in self.payloads],
                           list(self.free[k]))
            for r, q in self.reqs.items():
                if q.outcome is None:
                    rs.recv[r] = _SUCCESS if q.ok & bit else _FAILED if q.failed & bit else WAITING
                    rs.age[r] = q.age
                else:
                    rs.outcomes[r] = q.outcome
                if q.live & bit:
                    rs.slot_of[r] = q.slots[k]
                    rs.landed[r] = (ROOM_BIT if q.room & bit else 0) | (
                        PAYLOAD_BIT if q.payload & bit else 0)
                    if q.fenced & bit:
                        rs.fenced.add(r)
                    if q.quarantined & bit:
                        rs.quarantined.add(r)
            ranks.append(rs)
        requests = {r: Request(q.sent_room, q.sent_payload) for r, q in self.reqs.items()}
        return SystemState(self.variant, self.n_slots, ranks, requests, self._steps)

    def _fall_back(self) -> Stepper:
        """machine.py's form from now on (its Stepper, on system())."""
        self.general = self.system()
        stepper = self._stepper = Stepper(self.general)
        self.reqs, self.queue = {}, []
        return stepper

    @property
    def steps(self) -> int:
        return self._steps if self.general is None else self.general.steps

    def queued(self) -> int:
        """How many requests rank 0 queues (every rank's count, in the packed form)."""
        return len(self.queue) if self.general is None else len(self.general.ranks[0].queue)

    def in_queue(self, rank: int, req: int) -> bool:
        if self.general is not None:
            return req in self.general.ranks[rank].recv
        q = self.reqs.get(req)
        return q is not None and q.outcome is None

    def writes_pending(self, rank: int, req: int) -> bool:
        """Rank ``rank`` keeps ``req``'s slot for writes not yet landed or fenced."""
        if self.general is not None:
            rs = self.general.ranks[rank]
            return req in rs.landed and req not in rs.fenced and rs.landed[req] != ALL_FIELDS
        q, bit = self.reqs.get(req), 1 << rank
        return q is not None and bool(q.live & bit) and not q.fenced & bit and not (
            q.room & q.payload & bit)

    def fenceable(self, rank: int, req: int) -> bool:
        """Rank ``rank`` tracks a write of ``req`` that is not fenced."""
        if self.general is not None:
            rs = self.general.ranks[rank]
            return req in rs.landed and req not in rs.fenced
        q, bit = self.reqs.get(req), 1 << rank
        return q is not None and bool(q.live & bit) and not q.fenced & bit

    def tracked(self, req: int) -> bool:
        """Some rank still keeps a slot for ``req`` (forget must wait)."""
        if self.general is not None:
            return any(req in rs.slot_of for rs in self.general.ranks)
        q = self.reqs.get(req)
        return q is not None and q.live != 0

    # -- environment events ----------------------------------------------------------
    def admitting(self) -> bool:
        """The next request can be enqueued (by every rank, or by some with local
        admission)."""
        if self.general is not None:
            return bool(machine.admitting(self.general))
        return all(self.free)

    def enqueue(self, req: int, room: int, payload: int) -> None:
        if self.general is not None:
            return machine.enqueue(self.general, req, room, payload)
        if req in self.reqs:
            raise EventNotEnabled(f"enqueue: request {req} was already enqueued")
        if not all(self.free):
            full = next(k for k, free in enumerate(self.free) if not free)
            raise EventNotEnabled(f"enqueue: rank {full} has no free metadata slot")
        self.reqs[req] = _Req(room, payload, tuple(map(deque.popleft, self.free)), self.all_ranks)
        self.queue.append(req)
        self._kept = None

    def deliver(self, req: int, codes: Sequence[int]) -> None:
        """batch.deliver: each event ``kind * ranks + rank`` of ``req`` in order (a
        refused one raises after those before it were performed; a bad code before any)."""
        if self.general is not None:
            return deliver(self.general, req, codes)
        table = self._codes
        try:
            bad = bool(codes) and (min(codes) < 0 or max(codes) >= len(table))
        except TypeError:
            bad = True
        if bad:
            decode(self.n_ranks, codes)          # raises, naming the code
        self._kept = None
        q = self.reqs.get(req)
        if q is not None and q.outcome is None:
            q.reduced = -1
            if len(codes) > 1:
                events, bits = 0, self._pow2
                for code in codes:
                    events |= bits[code]
                if events.bit_count() == len(codes) and self._at_once(q, events, codes):
                    return           # (distinct codes: a code twice goes to the loop)
        for code in codes:           # one by one: a refused event raises after the others
            self._arrive(req, q, *table[code])

    def deliver_set(self, req: int, events: object) -> None:
        """``deliver`` of the codes in the set ``events`` (bit ``code``), in code order:
        every KvDone, then every Fail, every payload, every room. A driver may hand a
        request's events over so when that order is as good as its own: events on
        different ranks commute (each touches its rank's receiver, row and slot), so it
        holds where each rank's events come in kind order, as KV, then payload, then
        room do in the simulator's physics."""
        if (not isinstance(events, int) or isinstance(events, bool) or events < 0
                or events >> len(self._codes)):      # (object: checked here, not at the call)
            raise EventNotEnabled(f"deliver_set: {events!r} is not a set of event codes "
                                  f"0..{len(self._codes) - 1}")
        q = self.reqs.get(req) if self.general is None else None
        self._kept = None
        if q is not None and q.outcome is None:
            q.reduced = -1
            if self._at_once(q, events, None):
                return
        self.deliver(req, [code for code in range(len(self._codes)) if events >> code & 1])

    def _at_once(self, q: _Req, events: int, codes: Sequence[int] | None) -> bool:
        """Perform the set of events ``events`` of a queued request (``codes``: their
        order, None for code order) as one mask update where their order cannot matter
        and none is refused (no rank both done and failed, no field landing twice, the
        room after its payload where the variant orders them); False (nothing done)
        otherwise, for the loop in order."""
        T, everyone = self.n_ranks, self.all_ranks
        done, failed = events & everyone, events >> T & everyone
        payload, room = events >> 2 * T & everyone, events >> 3 * T
        if done & (q.ok | q.failed) or failed & q.failed or done & failed or (
                payload & q.payload or room & q.room):
            return False
        unpaid = room & ~q.payload
        if unpaid and self.variant.room_after_payload:
            if unpaid & ~payload:
                return False
            if codes is not None:       # (in code order each payload precedes its room)
                position = codes.index
                for k in range(T):
                    if unpaid >> k & 1 and position(3 * T + k) < position(2 * T + k):
                        return False
        q.ok = (q.ok | done) & ~failed
        q.failed |= failed
        for fields, rows, value in ((payload, self.payloads, q.sent_payload),
                                    (room, self.rooms, q.sent_room)):
            if fields == everyone:
                _put(rows, q.slots, value)
            elif fields:
                for k, slot in enumerate(q.slots):
                    if fields >> k & 1:
                        rows[slot][k] = value
        q.payload |= payload
        q.room |= room
        return True

    def _arrive(self, req: int, q: _Req | None, kind: int, k: int, bit: int) -> None:
        """machine._arrive of one event on the packed fields (a queued request's slot is
        live and unfenced on every rank)."""
        if kind < PAYLOAD_LANDS:
            if q is None or q.outcome is not None or q.failed & bit or (
                    kind == KV_DONE and q.ok & bit):
                raise _refusal(self.system(), req, kind, k)
            if kind == KV_DONE:
                q.ok |= bit
            else:
                q.failed |= bit
                q.ok &= ~bit
            return
        room = kind == ROOM_LANDS
        if q is None or not q.live & bit or (q.room if room else q.payload) & bit or (
                q.fenced & bit) or (room and self.variant.room_after_payload and
                                    not q.payload & bit):
            raise _refusal(self.system(), req, kind, k)
        slot = q.slots[k]
        if room:
            self.rooms[slot][k] = q.sent_room
            q.room |= bit
        else:
            self.payloads[slot][k] = q.sent_payload
            q.payload |= bit
        if q.outcome is not None:        # a late write: the slot may have a new tenant
            self._mark_tenant(k, slot, bit)
            self._writes_done(q, bit, k)

    def _mark_tenant(self, k: int, slot: int, bit: int) -> None:
        """A late write hit ``slot`` on rank k: its queued tenant's row is foreign there."""
        for tenant in self.queue:
            other = self.reqs[tenant]
            if other.slots[k] == slot:
                other.foreign |= bit
                other.reduced = -1
                return

    def _writes_done(self, q: _Req, bit: int, k: int) -> None:
        """machine._writes_done on rank k of a request that left the queue."""
        done = bool(q.room & q.payload & bit or q.fenced & bit)
        if q.quarantined & bit and done:
            q.quarantined &= ~bit
            self._release(q.slots, self.all_ranks & ~bit)
        if done:
            q.live &= ~bit
            q.fenced &= ~bit

    def _release(self, slots: tuple[int, ...], kept: int) -> None:
        """machine._free_slots: each rank's slot (of ``slots``) back to its free list,
        zeroed first where the variant clears, except on the ranks in mask ``kept``."""
        clear = self.variant.clear_on_free
        if not kept:
            if clear:
                _put(self.rooms, slots, 0)
            deque(map(deque.append, self.free, slots), 0)    # each rank's append, in C
            return
        for k, slot in enumerate(slots):
            if not kept >> k & 1:
                if clear:
                    self.rooms[slot][k] = 0
                self.free[k].append(slot)

    def fence(self, rank: int, req: int) -> None:
        if self.general is not None:
            machine.apply(self.general, Fence(rank, req))
            return
        q = self.reqs.get(req)
        bit = 1 << rank if 0 <= rank < self.n_ranks else 0
        if not bit or q is None or q.outcome is None or not q.live & bit or q.fenced & bit:
            machine.apply(self.system(), Fence(rank, req))     # raises its refusal
            raise AssertionError(f"fence ({rank}, {req}): refused here, enabled in machine.py")
        q.fenced |= bit
        self._kept = None
        self._writes_done(q, bit, rank)

    def forget_done(self, reqs: Sequence[int]) -> list[int]:
        """``forget`` each request of ``reqs`` that no rank keeps a slot for any more;
        returns the others (still written somewhere), in order."""
        kept = []
        for r in reqs:
            if self.tracked(r):
                kept.append(r)
            else:
                self.forget(r)
        return kept

    def forget(self, req: int) -> None:
        if self.general is not None:
            return machine.forget(self.general, req)
        q = self.reqs.get(req)
        if q is None or q.outcome is None or q.live:
            machine.forget(self.system(), req)                   # raises its refusal
            raise AssertionError(f"forget {req}: refused here, allowed in machine.py")
        del self.reqs[req]

    def violations(self, rec: StepPops | StepRecord) -> list[Violation]:
        """invariants.step_violations of the step just taken. A packed step keeps the
        queues equal and every rank's pops the same (else machine.py took it), so of
        what a step can break only no_corruption is left to look for: on a commit that
        read another payload, the full check on ``system()``."""
        if self.general is not None:
            return step_violations(self.general, rec)
        reqs = self.reqs
        if misread(rec.popped[0], lambda r: reqs[r].sent_payload):
            return step_violations(self.system(), rec)
        return []

    # -- the protocol step -----------------------------------------------------------
    def step(self, quiet: bool = False) -> StepPops:
        """``apply(Step(), detail=False)``. ``quiet`` (no event since the last step)
        lets machine.py's form repeat a step that kept every request (batch.Stepper).
        The packed form keeps each request's MIN until an event changes it, and knows
        itself when no event came since a step that could pop nothing: without a
        timeout to reach, that step repeats (only the ages move)."""
        if self._stepper is not None:
            return self._stepper.step(quiet)
        queue = self.queue
        popping: list[int] = []
        decided: list[tuple[int, int, int]] | None = []
        if self._kept is not None:                # the last step, again
            ageing = self._kept
        else:
            reduced, popping, ageing = self._reduce()
            if popping:
                decided = self._decide(reduced, popping)
            if decided is None:                   # the ranks part: machine.py's step
                return self._fall_back().step(False)
        step_no = self._steps
        self._steps += 1
        for q in ageing:
            q.age += 1
        if not decided:
            if not popping and self.variant.timeout_steps is None:
                self._kept = ageing
            return _record((step_no, self._no_pops, None))
        popped = tuple((queue[pos], d, p) for pos, d, p in decided)
        leaving = [pos for pos, _, _ in decided]
        self.queue = [r for pos, r in enumerate(queue) if pos not in leaving]
        self._leave(popped, leaving)
        return _record((step_no, (popped,) * self.n_ranks, None))

    def _reduce(self) -> tuple[list[int], list[int], list[_Req]]:
        """The MIN over ranks of each queued request's gated poll (machine._polls: the
        kernel's gate table at each rank's poll, and its row's room against the
        request's); the positions of those the MIN may let leave; and the requests that
        age if kept (the MIN says every receiver latched Success)."""
        out: list[int] = []
        popping: list[int] = []
        ageing: list[_Req] = []
        keeps, timeout = self._tables[2], self.variant.timeout_steps
        reqs = self.reqs
        for r in self.queue:
            q = reqs[r]
            timed = 8 if timeout is not None and q.age >= timeout else 0
            low = q.reduced
            if low < 0 or q.timed != timed:
                low = q.reduced = self._min(q, q.sent_room, timed)
                q.timed = timed
            out.append(low)
            if not keeps[low]:
                popping.append(len(out) - 1)
            if low >= _AGES_FROM:
                ageing.append(q)
        return out, popping, ageing

    def _min(self, q: _Req, expected: int, timed: int) -> int:
        """One request's MIN (see _reduce); ``timed`` is 8 where its age reached the
        timeout (the gate table's timed offset)."""
        gate, everyone = self._tables[0], self.all_ranks
        own = compare_index(expected, expected)      # a row that holds its own room
        if q.ok == q.room == everyone and not q.foreign:
            # every receiver latched Success and every row holds its own room
            return gate[_SUCCESS * 16 + timed + own]
        ok, failed = q.ok, q.failed
        if ok != everyone:
            # The ranks that have not latched Success give the gate table's value for
            # their poll where it reads no row (_row_free's groups: timed, and whether
            # the expected room is 0); the Success ones count only where their least
            # value could be lower still.
            group, flat = (timed + (own & 4)) // 4, self._unread
            low_failed = flat[_FAILED * 4 + group] if failed else _SUCCESS
            low_waiting = flat[WAITING * 4 + group] if everyone & ~(ok | failed) else _SUCCESS
            if low_failed is not None and low_waiting is not None:
                low = min(low_failed, low_waiting)
                if not ok or self._success_floor[group] >= low:
                    return low
        low, bit = _SUCCESS, 1
        for seen in _seen(self.rooms, q.slots):
            poll = _SUCCESS if ok & bit else _FAILED if failed & bit else WAITING
            g = gate[poll * 16 + timed + compare_index(seen, expected)]
            if g < low:
                low = g
            bit <<= 1
        return low

    def _decide(self, reduced: list[int], popping: list[int]) -> list[tuple[int, int, int]] | None:
        """(position, Decision, payload read) of each request the MIN lets leave, the
        same on every rank; None if any rank decides or reads otherwise."""
        out: list[tuple[int, int, int]] = []
        reqs, rooms, payloads = self.reqs, self.rooms, self.payloads
        queue, everyone, pop = self.queue, self.all_ranks, self._tables[1]
        for pos in popping:
            r = queue[pos]
            q = reqs[r]
            expected, row = q.sent_room, reduced[pos] * 8
            if q.room == q.payload == everyone and not q.foreign:   # its own rows everywhere
                d = pop[row + compare_index(expected, expected)]
                first = (d, q.sent_payload if d == _COMMIT else 0)
            else:
                first = (-1, 0)           # (no rank yet: every rank holds it, agreed admission)
                for seen, read in zip(_seen(rooms, q.slots), _seen(payloads, q.slots)):
                    d = pop[row + compare_index(seen, expected)]
                    got = (d, read if d == _COMMIT else 0)
                    if first[0] < 0:
                        first = got
                    elif got != first:
                        return None
            if first[0] != _KEEP:    # (every rank keeps it: the MIN was Success, no room)
                out.append((pos, first[0], first[1]))
        return out

    def _leave(self, popped: Sequence[tuple[int, int, int]], positions: list[int]) -> None:
        """machine._leave, _free_slots and _forget_if_done on every rank at once: each
        rank frees the slot now, or quarantines it while writes are pending there."""
        if self.variant.free_order is not FreeOrder.QUEUE:
            popped = machine._set_order(list(popped), positions)
        quarantine, everyone = self.variant.fence_before_reuse, self.all_ranks
        reqs = self.reqs
        for r, d, payload in popped:
            q = reqs[r]
            q.outcome = ("commit", payload) if d == _COMMIT else ("abort", d)
            done = (q.room & q.payload) | q.fenced       # ranks no write can reach any more
            q.quarantined = everyone & ~done if quarantine else 0
            self._release(q.slots, q.quarantined)
            q.live &= ~done
            q.fenced &= ~done
