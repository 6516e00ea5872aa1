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
