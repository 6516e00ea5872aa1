"""``pdgate sweep``: a grid of simulations (ranks x metadata lag x arrival rate x
variant) run in parallel, to CSV; with ``--hazard``, the divergence hazard per cell; with
``--capacity``, the highest arrival rate that keeps TTFT p99 under a target for each
(ranks, lag, variant).

Engines: local processes, or Dask distributed (``--engine dask``, a local cluster or
``--address`` of a running one). Dask rather than Ray: it is pure Python, installs from
PyPI with no daemon binaries, starts a local cluster of worker processes in seconds on
a CI machine, and ``distributed.Client(address)`` is all a user's cluster needs; the
cells are independent function calls, which is what ``client.map`` does. Every engine
runs the same ``_cell`` on the same arguments (seeds included), so the CSV is the same.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import itertools
import json
import logging
import math
import multiprocessing as mp
import os
import sys
import time
from typing import Any, Iterable, Iterator

from model.cli import resolve_problem
from model.spec.variants import VARIANTS
from sim.draws import draw
from sim.engine import Simulation
from sim.errors import SimCutShort, SimInputError, check_writable, run_reporting
from sim.hazard import HAZARD_COLUMNS, summarize_hazard
from sim.options import (MAX_RANKS, add_model_arguments, build_config, build_workload, nonneg_int,
                         positive_float, positive_int)
from sim.results import SUMMARY_KEYS, summarize

PROG = "pdgate sweep"
DEFAULT_RATES = [2.0, 4.0, 8.0]
BACKSTOP_S = 60.0          # beyond --cell-timeout (cells stop themselves at it)
DASK_CONNECT_S = 30
GRID_COLUMNS = ("params", "metadata_lag", "rate", *SUMMARY_KEYS, "undecided", "stuck")
CAPACITY_COLUMNS = ("params", "variant", "ranks", "metadata_lag", "ttft_p99_target_ms", "capacity_rate",
                    "ttft_p99_ms_at_capacity", "bracket_lo", "bracket_hi", "note")
HAZARD_GRID_COLUMNS = ("params", "ranks", "metadata_lag", "rate", *HAZARD_COLUMNS)
CELL_KEYS = ("variant", "ranks", "metadata_lag", "rate")
LAYOUT = {"grid": (GRID_COLUMNS, CELL_KEYS), "hazard": (HAZARD_GRID_COLUMNS, CELL_KEYS),
          "capacity": (CAPACITY_COLUMNS, CELL_KEYS[:3])}


def _list(kind: type, flag: str):
    def conv(text: str) -> list:
        try:
            vals = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} must be a comma list of numbers") from None
        if not vals or any(not math.isfinite(v) or v <= 0 for v in vals):
            raise argparse.ArgumentTypeError(f"values must be finite and > 0, got {text!r}")
        if kind is int and any(v > MAX_RANKS for v in vals):
            raise argparse.ArgumentTypeError(f"values must be at most {MAX_RANKS}, got {text!r}")
        return vals
    return conv


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", default="ungated,gate,strict", help="comma list of variants")
    p.add_argument("--ranks", type=_list(int, "--ranks"), default=[2, 4, 8], help="comma list")
    p.add_argument("--metadata-lag", nargs="+", default=["exp:0.3"], metavar="DIST",
                   help="one or more lag distributions (space separated)")
    p.add_argument("--rate", type=_list(float, "--rate"), default=None,
                   help="comma list of arrival rates, requests/s (default 2,4,8; with --trace-in "
                        "target mean rates, default the trace's own)")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--out", default="sweep.csv", metavar="CSV",
                   help="where the rows go; cells already in it (same parameters) are skipped")
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                   help="worker processes (local engine; dask: workers of the local cluster)")
    p.add_argument("--engine", choices=("local", "dask"), default="local",
                   help="local processes, or Dask distributed (a local cluster, or --address)")
    p.add_argument("--address", metavar="HOST:PORT",
                   help="--engine dask: the scheduler of a running cluster (tcp://host:8786)")
    p.add_argument("--cell-timeout", type=positive_float, default=600.0, metavar="S",
                   help="fail if one cell takes longer (wall seconds)")
    p.add_argument("--capacity", action="store_true",
                   help="search the highest rate with TTFT p99 <= --ttft-p99-target")
    p.add_argument("--hazard", action="store_true",
                   help="per cell, --replications runs until the first invariant break")
    p.add_argument("--replications", type=positive_int, default=5, help="--hazard: seeds per cell")
    p.add_argument("--ttft-p99-target", type=positive_float, default=500.0, metavar="MS")
    p.add_argument("--rate-lo", type=positive_float, default=0.5)
    p.add_argument("--rate-hi", type=positive_float, default=64.0)
    p.add_argument("--capacity-iters", type=positive_int, default=8, help="bisection steps")
    p.add_argument("--plot", metavar="DIR", help="grid: ttft_p99_vs_rate.png, a line per variant")
    add_model_arguments(p, sweep=True)


def _simulate(args: argparse.Namespace, variant: str, ranks: int, lag: str, rate: float | None,
              seed: int | None = None) -> dict:
    seed = args.seed if seed is None else seed
    cfg = build_config(args, variant, ranks, [lag], seed, several=True)
    run = Simulation(cfg, build_workload(args, rate, seed), wall_limit_s=args.cell_timeout).run()
    if run.cut_short:
        raise SimCutShort(f"cell {variant} ranks={ranks} lag={lag} rate={rate}: {run.cut_short}")
    return {"metadata_lag": lag, "rate": rate, **summarize(run, False)}, run


def _grid_cell(args: argparse.Namespace, *cell) -> list[dict]:
    return [_simulate(args, *cell)[0]]


def _hazard_cell(args: argparse.Namespace, variant: str, ranks: int, lag: str,
                 rate: float | None) -> list[dict]:
    runs = [_simulate(args, variant, ranks, lag, rate, args.seed + k)[1]
            for k in range(args.replications)]
    return [{"ranks": ranks, "metadata_lag": lag, "rate": rate, **row}
            for row in summarize_hazard(variant, runs)]


def _meets(row: dict, target: float) -> bool:
    p99 = row["ttft_p99_ms"]
    return (not row["diverged"] and not row["stuck"] and not row["undecided"]
            and p99 is not None and p99 <= target)


def _capacity(args: argparse.Namespace, variant: str, ranks: int, lag: str) -> list[dict]:
    """Bisection on the rate (TTFT p99 grows with load; a diverged run fails the target)."""
    target, lo, hi = args.ttft_p99_target, args.rate_lo, args.rate_hi
    row = {"variant": variant, "ranks": ranks, "metadata_lag": lag, "ttft_p99_target_ms": target,
           "capacity_rate": None, "ttft_p99_ms_at_capacity": None, "bracket_lo": lo,
           "bracket_hi": hi, "note": ""}
    at_lo = _simulate(args, variant, ranks, lag, lo)[0]
    if not _meets(at_lo, target):
        row["note"] = "misses the target even at --rate-lo" + (" (diverged)" if at_lo["diverged"] else "")
        return [row]
    at_hi = _simulate(args, variant, ranks, lag, hi)[0]
    if _meets(at_hi, target):
        row.update(capacity_rate=hi, ttft_p99_ms_at_capacity=at_hi["ttft_p99_ms"],
                   note="meets the target at --rate-hi (capacity is at least that)")
        return [row]
    best = at_lo
    for _ in range(args.capacity_iters):
        mid = (lo + hi) / 2
        res = _simulate(args, variant, ranks, lag, mid)[0]
        if _meets(res, target):
            lo, best = mid, res
        else:
            hi = mid
    row.update(capacity_rate=round(lo, 6), ttft_p99_ms_at_capacity=best["ttft_p99_ms"],
               bracket_lo=round(lo, 6), bracket_hi=round(hi, 6))
    return [row]


MODES = {"grid": _grid_cell, "hazard": _hazard_cell, "capacity": _capacity}


def _cell(job: tuple) -> tuple[tuple, list[dict]]:
    """One cell's rows (run in a worker process: local or Dask)."""
    args, mode, cell = job
    try:
        return cell, MODES[mode](args, *cell)
    except (SimInputError, SimCutShort) as exc:
        return cell, [{"error": str(exc)}]


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal; elsewhere (a log, a
    pipe) only the finished bar, one line."""

    def __init__(self, total: int, stream: Any = None):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def tick(self) -> None:
        self.done += 1
        if not self.tty and self.done < self.total:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.t0
        self.stream.write(f"{chr(13) if self.tty else ''}[{'#' * filled}{'.' * (width - filled)}] "
                          f"{self.done}/{self.total} cells, {elapsed:.1f} s")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def _local(args: argparse.Namespace, jobs: list[tuple]) -> Iterator[tuple[tuple, list[dict]]]:
    """Cells in this process (--jobs 1 or one cell) or a process pool, as they finish.
    Every cell stops itself at --cell-timeout; the pool's own timeout is a backstop."""
    if args.jobs == 1 or len(jobs) == 1:
        yield from map(_cell, jobs)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(min(args.jobs, len(jobs))) as pool:
        it = pool.imap_unordered(_cell, jobs)
        for _ in jobs:
            try:
                yield it.next(timeout=args.cell_timeout + BACKSTOP_S)
            except mp.TimeoutError:
                pool.terminate()
                raise SimCutShort(f"--cell-timeout: a cell took longer than {args.cell_timeout:g} s") from None


def _dask(args: argparse.Namespace, jobs: list[tuple]) -> Iterator[tuple[tuple, list[dict]]]:
    """Cells on Dask distributed: the cluster at --address, else a local cluster of
    --jobs worker processes (one thread each), closed at the end."""
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError as exc:       # pragma: no cover - a dependency of pdgate
        raise SimInputError(f"--engine dask: cannot import distributed ({exc})") from None
    cluster = None
    try:
        if args.address:
            client = Client(args.address, timeout=DASK_CONNECT_S)
        else:
            cluster = LocalCluster(n_workers=min(args.jobs, len(jobs)), threads_per_worker=1,
                                   processes=True, dashboard_address=None, silence_logs=logging.ERROR)
            client = Client(cluster, timeout=DASK_CONNECT_S)
    except (OSError, ValueError) as exc:
        raise SimInputError(f"--address: cannot reach a Dask scheduler at {args.address}: "
                            f"{str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}") from None
    try:
        futures = client.map(_cell, jobs, pure=False)
        deadline = args.cell_timeout * len(jobs) + BACKSTOP_S
        try:
            for fut in as_completed(futures, timeout=deadline):
                yield fut.result()
        except TimeoutError:
            raise SimCutShort(f"--cell-timeout: cells did not finish within {deadline:g} s") from None
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def params_key(args: argparse.Namespace) -> str:
    """A short digest of every flag that is not a grid axis or a way of running it, so a
    resumed sweep reuses only cells computed with the same model."""
    skip = {"variant", "ranks", "metadata_lag", "rate", "out", "jobs", "engine", "address",
            "cell_timeout", "plot", "command"}
    items = sorted((k, v) for k, v in vars(args).items() if k not in skip)
    return hashlib.sha256(json.dumps(items, default=str).encode()).hexdigest()[:12]


MAX_JOBS, MAX_ITERS, MAX_REPLICATIONS = 1024, 64, 10_000


def _check(args: argparse.Namespace) -> list[str]:
    for flag, val, cap in (("--jobs", args.jobs, MAX_JOBS), ("--capacity-iters", args.capacity_iters, MAX_ITERS),
                           ("--replications", args.replications, MAX_REPLICATIONS)):
        if val > cap:
            raise SimInputError(f"{flag}: at most {cap}, got {val}")
    variants = [v.strip() for v in args.variant.split(",") if v.strip()]
    for v in variants or [""]:
        if v not in VARIANTS:
            raise SimInputError(f"--variant: unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    if args.capacity and args.hazard:
        raise SimInputError("--hazard: choose --capacity or --hazard, not both")
    if args.capacity and not args.rate_lo < args.rate_hi:
        raise SimInputError(f"--rate-lo: must be below --rate-hi ({args.rate_lo:g} >= {args.rate_hi:g})")
    if args.capacity and args.trace_in:
        raise SimInputError("--capacity: searches a synthetic rate; with --trace-in sweep --rate "
                            "(target mean rates) instead")
    if args.address is not None:
        _check_address(args)
    if args.plot and (args.capacity or args.hazard):
        raise SimInputError("--plot: draws the grid's TTFT p99 vs rate (not --capacity or --hazard)")
    if os.path.exists(args.out) and not os.path.isfile(args.out):
        raise SimInputError(f"--out: {args.out} is not a regular file (a sweep resumes from "
                            f"its rows and replaces it with the finished grid)")
    check_writable(args.out, "--out")
    check_writable(args.plot, "--plot", directory=True)
    # fail fast on bad strings and unbounded draws before starting processes (the
    # fewest ranks carry the most bytes per rank)
    for lag in args.metadata_lag:
        for r in args.ranks:
            build_config(args, variants[0], r, [lag], args.seed, several=True)
    workload = build_workload(args, (args.rate or [None])[0], args.seed)
    for lag in args.metadata_lag:
        draw(build_config(args, variants[0], min(args.ranks), [lag], args.seed, several=True), workload)
    return variants


def _check_address(args: argparse.Namespace) -> None:
    """--address names a scheduler Dask can dial and whose host resolves, within
    model.cli's bounded lookup (a bad one was an internal error, or a 30 s wait, after
    the CSV had been rewritten)."""
    if args.engine != "dask":
        raise SimInputError("--address: applies to --engine dask")
    try:
        from distributed.comm import get_address_host_port
        host, port = get_address_host_port(args.address)
        if not 0 < port < 65536:
            raise ValueError(f"port {port} out of range 1..65535")
    except ImportError as exc:       # pragma: no cover - a dependency of pdgate
        raise SimInputError(f"--engine dask: cannot import distributed ({exc})") from None
    except (ValueError, TypeError) as exc:
        raise SimInputError(f"--address: {args.address[:80]!r} is not a scheduler address "
                            f"(tcp://HOST:PORT): {str(exc)[:120]}") from None
    problem = resolve_problem(host, port)
    if problem:
        raise SimInputError(f"--address: host {problem}")


def _cells(args: argparse.Namespace, variants: list[str], mode: str) -> list[tuple]:
    if mode == "capacity":
        return list(itertools.product(variants, args.ranks, args.metadata_lag))
    rates = args.rate or ([None] if args.trace_in else DEFAULT_RATES)
    return list(itertools.product(variants, args.ranks, args.metadata_lag, rates))


def _key(values: Iterable) -> tuple[str, ...]:
    """A cell as the CSV writes it (resumed rows come back as text)."""
    return tuple("" if v is None else str(v) for v in values)


MAX_RESUME_LINE = 1 << 20       # characters; a sweep row is well under 1 KB


def _bounded_lines(fp: Any, path: str) -> Iterator[str]:
    """``fp``'s lines, refusing one longer than MAX_RESUME_LINE: a file that is no
    sweep CSV (gigabytes with no newline) would otherwise be read whole into memory."""
    for number in itertools.count(1):
        line = fp.readline(MAX_RESUME_LINE + 1)
        if not line:
            return
        if len(line) > MAX_RESUME_LINE:
            raise SimInputError(f"--out: {path} line {number} is longer than {MAX_RESUME_LINE} "
                                f"characters: not a sweep CSV to resume; remove it or choose another path")
        yield line


def _read_done(path: str, columns: tuple[str, ...], key_cols: tuple[str, ...], params: str
               ) -> dict[tuple, list[dict]]:
    """Rows of --out computed with the same parameters, by cell."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, newline="", encoding="utf-8") as fp:
            reader = csv.DictReader(_bounded_lines(fp, path))
            if tuple(reader.fieldnames or ()) != columns:
                raise SimInputError(f"--out: {path} exists with other columns (another mode or "
                                    f"version); remove it or choose another path")
            done: dict[tuple, list[dict]] = {}
            for row in reader:
                if row["params"] == params:
                    _check_resumed(row, path, reader.line_num)
                    done.setdefault(_key(row[c] for c in key_cols), []).append(row)
            return done
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise SimInputError(f"--out: cannot read {path} to resume: {exc}") from None


RESUMED_NUMBERS = ("rate", "ttft_p99_ms", "capacity_rate", "ttft_p99_target_ms")


def _check_resumed(row: dict, path: str, line: int) -> None:
    """A resumed row's values that the summary and the plot read back: numbers (or
    empty) and a True/False ``diverged``; an edited file is refused, not a crash."""
    for col in RESUMED_NUMBERS:
        text = row.get(col) or ""
        try:
            ok = text == "" or math.isfinite(float(text))
        except ValueError:
            ok = False
        if not ok:
            raise SimInputError(f"--out: {path} line {line}: {col} {text[:40]!r} is not a finite "
                                f"number; remove that row (or the file) to recompute it")
    if row.get("diverged", "") not in ("", "True", "False"):
        raise SimInputError(f"--out: {path} line {line}: diverged {row['diverged'][:40]!r} is not "
                            f"True or False; remove that row (or the file) to recompute it")


def write_csv(path: str, rows: Iterable[dict], columns: tuple[str, ...], mode: str = "w") -> None:
    try:
        with open(path, mode, newline="", encoding="utf-8") as fp:
            w = csv.DictWriter(fp, fieldnames=list(columns), extrasaction="ignore")
            if mode == "w":
                w.writeheader()
            for row in rows:
                w.writerow({k: "" if row.get(k) is None else row.get(k) for k in columns})
    except OSError as exc:
        raise SimInputError(f"--out: cannot write {path}: {exc.strerror}") from None


def execute(args: argparse.Namespace) -> list[dict[str, Any]]:
    variants = _check(args)
    mode = "capacity" if args.capacity else "hazard" if args.hazard else "grid"
    columns, key_cols = LAYOUT[mode]
    params = params_key(args)
    cells = _cells(args, variants, mode)
    done = _read_done(args.out, columns, key_cols, params)
    keys = {cell: _key(cell) for cell in cells}     # cells are in key_cols' order
    todo = [c for c in cells if keys[c] not in done]
    if len(todo) < len(cells):
        print(f"{PROG}: {len(cells) - len(todo)} of {len(cells)} cells already in {args.out}, "
              f"skipped", file=sys.stderr)
    # rows are appended as cells finish (an interrupted sweep resumes from them), then
    # the file is rewritten in grid order, so it is the same for any engine and --jobs
    write_csv(args.out, [r for c in cells if keys[c] in done for r in done[keys[c]]], columns)
    progress = Progress(len(todo))
    jobs = [(args, mode, c) for c in todo]
    results: dict[tuple, list[dict]] = {}
    errors = []
    if jobs:
        for cell, rows in (_dask if args.engine == "dask" else _local)(args, jobs):
            if "error" in rows[0]:
                errors.append(rows[0]["error"])
            else:
                rows = [{"params": params, **r} for r in rows]
                results[keys[cell]] = rows
                write_csv(args.out, rows, columns, mode="a")
            progress.tick()
    if errors:
        raise (SimCutShort if "stopped at" in errors[0] or "--cell-timeout" in errors[0]
               else SimInputError)(errors[0])
    ordered = [r for c in cells for r in (done.get(keys[c]) or results[keys[c]])]
    tmp = args.out + ".tmp"
    write_csv(tmp, ordered, columns)
    os.replace(tmp, args.out)
    if mode == "capacity":
        for r in ordered:
            cap = "-" if r["capacity_rate"] in (None, "") else f"{float(r['capacity_rate']):.3f} req/s"
            print(f"{r['variant']:>12} ranks={r['ranks']} lag={r['metadata_lag']}: capacity {cap} "
                  f"(TTFT p99 <= {float(r['ttft_p99_target_ms']):g} ms) {r['note']}")
    if args.plot:
        from sim.outputs import write_sweep_plot
        print(f"wrote {write_sweep_plot(args.plot, ordered)}")
    print(f"wrote {len(ordered)} rows to {args.out}")
    return ordered


def run(args: argparse.Namespace) -> int:
    return run_reporting(PROG, execute, args)
