"""Everything a set of simulator runs reports, as JSON-able text, for comparing two
builds of the simulator (tests/sim/test_sim_compiled.py): ``python -m
tests.sim.digests`` prints them. Cases: every variant at 8 ranks under faults that
reach aborts, fences, quarantines and late writes, and the schedules and recorders
(eager, a trace, spans, stalls, a small pool, a timeout, the Mooncake sample)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from model.spec.variants import VARIANTS
from sim.config import SimConfig, Stall
from sim.workload import Workload, load_trace
from tests.sim.helpers import config, run, workload

SAMPLE = Path(__file__).resolve().parents[2] / "sim" / "data" / "mooncake_conversation_head1000.jsonl"
FAULTS = dict(fail_prob=0.1, lost_metadata_prob=0.05, late_write="exp:20", lag="exp:3")


def _cases() -> dict:
    wl = workload(300, 30.0, seed=1)
    cases = {f"{v}-8": (config(variant=v, ranks=8, seed=2, **FAULTS), wl, {}) for v in VARIANTS}
    cases.update({
        "gate-eager": (config(variant="gate", ranks=4, seed=3, **FAULTS), wl, {"eager": True}),
        "gate-trace": (config(variant="gate", ranks=4, seed=4, **FAULTS), wl, {"traced": True}),
        "deferred-trace": (config(variant="deferred", ranks=4, seed=5, release_timeout_s=0.5,
                                  **FAULTS), wl, {"traced": True}),
        "gate-spans-stalls": (config(variant="gate", ranks=4, seed=6, fail_prob=0.1,
                                     stalls=(Stall(1, 1000.0, 500.0),)), wl, {"record_spans": True}),
        "strict-timeout-pool": (config(variant="strict", ranks=8, seed=7, request_pool=4, slots=5,
                                       lost_metadata_prob=0.2, gate_timeout_s=0.3), wl, {}),
        "mooncake": (config(variant="gate", ranks=8), load_trace(str(SAMPLE)), {}),
    })
    return cases


def _hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def digest(cfg: SimConfig, wl: Workload, traced: bool = False, **kw: Any) -> dict:
    """Everything one run reports (``kw``: Simulation's keywords), arrays and texts hashed."""
    d, trace = run(cfg, wl, traced, **kw)
    return {"arrays": [_hash(a.tobytes()) for a in (d.commit_ms, d.kv_all_ms, d.outcome)],
            "counts": [d.protocol_steps, d.decode_steps, repr(d.sim_ms), d.stuck,
                       d.peak_in_flight, d.cut_short],
            "divergence": d.divergence.as_dict() if d.divergence else None,
            "spans": _hash(repr(d.spans).encode()), "outcomes": sorted(set(d.outcome.tolist())),
            "trace": _hash(trace.encode()) if traced else None}


def digests() -> dict[str, dict]:
    return {name: digest(cfg, wl, **kw) for name, (cfg, wl, kw) in _cases().items()}


if __name__ == "__main__":
    print(json.dumps(digests(), sort_keys=True))
