"""A thin wrapper around ``z3.Solver``: frames as context managers, a per-query
timeout, and timed checks. No module-level solver: every caller owns its own."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import z3


@dataclass
class CheckResult:
    status: str                 # "sat", "unsat" or "unknown"
    seconds: float
    model: z3.ModelRef | None = None
    reason: str = ""            # why "unknown" (timeout, incomplete quantifiers...)


class Solver:
    def __init__(self, timeout_ms: int = 20_000, logic: str | None = None):
        self._s = z3.SolverFor(logic) if logic else z3.Solver()
        self._s.set(timeout=timeout_ms)

    def add(self, *formulas: z3.BoolRef) -> None:
        self._s.add(*formulas)

    @contextmanager
    def frame(self) -> Iterator["Solver"]:
        """Everything added inside the ``with`` block is retracted when it ends."""
        self._s.push()
        try:
            yield self
        finally:
            self._s.pop()

    def check(self, *assumptions: z3.BoolRef) -> CheckResult:
        t0 = time.perf_counter()
        res = self._s.check(*assumptions)
        secs = time.perf_counter() - t0
        if res == z3.sat:
            return CheckResult("sat", secs, self._s.model())
        if res == z3.unsat:
            return CheckResult("unsat", secs)
        return CheckResult("unknown", secs, reason=self._s.reason_unknown())
