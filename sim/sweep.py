"""``pdgate sweep``: a grid of simulations (ranks x metadata lag x arrival rate x
variant) run in parallel over the cores, to CSV; or, with ``--capacity``, the highest
arrival rate that keeps TTFT p99 under a target for each (ranks, lag, variant).
"""
from __future__ import annotations

import argparse
import csv
import itertools
import multiprocessing as mp
import os
import sys
import time
from typing import Any, Iterable

from model.spec.variants import VARIANTS
from sim.engine import Simulation
from sim.errors import SimInputError, run_reporting
from sim.options import (add_model_arguments, build_config, build_workload, nonneg_int,
                         positive_float, positive_int)
from sim.results import SUMMARY_KEYS, summarize

PROG = "pdgate sweep"
GRID_COLUMNS = ("metadata_lag", "rate", *SUMMARY_KEYS, "undecided", "stuck")
CAPACITY_COLUMNS = ("variant", "ranks", "metadata_lag", "ttft_p99_target_ms", "capacity_rate",
                    "ttft_p99_ms_at_capacity", "bracket_lo", "bracket_hi", "note")


def _list(kind: type, flag: str):
    def conv(text: str) -> list:
        try:
            vals = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} must be a comma list of numbers") from None
        if not vals or any(v <= 0 for v in vals):
            raise argparse.ArgumentTypeError(f"values must be > 0, got {text!r}")
        return vals
    return conv


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", default="ungated,gate,strict", help="comma list of variants")
    p.add_argument("--ranks", type=_list(int, "--ranks"), default=[2, 4, 8], help="comma list")
    p.add_argument("--metadata-lag", nargs="+", default=["exp:0.3"], metavar="DIST",
                   help="one or more lag distributions (space separated)")
    p.add_argument("--rate", type=_list(float, "--rate"), default=[2.0, 4.0, 8.0],
                   help="comma list of arrival rates (requests/s)")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--out", default="sweep.csv", metavar="CSV", help="where the rows go")
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1, help="worker processes")
    p.add_argument("--cell-timeout", type=positive_float, default=600.0, metavar="S",
                   help="fail if one cell takes longer (wall seconds)")
    p.add_argument("--capacity", action="store_true",
                   help="search the highest rate with TTFT p99 <= --ttft-p99-target")
    p.add_argument("--ttft-p99-target", type=positive_float, default=500.0, metavar="MS")
    p.add_argument("--rate-lo", type=positive_float, default=0.5)
    p.add_argument("--rate-hi", type=positive_float, default=64.0)
    p.add_argument("--capacity-iters", type=positive_int, default=8, help="bisection steps")
    add_model_arguments(p, sweep=True)


def _simulate(args: argparse.Namespace, variant: str, ranks: int, lag: str, rate: float) -> dict:
    cfg = build_config(args, variant, ranks, [lag], args.seed, several=True)
    summary = summarize(Simulation(cfg, build_workload(args, rate, args.seed)).run(), False)
    return {"metadata_lag": lag, "rate": rate, **summary}


def _meets(row: dict, target: float) -> bool:
    p99 = row["ttft_p99_ms"]
    return (not row["diverged"] and not row["stuck"] and not row["undecided"]
            and p99 is not None and p99 <= target)


def _capacity(args: argparse.Namespace, variant: str, ranks: int, lag: str) -> dict:
    """Bisection on the rate (TTFT p99 grows with load; a diverged run fails the target)."""
    target, lo, hi = args.ttft_p99_target, args.rate_lo, args.rate_hi
    row = {"variant": variant, "ranks": ranks, "metadata_lag": lag, "ttft_p99_target_ms": target,
           "capacity_rate": None, "ttft_p99_ms_at_capacity": None, "bracket_lo": lo,
           "bracket_hi": hi, "note": ""}
    at_lo = _simulate(args, variant, ranks, lag, lo)
    if not _meets(at_lo, target):
        row["note"] = "misses the target even at --rate-lo" + (" (diverged)" if at_lo["diverged"] else "")
        return row
    at_hi = _simulate(args, variant, ranks, lag, hi)
    if _meets(at_hi, target):
        row.update(capacity_rate=hi, ttft_p99_ms_at_capacity=at_hi["ttft_p99_ms"],
                   note="meets the target at --rate-hi (capacity is at least that)")
        return row
    best = at_lo
    for _ in range(args.capacity_iters):
        mid = (lo + hi) / 2
        res = _simulate(args, variant, ranks, lag, mid)
        if _meets(res, target):
            lo, best = mid, res
        else:
            hi = mid
    row.update(capacity_rate=round(lo, 6), ttft_p99_ms_at_capacity=best["ttft_p99_ms"],
               bracket_lo=round(lo, 6), bracket_hi=round(hi, 6))
    return row


def _cell(job: tuple) -> dict:
    args, capacity, cell = job
    try:
        return _capacity(args, *cell) if capacity else _simulate(args, *cell)
    except SimInputError as exc:
        return {"error": str(exc)}


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, stream: Any = None):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr

    def tick(self) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // self.total
        elapsed = time.perf_counter() - self.t0
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                          f"cells, {elapsed:.1f} s")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def run_cells(args: argparse.Namespace, cells: list[tuple], capacity: bool) -> list[dict]:
    """Results in cell order; parallel over ``--jobs`` processes, each result within
    ``--cell-timeout`` seconds."""
    jobs = [(args, capacity, c) for c in cells]
    progress = Progress(len(jobs))
    out: list[dict] = []
    if args.jobs == 1 or len(jobs) == 1:
        for job in jobs:
            out.append(_cell(job))
            progress.tick()
        return out
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(min(args.jobs, len(jobs))) as pool:
        it = pool.imap(_cell, jobs)
        for _ in jobs:
            try:
                out.append(it.next(timeout=args.cell_timeout))
            except mp.TimeoutError:
                pool.terminate()
                raise SimInputError(f"--cell-timeout: a cell took longer than {args.cell_timeout:g} s") from None
            progress.tick()
    return out


def _check(args: argparse.Namespace) -> list[str]:
    variants = [v.strip() for v in args.variant.split(",") if v.strip()]
    for v in variants or [""]:
        if v not in VARIANTS:
            raise SimInputError(f"--variant: unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    if args.capacity and not args.rate_lo < args.rate_hi:
        raise SimInputError(f"--rate-lo: must be below --rate-hi ({args.rate_lo:g} >= {args.rate_hi:g})")
    # fail fast on bad strings before starting processes
    for lag in args.metadata_lag:
        for r in args.ranks:
            build_config(args, variants[0], r, [lag], args.seed, several=True)
    build_workload(args, args.rate[0], args.seed)
    return variants


def write_csv(path: str, rows: Iterable[dict], columns: tuple[str, ...]) -> None:
    try:
        with open(path, "w", newline="", encoding="utf-8") as fp:
            w = csv.DictWriter(fp, fieldnames=list(columns), extrasaction="ignore")
            w.writeheader()
            for row in rows:
                w.writerow({k: "" if row.get(k) is None else row.get(k) for k in columns})
    except OSError as exc:
        raise SimInputError(f"--out: cannot write {path}: {exc.strerror}") from None


def execute(args: argparse.Namespace) -> list[dict[str, Any]]:
    variants = _check(args)
    if args.capacity:
        cells = list(itertools.product(variants, args.ranks, args.metadata_lag))
    else:
        cells = list(itertools.product(variants, args.ranks, args.metadata_lag, args.rate))
    rows = run_cells(args, cells, args.capacity)
    for row in rows:
        if "error" in row:
            raise SimInputError(row["error"])
    write_csv(args.out, rows, CAPACITY_COLUMNS if args.capacity else GRID_COLUMNS)
    if args.capacity:
        for r in rows:
            cap = "-" if r["capacity_rate"] is None else f"{r['capacity_rate']:.3f} req/s"
            print(f"{r['variant']:>12} ranks={r['ranks']} lag={r['metadata_lag']}: capacity {cap} "
                  f"(TTFT p99 <= {r['ttft_p99_target_ms']:g} ms) {r['note']}")
    print(f"wrote {len(rows)} rows to {args.out}")
    return rows


def run(args: argparse.Namespace) -> int:
    return run_reporting(PROG, execute, args)
