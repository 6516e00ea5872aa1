"""Every random number of a run, drawn up front per request from named streams.

Each stream has its own generator seeded by (seed, stream number), and nothing
depends on the variant, so ``--compare`` runs the variants on identical draws
(common random numbers): request i gets the same prefill, transfer times, lags,
faults, room and payload under every variant, and decode step j the same forward time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.config import SimConfig
from sim.dists import Dist
from sim.errors import SimInputError
from sim.workload import Workload

STREAMS = {"workload": 0, "transfer": 1, "lag": 2, "faults": 3, "ids": 4, "forward": 5,
           "idle": 6, "fence": 7}
_CHUNK = 4096


def stream(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, STREAMS[name]])


@dataclass
class Draws:
    prefill_ms: np.ndarray   # (n,)
    xfer_ms: np.ndarray      # (n, T) KV transfer time per rank
    lag_ms: np.ndarray       # (n, T) metadata lag after KV completion
    fail_rank: np.ndarray    # (n,) the rank whose transfer fails, or -1
    lost: np.ndarray         # (n, T) metadata never lands on that rank
    late_ms: np.ndarray      # (n,) extra write delay for failed requests
    fence_ms: np.ndarray     # (n, T) abort -> prefill's acknowledgement
    room: list[int]          # bootstrap_room, non-zero 63-bit
    payload: list[int]       # first output token, non-zero int32


MAX_CELLS = 10**8     # requests x ranks: the draws below hold ~33 bytes per (request, rank)


def draw(cfg: SimConfig, wl: Workload) -> Draws:
    n, T = len(wl), cfg.ranks
    if n * T > MAX_CELLS:
        raise SimInputError(f"--requests x --ranks is {n * T}; the simulator draws per request and "
                            f"rank up front and takes at most {MAX_CELLS}")
    tokens = wl.input_len.astype(np.float64)
    ranges = np.ceil(tokens / cfg.page_tokens)
    base = (cfg.te_overhead_ms + cfg.te_per_range_ms * ranges
            + tokens * cfg.kv_bytes_per_token / T / (cfg.bandwidth_gbps * 1e6))
    xfer = base[:, None] + cfg.kv_jitter.draw(stream(cfg.seed, "transfer"), n * T).reshape(n, T)
    rng = stream(cfg.seed, "lag")
    lag = np.empty((n, T))
    skew = cfg.lag_skew or (1.0,) * T
    for k, dist in enumerate(cfg.lag_dists()):
        lag[:, k] = dist.draw(rng, n) * skew[k]
    rng = stream(cfg.seed, "faults")
    fails = rng.random(n) < cfg.fail_prob
    if wl.failed is not None:        # a trace's failed request: its transfer fails
        fails |= wl.failed
    fail_rank = np.where(fails, rng.integers(0, T, n), -1)
    lost = rng.random((n, T)) < cfg.lost_metadata_prob
    late = cfg.late_write.draw(rng, n) if cfg.late_write is not None else np.zeros(n)
    rng = stream(cfg.seed, "ids")
    room = rng.integers(1, 2**63 - 1, n, dtype=np.int64).tolist()
    payload = rng.integers(1, 2**31 - 1, n, dtype=np.int64).tolist()
    fence = cfg.fence_delay.draw(stream(cfg.seed, "fence"), n * T).reshape(n, T)
    # prefill computes only the prompt tokens its prefix cache does not hold
    computed = tokens if wl.cached_tokens is None else tokens - wl.cached_tokens
    prefill = cfg.prefill_base_ms + cfg.prefill_ms_per_token * computed
    out = Draws(prefill, xfer, lag, fail_rank, lost, late, fence, room, payload)
    _check_bounded(out, cfg)
    return out


def _check_bounded(d: Draws, cfg: SimConfig) -> None:
    """Every drawn duration must be finite and within --max-sim-seconds: a lag of
    ``const:1e308`` or ``lognormal:1e6,1`` would make a run that never ends."""
    limit = cfg.max_sim_s * 1000.0
    for flag, x in (("--prefill-base/--prefill-per-token", d.prefill_ms),
                    ("--kv-bytes-per-token/--bandwidth/--kv-jitter", d.xfer_ms),
                    ("--metadata-lag", d.lag_ms), ("--late-write", d.late_ms),
                    ("--fence-delay", d.fence_ms)):
        if x.size:
            top = float(np.max(x))
            if not top <= limit:       # also catches NaN and inf
                raise SimInputError(f"{flag}: draws up to {top:.3g} ms exceed --max-sim-seconds "
                                    f"({cfg.max_sim_s:g} s), so the run would not end")


class StepTimes:
    """Per-step durations from one stream, drawn in chunks (step j gets draw j)."""

    def __init__(self, dist: Dist, rng: np.random.Generator):
        self.dist, self.rng = dist, rng
        self.buf: list[float] = []
        self.pos = 0

    def next(self) -> float:
        if self.pos == len(self.buf):
            self.buf, self.pos = self.dist.draw(self.rng, _CHUNK).tolist(), 0
        self.pos += 1
        return self.buf[self.pos - 1]
