"""KVPoll and the MIN agreement, property-tested against a naive reference."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from model.spec.kvpoll import CollectiveMismatch, KVPoll, check_poll, min_reduce

polls = st.integers(min_value=0, max_value=4)


def naive_min(vectors: list[list[int]]) -> list[int]:
    """What every rank sees after all_reduce(MIN), written the slow obvious way."""
    out = []
    for i in range(len(vectors[0])):
        least = vectors[0][i]
        for v in vectors:
            if v[i] < least:
                least = v[i]
        out.append(least)
    return out


def test_values_are_sglangs():
    assert [(p.name, int(p)) for p in KVPoll] == [
        ("Failed", 0), ("Bootstrapping", 1), ("WaitingForInput", 2), ("Transferring", 3), ("Success", 4)]


@given(st.integers(1, 5).flatmap(lambda n: st.lists(st.lists(polls, min_size=n, max_size=n),
                                                     min_size=1, max_size=6)))
def test_min_reduce_matches_naive(vectors):
    got = min_reduce(vectors)
    assert got == naive_min(vectors)
    for i, column in enumerate(zip(*vectors)):
        # Failure spreads; Success only if every rank says Success.
        assert (got[i] == KVPoll.Failed) == (KVPoll.Failed in column)
        assert (got[i] == KVPoll.Success) == all(p == KVPoll.Success for p in column)


@given(st.lists(st.lists(polls, max_size=4), min_size=2, max_size=5)
       .filter(lambda vs: len({len(v) for v in vs}) > 1))
def test_unequal_lengths_raise_collective_mismatch(vectors):
    with pytest.raises(CollectiveMismatch) as err:
        min_reduce(vectors)
    assert err.value.lengths == tuple(len(v) for v in vectors)
    assert "collective mismatch" in str(err.value)


def test_empty_vectors_reduce_to_empty_and_no_ranks_is_an_error():
    assert min_reduce([[], [], []]) == []
    with pytest.raises(ValueError, match="at least one rank"):
        min_reduce([])


@pytest.mark.parametrize("value", [0, 1, 2, 3, 4])
def test_check_poll_accepts_kvpoll_values(value):
    assert check_poll(value) == value and type(check_poll(value)) is int


@pytest.mark.parametrize("value", [-1, 5, 2.5, True, 99])
def test_check_poll_rejects_everything_else(value):
    with pytest.raises(ValueError, match="outside KVPoll 0..4"):
        check_poll(value)
