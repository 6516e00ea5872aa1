"""Simulation parameters and their defaults (../shared/reference/anchors.md).

All times are milliseconds of simulated time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from model.spec.timeouts import STEP_FLOOR_S
from sim.dists import Dist, parse_dist
from sim.errors import SimInputError

# Mooncake TE small-transfer model: ~34 us + 1.5 us per memory range + 0.088 us per KiB.
TE_OVERHEAD_MS = 0.034
TE_PER_RANGE_MS = 0.0015
TE_GBPS = 1024 / 0.088e-6 / 1e9          # 0.088 us per KiB ~ 11.6 GB/s per transfer
# gloo all-reduce over TCP: ~0.35 ms for 1 KB (128 int64 polls): alpha + beta * n.
ALLREDUCE_ALPHA_MS = 0.30
ALLREDUCE_BETA_MS = 0.05 / 128
# A 70B-class model (80 layers, 8 KV heads x 128, K and V, bf16): KV bytes per token, all ranks.
KV_BYTES_PER_TOKEN = 80 * 8 * 128 * 2 * 2
# Caps that keep memory bounded (the spec keeps a metadata row per slot and rank).
MAX_POOL = 1_000_000
MAX_SLOT_ROWS = 10**7


@dataclass(frozen=True)
class Stall:
    rank: int
    start_ms: float
    duration_ms: float


@dataclass(frozen=True)
class TransferFit:
    """KV transfer times fitted to a real run (sim/fit.py): request i on rank r takes
    ``(base + per_page x pages) x exp(c_i + e_ir)``, the common factor c_i and the rank's
    noise e_ir from the run's own log residuals (c_i in request order from a random
    start, e_ir drawn at random), so the ranks' times are correlated as measured; with
    ``replay``, the measured times of request i mod n (rank r mod T)."""
    base_ms: float
    per_page_ms: float
    common: tuple[float, ...]                 # per request: the log residual its ranks share
    noise: tuple[float, ...]                  # per (request, rank): the rest
    replay: tuple[tuple[float, ...], ...] = ()

    def draw(self, rng: np.random.Generator, pages: np.ndarray, first: int, ranks: int,
             chunk: int) -> np.ndarray:
        """(len(pages), ranks) times for requests ``first ..``; ``chunk`` draws' worth
        of randomness either way, so a request's times depend on its index only."""
        m = len(pages)
        # the common factors in request order from a random start: a stall of the real
        # run (every process slowed at once) stays a stretch of slow requests
        start = int(rng.integers(0, len(self.common)))
        c = np.asarray(self.common)[(start + np.arange(chunk)) % len(self.common)][:m]
        e = np.asarray(self.noise)[rng.integers(0, len(self.noise), chunk * ranks)].reshape(chunk, ranks)[:m]
        if self.replay:
            table = np.asarray(self.replay)
            rows = (first + np.arange(m)) % len(table)
            return table[rows][:, np.arange(ranks) % table.shape[1]]
        base = self.base_ms + self.per_page_ms * pages
        return base[:, None] * np.exp(c[:, None] + e)


@dataclass(frozen=True)
class WriterFit:
    """The prefill's single writer, fitted to a real run (sim/fit.py): each (request,
    rank) job queues FIFO (requests in enqueue order, ranks in rank order), its KV write
    takes the transfer draw, then the room write; Success reaches the rank ``push_ms``
    later. A rank with a metadata delay (e2e's --metadata-delay) gets Success right
    after its KV write and its row ``delay`` later plus a wait behind the queue."""
    xfer_delay_ms: float          # enqueue -> the XFER reaches the prefill
    room_ms: float                # one metadata write
    push_ms: float                # the last write returned -> Success at the rank
    delay_ms: tuple[float, ...]   # per rank
    queue_delayed: bool = True    # a delayed row waits the backlog its request found;
    # False: it waits its metadata-lag draw (measured waits of delayed rows, sim/fit.py)


@dataclass(frozen=True)
class SimConfig:
    variant: str = "gate"
    ranks: int = 8
    request_pool: int = 64                 # max running + transferring requests
    slots: int | None = None               # metadata slots per rank; SGLang: 2 x request pool
    # Timeouts in seconds of simulated time, converted to agreed step counts as a deployed
    # worker converts them (model.spec.timeouts: steps of at least timeout_step_floor_ms).
    # None: the deployable default (30 s) where the variant has that timeout.
    gate_timeout_s: float | None = None    # strict's gate timeout
    release_timeout_s: float | None = None  # the deferred variants' release timeout
    timeout_step_floor_ms: float = STEP_FLOOR_S * 1000
    timeout_steps: int | None = None       # strict's count given directly (not with gate_timeout_s)
    no_clear: bool = False                 # reuse slots without zeroing the room (any variant)
    seed: int = 0
    # decode scheduler step: all-reduce (alpha + beta * n) then a forward pass
    forward: Dist = field(default_factory=lambda: parse_dist("const:25", "--forward"))
    idle_step: Dist = field(default_factory=lambda: parse_dist("const:1", "--idle-step"))
    allreduce_alpha_ms: float = ALLREDUCE_ALPHA_MS
    allreduce_beta_ms: float = ALLREDUCE_BETA_MS
    allreduce_extra: Dist | None = None    # calibrated: a measured residual added per step
    # prefill: base + per-token time on a pool of FIFO prefill servers
    prefill_base_ms: float = 15.0
    prefill_ms_per_token: float = 0.04
    prefill_servers: int = 4
    # KV transfer per rank: overhead + per range + bytes over bandwidth, plus jitter
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    page_tokens: int = 64
    te_overhead_ms: float = TE_OVERHEAD_MS
    te_per_range_ms: float = TE_PER_RANGE_MS
    bandwidth_gbps: float = TE_GBPS
    kv_jitter: Dist = field(default_factory=lambda: parse_dist("const:0", "--kv-jitter"))
    # metadata lag after KV completion, one distribution per rank (None: the default below)
    metadata_lag: tuple[Dist, ...] | None = None
    lag_skew: tuple[float, ...] | None = None
    # fitted to a real run (pdgate simulate --calibration); None: the model above
    transfer: TransferFit | None = None
    writer: WriterFit | None = None
    page_pool: int | None = None           # KV pages per rank (input_len = pages), see engine._take_pages
    fence_delay: Dist = field(default_factory=lambda: parse_dist("const:0.5", "--fence-delay"))
    # faults
    fail_prob: float = 0.0                 # per request: one rank's transfer fails
    lost_metadata_prob: float = 0.0        # per request and rank: the metadata never lands
    late_write: Dist | None = None         # extra delay of a failed request's metadata writes
    stalls: tuple[Stall, ...] = ()
    # bounds on a run (a run that would not end is refused or stopped with a message)
    max_sim_s: float = 1e7                 # simulated seconds
    max_steps: int | None = None           # protocol steps (None: 10**5 + 1000 per request)

    def lag_dists(self) -> tuple[Dist, ...]:
        if self.metadata_lag is not None:
            return self.metadata_lag
        return (parse_dist("exp:0.3", "--metadata-lag"),) * self.ranks

    def n_slots(self) -> int:
        return self.slots if self.slots is not None else 2 * self.request_pool

    def transfer_ms(self, tokens: float) -> float:
        """One rank's KV transfer for ``tokens`` tokens (without jitter)."""
        ranges = math.ceil(tokens / self.page_tokens)
        nbytes = tokens * self.kv_bytes_per_token / self.ranks
        return self.te_overhead_ms + self.te_per_range_ms * ranges + nbytes / (self.bandwidth_gbps * 1e6)

    def validate(self) -> "SimConfig":
        """Raise SimInputError naming the flag of the first bad value."""
        def need(ok: bool, flag: str, msg: str) -> None:
            if not ok:
                raise SimInputError(f"{flag}: {msg}")
        need(self.ranks >= 1, "--ranks", f"must be >= 1, got {self.ranks}")
        need(1 <= self.request_pool <= MAX_POOL, "--request-pool",
             f"must be in 1..{MAX_POOL}, got {self.request_pool}")
        need(self.n_slots() >= 1, "--slots", f"must be >= 1, got {self.slots}")
        need(self.n_slots() * self.ranks <= MAX_SLOT_ROWS, "--slots",
             f"{self.n_slots()} slots x {self.ranks} ranks is over {MAX_SLOT_ROWS} metadata rows")
        need(self.timeout_steps is None or self.timeout_steps >= 1, "--timeout-steps",
             f"must be >= 1, got {self.timeout_steps}")
        need(math.isfinite(self.timeout_step_floor_ms) and self.timeout_step_floor_ms > 0,
             "--timeout-step-floor", f"must be a finite number of ms > 0, got {self.timeout_step_floor_ms}")
        for flag, val in (("--allreduce-alpha", self.allreduce_alpha_ms),
                          ("--allreduce-beta", self.allreduce_beta_ms),
                          ("--prefill-base", self.prefill_base_ms),
                          ("--prefill-per-token", self.prefill_ms_per_token)):
            need(math.isfinite(val) and val >= 0, flag, f"must be a finite number >= 0, got {val}")
        need(1 <= self.prefill_servers <= MAX_POOL, "--prefill-servers",
             f"must be in 1..{MAX_POOL}, got {self.prefill_servers}")
        need(self.page_tokens >= 1, "--page-tokens", f"must be >= 1, got {self.page_tokens}")
        need(math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps > 0, "--bandwidth",
             f"must be > 0 GB/s, got {self.bandwidth_gbps}")
        for flag, p in (("--fail-prob", self.fail_prob), ("--lost-metadata-prob", self.lost_metadata_prob)):
            need(0.0 <= p <= 1.0, flag, f"must be a probability in [0, 1], got {p}")
        need(len(self.lag_dists()) == self.ranks, "--metadata-lag", "needs one distribution per rank")
        need(self.lag_skew is None or len(self.lag_skew) == self.ranks, "--lag-skew",
             "needs one multiplier per rank")
        need(math.isfinite(self.max_sim_s) and self.max_sim_s > 0, "--max-sim-seconds",
             f"must be a finite number > 0, got {self.max_sim_s}")
        limit_ms = self.max_sim_s * 1000.0
        for s in self.stalls:
            need(0 <= s.rank < self.ranks, "--stall", f"rank {s.rank} out of range 0..{self.ranks - 1}")
            need(s.start_ms >= 0 and s.duration_ms > 0, "--stall", "start must be >= 0 and duration > 0")
            need(s.start_ms + s.duration_ms <= limit_ms, "--stall",
                 f"the window ends after --max-sim-seconds ({self.max_sim_s:g} s)")
        for flag, val in (("--allreduce-alpha", self.allreduce_alpha_ms),
                          ("--allreduce-beta", self.allreduce_beta_ms)):
            need(val <= limit_ms, flag, f"{val:g} ms exceeds --max-sim-seconds ({self.max_sim_s:g} s)")
        for flag, dist in (("--forward", self.forward), ("--idle-step", self.idle_step)):
            need(dist.kind != "const" or dist.params[0] <= limit_ms, flag,
                 f"{dist} exceeds --max-sim-seconds ({self.max_sim_s:g} s)")
        return self
