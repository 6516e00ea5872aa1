"""The spec's int fast path (kernel.gate_table / pop_table, used by machine.py) equals
the kernel's definitions on every input, so the simulator's speed-up changes nothing."""
import random

from hypothesis import given, settings, strategies as st

from model.spec.kernel import Decision, compare_index, gate_table, gated_poll, pop_decision, pop_table
from model.spec.variants import VARIANTS, get_variant

ALL = list(VARIANTS.values()) + [get_variant("strict", 1), get_variant("strict", 9)]
rooms = st.sampled_from([0, 1, 5, 2**63 - 1, 2**64 - 1]) | st.integers(0, 2**64 - 1)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(ALL), st.integers(0, 4), rooms, rooms, st.integers(0, 12))
def test_gate_table_equals_gated_poll(v, poll, seen, expected, age):
    timed = v.timeout_steps is not None and age >= v.timeout_steps
    got = gate_table(v)[poll * 16 + 8 * timed + compare_index(seen, expected)]
    assert got == gated_poll(v, poll, seen, expected, age)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(ALL), st.integers(0, 4), rooms, rooms)
def test_pop_table_equals_pop_decision(v, reduced, seen, expected):
    got = pop_table(v)[reduced * 8 + compare_index(seen, expected)]
    assert got is Decision(pop_decision(v, reduced, seen, expected))


def test_equal_rooms_and_zero_rooms_exhaustively():
    rng = random.Random(0)
    for v in ALL:
        for poll in range(5):
            for seen, expected in [(0, 0), (0, 3), (3, 3), (3, 0), (3, 4)] + [
                    (rng.randrange(3), rng.randrange(3)) for _ in range(20)]:
                for age in range(6):
                    timed = v.timeout_steps is not None and age >= v.timeout_steps
                    assert gate_table(v)[poll * 16 + 8 * timed + compare_index(seen, expected)] \
                        == gated_poll(v, poll, seen, expected, age)


# A deliberately dumb protocol step written straight from the kernel (the machine's
# code before the fast path), to check the optimised machine step against.
from model.spec.events import Enqueue, Step
from model.spec.kernel import Decision as D
from model.spec.kvpoll import CollectiveMismatch, min_reduce
from model.spec.machine import RankStep, StepRecord, _leave, _release_held, apply, enabled
from model.spec.variants import Deferral, FreeOrder


def naive_step(state):
    v = state.variant
    locals_ = [[rs.recv[r] for r in rs.queue] for rs in state.ranks]
    gateds = [[gated_poll(v, p, rs.room_at[rs.slot_of[r]], state.requests[r].room, rs.age[r])
               for p, r in zip(loc, rs.queue)] for loc, rs in zip(locals_, state.ranks)]
    try:
        reduced = min_reduce(gateds)
    except CollectiveMismatch as exc:
        state.hung = exc.lengths
        return StepRecord(state.steps, tuple(
            RankStep(k, tuple(rs.queue), tuple(locals_[k]), tuple(gateds[k]), (), ())
            for k, rs in enumerate(state.ranks)), exc.lengths)
    records = []
    if v.defer_failed is not Deferral.NONE:
        _release_held(state)
    for k, rs in enumerate(state.ranks):
        before, popped, kept = tuple(rs.queue), [], []
        for red, r in zip(reduced, before):
            slot = rs.slot_of[r]
            d = D(pop_decision(v, red, rs.room_at[slot], state.requests[r].room))
            if d is D.KEEP:
                kept.append(r)
                rs.age[r] += red >= 3          # ages only after a MIN of Transferring or more
            else:
                popped.append((r, int(d), rs.payload_at[slot] if d is D.COMMIT else 0))
        rs.queue = kept
        order = popped
        if v.free_order is FreeOrder.SET:      # SGLang frees in set(positions) order
            at = {before.index(p[0]): p for p in popped}
            order = [at[i] for i in set(at)]
        _leave(state, [(rs, order)])
        records.append(RankStep(k, before, tuple(locals_[k]), tuple(gateds[k]), tuple(reduced),
                                tuple(popped)))
    state.steps += 1
    return StepRecord(state.steps - 1, tuple(records))


def test_machine_step_equals_the_naive_kernel_step_on_random_walks():
    from model.spec.state import initial_state
    rng = random.Random(7)
    steps = 0
    for trial in range(150):
        v = rng.choice(ALL)
        fast = initial_state(v, rng.randint(1, 3), rng.randint(1, 3))
        slow = fast.copy()
        nxt = 0
        for _ in range(40):
            offers = [Enqueue(nxt, rng.choice([0, 5, 6, 5]), rng.randint(1, 3))]
            events = enabled(fast, offers)
            if not events:
                break
            ev = rng.choice(events)
            if isinstance(ev, Enqueue):
                nxt += 1
            if isinstance(ev, Step):
                assert apply(fast, ev) == naive_step(slow)
                steps += 1
            else:
                apply(fast, ev)
                apply(slow, ev)
            assert fast.key() == slow.key() and fast.steps == slow.steps
    assert steps > 500
