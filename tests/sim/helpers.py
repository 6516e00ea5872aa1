"""Small builders shared by the simulator tests."""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from sim.config import SimConfig
from sim.dists import parse_dist
from sim.draws import stream
from sim.engine import Simulation, trace_writer
from sim.rundata import RunData
from sim.workload import Workload, synthetic


def workload(n: int = 200, rate: float = 8.0, seed: int = 0, burstiness: float = 1.0) -> Workload:
    return synthetic(stream(seed, "workload"), n, rate, burstiness,
                     parse_dist("lognormal:7,0.8", "--input-len"),
                     parse_dist("lognormal:4,0.5", "--output-len"))


def config(**kw) -> SimConfig:
    if "lag" in kw:
        lag = kw.pop("lag")
        ranks = kw.get("ranks", 8)
        kw["metadata_lag"] = tuple(parse_dist(x, "--metadata-lag") for x in (
            lag if isinstance(lag, list) else [lag] * ranks))
    for key in ("forward", "idle_step", "late_write", "fence_delay", "kv_jitter"):
        if isinstance(kw.get(key), str):
            kw[key] = parse_dist(kw[key], "--" + key)
    return SimConfig(**kw)


def run(cfg: SimConfig, wl: Workload | None = None, traced: bool = False,
        **kw: Any) -> tuple[RunData, str]:
    """Run once (``kw``: Simulation's keywords); with ``traced`` also return the spec
    trace text."""
    wl = wl if wl is not None else workload(seed=cfg.seed)
    if not traced:
        return Simulation(cfg, wl, **kw).run(), ""
    buf = io.StringIO()
    writer = trace_writer(buf, cfg, "test")
    data = Simulation(cfg, wl, trace=writer, **kw).run()
    return data, buf.getvalue()


def one_request(at_ms: float = 0.0, tokens: int = 100) -> Workload:
    return Workload(np.array([at_ms]), np.array([tokens]), np.array([5]), "one")
