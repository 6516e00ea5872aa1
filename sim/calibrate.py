"""``pdgate calibrate E2E.json [MORE.json ...] [--out CONFIG] [--validate HELD.json ...]``.

Fits the simulator to real e2e runs (sim/fit.py: the first run and its repeats pooled)
and, with ``--validate``, checks the fit against held-out runs: those of one setup
(repeats with other seeds) are pooled, simulated with their setup (ranks, inflight,
metadata delays) from the calibration alone, and the p50/p90/p99 of gate delay and
enqueue -> commit are compared with what the runs measured, beside how far the runs'
own percentiles spread around the pooled one (the noise floor).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from model.cli import number
from sim import calibrated
from sim.config import SimConfig
from sim.draws import stream
from sim.engine import Simulation
from sim.errors import SimInputError, check_writable
from impl.mooncake.timeline import latencies
from sim.fit import check_setup, fit, load_e2e, setup_key

PROG = "pdgate calibrate"
METRICS = ("gate_delay", "enqueue_commit")
QUANTILES = (50, 90, 99)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("e2e", nargs="+", metavar="E2E.json",
                   help="pdgate e2e JSON(s) (.gz too); the first is fitted, the others only add "
                        "rank counts to the all-reduce fit")
    p.add_argument("--out", metavar="CONFIG", help="write the calibration here (for simulate --calibration)")
    p.add_argument("--validate", nargs="+", default=[], metavar="HELD.json",
                   help="held-out e2e runs to simulate from the calibration and compare")
    p.add_argument("--transfer-model", default="writer",
                   help=f"--validate: one of {', '.join(calibrated.MODELS)}, or 'all'")
    p.add_argument("--seeds", type=number(1, 1000, integer=True), default=5,
                   help="--validate: simulation seeds pooled per run, 1..1000")
    p.add_argument("--json", metavar="PATH", help="--validate: the table as JSON")


def simulated(cal: dict[str, Any], setup: dict[str, Any], model: str, seeds: int
              ) -> dict[str, list[float]]:
    """The held-out run's setup simulated from ``cal`` over ``seeds`` seeds (pooled)."""
    ranks, n = int(setup["ranks"]), int(setup["requests"])
    delays = {int(r): float(ms) for r, ms in (setup.get("metadata_delay_ms") or {}).items()}
    out: dict[str, list[float]] = {m: [] for m in METRICS}
    for seed in range(seeds):
        cfg = calibrated.configure(SimConfig(variant=setup.get("variant") or "strict", ranks=ranks,
                                             seed=seed), cal, model, delays, int(setup["inflight"]))
        run = Simulation(cfg, calibrated.workload(cal, n, stream(seed, "workload"))).run()
        ok = ~np.isnan(run.commit_ms)
        out["gate_delay"] += (run.commit_ms - run.kv_all_ms)[ok & ~np.isnan(run.kv_all_ms)].tolist()
        assert run.enqueue_ms is not None
        out["enqueue_commit"] += (run.commit_ms - run.enqueue_ms)[ok].tolist()
    return out


def describe(setup: dict[str, Any]) -> str:
    delays = setup.get("metadata_delay_ms") or {}
    return (f"T={setup['ranks']} inflight={setup['inflight']}"
            + "".join(f" delay {r}:{ms:g}" for r, ms in delays.items()))


def _latencies(doc: dict[str, Any], path: str = "an e2e run") -> dict[str, list[float]]:
    """``latencies`` of one run; a malformed request is one line naming the file."""
    try:
        return latencies(doc["timeline"]["requests"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SimInputError(f"{path}: malformed e2e timeline request ({type(exc).__name__}: {exc})") from None


def _measured(docs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per-request latencies of e2e runs, pooled (the runs' own timelines)."""
    out: dict[str, list[float]] = {m: [] for m in METRICS}
    for doc in docs:
        got = _latencies(doc)
        for m in METRICS:
            out[m] += got[m]
    return out


def compare(cal: dict[str, Any], label: str, docs: list[dict[str, Any]], model: str, seeds: int,
            role: str, other: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Rows of the percentiles measured over ``docs`` (runs of one setup, requests pooled)
    against the simulated ones, or with ``other`` (runs of the same setup) against
    theirs: the noise floor. ``spread_pct``: how far the runs' own percentiles lie from
    the pooled one (the most, in %; 0 for one run): an error inside it is noise."""
    real = _measured(docs)
    est = _measured(other) if other is not None else simulated(cal, docs[0]["setup"], model, seeds)
    rows = []
    for m in METRICS:
        for q in QUANTILES:
            r = float(np.percentile(real[m], q)) if real[m] else None
            e = float(np.percentile(est[m], q)) if est[m] else None
            err = (e - r) / r * 100 if r and e is not None else None
            single = [doc.get(f"{m}_p{q}_ms") for doc in docs]
            spread = (max(abs(v - r) / r * 100 for v in single) if r and len(docs) > 1
                      and all(v is not None for v in single) else 0.0)
            rows.append({"run": label, "role": role, "setup": describe(docs[0]["setup"]),
                         "runs": len(docs), "model": model, "metric": m, "quantile": f"p{q}",
                         "e2e_ms": None if r is None else round(r, 3),
                         "sim_ms": None if e is None else round(e, 3),
                         "error_pct": None if err is None else round(err, 1),
                         "spread_pct": round(spread, 1)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: one line per (runs, model), p50/p90/p99 errors of each metric,
    each with the runs' own spread around their pooled value."""
    head = "| runs | role | setup | model | " + " | ".join(
        f"{m.replace('_', ' ')} p{q}" for m in METRICS for q in QUANTILES) + " |"
    lines = [head, "|" + "---|" * (4 + len(METRICS) * len(QUANTILES))]
    keys = list(dict.fromkeys((r["run"], r["model"]) for r in rows))
    for run, model in keys:
        mine = [r for r in rows if r["run"] == run and r["model"] == model]
        cells = [f"{r['e2e_ms']:.1f} / {r['sim_ms']:.1f} ({r['error_pct']:+.0f}%"
                 + (f" ±{r['spread_pct']:.0f}" if r["runs"] > 1 else "") + ")"
                 if r["error_pct"] is not None else "-" for r in mine]
        lines.append(f"| {run} | {mine[0]['role']} | {mine[0]['setup']} | {model} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def groups(held: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Held-out runs grouped by setup (repeats pooled), in the order given; each group's
    label names its files."""
    by: dict[tuple, list[tuple[str, dict[str, Any]]]] = {}
    for path, doc in held:
        by.setdefault(setup_key(doc["setup"]), []).append((path, doc))
    return [(", ".join(p.rsplit("/", 1)[-1].removesuffix(".gz").removesuffix(".json") for p, _ in g),
             [d for _, d in g]) for g in by.values()]


def execute(args: argparse.Namespace) -> int:
    models = list(calibrated.MODELS) if args.transfer_model == "all" else [args.transfer_model]
    if any(m not in calibrated.MODELS for m in models):
        raise SimInputError(f"--transfer-model: one of {', '.join(calibrated.MODELS)} or all, "
                            f"got {args.transfer_model!r}")
    check_writable(args.out, "--out")
    check_writable(args.json, "--json")
    docs = [(p, load_e2e(p)) for p in args.e2e]
    held = [(p, load_e2e(p)) for p in args.validate if p not in args.e2e]   # (fitted rows: always)
    for path, doc in docs + held:
        check_setup(doc, path)
        _latencies(doc, path)
    cal = fit(docs)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fp:
            json.dump(cal, fp, separators=(",", ":"))
        print(f"wrote {args.out}")
    a, t = cal["allreduce"], cal["transfer"]
    print(f"fitted {docs[0][0]}: pops {a['alpha_ms']:.3f} ms + {a['beta_ms']:.4f} ms x queued after a "
          f"step starts (+ a residual trace), then {np.median(cal['step_rest_ms']):.3f} ms (median "
          f"of {len(cal['step_rest_ms'])} steps); steps {cal['step_growth_per_rank_doubling']:+.0%} "
          f"per doubling of the ranks (ranks seen {cal['ranks_seen']}); transfer correlation across "
          f"ranks {t['correlation']} (common share of log variance {t['log_share_common']}); "
          f"writer's KV writes {cal['writer']['correlation']}")
    if not held:
        return 0
    pooled = [doc for path, doc in docs if path in cal["pooled"]]
    fitted = ", ".join(p.rsplit("/", 1)[-1].removesuffix(".gz").removesuffix(".json")
                       for p in cal["pooled"])
    rows = []
    for label, group in groups(held):   # the same setup run again: how far real runs differ
        if setup_key(group[0]["setup"]) == setup_key(pooled[0]["setup"]):
            rows += compare(cal, label, group, "e2e (fitted runs)", args.seeds, "repeat", pooled)
    for model in models:
        rows += compare(cal, fitted, pooled, model, args.seeds, "fitted")
        for label, group in groups(held):
            rows += compare(cal, label, group, model, args.seeds, "held out")
    print("e2e / simulated ms (error ±the runs' own spread around their pooled value)")
    print(table(rows))
    held_errs = [abs(r["error_pct"]) for r in rows if r["role"] == "held out" and r["error_pct"] is not None]
    if held_errs:
        inside = sum(abs(r["error_pct"]) <= max(r["spread_pct"], 10) for r in rows
                     if r["role"] == "held out" and r["error_pct"] is not None)
        print(f"held-out errors: median {np.median(held_errs):.0f}%, worst {max(held_errs):.0f}%, "
              f"{sum(e <= 10 for e in held_errs)} of {len(held_errs)} within 10%, {inside} within "
              f"10% or the runs' own spread")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fp:
            json.dump({"calibration": docs[0][0], "rows": rows}, fp, indent=1)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return execute(args)
    except SimInputError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
