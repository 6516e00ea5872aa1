"""Summaries of a run: the issue's keys, the table, JSON."""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from model.spec.kernel import Decision
from sim.rundata import RunData

SUMMARY_KEYS = ("variant", "ranks", "requests", "committed", "aborted", "diverged",
                "diverged_at_step", "ttft_p50_ms", "ttft_p99_ms", "gate_delay_p50_ms",
                "gate_delay_p99_ms", "sim_seconds", "wall_seconds")


def _pct(x: np.ndarray, q: float) -> float | None:
    return None if len(x) == 0 else round(float(np.percentile(x, q)), 6)


def ttft_ms(run: RunData) -> np.ndarray:
    """Arrival -> commit (the first token reaches the decode worker), committed only."""
    ok = ~np.isnan(run.commit_ms)
    return run.commit_ms[ok] - run.arrival_ms[ok]


def gate_delay_ms(run: RunData) -> np.ndarray:
    """Commit time minus the time every rank's KV reached Success, committed only."""
    ok = ~np.isnan(run.commit_ms) & ~np.isnan(run.kv_all_ms)
    return run.commit_ms[ok] - run.kv_all_ms[ok]


def summarize(run: RunData, wall_clock: bool = True) -> dict[str, Any]:
    """The issue's keys first, then details. ``wall_clock=False`` writes
    ``wall_seconds: null`` so that same-seed outputs are byte-identical."""
    committed = int(np.sum(run.outcome == int(Decision.COMMIT)))
    decided = int(np.sum(run.outcome >= 0))
    ttft, gate = ttft_ms(run), gate_delay_ms(run)
    div = run.divergence
    by_reason = {d.name.lower(): int(np.sum(run.outcome == int(d)))
                 for d in Decision if d not in (Decision.KEEP, Decision.COMMIT)}
    out: dict[str, Any] = {
        "variant": run.variant.name if run.cfg.variant == run.variant.name else run.cfg.variant,
        "ranks": run.cfg.ranks,
        "requests": len(run.workload),
        "committed": committed,
        "aborted": decided - committed,
        "diverged": div is not None,
        "diverged_at_step": div.step if div else None,
        "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
        "gate_delay_p50_ms": _pct(gate, 50), "gate_delay_p99_ms": _pct(gate, 99),
        "sim_seconds": round(run.sim_ms / 1000.0, 6),
        "wall_seconds": round(run.wall_seconds, 3) if wall_clock else None,
        "divergence": div.as_dict() if div else None,
        "undecided": len(run.workload) - decided,
        "stuck": run.stuck,
        "aborted_by_reason": by_reason,
        "ttft_mean_ms": None if len(ttft) == 0 else round(float(ttft.mean()), 6),
        "gate_delay_mean_ms": None if len(gate) == 0 else round(float(gate.mean()), 6),
        "protocol_steps": run.protocol_steps,
        "decode_steps": run.decode_steps,
        "slots": run.cfg.n_slots(),
        "seed": run.cfg.seed,
        "variant_rules": run.variant.describe(),
        "workload": run.workload.source,
        "trace": run.workload.info,
        "cut_short": run.cut_short,
    }
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if math.isfinite(v) else str(v)
    return str(v)


def table(rows: list[dict[str, Any]], keys: tuple[str, ...] = SUMMARY_KEYS) -> str:
    """A plain text table, one row per run."""
    cells = [[k for k in keys]] + [[_fmt(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(c[j]) for c in cells) for j in range(len(keys))]
    lines = ["  ".join(c[j].rjust(widths[j]) if j else c[j].ljust(widths[j])
                       for j in range(len(keys))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def step_note(run: RunData) -> str:
    """Gate delay is measured in scheduler steps: say which step time it reflects."""
    if run.cfg.allreduce_extra is not None:
        return ("note: gate delay is bounded by the decode step: here the measured step and "
                "pop-delay traces of the calibration (--calibration)")
    return (f"note: gate delay is bounded by the decode step (--forward {run.cfg.forward}): a row "
            f"that lands just after a poll waits for the next one; give a measured step time "
            f"distribution with --forward empirical:FILE")


def divergence_line(summary: dict[str, Any]) -> str | None:
    div = summary.get("divergence")
    if not div:
        return None
    return (f"{summary['variant']}: DIVERGED at step {div['step']} (t={div['time_ms']:.3f} ms): "
            f"{div['invariant']} violated, ranks {div['ranks']}, requests {div['requests']}: "
            f"{div['detail']}; the run stopped there (the ranks would hang or disagree)")


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False) + "\n"
