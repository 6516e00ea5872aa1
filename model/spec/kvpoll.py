"""KVPoll values (SGLang's plain ints) and the MIN agreement across TP ranks."""
from __future__ import annotations

from enum import IntEnum
from typing import Sequence


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


POLL_VALUES = frozenset(int(p) for p in KVPoll)


class CollectiveMismatch(Exception):
    """Ranks tried to all-reduce vectors of different lengths (gloo: mismatch or hang)."""

    def __init__(self, lengths: Sequence[int]):
        self.lengths = tuple(lengths)
        detail = ", ".join(f"rank {k}: {n}" for k, n in enumerate(self.lengths))
        super().__init__(f"collective mismatch: ranks reduce vectors of different lengths ({detail})")


def check_poll(value: int) -> int:
    """Return ``value`` as an int if it is a KVPoll value, else raise ValueError."""
    if isinstance(value, bool) or int(value) != value or int(value) not in POLL_VALUES:
        raise ValueError(f"poll value {value!r} is outside KVPoll 0..4")
    return int(value)


def min_reduce(vectors: Sequence[Sequence[int]]) -> list[int]:
    """Element-wise MIN over one vector per rank: what ``all_reduce(MIN)`` computes.

    Position i must mean the same request on every rank; the spec cannot check that,
    only the lengths (a length mismatch is what gloo reports or hangs on).
    """
    if not vectors:
        raise ValueError("min_reduce needs at least one rank")
    n = len(vectors[0])
    for v in vectors:
        if len(v) != n:
            raise CollectiveMismatch([len(v) for v in vectors])
    return list(map(min, zip(*vectors)))
