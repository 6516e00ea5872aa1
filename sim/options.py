"""Command-line options shared by ``pdgate simulate`` and ``pdgate sweep``, and their
conversion into a SimConfig and a Workload. Bad values give one line naming the flag."""
from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable, NoReturn

from model.spec.timeouts import STEP_FLOOR_S
from model.spec.variants import VARIANTS
from sim.config import ALLREDUCE_ALPHA_MS, ALLREDUCE_BETA_MS, TE_GBPS, SimConfig, Stall
from sim.dists import parse_dist, parse_rank_dists, parse_skew
from sim.draws import stream
from sim.errors import SimInputError
from sim.traces import DEFAULT_CACHE_BLOCKS
from sim.workload import Workload, load_trace, synthetic


DEFAULT_REQUESTS = 1000
DEFAULT_RATE = 4.0
DEFAULT_INPUT, DEFAULT_OUTPUT = "lognormal:7,0.8", "lognormal:5,0.8"
MAX_REQUESTS = 50_000_000
MAX_RANKS = 1024


def _number(kind: Callable[[str], Any], lo: float, strict: bool, what: str) -> Callable[[str], Any]:
    def conv(text: str) -> Any:
        try:
            val = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(val) or val < lo or (strict and val == lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {lo:g}, got {text}")
        return val
    return conv


positive_int = _number(int, 0, True, "an integer")
nonneg_int = _number(int, 0, False, "an integer")
positive_float = _number(float, 0, True, "a number")
nonneg_float = _number(float, 0, False, "a number")


def probability(text: str) -> float:
    val = nonneg_float(text)
    if val > 1:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text}")
    return val


def one_line_errors(p: argparse.ArgumentParser) -> None:
    """argparse prints the usage before its error; users get one line and exit 2."""
    def error(message: str) -> NoReturn:
        print(f"{p.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)
    p.error = error  # type: ignore[method-assign]


def add_model_arguments(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """Workload, timing and fault flags (times in ms, distributions as in docs/SIMULATOR.md)."""
    one_line_errors(p)
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=positive_int, default=None,
                   help=f"requests to simulate (default {DEFAULT_REQUESTS}); with --trace-in it "
                        f"truncates the replay (a replay is whole by default)")
    if not sweep:
        w.add_argument("--rate", type=positive_float, default=None,
                       help=f"arrivals per second (default {DEFAULT_RATE:g}); with --trace-in the "
                            f"target mean rate: inter-arrival times are rescaled to it")
    w.add_argument("--burstiness", type=positive_float, default=None,
                   help="Gamma shape of inter-arrival gaps (1 = Poisson, the default; < 1 burstier)")
    w.add_argument("--trace-in", metavar="PATH",
                   help="replay a published trace: Mooncake FAST'25 JSONL, Azure 2023/2024/2025 "
                        "CSV or BurstGPT CSV (docs/SIMULATOR.md)")
    w.add_argument("--trace-window", metavar="START:END",
                   help="--trace-in: only the requests arriving in [START, END) seconds from its first")
    w.add_argument("--time-scale", type=positive_float, default=None, metavar="X",
                   help="--trace-in: multiply inter-arrival times by X (0.5 = twice the rate)")
    w.add_argument("--prefix-cache-blocks", type=nonneg_int, default=None, metavar="N",
                   help=f"--trace-in with hash_ids: prefill-side LRU prefix cache of N blocks of "
                        f"512 tokens (default {DEFAULT_CACHE_BLOCKS}; 0 = off)")
    w.add_argument("--input-len", default=None, metavar="DIST",
                   help=f"prompt tokens (default {DEFAULT_INPUT})")
    w.add_argument("--output-len", default=None, metavar="DIST",
                   help=f"output tokens (default {DEFAULT_OUTPUT})")
    t = p.add_argument_group("timing (ms)")
    t.add_argument("--forward", default="const:25", metavar="DIST", help="decode forward pass")
    t.add_argument("--idle-step", default="const:1", metavar="DIST",
                   help="scheduler loop time when no batch runs")
    t.add_argument("--allreduce-alpha", type=nonneg_float, default=ALLREDUCE_ALPHA_MS, metavar="MS")
    t.add_argument("--allreduce-beta", type=nonneg_float, default=ALLREDUCE_BETA_MS, metavar="MS",
                   help="per queued request")
    t.add_argument("--prefill-base", type=nonneg_float, default=15.0, metavar="MS")
    t.add_argument("--prefill-per-token", type=nonneg_float, default=0.04, metavar="MS")
    t.add_argument("--prefill-servers", type=positive_int, default=4)
    t.add_argument("--kv-bytes-per-token", type=positive_int, default=SimConfig.kv_bytes_per_token,
                   help="KV bytes per prompt token over all ranks")
    t.add_argument("--page-tokens", type=positive_int, default=64, help="tokens per transfer range")
    t.add_argument("--bandwidth", type=positive_float, default=round(TE_GBPS, 3), metavar="GBPS",
                   help="per-rank transfer bandwidth, GB/s")
    t.add_argument("--kv-jitter", default="const:0", metavar="DIST", help="added to each transfer")
    if not sweep:
        t.add_argument("--metadata-lag", action="append", metavar="DIST|RANK=DIST",
                       help="metadata lag after KV completion (default exp:0.3); RANK=DIST overrides one rank")
    t.add_argument("--lag-skew", metavar="S|M0,M1,..",
                   help="per-rank lag multipliers: a ramp 1..1+S, or one per rank")
    t.add_argument("--fence-delay", default="const:0.5", metavar="DIST",
                   help="abort -> prefill's acknowledgement (after its writes completed)")
    c = p.add_argument_group("capacity")
    c.add_argument("--request-pool", type=positive_int, default=64,
                   help="max requests transferring or running")
    c.add_argument("--slots", type=positive_int, help="metadata slots per rank (default 2 x pool)")
    c.add_argument("--gate-timeout-s", type=positive_float, metavar="S",
                   help="strict's gate timeout in simulated seconds (default 30), converted to an "
                        "agreed step count as a deployed worker does (see --timeout-step-floor)")
    c.add_argument("--timeout-steps", type=positive_int, metavar="N",
                   help="strict's timeout as a step count instead of --gate-timeout-s")
    c.add_argument("--release-timeout-s", type=positive_float, metavar="S",
                   help="the deferred variants' release timeout in seconds (default 30)")
    c.add_argument("--timeout-step-floor", type=positive_float, default=STEP_FLOOR_S * 1000, metavar="MS",
                   help="the shortest scheduler step the seconds-to-steps conversion assumes (ms, default 1)")
    f = p.add_argument_group("faults")
    f.add_argument("--fail-prob", type=probability, default=0.0,
                   help="per request: one rank's transfer fails")
    f.add_argument("--lost-metadata-prob", type=probability, default=0.0,
                   help="per request and rank: the metadata row never lands")
    f.add_argument("--late-write", metavar="DIST",
                   help="extra delay of a failed request's metadata writes (late writes after the abort)")
    f.add_argument("--no-clear", action="store_true", help="reuse slots without zeroing the room")
    f.add_argument("--stall", action="append", default=[], metavar="RANK:START:DURATION",
                   help="the rank's KV and metadata are held during the window (ms)")
    b = p.add_argument_group("bounds")
    b.add_argument("--max-sim-seconds", type=positive_float, default=1e7, metavar="S",
                   help="refuse draws and arrivals beyond S simulated seconds; stop a run there")
    b.add_argument("--max-steps", type=positive_int, default=None, metavar="N",
                   help="stop a run after N protocol steps (default 10**5 + 1000 per request)")


def parse_stall(text: str, ranks: int) -> Stall:
    parts = text.split(":")
    try:
        rank, start, dur = int(parts[0]), float(parts[1]), float(parts[2])
        if len(parts) != 3:
            raise ValueError
    except (ValueError, IndexError):
        raise SimInputError(f"--stall: {text!r} must be RANK:START_MS:DURATION_MS") from None
    if not 0 <= rank < ranks or start < 0 or not dur > 0 or not math.isfinite(start + dur):
        raise SimInputError(f"--stall: {text!r}: rank must be in 0..{ranks - 1}, start >= 0, duration > 0")
    return Stall(rank, start, dur)


def build_config(args: argparse.Namespace, variant: str, ranks: int, lag: list[str] | None,
                 seed: int, several: bool = False) -> SimConfig:
    """A validated SimConfig from the flags (variant, ranks, lag and seed given apart
    because --compare and the sweep vary them). With ``several`` variants,
    the timeout flags apply to those that have that timeout."""
    if not 1 <= ranks <= MAX_RANKS:
        raise SimInputError(f"--ranks: must be in 1..{MAX_RANKS}, got {ranks}")
    base = VARIANTS.get(variant)
    gate = args.gate_timeout_s, args.timeout_steps
    release = args.release_timeout_s
    if several and base is not None:
        gate = gate if base.timeout_steps is not None else (None, None)
        release = release if base.release_timeout_steps is not None else None
    cfg = SimConfig(
        variant=variant, ranks=ranks, request_pool=args.request_pool, slots=args.slots,
        gate_timeout_s=gate[0], timeout_steps=gate[1], release_timeout_s=release,
        timeout_step_floor_ms=args.timeout_step_floor, no_clear=args.no_clear, seed=seed,
        forward=parse_dist(args.forward, "--forward"),
        idle_step=parse_dist(args.idle_step, "--idle-step"),
        allreduce_alpha_ms=args.allreduce_alpha, allreduce_beta_ms=args.allreduce_beta,
        prefill_base_ms=args.prefill_base, prefill_ms_per_token=args.prefill_per_token,
        prefill_servers=args.prefill_servers, kv_bytes_per_token=args.kv_bytes_per_token,
        page_tokens=args.page_tokens, bandwidth_gbps=args.bandwidth,
        kv_jitter=parse_dist(args.kv_jitter, "--kv-jitter"),
        metadata_lag=tuple(parse_rank_dists(lag or ["exp:0.3"], ranks, "--metadata-lag")),
        lag_skew=tuple(parse_skew(args.lag_skew, ranks)),
        fence_delay=parse_dist(args.fence_delay, "--fence-delay"),
        fail_prob=args.fail_prob, lost_metadata_prob=args.lost_metadata_prob,
        late_write=parse_dist(args.late_write, "--late-write") if args.late_write else None,
        stalls=tuple(parse_stall(s, ranks) for s in args.stall),
        max_sim_s=args.max_sim_seconds, max_steps=args.max_steps)
    if getattr(args, "calibration", None):
        from sim import calibrated
        calibrated.check_flags(args)
        return calibrated.configure(cfg.validate(), calibrated.load(args.calibration),
                                    args.transfer_model or "writer",
                                    calibrated.parse_delays(args.metadata_delay), args.inflight)
    return cfg.validate()


def _window(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    try:
        lo, hi = float(start), float(end)
    except ValueError:
        raise SimInputError(f"--trace-window: {text!r} must be START:END in seconds") from None
    if not sep or not (math.isfinite(lo) and math.isfinite(hi)) or not 0 <= lo < hi:
        raise SimInputError(f"--trace-window: {text!r} must be START:END seconds with 0 <= START < END")
    return lo, hi


def check_workload_flags(args: argparse.Namespace) -> None:
    """A flag that has no meaning for the chosen workload is refused, never ignored."""
    def given(name: str) -> bool:
        return getattr(args, name, None) is not None

    if args.trace_in:
        for name in ("burstiness", "input_len", "output_len"):
            if given(name):
                raise SimInputError(f"--{name.replace('_', '-')}: does not apply to a replay "
                                    f"(--trace-in gives arrivals and lengths)")
        if given("time_scale") and given("rate"):
            raise SimInputError("--time-scale: give either --time-scale or --rate (a target mean "
                                "rate) for a replay, not both")
    else:
        for name in ("trace_window", "time_scale", "prefix_cache_blocks"):
            if given(name):
                raise SimInputError(f"--{name.replace('_', '-')}: applies only to a replay (--trace-in)")
    n = args.requests or DEFAULT_REQUESTS
    if n > MAX_REQUESTS:
        raise SimInputError(f"--requests: at most {MAX_REQUESTS}, got {n}")


def build_workload(args: argparse.Namespace, rate: float | None, seed: int) -> Workload:
    """The flags' workload; ``rate`` is the synthetic rate, or a replay's target mean rate."""
    check_workload_flags(args)
    if getattr(args, "calibration", None):
        from sim import calibrated
        cal = calibrated.load(args.calibration)
        return calibrated.workload(cal, args.requests or cal["setup"]["requests"],
                                   stream(seed, "workload"))
    if args.trace_in:
        window = _window(args.trace_window) if args.trace_window else None
        blocks = DEFAULT_CACHE_BLOCKS if args.prefix_cache_blocks is None else args.prefix_cache_blocks
        return load_trace(args.trace_in, args.requests, window, blocks,
                          args.time_scale or 1.0, rate)
    return synthetic(stream(seed, "workload"), args.requests or DEFAULT_REQUESTS,
                     DEFAULT_RATE if rate is None else rate,
                     1.0 if args.burstiness is None else args.burstiness,
                     parse_dist(args.input_len or DEFAULT_INPUT, "--input-len"),
                     parse_dist(args.output_len or DEFAULT_OUTPUT, "--output-len"))
