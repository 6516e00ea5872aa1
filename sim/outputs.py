"""Perfetto / Chrome trace JSON (one track per rank) and PNG CDF plots."""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from model.spec.kernel import Decision
from sim.draws import Draws, prefill_schedule
from sim.errors import SimInputError
from sim.rundata import RunData
from sim.results import gate_delay_ms, ttft_ms


MAX_PREFILL_SLICES = 100_000     # a trace beyond this would not load in the UI anyway


def _prefill_events(run: RunData, pid: int, us) -> list[dict[str, Any]]:
    """A track per prefill server: each request's arrival instant and its prefill slice
    (queueing for a server shows as the gap between them)."""
    cfg, T = run.cfg, run.cfg.ranks
    n = min(len(run.arrival_ms), MAX_PREFILL_SLICES)
    arrivals = run.arrival_ms[:n].tolist()
    durations = Draws(cfg, run.workload).prefill_ms[:n].tolist()
    ends, servers = prefill_schedule(arrivals, durations, cfg.prefill_servers)
    ev: list[dict[str, Any]] = [
        {"ph": "M", "pid": pid, "tid": T + s, "name": "thread_name", "args": {"name": f"prefill server {s}"}}
        for s in range(cfg.prefill_servers)]
    for i, (t, dur, end, s) in enumerate(zip(arrivals, durations, ends, servers)):
        ev.append({"ph": "i", "s": "t", "pid": pid, "tid": T + s, "ts": us(t), "name": f"arrive r{i}",
                   "cat": "arrival"})
        ev.append({"ph": "X", "pid": pid, "tid": T + s, "ts": us(end - dur), "dur": us(dur),
                   "name": f"prefill r{i}", "cat": "prefill",
                   "args": {"request": i, "queued_ms": round(max(end - dur - t, 0.0), 3)}})
    return ev


def perfetto_events(run: RunData, pid: int, name: str) -> list[dict[str, Any]]:
    """Chrome trace events (times in us): per prefill server, each request's arrival
    and prefill; per rank, a KV slice and a metadata-lag slice per request, the MIN
    all-reduce of every protocol step, and commit/abort instants."""
    T = run.cfg.ranks
    ev: list[dict[str, Any]] = [{"ph": "M", "pid": pid, "name": "process_name",
                                 "args": {"name": f"decode worker ({name})"}}]
    ev += [{"ph": "M", "pid": pid, "tid": k, "name": "thread_name", "args": {"name": f"rank {k}"}}
           for k in range(T)]

    def us(ms: float) -> float:
        return round(ms * 1000.0, 3)

    ev += _prefill_events(run, pid, us)

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
    try:
        with open(path, "w", encoding="utf-8") as fp:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fp, separators=(",", ":"))
    except OSError as exc:            # the disk filled during the run (probed before it)
        raise SimInputError(f"--perfetto: cannot write {path}: {exc.strerror or exc}") from None


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    try:
        os.makedirs(directory, exist_ok=True)
        fig.savefig(path, metadata={"Software": None})
    except OSError as exc:
        raise SimInputError(f"--plot: cannot write {path}: {exc.strerror or exc}") from None
    finally:
        _pyplot().close(fig)
    return path


def write_hazard_plot(directory: str, runs: dict[str, list[RunData]], requests: int) -> str:
    """Per variant, the fraction of replications still without a break after x requests
    (a survival curve; replications without a break stay up to the workload's end). The
    x axis is logarithmic: breaks after 3 and after 30 000 requests both show."""
    from sim.hazard import first_break
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.0), dpi=100, layout="constrained")
    for k, (name, reps) in enumerate(runs.items()):
        at = sorted(max(1, b["requests"]) for b in map(first_break, reps) if b is not None)
        xs = [1] + at + [max(requests, 1)]
        ys = [1.0] + [1.0 - (i + 1) / len(reps) for i in range(len(at))] + [1.0 - len(at) / len(reps)]
        ax.step(xs, ys, where="post", label=f"{name} ({len(at)}/{len(reps)} broke)",
                linestyle=_DASHES[k % len(_DASHES)])     # unbroken variants share y = 1
    ax.set_xscale("log")
    ax.set_xlabel("requests served (log scale)")
    ax.set_ylabel("fraction of replications without an invariant break")
    ax.set_ylim(-0.03, 1.03)
    ax.set_title(f"divergence hazard, {next(iter(runs.values()))[0].cfg.ranks} ranks")
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(fontsize="small", loc="outside right upper")   # beside the axes, never over data
    return _save(fig, directory, "hazard.png")


_DASHES = ("-", "--", "-.", ":")


def _label(run: RunData) -> str:
    div = run.divergence
    if div is None:
        return run.cfg.variant
    return f"{run.cfg.variant} (DIVERGED at t={div.time_ms / 1000:.2f} s: {div.violation.invariant})"


def _cdf(ax, x: np.ndarray, label: str, **style) -> None:
    """An empirical CDF; an empty sample still gets its legend entry, saying so."""
    x = np.sort(x)
    ax.step(x, np.arange(1, len(x) + 1) / max(len(x), 1), where="post",
            label=label if len(x) else f"{label}: nothing committed", **style)


def write_plots(directory: str, runs: list[RunData], ideal: RunData | None = None) -> list[str]:
    """CDFs of TTFT and gate delay, variants overlaid (and the ideal reference: ungated
    with every row visible with its KV); returns the PNG paths. With the reference, the
    TTFT figure's lower panel is each variant's per-request TTFT minus the reference's
    for the same request (common random numbers): the gate's cost, a few ms that the
    CDF above, spanning hundreds, cannot show. A diverged variant is named in the
    legend and the title."""
    from sim.compare import paired_ttft_diff
    plt = _pyplot()
    paths = []
    diverged = [r.cfg.variant for r in runs if r.divergence is not None]
    for fname, title, metric in (("ttft_cdf.png", "TTFT", ttft_ms),
                                 ("gate_delay_cdf.png", "gate delay", gate_delay_ms)):
        cost = ideal is not None and metric is ttft_ms
        fig, axes = plt.subplots(2 if cost else 1, 1, figsize=(7.0, 6.4 if cost else 4.0), dpi=100,
                                 layout="constrained", squeeze=False,
                                 gridspec_kw={"height_ratios": [3, 2]} if cost else None)
        ax = axes[0][0]
        for k, run in enumerate(runs):     # dashes keep identical curves (gate, strict) visible
            _cdf(ax, metric(run), _label(run), color=f"C{k}", linestyle=_DASHES[k % len(_DASHES)])
        if ideal is not None:
            _cdf(ax, metric(ideal), "ideal (metadata with its KV)", linestyle=":", color="black")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of committed requests")
        ax.set_title(f"{title} CDF, {runs[0].cfg.ranks} ranks"
                     + (f"; diverged: {', '.join(diverged)}" if diverged else ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")     # below a CDF: empty
        if cost:
            dax = axes[1][0]
            for k, run in enumerate(runs):
                d = paired_ttft_diff(run, ideal)
                _cdf(dax, d, color=f"C{k}", linestyle=_DASHES[k % len(_DASHES)],
                     label=f"{run.cfg.variant}: mean {d.mean():+.2f} ms over {len(d)} requests "
                           f"(seed {run.cfg.seed})" if len(d) else run.cfg.variant)
            dax.axvline(0, color="black", linestyle=":", linewidth=1)
            dax.set_xscale("symlog", linthresh=1.0)
            dax.set_xlabel("TTFT minus the ideal reference's, same request (ms, linear within 1 ms, log beyond)")
            dax.set_ylabel("fraction of paired requests")
            dax.set_title("the gate's cost: per-request TTFT difference from the ideal reference",
                          fontsize="medium")
            dax.grid(True, which="both", alpha=0.3)
            dax.legend(fontsize="small", loc="upper left")
        paths.append(_save(fig, directory, fname))
    return paths


def write_sweep_plot(directory: str, rows: list[dict[str, Any]]) -> str:
    """TTFT p99 against the arrival rate, one line per (variant, ranks, lag); a diverged
    cell is marked with an x (its TTFT covers only the requests before the break)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.6, 4.4), dpi=100, layout="constrained")
    lines: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("rate") not in (None, "") and r.get("ttft_p99_ms") not in (None, ""):
            lines.setdefault((r["variant"], r["ranks"], r["metadata_lag"]), []).append(r)
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]   # overlapping lines stay visible
    for j, ((variant, ranks, lag), rs) in enumerate(lines.items()):
        rs.sort(key=lambda r: float(r["rate"]))
        x = [float(r["rate"]) for r in rs]
        y = [float(r["ttft_p99_ms"]) for r in rs]
        marker, style = styles[j % len(styles)]
        (line,) = ax.plot(x, y, marker=marker, linestyle=style, markerfacecolor="none",
                          label=f"{variant}, {ranks} ranks, lag {lag}")
        bad = [(a, b) for a, b, r in zip(x, y, rs) if str(r["diverged"]) == "True"]
        if bad:
            ax.scatter(*zip(*bad), marker="x", s=80, color=line.get_color())
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("TTFT p99 (ms, log scale)")
    ax.set_yscale("log")
    ax.set_title("TTFT p99 vs rate (x: diverged, TTFT of the requests before the break)",
                 fontsize="medium")
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(fontsize="small", loc="outside right upper")   # beside the axes, never over data
    return _save(fig, directory, "ttft_p99_vs_rate.png")
