"""``pdgate e2e``: the gated decode path end to end over real Mooncake on 127.0.0.1.

One prefill process and T decode-rank processes (a gloo group) move real KV pages and
metadata rows with Mooncake, run impl.decode's DecodeTransferQueue, check every
request's KV bytes and metadata row byte for byte, print the figures, and write a trace
that ``pdgate validate`` replays through the spec (docs/MOONCAKE.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from impl.decode.timeouts import GATE_TIMEOUT_S, steps_for
from impl.mooncake.prefill_main import add_workload_arguments, rank_ms

KEYS = ("committed", "aborted", "lost", "byte_exact", "gate_holds", "commit_latency_p50_ms",
        "commit_latency_p99_ms", "mb_per_s")


@dataclass
class E2EConfig:
    ranks: int = 2
    requests: int = 32
    variant: str = "strict"
    metadata_delay: list[tuple[int, float]] = field(default_factory=list)   # (rank, seconds)
    workload: list[str] = field(default_factory=list)     # --seed/--page-bytes/... as argv
    rank_args: list[str] = field(default_factory=list)    # forwarded to every decode rank
    timeout_steps: int | None = None
    slots: int = 64
    baseline: bool = False
    trace: str | None = None
    timeout_s: float = 120.0
    host: str = "127.0.0.1"


def timeout_steps_for(variant: str, step_ms: float, given: int | None,
                      gate_timeout_s: float = GATE_TIMEOUT_S) -> int | None:
    """strict's agreed step count: ``--timeout-steps`` if given, else ``--gate-timeout-s``
    at the rank loop's step period (a step takes at least ``--step-ms``)."""
    if variant != "strict":
        return None
    return given if given is not None else steps_for(gate_timeout_s, step_ms / 1000)


def run_e2e(cfg: E2EConfig) -> dict[str, Any]:
    """Run once; returns the figures (plus ``trace``, ``trace_valid``, ``trace_message``)."""
    from impl.mooncake.cluster import Cluster
    from impl.mooncake.report import figures, load_log, write_trace
    from model.spec.validate import validate

    with tempfile.TemporaryDirectory(prefix="pdgate-e2e-") as tmp:
        work = Path(tmp)
        rank_args = [*cfg.rank_args, "--variant", cfg.variant, "--slots", str(cfg.slots)]
        if cfg.timeout_steps is not None:
            rank_args += ["--timeout-steps", str(cfg.timeout_steps)]
        cluster = Cluster(cfg.ranks, work, cfg.workload, rank_args, host=cfg.host,
                          timeout_s=cfg.timeout_s)
        try:
            extra = [f"--metadata-delay={r}:{s * 1000:g}" for r, s in cfg.metadata_delay]
            prefill, endpoint = cluster.start_prefill(0, cfg.requests,
                                                      extra + (["--allow-baseline"] if cfg.baseline else []))
            cluster.start_ranks()
            cluster.serve(endpoint, 0, cfg.requests)
            cluster.wait_idle(cfg.timeout_s)
            baseline = None
            if cfg.baseline:
                prefill.send("baseline")
                baseline = prefill.read(cfg.timeout_s, "baseline figures")
            results = cluster.finish()
            prefill.send("quit")
            prefill.close(30)
        finally:
            cluster.close()
        logs = [load_log(str(work / f"rank{r}.jsonl")) for r in range(cfg.ranks)]
        trace_path = cfg.trace or str(work / "trace.ndjson")
        with open(trace_path, "w", encoding="utf-8") as fp:
            write_trace(logs, fp, cfg.variant, cfg.slots, cfg.timeout_steps)
        with open(trace_path, encoding="utf-8") as fp:
            check = validate(fp)
        out = figures(results, logs, cfg.requests)
        out.update(variant=cfg.variant, timeout_steps=cfg.timeout_steps,
                   trace=cfg.trace, trace_valid=check.ok, trace_message=check.message)
        if baseline is not None:
            # Same bytes both ways (KV + rows + rooms as written), so the ratio of times.
            # One cold run; bench_e2e warms up and takes the median over phases.
            raw = baseline["bytes"] / max(baseline["seconds"], 1e-9) / 1e6
            out.update(raw_mb_per_s=round(raw, 2), raw_bytes=baseline["bytes"],
                       throughput_ratio=round(baseline["seconds"] / out["seconds"], 3))
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from impl.mooncake.rank import add_rank_arguments
    p.add_argument("--ranks", type=int, default=2, help="decode TP ranks T")
    add_workload_arguments(p)
    add_rank_arguments(p)
    p.add_argument("--metadata-delay", type=rank_ms, action="append", default=[], metavar="RANK:MS",
                   help="prefill sends RANK its Success first and its metadata row MS later "
                        "(Success outrunning the row, as async NVLink/RDMA allow): the gate holds")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--trace", metavar="PATH", help="write the impl trace (pdgate validate PATH)")
    p.add_argument("--baseline", action="store_true",
                   help="also time raw batch_transfer_sync_write of the same KV bytes")
    p.add_argument("--timeout-s", type=float, default=120.0, help="bound on the whole run")


def _usage_error(args: argparse.Namespace) -> str | None:
    if not 1 <= args.ranks <= 16:
        return f"--ranks must be in 1..16, got {args.ranks}"
    if args.requests < 1:
        return f"--requests must be >= 1, got {args.requests}"
    for r, _ in args.metadata_delay:
        if r >= args.ranks:
            return f"--metadata-delay names rank {r}, but ranks are 0..{args.ranks - 1}"
    if args.timeout_steps is not None and args.timeout_steps < 1:
        return f"--timeout-steps must be >= 1, got {args.timeout_steps}"
    if args.step_ms <= 0 or args.timeout_s <= 0 or not args.gate_timeout_s > 0:
        return "--step-ms, --timeout-s and --gate-timeout-s must be > 0"
    if args.inflight < 1 or args.slots < args.inflight:
        return f"need 1 <= --inflight <= --slots, got {args.inflight} and {args.slots}"
    if args.max_pages > args.pages or args.min_pages < 1 or args.min_pages > args.max_pages:
        return (f"need 1 <= --min-pages <= --max-pages <= --pages, got {args.min_pages}, "
                f"{args.max_pages} and {args.pages}")
    if args.device not in ("cpu", "cuda"):
        return f"--device must be cpu or cuda, got {args.device!r}"
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            return ("--device cuda needs a CUDA GPU and the mooncake-cuda extra; "
                    "torch sees no CUDA device here")
    return None


def run(args: argparse.Namespace) -> int:
    problem = _usage_error(args)
    if problem is None:
        try:
            from impl.mooncake.engine import _import_engine
            _import_engine()
        except Exception as exc:      # MooncakeUnavailable: one line, no traceback
            problem = str(exc)
    if problem:
        print(f"pdgate e2e: {problem}", file=sys.stderr)
        return 2
    workload = ["--seed", str(args.seed), "--page-bytes", str(args.page_bytes),
                "--min-pages", str(args.min_pages), "--max-pages", str(args.max_pages)]
    rank_args = ["--pages", str(args.pages), "--inflight", str(args.inflight),
                 "--step-ms", str(args.step_ms), "--device", args.device,
                 "--heartbeat-ms", str(args.heartbeat_ms),
                 "--heartbeat-misses", str(args.heartbeat_misses),
                 "--fence-grace-s", str(args.fence_grace_s),
                 "--collective-timeout-s", str(args.collective_timeout_s)]
    cfg = E2EConfig(args.ranks, args.requests, args.variant, args.metadata_delay, workload,
                    rank_args, timeout_steps_for(args.variant, args.step_ms, args.timeout_steps,
                                                 args.gate_timeout_s),
                    args.slots, args.baseline, args.trace, args.timeout_s, args.host)
    from impl.mooncake.cluster import ClusterError
    from impl.mooncake.report import ReportError
    try:
        out = run_e2e(cfg)
    except (ClusterError, ReportError, OSError) as exc:
        print(f"pdgate e2e: {exc}", file=sys.stderr)
        return 1
    for key in (*KEYS, "trace_valid"):
        print(f"{key:24s} {out[key]}")
    if not out["trace_valid"]:
        print(f"trace: {out['trace_message']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fp:
            json.dump(out, fp, indent=2, sort_keys=True)
    ok = out["trace_valid"] and out["byte_exact"] and out["lost"] == 0 and out["disagree"] == 0
    return 0 if ok else 1
