"""Perfetto / Chrome trace JSON (one track per rank) and PNG CDF plots."""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from model.spec.kernel import Decision
from sim.engine import RunData
from sim.results import gate_delay_ms, ttft_ms


def perfetto_events(run: RunData, pid: int, name: str) -> list[dict[str, Any]]:
    """Chrome trace events (times in us): per rank, a KV slice and a metadata-lag slice
    per request, the MIN all-reduce of every protocol step, and commit/abort instants."""
    T = run.cfg.ranks
    ev: list[dict[str, Any]] = [{"ph": "M", "pid": pid, "name": "process_name",
                                 "args": {"name": f"decode worker ({name})"}}]
    ev += [{"ph": "M", "pid": pid, "tid": k, "name": "thread_name", "args": {"name": f"rank {k}"}}
           for k in range(T)]

    def us(ms: float) -> float:
        return round(ms * 1000.0, 3)

    for kind, rank, ident, t0, t1 in run.spans:
        if kind in ("kv", "lag"):
            ev.append({"ph": "X", "pid": pid, "tid": rank, "ts": us(t0), "dur": us(t1 - t0),
                       "name": f"{'KV transfer' if kind == 'kv' else 'metadata lag'} r{ident}",
                       "cat": kind, "args": {"request": ident}})
        elif kind == "step":
            ev += [{"ph": "X", "pid": pid, "tid": k, "ts": us(t0), "dur": us(t1 - t0),
                    "name": f"MIN step {ident}", "cat": "step"} for k in range(T)]
        else:
            what = Decision(t1).name.lower()
            ev += [{"ph": "i", "s": "t", "pid": pid, "tid": k, "ts": us(t0),
                    "name": f"{what} r{ident}", "cat": "pop"} for k in range(T)]
    if run.divergence is not None:
        div = run.divergence
        ev += [{"ph": "i", "s": "t", "pid": pid, "tid": k, "ts": us(div.time_ms),
                "name": f"DIVERGED: {div.violation.invariant}", "cat": "divergence",
                "args": {"detail": div.violation.detail}} for k in div.violation.ranks]
    return ev


def write_perfetto(path: str, runs: list[RunData]) -> None:
    events: list[dict[str, Any]] = []
    for pid, run in enumerate(runs, 1):
        events += perfetto_events(run, pid, run.cfg.variant)
    with open(path, "w", encoding="utf-8") as fp:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fp, separators=(",", ":"))


def write_plots(directory: str, runs: list[RunData]) -> list[str]:
    """CDFs of TTFT and gate delay, variants overlaid; returns the PNG paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for fname, title, metric in (("ttft_cdf.png", "TTFT", ttft_ms),
                                 ("gate_delay_cdf.png", "gate delay", gate_delay_ms)):
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for run in runs:
            x = np.sort(metric(run))
            if len(x):
                label = run.cfg.variant + (" (diverged)" if run.divergence else "")
                ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of committed requests")
        ax.set_title(f"{title} CDF, {runs[0].cfg.ranks} ranks")
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = os.path.join(directory, fname)
        fig.savefig(path, metadata={"Software": None})
        plt.close(fig)
        paths.append(path)
    return paths
