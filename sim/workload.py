"""The workload: when requests arrive and how long their prompts and outputs are.

Synthetic: Poisson, or Gamma inter-arrivals with a burstiness shape (1 = Poisson, as in
SGLang's ``bench_serving --burstiness``). Replay: the published traces of sim/traces.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.dists import Dist
from sim.errors import SimInputError
from sim.traces import DEFAULT_CACHE_BLOCKS, MAX_TOKENS, read_trace


@dataclass(frozen=True)
class Workload:
    arrival_ms: np.ndarray     # float64, non-decreasing
    input_len: np.ndarray      # int64 tokens >= 1
    output_len: np.ndarray     # int64 tokens >= 1
    source: str
    failed: np.ndarray | None = None          # bool: a trace's failed request (0 output tokens)
    cached_tokens: np.ndarray | None = None   # int64: prompt tokens found in the prefix cache
    info: dict | None = None                  # what reading the trace found (summary "trace")

    def __len__(self) -> int:
        return len(self.arrival_ms)


def synthetic(rng: np.random.Generator, n: int, rate: float, burstiness: float,
              input_len: Dist, output_len: Dist) -> Workload:
    """``n`` arrivals at ``rate`` requests/s; Gamma(shape=burstiness) gaps keep the mean."""
    if n < 1:
        raise SimInputError(f"--requests must be >= 1, got {n}")
    if not rate > 0 or not math.isfinite(rate):
        raise SimInputError(f"--rate must be a positive number of requests/s, got {rate}")
    if not burstiness > 0 or not math.isfinite(burstiness):
        raise SimInputError(f"--burstiness must be > 0, got {burstiness}")
    mean_gap_ms = 1000.0 / rate
    gaps = rng.gamma(burstiness, mean_gap_ms / burstiness, n)
    gaps[0] = 0.0
    return Workload(np.cumsum(gaps), _tokens(input_len.draw(rng, n), "--input-len"),
                    _tokens(output_len.draw(rng, n), "--output-len"),
                    f"synthetic rate={rate:g}/s burstiness={burstiness:g}")


def _tokens(x: np.ndarray, flag: str) -> np.ndarray:
    top = float(np.max(x)) if len(x) else 0.0
    if not top <= MAX_TOKENS:
        raise SimInputError(f"{flag}: draws up to {top:.3g} tokens, beyond {MAX_TOKENS} per request")
    return np.maximum(1, np.rint(x)).astype(np.int64)


def load_trace(path: str, limit: int | None = None, window_s: tuple[float, float] | None = None,
               cache_blocks: int = DEFAULT_CACHE_BLOCKS, time_scale: float = 1.0, target_rate: float | None = None
               ) -> Workload:
    """A published trace (sim/traces.py) as a Workload: ``limit`` requests at most (the
    replay is whole by default), inside ``window_s``, inter-arrival times multiplied by
    ``time_scale`` or scaled to a mean rate of ``target_rate`` requests/s."""
    rows = read_trace(path, limit, window_s, cache_blocks)
    t = np.frombuffer(rows.arrival_ms, dtype=np.float64).copy()
    span_s = float(t[-1]) / 1000.0
    if target_rate is not None:
        if len(t) < 2 or span_s <= 0:
            raise SimInputError(f"--rate: the replay's requests all arrive at once, so it has no "
                                f"mean rate to rescale (use --time-scale)")
        time_scale = (len(t) - 1) / span_s / target_rate
    t *= time_scale
    failed = np.frombuffer(rows.failed, dtype=np.int8).astype(bool)
    info = {"format": rows.fmt, "rows_read": rows.rows_read, "requests": len(rows),
            "truncated_by_requests": rows.truncated, "window_s": list(window_s) if window_s else None,
            "time_scale": round(time_scale, 9), "failed_rows": int(failed.sum()),
            "prefix_cache_blocks": cache_blocks,
            "prefix_hit_rate": round(rows.cache_hits / rows.cache_lookups, 6) if rows.cache_lookups else 0.0}
    return Workload(t, np.maximum(1, np.frombuffer(rows.input_len, dtype=np.int64)),
                    np.maximum(1, np.frombuffer(rows.output_len, dtype=np.int64)),
                    f"trace {Path(path).name} ({rows.fmt})", failed=failed,
                    cached_tokens=np.frombuffer(rows.cached_tokens, dtype=np.int64).copy(), info=info)
