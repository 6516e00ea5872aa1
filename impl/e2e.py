"""``pdgate e2e``: the gated decode path end to end over real Mooncake on 127.0.0.1.

One prefill process and T decode-rank processes (a gloo group) move real KV pages and
metadata rows with Mooncake, run impl.decode's DecodeTransferQueue, check every
request's KV bytes and metadata row byte for byte, print the figures, and write a trace
that ``pdgate validate`` replays through the spec (docs/MOONCAKE.md).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from impl.decode.timeouts import GATE_TIMEOUT_S, steps_for
from impl.mooncake.prefill_main import add_workload_arguments, rank_ms
from model.cli import number, resolve_problem, writable_problem

KEYS = ("committed", "aborted", "lost", "byte_exact", "gate_holds", "commit_latency_p50_ms",
        "commit_latency_p99_ms", "mb_per_s", "ttft_p50_ms", "ttft_p99_ms", "gate_delay_p50_ms",
        "gate_delay_p99_ms", "enqueue_commit_p50_ms", "enqueue_commit_p99_ms")


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
    step_ms: float = 2.0
    work_dir: str | None = None       # rank logs, stderr, default JSON and trace
    netns: bool = False               # children in a private network namespace (loopback only)
    # Tests only: called with (cluster, prefill) once the ranks were told to serve
    # (an attacker, a kill), to check what the run then reports.
    during: Callable[[Any, Any], None] | None = None


def timeout_steps_for(variant: str, step_ms: float, given: int | None,
                      gate_timeout_s: float = GATE_TIMEOUT_S) -> int | None:
    """strict's agreed step count: ``--timeout-steps`` if given, else ``--gate-timeout-s``
    at the rank loop's step period (a step takes at least ``--step-ms``)."""
    if variant != "strict":
        return None
    return given if given is not None else steps_for(gate_timeout_s, step_ms / 1000)


def aborts_explained(cfg: E2EConfig) -> bool:
    """Whether a fault this run injected can abort requests: only a metadata delay
    longer than strict's timeout does (``gate`` has no timeout; a delay only holds)."""
    if cfg.timeout_steps is None:
        return False
    return any(s * 1000 >= cfg.timeout_steps * cfg.step_ms for _, s in cfg.metadata_delay)


def setup(cfg: E2EConfig) -> dict[str, Any]:
    """What ``pdgate calibrate`` needs to know of how the run was set up. The workload
    is closed-loop: every request is served at once and admitted as room frees."""
    args = cfg.rank_args + cfg.workload
    flag = (lambda name, default: args[args.index(name) + 1] if name in args else default)
    return {"ranks": cfg.ranks, "requests": cfg.requests, "variant": cfg.variant,
            "arrivals": "closed-loop", "step_ms": cfg.step_ms, "slots": cfg.slots,
            "inflight": int(flag("--inflight", 16)), "pages": int(flag("--pages", 512)),
            "min_pages": int(flag("--min-pages", 0)), "max_pages": int(flag("--max-pages", 0)),
            "page_bytes": int(flag("--page-bytes", 0)),
            "metadata_delay_ms": {str(r): s * 1000 for r, s in cfg.metadata_delay}}


def machine_load() -> dict[str, float | None]:
    """How busy the machine was, for reading a run's timings: the 1-minute load average
    and the share of the last 10 s in which some runnable task waited for a CPU
    (/proc/pressure/cpu, where the kernel has it); None where unreadable."""
    out: dict[str, float | None] = {"loadavg_1m": None, "cpu_pressure_some_avg10": None}
    try:
        with open("/proc/loadavg", encoding="ascii") as fp:
            out["loadavg_1m"] = float(fp.read().split()[0])
        with open("/proc/pressure/cpu", encoding="ascii") as fp:
            some = fp.readline().split()
        out["cpu_pressure_some_avg10"] = float(some[1].split("=")[1])
    except (OSError, ValueError, IndexError):
        pass
    return out


def run_e2e(cfg: E2EConfig) -> dict[str, Any]:
    """Run once; returns the figures (plus ``trace``, ``trace_valid``, ``trace_message``,
    ``work_dir``, ``error``). A run that fails still returns what it can: the error,
    the trace of the steps every rank logged, and the work dir with the rank logs."""
    from impl.mooncake.cluster import Cluster, ClusterError
    from impl.mooncake.report import ReportError, figures, load_log, write_trace
    from impl.mooncake.timeline import timeline
    from model.spec.validate import validate

    # absolute: the children run in the repository, not in this process's folder
    work = Path(cfg.work_dir).absolute() if cfg.work_dir else Path(tempfile.mkdtemp(prefix="pdgate-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    rank_args = [*cfg.rank_args, "--variant", cfg.variant, "--slots", str(cfg.slots)]
    if cfg.timeout_steps is not None:
        rank_args += ["--timeout-steps", str(cfg.timeout_steps)]
    cluster = Cluster(cfg.ranks, work, cfg.workload, rank_args, host=cfg.host,
                      timeout_s=cfg.timeout_s, netns=cfg.netns)
    error, results, baseline, prefill_stats = None, None, None, {}
    load_before = machine_load()
    _INTERRUPTS.arm(True)
    try:
        extra = [f"--metadata-delay={r}:{s * 1000:g}" for r, s in cfg.metadata_delay]
        prefill, endpoint = cluster.start_prefill(0, cfg.requests,
                                                  extra + (["--allow-baseline"] if cfg.baseline else []))
        cluster.ready = cluster.start_ranks()
        cluster.serve(endpoint, 0, cfg.requests)
        if cfg.during is not None:
            cfg.during(cluster, prefill)
        cluster.wait_idle(cfg.timeout_s)
        try:
            if cfg.baseline:
                prefill.send("baseline")
                baseline = prefill.read(cfg.timeout_s, "baseline figures")
            prefill.send("stats")
            prefill_stats = prefill.read(30, "prefill stats")
        except ClusterError as exc:      # a dead prefill: the ranks' decisions still count
            error = _first_line(exc)
        results = cluster.finish()
        if error is None:
            prefill.send("quit")
            prefill.close(30)
    except (ClusterError, OSError, KeyError, ValueError) as exc:
        error = error or _first_line(exc)
    except KeyboardInterrupt as exc:     # SIGINT, or SIGTERM (_Interrupts)
        error = f"interrupted by {signal.Signals(getattr(exc, 'signum', signal.SIGINT)).name}"
    finally:
        _INTERRUPTS.arm(False)
        cluster.close()
    partial = results is None
    logs = [load_log(str(work / f"rank{r}.jsonl"), partial=partial) for r in range(cfg.ranks)]
    trace_path = cfg.trace or str(work / "trace.ndjson")
    try:
        with open(trace_path, "w", encoding="utf-8") as fp:
            write_trace(logs, fp, cfg.variant, cfg.slots, cfg.timeout_steps, partial=partial)
        with open(trace_path, encoding="utf-8") as fp:
            check = validate(fp)
        trace_valid, trace_message = check.ok, check.message
    except (ReportError, KeyError, ValueError) as exc:
        trace_valid, trace_message = False, f"trace not written: {exc}"
    out: dict[str, Any] = dict.fromkeys(KEYS)
    out.update(ranks=cfg.ranks, requests=cfg.requests, disagree=None, dropped_frames=0,
               rejected_frames=0, broken_connections=0, foreign_writes=0)
    if results is not None:
        out.update(figures(results, logs, cfg.requests))
        out.update(timeline(results, logs, prefill_stats.get("landings", [])))
    out["setup"] = setup(cfg)
    out["machine_load"] = {"before": load_before, "after": machine_load()}
    out["dropped_frames"] += prefill_stats.get("dropped", 0)
    out["rejected_frames"] += prefill_stats.get("rejected", 0)
    out["broken_connections"] += prefill_stats.get("broken", 0)   # garbage, oversized frames
    out["prefill_digest_seconds"] = prefill_stats.get("digest_seconds")
    unexplained = bool(out["aborted"]) and not aborts_explained(cfg)
    out.update(variant=cfg.variant, timeout_steps=cfg.timeout_steps, trace=trace_path,
               trace_partial=partial, trace_valid=trace_valid, trace_message=trace_message,
               work_dir=str(work), error=error, netns=cfg.netns,
               disturbed=bool(out["dropped_frames"] or out["rejected_frames"]
                              or out["broken_connections"] or out["foreign_writes"]
                              or unexplained),
               unexplained_aborts=unexplained)
    if baseline is not None and results is not None:
        # Same bytes both ways (KV + rows + rooms as written), so the ratio of times.
        # One cold run; bench_e2e warms up and takes the median over phases.
        raw = baseline["bytes"] / max(baseline["seconds"], 1e-9) / 1e6
        out.update(raw_mb_per_s=round(raw, 2), raw_bytes=baseline["bytes"],
                   throughput_ratio=round(baseline["seconds"] / out["seconds"], 3))
    return out


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) during a run: it stops there and still writes its JSON."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Interrupts:
    """SIGINT and SIGTERM, while ``pdgate e2e`` runs: the first, while the cluster runs
    (``armed``), raises Interrupted there; any other is only recorded, so the cleanup
    (children killed, trace and JSON written) finishes before the exit 128 + signal."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._armed = False

    def _handler(self, signum: int, frame: Any) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if first and self._armed:
            raise Interrupted(signum)

    @contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self.signum = None
        old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def arm(self, on: bool) -> None:
        self._armed = on and self.signum is None


_INTERRUPTS = _Interrupts()


def run_ok(out: dict[str, Any]) -> bool:
    """Exit 0: no error, a valid trace, every commit byte-exact, nothing lost or in
    disagreement, and nothing disturbed the run (frames rejected or dropped, foreign
    writes found by the digest check, aborts no injected fault explains)."""
    return (out["error"] is None and out["trace_valid"] and bool(out["byte_exact"])
            and out["lost"] == 0 and out["disagree"] == 0 and not out["disturbed"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    from impl.mooncake.rank import add_rank_arguments
    p.add_argument("--ranks", type=number(integer=True), default=2, help="decode TP ranks T, 1..16")
    add_workload_arguments(p)
    add_rank_arguments(p)
    p.add_argument("--metadata-delay", type=rank_ms, action="append", default=[], metavar="RANK:MS",
                   help="prefill sends RANK its Success first and its metadata row MS later "
                        "(Success outrunning the row, as async NVLink/RDMA allow): the gate holds")
    p.add_argument("--json", metavar="PATH",
                   help="where to write the figures as JSON (default: in the work dir)")
    p.add_argument("--trace", metavar="PATH",
                   help="where to write the impl trace, for pdgate validate (default: in the work dir)")
    p.add_argument("--baseline", action="store_true",
                   help="also time raw batch_transfer_sync_write of the same KV bytes")
    p.add_argument("--timeout-s", type=number(0, 86400, above=True), default=120.0,
                   help="bound on the whole run")
    p.add_argument("--work-dir", metavar="DIR",
                   help="rank logs, the JSON and the trace by default (default: a new temporary "
                        "folder; kept, with the rank logs, when the run fails)")
    p.add_argument("--keep-logs", action="store_true", help="keep the rank logs of a good run too")
    p.add_argument("--netns", choices=("auto", "on", "off"), default="auto",
                   help="run the prefill and ranks in a private network namespace with only a "
                        "loopback, so no other process reaches Mooncake's listeners (needs root "
                        "and nsenter; auto: when available)")


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
    kv = args.requests * args.max_pages * args.page_bytes * args.ranks
    if kv > 2 << 30:
        return (f"the workload needs up to {kv >> 20} MiB of prefill KV (--requests x "
                f"--max-pages x --page-bytes x --ranks), limit 2048 MiB")
    if args.pages * args.page_bytes > 4 << 30:
        return f"--pages x --page-bytes is {(args.pages * args.page_bytes) >> 20} MiB per rank, limit 4096 MiB"
    if not args.gate_timeout_s > 0:
        return "--gate-timeout-s must be > 0"
    if args.inflight < 1 or args.slots < args.inflight:
        return f"need 1 <= --inflight <= --slots, got {args.inflight} and {args.slots}"
    if args.max_pages > args.pages or args.min_pages < 1 or args.min_pages > args.max_pages:
        return (f"need 1 <= --min-pages <= --max-pages <= --pages, got {args.min_pages}, "
                f"{args.max_pages} and {args.pages}")
    where = resolve_problem(args.host)
    if where:
        return f"--host: {where}"
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
    for path in (args.json, args.trace):
        problem = problem or (writable_problem(path) if path else None)
    if problem is None:
        try:
            from impl.mooncake.engine import _import_engine
            _import_engine()
        except Exception as exc:      # MooncakeUnavailable: one line, no traceback
            problem = str(exc)
    netns = args.netns == "on"
    if problem is None and args.netns != "off":
        from impl.mooncake.netns import problem as netns_problem
        why = netns_problem()
        netns = why is None
        if why and args.netns == "on":
            problem = f"--netns on: {why}"
        elif why:
            print(f"pdgate e2e: no private network namespace ({why}); Mooncake's listeners "
                  f"are reachable by other local processes", file=sys.stderr)
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
                 "--collective-timeout-s", str(args.collective_timeout_s),
                 "--connect-timeout-s", str(args.connect_timeout_s)]
    cfg = E2EConfig(args.ranks, args.requests, args.variant, args.metadata_delay, workload,
                    rank_args, timeout_steps_for(args.variant, args.step_ms, args.timeout_steps,
                                                 args.gate_timeout_s),
                    args.slots, args.baseline, args.trace, args.timeout_s, args.host,
                    args.step_ms, args.work_dir, netns=netns)
    with _INTERRUPTS.installed() as interrupted:
        out = run_e2e(cfg)
        ok = run_ok(out)
        json_path = args.json or str(Path(out["work_dir"]) / "e2e.json")
        try:
            with open(json_path, "w", encoding="utf-8") as fp:
                json.dump(out, fp, indent=2, sort_keys=True)
        except OSError as exc:
            print(f"pdgate e2e: --json: cannot write {json_path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if out["error"]:
        print(f"pdgate e2e: {out['error']}", file=sys.stderr)
    for key in (*KEYS, "dropped_frames", "rejected_frames", "broken_connections",
                "foreign_writes", "disturbed",
                "trace_valid"):
        print(f"{key:24s} {out[key]}")
    if not out["trace_valid"]:
        print(f"trace: {out['trace_message']}")
    if out.get("abort_reasons"):         # the ranks' own words, not only the prefill's stderr
        print(f"abort reasons: {json.dumps(out['abort_reasons'])}")
    print(f"json {json_path}; trace {out['trace']}")
    if ok and not args.keep_logs:
        _remove_rank_files(Path(out["work_dir"]), args.ranks)
    else:
        print(f"rank logs kept in {out['work_dir']}")
    return 128 + interrupted.signum if interrupted.signum else 0 if ok else 1


def _remove_rank_files(work: Path, ranks: int) -> None:
    """A good run keeps its JSON and trace, not the per-child logs."""
    names = [f"rank{r}{ext}" for r in range(ranks)
             for ext in (".jsonl", ".jsonl.result.json", ".stderr")] + ["prefill0.stderr"]
    for name in names:
        try:
            (work / name).unlink()
        except OSError:
            pass
    try:
        work.rmdir()          # only if nothing is left (the JSON and trace went elsewhere)
    except OSError:
        pass
