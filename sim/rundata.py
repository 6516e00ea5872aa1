"""What a simulation run produced (RunData) and where it first broke an invariant
(Divergence): plain dataclasses, apart from the engine so that the engine can be
compiled (see setup.py) while these stay ordinary Python classes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model.spec.invariants import Violation
from model.spec.variants import Variant
from sim.config import SimConfig
from sim.workload import Workload


@dataclass
class Divergence:
    step: int
    time_ms: float
    violation: Violation

    def as_dict(self) -> dict[str, Any]:
        v = self.violation
        return {"step": self.step, "time_ms": round(self.time_ms, 6), "invariant": v.invariant,
                "ranks": list(v.ranks), "requests": list(v.reqs), "detail": v.detail}


@dataclass
class RunData:
    """What a run produced (summaries are in sim/results.py)."""
    cfg: SimConfig
    variant: Variant
    workload: Workload
    arrival_ms: np.ndarray
    commit_ms: np.ndarray          # nan unless committed
    kv_all_ms: np.ndarray          # nan unless every rank's KV reached Success
    outcome: np.ndarray            # -1 undecided, else a Decision value
    protocol_steps: int
    decode_steps: int
    sim_ms: float
    wall_seconds: float
    divergence: Divergence | None
    stuck: int                     # requests held forever (no timeout can free them)
    peak_in_flight: int            # most requests arrived and not yet done at once
    spans: list[tuple] = field(default_factory=list)   # Perfetto data, when recorded
    cut_short: str | None = None   # the run hit --max-sim-seconds or --max-steps
    enqueue_ms: np.ndarray | None = None   # when each request was enqueued (0 if never)
