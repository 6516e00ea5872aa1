"""The spec's kernel evaluated on Python ints and on Z3 terms agrees everywhere on
small value domains (exhaustively), for every variant and ablation."""
import itertools

import pytest
import z3

from model.encoding.vocab import Z3OPS
from model.spec.kernel import gated_poll, pop_decision
from model.spec.variants import ABLATIONS, VARIANTS

ALL = {**VARIANTS, **ABLATIONS}
ROOMS = (0, 1, 7)


def _z3_value(term) -> int:
    return z3.simplify(term).as_long()


@pytest.mark.parametrize("name", sorted(ALL))
def test_gated_poll_matches_on_every_small_input(name):
    v = ALL[name]
    for local, seen, expected, age in itertools.product(range(5), ROOMS, ROOMS, range(7)):
        want = gated_poll(v, local, seen, expected, age)
        got = gated_poll(v, z3.IntVal(local), z3.IntVal(seen), z3.IntVal(expected), z3.IntVal(age), Z3OPS)
        assert _z3_value(got) == want, (name, local, seen, expected, age)


@pytest.mark.parametrize("name", sorted(ALL))
def test_pop_decision_matches_on_every_small_input(name):
    v = ALL[name]
    for reduced, seen, expected in itertools.product(range(5), ROOMS, ROOMS):
        want = int(pop_decision(v, reduced, seen, expected))
        got = pop_decision(v, z3.IntVal(reduced), z3.IntVal(seen), z3.IntVal(expected), Z3OPS)
        assert _z3_value(got) == want, (name, reduced, seen, expected)
