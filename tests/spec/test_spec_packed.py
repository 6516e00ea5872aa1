"""``PackedState`` (the simulator's state, packed across ranks) is machine.py's
SystemState under ``apply``: after every event of random walks of every variant, its
``system()`` view has the same key and step count, every step the same StepPops, every
refused event the same message; walks reach the fallback to machine.py (ranks that
decide differently) and go on from there."""
import random

import pytest

from model.spec.events import Enqueue, Event, Fail, Fence, KvDone, Land, Step
from model.spec.machine import EventNotEnabled, apply
from model.spec.packed import PackedState, packs
from model.spec.state import initial_state
from model.spec.variants import ABLATIONS, VARIANTS, get_variant

from .walks import event_code, random_walk, refusal

ALL = [*VARIANTS.values(), *ABLATIONS.values(), get_variant("strict", 1), get_variant("strict", 2)]


def _perform(packed: PackedState, ev: Event, quiet: bool):
    """``ev`` on the packed form: its return (a step's StepPops) or the refusal."""
    try:
        if isinstance(ev, Step):
            return packed.step(quiet)
        if isinstance(ev, Enqueue):
            return packed.enqueue(ev.req, ev.room, ev.payload)
        if isinstance(ev, Fence):
            return packed.fence(ev.rank, ev.req)
        return packed.deliver(ev.req, [event_code(ev, packed.n_ranks)])
    except EventNotEnabled as exc:
        return str(exc)


def _reference(state, ev: Event):
    try:
        return apply(state, ev, detail=False)
    except EventNotEnabled as exc:
        return str(exc)


def _odd(rng: random.Random, n: int, reqs: int) -> Event:
    """An event drawn blind: often refused (rank or request out of range, already
    latched or landed, not left yet)."""
    r, k = rng.randint(-1, reqs), rng.randrange(n)     # deliver's codes name ranks in range
    return rng.choice([KvDone(k, r), Fail(k, r), Land(k, r, "room"), Land(k, r, "payload"),
                       Fence(rng.randint(-1, n), r), Enqueue(rng.randint(0, reqs), 5, 1)])


def test_packed_state_is_apply_event_for_event():
    rng = random.Random(23)
    counts = {"steps": 0, "pops": 0, "refused": 0, "fallbacks": 0, "packed_walks": 0, "quiet": 0}
    for _ in range(400):
        v = rng.choice(ALL)
        n, slots = rng.randint(1, 4), rng.randint(1, 3)
        ref = initial_state(v, n, slots)
        packed = PackedState(v, n, slots)
        counts["packed_walks"] += packs(v)
        last_was_step = False
        for ev, nxt in random_walk(rng, ref, 60):
            quiet = last_was_step and rng.random() < 0.7
            counts["quiet"] += quiet and isinstance(ev, Step)
            was_packed = packed.general is None
            want, got = _reference(ref, ev), _perform(packed, ev, quiet)
            assert got == want, (v.name, ev)
            if isinstance(ev, Step):
                counts["steps"] += 1
                counts["pops"] += any(want.popped)
                counts["fallbacks"] += was_packed and packed.general is not None
            last_was_step = isinstance(ev, Step)
            bad = _odd(rng, n, nxt)
            msg = _reference(ref.copy(), bad)
            if isinstance(msg, str):       # the same refusal, and nothing performed
                assert _perform(packed, bad, False) == msg, (v.name, bad)
                counts["refused"] += 1
            assert packed.system().key() == ref.key() and packed.steps == ref.steps
    assert counts["steps"] > 3000 and counts["pops"] > 500 and counts["refused"] > 5000
    assert counts["packed_walks"] > 200 and counts["fallbacks"] >= 3 and counts["quiet"] > 300, counts


def test_packed_batches_and_forget_match_apply():
    """Many events of a request in one ``deliver`` (refused part-way: the ones before
    performed), and ``forget``, as machine.py does them."""
    from model.spec.batch import deliver
    from model.spec.machine import forget
    rng = random.Random(5)
    batches = forgotten = sets = 0
    for _ in range(300):
        v = rng.choice([u for u in ALL if packs(u)])
        n = rng.randint(1, 4)
        ref, packed = initial_state(v, n, 3), PackedState(v, n, 3)
        for ev, nxt in random_walk(rng, ref, 50):
            assert _reference(ref, ev) == _perform(packed, ev, False)
            req = rng.randint(0, max(nxt - 1, 0))
            codes = [rng.randrange(4 * n) for _ in range(rng.randint(1, 3 * n))]
            if rng.random() < 0.5:
                assert refusal(deliver, ref, req, codes) == refusal(packed.deliver, req, codes)
            else:       # the set of those events, in code order
                events = sum(1 << c for c in set(codes))
                assert refusal(deliver, ref, req, sorted(set(codes))) == refusal(
                    packed.deliver_set, req, events)
                sets += 1
            batches += 1
            want = refusal(forget, ref, req)
            if rng.random() < 0.5:
                assert refusal(packed.forget, req) == want
            else:       # forget_done keeps what is still written somewhere, refuses the rest
                kept: list = []
                got = refusal(lambda r: kept.extend(packed.forget_done([r])), req)
                assert (got, kept) in ([(want, [])] if want is None or not packed.tracked(req)
                                       else [(None, [req])])
            forgotten += want is None
            assert packed.system().key() == ref.key()
    assert batches > 3000 and forgotten > 50 and sets > 1000
    for bad in (-1, 1 << (4 * n), 2.0, True):
        assert "not a set of event codes" in refusal(packed.deliver_set, 0, bad)


@pytest.mark.source_modules
@pytest.mark.parametrize("rule,test", [
    ("_release", lambda: test_packed_state_is_apply_event_for_event()),
    ("_mark_tenant", lambda: test_a_late_write_into_a_reused_slot_is_seen_by_the_packed_step())])
def test_a_wrong_packed_rule_is_caught(monkeypatch, rule, test):
    """These tests can fail: a packed form that never clears freed rows, or that misses
    a late write into a reused slot (and so trusts the tenant's own rows), parts from
    apply."""
    from model.spec import packed as packed_mod

    def no_clear(self, slots, kept):
        for k, slot in enumerate(slots):
            if not kept >> k & 1:
                self.free[k].append(slot)
    monkeypatch.setattr(packed_mod.PackedState, rule,
                        no_clear if rule == "_release" else lambda self, k, slot, bit: None)
    with pytest.raises(AssertionError):
        test()


def _late_write_into_a_reused_slot(make):
    """Request 0 aborts (rank 0 failed) with its room still in flight to rank 1; request
    1 takes the freed slot and lands everything; then 0's late room lands in 1's slot
    on rank 1. gate reads a non-zero foreign room there: rank 1 aborts 1 as a mismatch
    while rank 0 commits it (the divergence the gate cannot stop)."""
    s = make(get_variant("gate"), 2, 1)
    events = [Enqueue(0, 7, 70), KvDone(1, 0), Fail(0, 0), Land(1, 0, "payload"), Step(),
              Enqueue(1, 8, 80)]
    events += [e for k in (0, 1) for e in (KvDone(k, 1), Land(k, 1, "payload"), Land(k, 1, "room"))]
    events += [Land(1, 0, "room"), Step()]
    return s, events


def test_a_late_write_into_a_reused_slot_is_seen_by_the_packed_step():
    ref, events = _late_write_into_a_reused_slot(initial_state)
    packed = PackedState(ref.variant, 2, 1)
    for ev in events:
        assert _perform(packed, ev, False) == _reference(ref, ev)
        assert packed.system().key() == ref.key()
    assert packed.general is not None      # the ranks parted: machine.py took the step
    assert [rs.outcomes[1][0] for rs in ref.ranks] == ["commit", "abort"]
