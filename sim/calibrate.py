"""``pdgate calibrate E2E.json [MORE.json ...] [--out CONFIG] [--validate HELD.json ...]``.

Fits the simulator to a real e2e run (sim/fit.py) and, with ``--validate``, checks the
fit against held-out runs: each is simulated with its own setup (ranks, inflight,
metadata delays) from the calibration alone, and the p50/p90/p99 of its gate delay and
enqueue -> commit are compared with what the run measured.
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
from sim.fit import check_setup, fit, load_e2e

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


def compare(cal: dict[str, Any], path: str, doc: dict[str, Any], model: str, seeds: int,
            role: str, other: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Rows of ``doc``'s measured percentiles against the simulated ones, or with
    ``other`` (an e2e run of the same setup) against that run's: the noise floor."""
    sim = simulated(cal, doc["setup"], model, seeds) if other is None else {}
    rows = []
    for m in METRICS:
        for q in QUANTILES:
            real = doc.get(f"{m}_p{q}_ms")
            if other is not None:
                est = other.get(f"{m}_p{q}_ms")
            else:
                est = float(np.percentile(sim[m], q)) if sim[m] else None
            err = (est - real) / real * 100 if real and est is not None else None
            rows.append({"run": path, "role": role, "setup": describe(doc["setup"]), "model": model,
                         "metric": m, "quantile": f"p{q}", "e2e_ms": real,
                         "sim_ms": None if est is None else round(est, 3),
                         "error_pct": None if err is None else round(err, 1)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: one line per (run, model), p50/p90/p99 errors of each metric."""
    head = "| run | role | setup | model | " + " | ".join(
        f"{m.replace('_', ' ')} p{q}" for m in METRICS for q in QUANTILES) + " |"
    lines = [head, "|" + "---|" * (4 + len(METRICS) * len(QUANTILES))]
    keys = list(dict.fromkeys((r["run"], r["model"]) for r in rows))
    for run, model in keys:
        mine = [r for r in rows if r["run"] == run and r["model"] == model]
        cells = [f"{r['e2e_ms']:.1f} / {r['sim_ms']:.1f} ({r['error_pct']:+.0f}%)"
                 if r["error_pct"] is not None else "-" for r in mine]
        lines.append(f"| {run.rsplit('/', 1)[-1]} | {mine[0]['role']} | {mine[0]['setup']} | {model} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def execute(args: argparse.Namespace) -> int:
    models = list(calibrated.MODELS) if args.transfer_model == "all" else [args.transfer_model]
    if any(m not in calibrated.MODELS for m in models):
        raise SimInputError(f"--transfer-model: one of {', '.join(calibrated.MODELS)} or all, "
                            f"got {args.transfer_model!r}")
    check_writable(args.out, "--out")
    check_writable(args.json, "--json")
    docs = [(p, load_e2e(p)) for p in args.e2e]
    held = [(p, load_e2e(p)) for p in args.validate if p not in args.e2e]   # (fitted rows: always)
    for path, doc in docs[:1] + held:
        check_setup(doc, path)
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
    rows = []
    for path, doc in held:      # the same setup run again: how far real runs differ
        if describe(doc["setup"]) == describe(docs[0][1]["setup"]):
            rows += compare(cal, path, doc, "e2e (calibration run)", args.seeds, "repeat", docs[0][1])
    for model in models:
        rows += compare(cal, docs[0][0], docs[0][1], model, args.seeds, "fitted")
        for path, doc in held:
            rows += compare(cal, path, doc, model, args.seeds, "held out")
    print("e2e / simulated ms (error)")
    print(table(rows))
    held_errs = [abs(r["error_pct"]) for r in rows if r["role"] == "held out" and r["error_pct"] is not None]
    if held_errs:
        print(f"held-out errors: median {np.median(held_errs):.0f}%, worst {max(held_errs):.0f}%, "
              f"{sum(e <= 10 for e in held_errs)} of {len(held_errs)} within 10%")
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
