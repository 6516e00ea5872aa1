"""``--compare``: variants on identical draws (common random numbers) and the TTFT
cost of each against the first (the baseline) with a 95% confidence interval."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from sim.rundata import RunData

# Student t 0.975 quantiles for 1..30 degrees of freedom (beyond: the normal's 1.96).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
BATCHES = 10


def t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


def paired_ttft_diff(run: RunData, base: RunData) -> np.ndarray:
    """Per request TTFT(run) - TTFT(base), requests committed in both, in request order."""
    both = ~np.isnan(run.commit_ms) & ~np.isnan(base.commit_ms)
    return run.commit_ms[both] - base.commit_ms[both]


def mean_ci(samples: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95% interval by Student's t."""
    x = np.asarray(samples, dtype=np.float64)
    m = float(x.mean())
    if len(x) < 2:
        return m, math.nan, math.nan
    half = t975(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return m, m - half, m + half


def ttft_cost(runs: list[RunData], bases: list[RunData]) -> dict[str, Any]:
    """The cost over replications (one mean per replication; CI across them). With a
    single replication, batch means over the paired differences in request order
    (neighbouring requests share queueing, so single requests are not independent)."""
    diffs = [paired_ttft_diff(r, b) for r, b in zip(runs, bases)]
    pairs = int(sum(len(d) for d in diffs))
    if len(runs) >= 2:
        per_rep = [float(d.mean()) for d in diffs if len(d)]
        method = "replication means"
    else:
        d = diffs[0]
        per_rep = [float(b.mean()) for b in np.array_split(d, min(BATCHES, len(d))) if len(b)] \
            if len(d) else []     # a variant that diverged before its first commit: no pairs
        method = "batch means"
    if not per_rep:
        return {"mean_ms": None, "ci95_ms": None, "pairs": 0, "method": method}
    m, lo, hi = mean_ci(per_rep)
    ci = None if math.isnan(lo) else [round(lo, 6), round(hi, 6)]
    # replications that had pairs at all (a baseline that diverged at once has none)
    used = len(per_rep) if len(runs) >= 2 else 1
    return {"mean_ms": round(m, 6), "ci95_ms": ci, "pairs": pairs, "method": method,
            "replications": used, "replications_run": len(runs)}


def cost_line(name: str, base: str, cost: dict[str, Any]) -> str:
    if cost["mean_ms"] is None:
        return f"TTFT cost of {name} vs {base}: no request committed in both runs"
    ci = cost["ci95_ms"]
    ci_text = f"95% CI [{ci[0]:+.3f}, {ci[1]:+.3f}] ms" if ci else "no CI (one sample)"
    reps = f"{cost['replications']} of {cost['replications_run']} replication(s) with pairs"
    return (f"TTFT cost of {name} vs {base}: {cost['mean_ms']:+.3f} ms per request, {ci_text} "
            f"({cost['pairs']} paired requests, {reps}, {cost['method']})")
