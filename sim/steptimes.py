"""Per-step durations (forward passes, idle spins) drawn in blocks from one stream: the
decode scheduler takes them one or many at a time. Apart from sim/draws.py so that it can
be compiled with the engine (see setup.py)."""
from __future__ import annotations

import numpy as np

from sim.dists import Dist

_BLOCK = 4096       # draws per refill


class StepTimes:
    """Per-step durations from one stream, drawn in blocks (step j gets draw j): one at a
    time (``next``) or many at once (``advance``), in the same order either way."""

    def __init__(self, dist: Dist, rng: np.random.Generator):
        self.dist, self.rng = dist, rng
        self.block: list[float] = []
        self.pos = 0              # the next draw's index in block

    def _refill(self) -> None:
        self.block, self.pos = self.dist.draw(self.rng, _BLOCK).tolist(), 0

    def next(self) -> float:
        pos = self.pos
        if pos == len(self.block):
            self._refill()
            pos = 0
        self.pos = pos + 1
        return self.block[pos]

    def advance(self, t: float, until: float, most: int) -> tuple[float, int]:
        """``t`` plus the next durations, added one at a time (the same sums as ``t +=
        next()`` in a loop), stopping after ``most`` of them or after the first sum that
        reaches ``until``; and how many were taken."""
        taken = 0
        while True:
            block, start = self.block, self.pos
            stop = start + most - taken
            if stop > len(block):
                stop = len(block)
            for k in range(start, stop):
                t += block[k]
                if t >= until:
                    self.pos = k + 1
                    return t, taken + k + 1 - start
            taken += stop - start
            self.pos = stop
            if taken == most:
                return t, taken
            self._refill()
