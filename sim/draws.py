"""Every random number of a run, per request from named streams.

Each stream has its own generator seeded by (seed, stream number[, chunk]), and nothing
depends on the variant, so ``--compare`` runs the variants on identical draws
(common random numbers): request i gets the same prefill, transfer times, lags,
faults, room and payload under every variant, and decode step j the same forward time.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from sim.config import SimConfig
from sim.dists import Dist
from sim.errors import SimInputError
from sim.workload import Workload

STREAMS = {"workload": 0, "transfer": 1, "lag": 2, "faults": 3, "ids": 4, "forward": 5,
           "idle": 6, "fence": 7, "allreduce": 8}


def stream(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, STREAMS[name]])


@dataclass
class DrawChunk:
    """The draws of requests ``c * CHUNK`` .. ``c * CHUNK + m - 1``."""
    xfer_ms: np.ndarray      # (m, T) KV transfer time per rank
    lag_ms: np.ndarray       # (m, T) metadata lag after KV completion
    fail_rank: np.ndarray    # (m,) the rank whose transfer fails, or -1
    lost: np.ndarray         # (m, T) metadata never lands on that rank
    late_ms: np.ndarray      # (m,) extra write delay for failed requests
    fence_ms: np.ndarray     # (m, T) abort -> prefill's acknowledgement
    room: list[int]          # bootstrap_room, non-zero 63-bit
    payload: list[int]       # first output token, non-zero int32


CHUNK = 4096
MAX_CELLS = 10**9     # requests x ranks (results hold ~8 bytes per cell at most)
_KEPT = 8             # chunks kept drawn (requests enqueue in about arrival order)


class Draws:
    """Every per-request random number, by chunks of CHUNK requests, each chunk from
    streams seeded by (seed, stream, chunk): a request's draws depend on the seed and
    its index only (not on the variant, nor on how many requests follow), any chunk can
    be drawn again identically, and only a few are held, so memory does not grow with
    the workload. ``prefill_ms`` (no randomness) is for every request."""

    def __init__(self, cfg: SimConfig, wl: Workload):
        n, T = len(wl), cfg.ranks
        if n * T > MAX_CELLS:
            raise SimInputError(f"--requests x --ranks is {n * T}; the simulator takes at most "
                                f"{MAX_CELLS}")
        self.cfg, self.wl, self.n = cfg, wl, n
        tokens = wl.input_len.astype(np.float64)
        # prefill computes only the prompt tokens its prefix cache does not hold
        computed = tokens if wl.cached_tokens is None else tokens - wl.cached_tokens
        self.prefill_ms = cfg.prefill_base_ms + cfg.prefill_ms_per_token * computed
        self.kept: OrderedDict[int, DrawChunk] = OrderedDict()

    def chunks(self) -> int:
        return -(-self.n // CHUNK)

    def chunk(self, c: int) -> DrawChunk:
        got = self.kept.get(c)
        if got is None:
            got = self.kept[c] = self._draw(c)
            if len(self.kept) > _KEPT:
                self.kept.popitem(last=False)
        return got

    def row(self, i: int) -> tuple[DrawChunk, int]:
        """Request ``i``'s chunk and its index there."""
        c, j = divmod(i, CHUNK)
        return self.chunk(c), j

    def check_all(self) -> None:
        """Draw every chunk once (keeping none beyond the usual) so that a distribution
        that draws out of bounds is refused before the run starts."""
        for c in range(self.chunks()):
            self.chunk(c)

    def _draw(self, c: int) -> DrawChunk:
        cfg, wl, T = self.cfg, self.wl, self.cfg.ranks
        lo, hi = c * CHUNK, min(self.n, (c + 1) * CHUNK)
        m = hi - lo

        def rng(name: str) -> np.random.Generator:
            return np.random.default_rng([cfg.seed, STREAMS[name], c])

        tokens = wl.input_len[lo:hi].astype(np.float64)
        ranges = np.ceil(tokens / cfg.page_tokens)
        base = (cfg.te_overhead_ms + cfg.te_per_range_ms * ranges
                + tokens * cfg.kv_bytes_per_token / T / (cfg.bandwidth_gbps * 1e6))
        # every chunk draws CHUNK requests' worth (the last one too, then cut), so a
        # request's draws do not depend on how many requests follow it
        if cfg.transfer is not None:
            xfer = cfg.transfer.draw(rng("transfer"), tokens, lo, T, CHUNK)
        else:
            xfer = base[:, None] + cfg.kv_jitter.draw(rng("transfer"), CHUNK * T).reshape(CHUNK, T)[:m]
        r = rng("lag")
        lag = np.empty((m, T))
        skew = cfg.lag_skew or (1.0,) * T
        for k, dist in enumerate(cfg.lag_dists()):
            lag[:, k] = dist.draw(r, CHUNK)[:m] * skew[k]
        r = rng("faults")
        fails = r.random(CHUNK)[:m] < cfg.fail_prob
        if wl.failed is not None:        # a trace's failed request: its transfer fails
            fails |= wl.failed[lo:hi]
        fail_rank = np.where(fails, r.integers(0, T, CHUNK)[:m], -1)
        lost = r.random((CHUNK, T))[:m] < cfg.lost_metadata_prob
        late = cfg.late_write.draw(r, CHUNK)[:m] if cfg.late_write is not None else np.zeros(m)
        r = rng("ids")
        room = r.integers(1, 2**63 - 1, CHUNK, dtype=np.int64)[:m].tolist()
        payload = r.integers(1, 2**31 - 1, CHUNK, dtype=np.int64)[:m].tolist()
        fence = cfg.fence_delay.draw(rng("fence"), CHUNK * T).reshape(CHUNK, T)[:m]
        out = DrawChunk(xfer, lag, fail_rank, lost, late, fence, room, payload)
        _check_bounded(out, cfg, self.prefill_ms[lo:hi])
        return out


def prefill_schedule(arrivals: list[float], durations: list[float],
                     servers: int) -> tuple[list[float], list[int]]:
    """FIFO prefill servers (the engine's plan, and Perfetto's prefill slices): each
    request's prefill end time, in request order, and the server that ran it (the
    earliest free one)."""
    free = [(0.0, s) for s in range(servers)]
    ends: list[float] = []
    which: list[int] = []
    for t, dur in zip(arrivals, durations):
        at, s = free[0]
        end = max(t, at) + dur
        heapq.heapreplace(free, (end, s))
        ends.append(end)
        which.append(s)
    return ends, which


def draw(cfg: SimConfig, wl: Workload) -> Draws:
    """The run's draws, every chunk checked for bounds."""
    d = Draws(cfg, wl)
    d.check_all()
    return d


def _check_bounded(d: DrawChunk, cfg: SimConfig, prefill_ms: np.ndarray) -> None:
    """Every drawn duration must be finite and within --max-sim-seconds: a lag of
    ``const:1e308`` or ``lognormal:1e6,1`` would make a run that never ends."""
    limit = cfg.max_sim_s * 1000.0
    for flag, x in (("--prefill-base/--prefill-per-token", prefill_ms),
                    ("--kv-bytes-per-token/--bandwidth/--kv-jitter", d.xfer_ms),
                    ("--metadata-lag", d.lag_ms), ("--late-write", d.late_ms),
                    ("--fence-delay", d.fence_ms)):
        if x.size:
            top = float(np.max(x))
            if not top <= limit:       # also catches NaN and inf
                raise SimInputError(f"{flag}: draws up to {top:.3g} ms exceed --max-sim-seconds "
                                    f"({cfg.max_sim_s:g} s), so the run would not end")
