"""The divergence hazard: how long does a variant run before its first invariant break?

Each replication runs the variant on its own seed until the first break (the run stops
there) or until the workload ends (censored: no break within it). Per variant and per
invariant that broke: how many replications broke by it, and the mean and 95% interval
(Student's t over the replications) of the requests and simulated seconds until the
break. "Requests until the break" counts the requests that had arrived by then.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from sim.compare import mean_ci
from sim.rundata import RunData

HAZARD_COLUMNS = ("variant", "invariant", "replications", "breaks", "no_break",
                  "requests_to_break_mean", "requests_to_break_ci95_lo", "requests_to_break_ci95_hi",
                  "seconds_to_break_mean", "seconds_to_break_ci95_lo", "seconds_to_break_ci95_hi")


def first_break(run: RunData) -> dict[str, Any] | None:
    """The run's first break: invariant, requests arrived by then, simulated seconds."""
    div = run.divergence
    if div is None:
        return None
    arrived = int(np.searchsorted(run.arrival_ms, div.time_ms, side="right"))
    return {"invariant": div.violation.invariant, "requests": arrived,
            "seconds": div.time_ms / 1000.0}


def _stat(values: list[float]) -> tuple[float | None, float | None, float | None]:
    """Mean and 95% interval; the lower bound clipped at 0 (counts and times are not
    negative, and few breaks give a wide interval)."""
    if not values:
        return None, None, None
    m, lo, hi = mean_ci(values)
    lo = max(lo, 0.0) if not math.isnan(lo) else lo
    r = lambda x: None if math.isnan(x) else round(x, 6)   # noqa: E731
    return r(m), r(lo), r(hi)


def summarize_hazard(variant: str, runs: list[RunData]) -> list[dict[str, Any]]:
    """One row per invariant that broke (all replications counted in each), or one row
    with invariant '-' when none did."""
    breaks = [first_break(r) for r in runs]
    found = [b for b in breaks if b is not None]
    by_inv: dict[str, list[dict]] = {}
    for b in found:
        by_inv.setdefault(b["invariant"], []).append(b)
    rows = []
    for inv, bs in sorted(by_inv.items()) or [("-", [])]:
        req = _stat([float(b["requests"]) for b in bs])
        sec = _stat([b["seconds"] for b in bs])
        rows.append({"variant": variant, "invariant": inv, "replications": len(runs),
                     "breaks": len(bs), "no_break": len(runs) - len(found),
                     "requests_to_break_mean": req[0], "requests_to_break_ci95_lo": req[1],
                     "requests_to_break_ci95_hi": req[2], "seconds_to_break_mean": sec[0],
                     "seconds_to_break_ci95_lo": sec[1], "seconds_to_break_ci95_hi": sec[2]})
    return rows


def hazard_line(row: dict[str, Any], requests: int) -> str:
    if row["breaks"] == 0:
        return (f"{row['variant']}: no invariant broke in {row['replications']} replication(s) of "
                f"{requests} requests")
    ci = ""
    if row["requests_to_break_ci95_lo"] is not None:
        ci = (f" (95% CI {row['requests_to_break_ci95_lo']:.1f}..{row['requests_to_break_ci95_hi']:.1f};"
              f" {row['seconds_to_break_mean']:.3f} s, CI {row['seconds_to_break_ci95_lo']:.3f}.."
              f"{row['seconds_to_break_ci95_hi']:.3f})")
    else:
        ci = f" ({row['seconds_to_break_mean']:.3f} s)"
    return (f"{row['variant']}: {row['invariant']} broke in {row['breaks']} of {row['replications']} "
            f"replication(s) after {row['requests_to_break_mean']:.1f} requests on average{ci}; "
            f"{row['no_break']} ran {requests} requests without a break")
