"""The spec's invariants over the encoding (same names as model/spec/invariants.py)
and the strengthening lemmas the inductive proofs need, each a named predicate."""
from __future__ import annotations

from typing import Callable

import z3

from model.spec.kvpoll import KVPoll
from model.encoding.vocab import Ctx, State

Pred = Callable[[Ctx, State], z3.BoolRef]
_POLLS_HELD = (int(KVPoll.Failed), int(KVPoll.WaitingForInput), int(KVPoll.Success))


def queues_identical(c: Ctx, s: State) -> z3.BoolRef:
    """Same members on every rank (= same list: see the queue-order argument in actions.py)."""
    return c.forall(("Rank", "Rank", "Req"), lambda k1, k2, r: s.inq(k1, r) == s.inq(k2, r))


def outcomes_agree(c: Ctx, s: State) -> z3.BoolRef:
    return c.forall(("Rank", "Rank", "Req"), lambda k1, k2, r: z3.And(
        s.dec(k1, r) == s.dec(k2, r), z3.Implies(s.dec(k1, r), s.commit(k1, r) == s.commit(k2, r))))


def no_corruption(c: Ctx, s: State) -> z3.BoolRef:
    return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(z3.And(s.dec(k, r), s.commit(k, r)),
                                                             s.cpay(k, r) == c.payload(r)))


def exactly_once(c: Ctx, s: State) -> z3.BoolRef:
    """Never queued and decided at once (queued twice is impossible by the representation)."""
    return c.forall(("Rank", "Req"), lambda k, r: z3.Not(z3.And(s.inq(k, r), s.dec(k, r))))


def bounded_wait(c: Ctx, s: State) -> z3.BoolRef:
    """strict's liveness bound: a queued request has been polled at most timeout_steps
    times (a variant without timeout: at most some W >= 1 times)."""
    bound = c.variant.timeout_steps
    if bound is None:           # no timeout: any bound W >= 1 (Ctx.wait_bound)
        bound = c.wait_bound
    return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(s.inq(k, r), s.age(k, r) <= bound))


# -- strengthening lemmas ---------------------------------------------------------------
def fresh_is_blank(c: Ctx, s: State) -> z3.BoolRef:
    """A request not yet enqueued has no queue entry, outcome, landed write or fence."""
    return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(z3.Not(s.enq(r)), z3.And(
        z3.Not(s.inq(k, r)), z3.Not(s.dec(k, r)), z3.Not(s.lr(k, r)), z3.Not(s.lp(k, r)),
        z3.Not(s.fen(k, r)), z3.Not(s.quar(k, r)), z3.Not(s.held(k, r)))))


def recv_range(c: Ctx, s: State) -> z3.BoolRef:
    """A queued receiver polls WaitingForInput, Success or Failed (the spec's only values)."""
    return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(
        s.inq(k, r), z3.Or([s.recv(k, r) == p for p in _POLLS_HELD])))


def ages_agree(c: Ctx, s: State) -> z3.BoolRef:
    return c.forall(("Rank", "Rank", "Req"), lambda k1, k2, r: z3.Implies(
        z3.And(s.inq(k1, r), s.inq(k2, r)), s.age(k1, r) == s.age(k2, r)))


def slot_owner(c: Ctx, s: State) -> z3.BoolRef:
    """A request that holds a slot owns it and the slot is not free (so no two holders share one)."""
    return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(s.occupies(k, r), z3.And(
        z3.Not(s.free(k, s.slot(k, r))), s.owner(k, s.slot(k, r)) == r)))


def slot_held(c: Ctx, s: State) -> z3.BoolRef:
    """A slot off the free list is held by its owner."""
    return c.forall(("Rank", "Slot"), lambda k, x: z3.Implies(z3.Not(s.free(k, x)), z3.And(
        s.occupies(k, s.owner(k, x)), s.slot(k, s.owner(k, x)) == x)))


def quarantine_decided(c: Ctx, s: State) -> z3.BoolRef:
    """A quarantined or deferred slot belongs to a request that left the queue."""
    return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(z3.Or(s.quar(k, r), s.held(k, r)), z3.And(
        s.dec(k, r), z3.Not(s.inq(k, r)), z3.Not(z3.And(s.quar(k, r), s.held(k, r))))))


def no_quarantine(c: Ctx, s: State) -> z3.BoolRef:
    """Variants without fence-before-reuse never quarantine a slot."""
    return c.forall(("Rank", "Req"), lambda k, r: z3.Not(s.quar(k, r)))


def occupancy_agrees(c: Ctx, s: State) -> z3.BoolRef:
    """Every rank's slots are held by the same requests (queued or deferred): with local
    admission that is what makes the ranks' free-slot counts, hence their admission
    decisions, equal (the capacity argument in actions._local_admission)."""
    return c.forall(("Rank", "Rank", "Req"), lambda k1, k2, r: s.occupies(k1, r) == s.occupies(k2, r))


def writes_to_held_slots(c: Ctx, s: State) -> z3.BoolRef:
    """Fencing: a write still in flight targets a slot its request still holds."""
    return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(s.pending(k, r), s.occupies(k, r)))


def free_rows_zero(c: Ctx, s: State) -> z3.BoolRef:
    return c.forall(("Rank", "Slot"), lambda k, x: z3.Implies(s.free(k, x), s.rroom(k, x) == 0))


def room_is_own_or_zero(c: Ctx, s: State) -> z3.BoolRef:
    return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(
        s.inq(k, r), s.seen(k, r) == z3.If(s.lr(k, r), c.room(r), 0)))


def room_after_payload(c: Ctx, s: State) -> z3.BoolRef:
    return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(s.lr(k, r), s.lp(k, r)))


def payload_is_own(c: Ctx, s: State) -> z3.BoolRef:
    return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(
        z3.And(s.inq(k, r), s.lp(k, r)), s.rpay(k, s.slot(k, r)) == c.payload(r)))


SAFETY: dict[str, Pred] = {
    "queues_identical": queues_identical,
    "outcomes_agree": outcomes_agree,
    "no_corruption": no_corruption,
    "exactly_once": exactly_once,
}

LEMMAS: dict[str, Pred] = {f.__name__: f for f in (
    fresh_is_blank, recv_range, ages_agree, slot_owner, slot_held, quarantine_decided,
    no_quarantine, occupancy_agrees,
    writes_to_held_slots, free_rows_zero, room_is_own_or_zero, room_after_payload, payload_is_own)}

PREDICATES: dict[str, Pred] = {**SAFETY, "bounded_wait": bounded_wait, **LEMMAS}
