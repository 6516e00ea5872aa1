"""Trace hooks: off unless a tracer is given. Each rank records, per protocol step, what
``model.spec.machine.RankStep`` holds, so that ``impl.replay`` can merge the ranks'
records into a spec trace (docs/trace-format.md) that ``pdgate validate`` replays."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class StepTrace:
    step: int
    queue: tuple[str, ...]                      # request ids before the pop
    local: tuple[int, ...]                      # receiver polls
    gated: tuple[int, ...]                      # after the gate
    reduced: tuple[int, ...]                    # the MIN (empty if the step failed)
    popped: tuple[tuple[str, int, int], ...]    # (rid, Decision, first token or 0)
    hang: tuple[int, ...] | None = None         # every rank's queue length on a mismatch
    error: str | None = None                    # the step's typed error, if it raised

    def to_json(self) -> dict:
        return {"step": self.step, "queue": list(self.queue), "local": list(self.local),
                "gated": list(self.gated), "reduced": list(self.reduced),
                "popped": [list(p) for p in self.popped],
                "hang": list(self.hang) if self.hang is not None else None, "error": self.error}

    @classmethod
    def from_json(cls, obj: dict) -> "StepTrace":
        return cls(obj["step"], tuple(obj["queue"]), tuple(obj["local"]), tuple(obj["gated"]),
                   tuple(obj["reduced"]), tuple(tuple(p) for p in obj["popped"]),
                   tuple(obj["hang"]) if obj["hang"] is not None else None, obj["error"])


class Tracer(Protocol):
    def record(self, rec: StepTrace) -> None: ...


@dataclass
class ListTracer:
    """Keeps every record in memory (tests, replay)."""
    records: list[StepTrace] = field(default_factory=list)

    def record(self, rec: StepTrace) -> None:
        self.records.append(rec)
