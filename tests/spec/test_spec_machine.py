"""The transition function: enabling conditions, typed refusals that leave the state
untouched, slot FIFO / clearing / fencing / quarantine, and the purity of ``step``."""
from __future__ import annotations

import random

import pytest

from model.spec.events import PAYLOAD, ROOM, Enqueue, Fail, Fence, KvDone, Land, Step
from model.spec.kernel import Decision
from model.spec.kvpoll import KVPoll
from model.spec.machine import EventNotEnabled, apply, enabled, step
from model.spec.state import initial_state
from model.spec.variants import VARIANTS


def fresh(state, n: int = 1) -> list[Enqueue]:
    base = max(state.requests, default=-1) + 1
    return [Enqueue(base + i, 100 + base + i, 500 + base + i) for i in range(n)]


def walk(variant: str, seed: int, length: int, ranks: int = 2, slots: int = 2):
    """A seeded random run; yields every state reached (the same object, mutated)."""
    rng = random.Random(seed)
    s = initial_state(VARIANTS[variant], ranks, slots)
    yield s
    for _ in range(length):
        events = enabled(s, fresh(s))
        if not events:
            return
        apply(s, rng.choice(events))
        yield s


def universe(state) -> list:
    """Every event over the ranks and requests seen so far, one rank and request past them."""
    reqs = list(range(max(state.requests, default=-1) + 2))
    out = [Step(), *fresh(state)]
    if 0 in state.requests:
        out.append(Enqueue(0, 1, 1))      # a duplicate id
    for k in range(state.n_ranks + 1):
        for r in reqs:
            out += [KvDone(k, r), Fail(k, r), Fence(k, r), Land(k, r, ROOM), Land(k, r, PAYLOAD)]
    return out + [Land(0, 0, "checksum")]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_enabled_is_exactly_what_apply_accepts(variant):
    refused = accepted = 0
    for seed in range(12):
        for s in walk(variant, seed, 30):
            on = enabled(s, fresh(s))
            for ev in universe(s):
                before = s.key(), s.steps
                trial = s.copy()
                try:
                    apply(trial, ev)
                except EventNotEnabled as exc:
                    refused += 1
                    assert ev not in on, f"{ev} is listed as enabled but refused: {exc}"
                    assert (trial.key(), trial.steps) == before, f"refusing {ev} changed the state"
                    assert str(exc) and "\n" not in str(exc)
                else:
                    accepted += 1
                    assert ev in on, f"{ev} was accepted but enabled() does not list it"
    assert refused > 100 and accepted > 100


def test_hung_state_refuses_everything():
    s = initial_state(VARIANTS["ungated"], 2, 2)
    for ev in [Enqueue(1, 7, 5), KvDone(0, 1), KvDone(1, 1), Land(0, 1, PAYLOAD), Land(0, 1, ROOM),
               Step(), Enqueue(2, 8, 6)]:
        apply(s, ev)
    rec = apply(s, Step())
    assert rec.hang == (1, 2) and s.hung == (1, 2)
    assert enabled(s, fresh(s)) == []
    with pytest.raises(EventNotEnabled, match="hung in a mismatched collective"):
        apply(s, Step())


def test_out_of_range_rank_and_unknown_field_are_refused():
    s = initial_state(VARIANTS["gate"], 2, 2)
    apply(s, Enqueue(1, 7, 5))
    with pytest.raises(EventNotEnabled, match="rank 2 out of range 0..1"):
        apply(s, KvDone(2, 1))
    with pytest.raises(EventNotEnabled, match="unknown field"):
        apply(s, Land(0, 1, "logprobs"))


def test_receiver_latches_but_a_failure_after_success_is_honoured_while_queued():
    s = initial_state(VARIANTS["gate"], 1, 1)
    apply(s, Enqueue(1, 7, 5))
    apply(s, KvDone(0, 1))
    assert s.ranks[0].recv[1] == KVPoll.Success
    with pytest.raises(EventNotEnabled, match="already latched Success"):
        apply(s, KvDone(0, 1))
    apply(s, Fail(0, 1))                       # the gate was holding it: Failed wins
    assert s.ranks[0].recv[1] == KVPoll.Failed
    for ev in (Fail(0, 1), KvDone(0, 1)):
        with pytest.raises(EventNotEnabled, match="already latched Failed"):
            apply(s, ev)
    apply(s, Step())
    assert s.ranks[0].outcomes[1] == ("abort", Decision.ABORT_FAILED)
    with pytest.raises(EventNotEnabled, match="not in rank 0's transfer queue"):
        apply(s, Fail(0, 1))


def test_slots_are_a_fifo_free_list():
    s = initial_state(VARIANTS["gate"], 1, 3)
    apply(s, Enqueue(0, 100, 500))
    apply(s, Enqueue(1, 101, 501))
    rs = s.ranks[0]
    assert (rs.slot_of[0], rs.slot_of[1], rs.free) == (0, 1, [2])
    apply(s, Fail(0, 1))
    apply(s, Step())                        # r1 aborts; slot 1 goes to the back
    assert rs.free == [2, 1]
    apply(s, Enqueue(2, 102, 502))
    apply(s, Enqueue(3, 103, 503))
    assert (rs.slot_of[2], rs.slot_of[3], rs.free) == (2, 1, [])
    with pytest.raises(EventNotEnabled, match="no free metadata slot"):
        apply(s, Enqueue(4, 104, 504))


def test_a_named_slot_must_be_free_on_its_rank():
    """A trace of a real run names the slot each rank's allocator gave (live): the spec
    takes exactly those, and refuses one it still holds, saying who holds it."""
    s = initial_state(VARIANTS["strict"], 2, 3)
    apply(s, Enqueue(0, 100, 500, slots=(2, 1)))
    assert [rs.slot_of[0] for rs in s.ranks] == [2, 1]
    assert [rs.free for rs in s.ranks] == [[0, 1], [0, 2]]
    apply(s, Fail(0, 0))
    apply(s, Step())                         # aborted everywhere; its writes may still land
    with pytest.raises(EventNotEnabled, match="slot 2 on rank 0 is still held by request 0 "
                                              r"\(quarantined until its writes are fenced\)"):
        apply(s, Enqueue(1, 101, 501, slots=(2, 0)))
    assert 1 not in s.requests                 # refused: the state untouched
    apply(s, Fence(0, 0))
    apply(s, Fence(1, 0))
    apply(s, Enqueue(1, 101, 501, slots=(2, 1)))     # fenced: reused on both ranks
    with pytest.raises(EventNotEnabled, match="slot 2 on rank 0 is still held by request 1 "
                                              r"\(queued\)"):
        apply(s, Enqueue(2, 102, 502, slots=(2, 0)))
    with pytest.raises(EventNotEnabled, match="3 slots named for 2 ranks"):
        apply(s, Enqueue(2, 102, 502, slots=(0, 0, 0)))


def test_agreed_deferral_releases_at_the_fence_that_makes_every_holder_ready():
    """0.5.23 resolves its holds before each admission: the last holder's fence releases
    the slot on every rank at once (before the next enqueue), an earlier one does not."""
    s = initial_state(VARIANTS["deferred"], 2, 1)
    apply(s, Enqueue(0, 100, 500))
    for k in (0, 1):
        apply(s, Fail(k, 0))
    apply(s, Step())
    assert [rs.held for rs in s.ranks] == [{0: 0}, {0: 0}]
    apply(s, Fence(0, 0))
    assert [rs.free for rs in s.ranks] == [[], []]          # rank 1 may still be written
    apply(s, Fence(1, 0))
    assert [rs.free for rs in s.ranks] == [[0], [0]] and not any(rs.held for rs in s.ranks)
    apply(s, Enqueue(1, 101, 501, slots=(0, 0)))             # reused before any step


def _commit_one(variant: str):
    s = initial_state(VARIANTS[variant], 1, 1)
    for ev in (Enqueue(1, 7, 5), KvDone(0, 1), Land(0, 1, PAYLOAD), Land(0, 1, ROOM)):
        apply(s, ev)
    rec = apply(s, Step())
    assert rec.ranks[0].popped == ((1, 1, 5),)
    return s.ranks[0]


@pytest.mark.parametrize("variant, room_after", [("ungated", 7), ("gate-noclear", 7),
                                                 ("gate", 0), ("strict", 0)])
def test_room_is_zeroed_on_free_only_where_the_variant_clears(variant, room_after):
    rs = _commit_one(variant)
    assert rs.room_at == [room_after]
    assert rs.payload_at == [5]            # only the room column is cleared
    assert rs.free == [0] and rs.outcomes == {1: ("commit", 5)}


def _abort_before_landing(variant: str):
    s = initial_state(VARIANTS[variant], 1, 1)
    apply(s, Enqueue(1, 7, 5))
    apply(s, Fail(0, 1))
    apply(s, Step())
    return s


def test_strict_quarantines_a_slot_until_its_writes_land():
    s = _abort_before_landing("strict")
    rs = s.ranks[0]
    assert rs.quarantined == {1} and rs.free == []
    apply(s, Land(0, 1, PAYLOAD))
    assert rs.quarantined == {1} and rs.free == []
    apply(s, Land(0, 1, ROOM))             # the late write lands into the quarantined slot
    assert rs.quarantined == set() and rs.free == [0] and rs.room_at == [0]
    assert 1 not in rs.slot_of             # nothing more can land for it


def test_strict_fence_releases_the_slot_and_stops_late_writes():
    s = _abort_before_landing("strict")
    rs = s.ranks[0]
    apply(s, Fence(0, 1))
    assert rs.quarantined == set() and rs.free == [0]
    with pytest.raises(EventNotEnabled, match="no write in flight"):
        apply(s, Land(0, 1, ROOM))


@pytest.mark.parametrize("variant", ["ungated", "gate-noclear", "gate"])
def test_other_variants_free_at_once_and_let_late_writes_land(variant):
    s = _abort_before_landing(variant)
    rs = s.ranks[0]
    assert rs.free == [0] and rs.quarantined == set()
    apply(s, Enqueue(2, 8, 6))
    apply(s, Land(0, 1, ROOM))             # r1's late write lands in r2's slot
    assert rs.room_at == [7] and rs.room_seen(2) == 7


def test_fence_needs_a_departed_request_with_writes_in_flight():
    s = initial_state(VARIANTS["strict"], 1, 1)
    apply(s, Enqueue(1, 7, 5))
    with pytest.raises(EventNotEnabled, match="has not left"):
        apply(s, Fence(0, 1))


def test_strict_lands_the_room_only_after_the_payload():
    s = initial_state(VARIANTS["strict"], 1, 1)
    apply(s, Enqueue(1, 7, 5))
    with pytest.raises(EventNotEnabled, match="before its payload"):
        apply(s, Land(0, 1, ROOM))
    apply(s, Land(0, 1, PAYLOAD))
    apply(s, Land(0, 1, ROOM))
    with pytest.raises(EventNotEnabled, match="already landed"):
        apply(s, Land(0, 1, ROOM))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_step_never_mutates_its_input(variant):
    for seed in range(8):
        for s in walk(variant, 100 + seed, 25):
            before = (s.key(), s.steps, s.hung)
            snapshot = s.copy()
            for ev in enabled(s, fresh(s)):
                nxt, _ = step(s, ev)
                assert nxt is not s
                assert (s.key(), s.steps, s.hung) == before
            assert s.key() == snapshot.key()


def test_enqueue_happens_on_every_rank_and_ages_count_only_gate_held_steps():
    s = initial_state(VARIANTS["gate"], 3, 2)
    apply(s, Enqueue(4, 7, 5))
    apply(s, Step())
    apply(s, Step())
    for rs in s.ranks:       # WaitingForInput is the receiver's timeout, not the gate's
        assert rs.queue == [4] and rs.age == {4: 0} and rs.recv[4] == KVPoll.WaitingForInput
    for k in range(3):
        apply(s, KvDone(k, 4))
    apply(s, Land(0, 4, "room"))
    apply(s, Step())         # every rank latched Success, ranks 1 and 2 hold it: MIN Transferring
    assert [rs.age for rs in s.ranks] == [{4: 1}] * 3
    assert s.steps == 3
    with pytest.raises(EventNotEnabled, match="already enqueued"):
        apply(s, Enqueue(4, 9, 9))


def test_queues_identical_reports_several_differing_ranks():
    from model.spec.invariants import queues_identical
    s = initial_state(VARIANTS["gate"], 3, 2)
    s.ranks[0].queue, s.ranks[1].queue, s.ranks[2].queue = [1, 2], [2], [1]
    (v,) = queues_identical(s)
    assert v.invariant == "queues_identical" and v.ranks == (0, 1, 2) and v.reqs == (1, 2)
