"""An in-process stand-in for a gloo group: T ranks as T threads meeting at a barrier.

It implements the same two collectives as ``GlooExchange`` (so ``agree_min`` and the
queue run unchanged), for tests and for embedding T ranks in one process."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from impl.decode.errors import CollectiveTimeout


class LockstepGroup:
    def __init__(self, world_size: int, timeout_s: float = 10.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_s
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Any] = [None] * world_size

    def exchange(self, rank: int) -> "LockstepExchange":
        return LockstepExchange(self, rank)

    def _gather(self, rank: int, value: Any, what: str) -> list[Any]:
        try:
            self._barrier.wait(self.timeout_s)
            self._slots[rank] = value
            self._barrier.wait(self.timeout_s)
            out = list(self._slots)
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            raise CollectiveTimeout(what, self.timeout_s) from None
        return out


class LockstepExchange:
    def __init__(self, group: LockstepGroup, rank: int):
        self.group, self.rank = group, rank
        self.timeout_s = group.timeout_s

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def all_reduce_min(self, msg: torch.Tensor) -> torch.Tensor:
        parts = self.group._gather(self.rank, msg.clone(), "all_reduce(MIN)")
        if len({p.numel() for p in parts}) > 1:     # gloo would fail or hang here
            raise CollectiveTimeout("all_reduce(MIN) with mismatched sizes", self.timeout_s)
        msg.copy_(torch.stack(parts).min(dim=0).values)
        return msg

    def all_gather_rows(self, row: list[int]) -> list[list[int]]:
        return [list(r) for r in self.group._gather(self.rank, list(row), "all_gather")]


def run_ranks(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run one callable per rank concurrently; each result is a value or the exception."""
    def call(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:     # returned so the caller can compare ranks
            return exc
    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        return list(pool.map(call, fns))
