"""Turn the decode ranks' logs and results into the e2e figures and one spec trace.

The trace interleaves what each rank saw between its steps (environment events, in its
own order; a rank's events only touch that rank's state, so ranks can be listed one
after another), then the step's enqueues (identical on every rank, checked), then the
step itself with every rank's poll, gate, MIN and pops (docs/trace-format.md).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from model.spec.events import Enqueue
from model.spec.machine import RankStep, StepRecord
from model.spec.kernel import Decision
from model.spec.trace import Header, TraceWriter, parse_record

COMMIT = Decision.COMMIT.name.lower()


class ReportError(RuntimeError):
    """The ranks' logs do not fit together (one line)."""


def load_log(path: str, partial: bool = False) -> list[dict[str, Any]]:
    """A rank's log. ``partial``: the log of a run that failed, whose rank may have been
    killed mid-line: a missing file is empty, and an unreadable last line is dropped."""
    try:
        with open(path, encoding="utf-8") as fp:
            lines = [line for line in fp if line.strip()]
    except FileNotFoundError:
        if partial:
            return []
        raise
    out = []
    for n, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if partial and n == len(lines) - 1:
                break
            raise ReportError(f"{path}: line {n + 1} is not JSON") from None
    return out


@dataclass
class _Segment:
    early: list[dict[str, Any]]      # environment events logged before its first enqueue
    events: list[dict[str, Any]]     # the rest
    enqueues: list[dict[str, Any]]
    step: dict[str, Any] | None


def _segments(log: list[dict[str, Any]]) -> list[_Segment]:
    """A rank's log cut at its step records; records of other kinds (``pool``,
    ``release``: what the live ranks note for live_trace) are skipped."""
    out, early, events, enqs = [], [], [], []
    for rec in log:
        if rec["k"] == "env":
            (events if enqs else early).append(rec)
        elif rec["k"] == "enq":
            enqs.append(rec)
        elif rec["k"] == "step":
            out.append(_Segment(early, events, enqs, rec))
            early, events, enqs = [], [], []
    out.append(_Segment(early, events, enqs, None))
    return out


def _slots(enqueues: list[list[dict[str, Any]]], i: int) -> tuple[int, ...] | None:
    """The slot each rank logged for its ``i``-th enqueue of a segment, where every
    rank logged one (a live rank's real metadata slot); None otherwise."""
    named = [e[i].get("slot") for e in enqueues]
    return None if any(s is None for s in named) else tuple(int(s) for s in named)


def write_trace(logs: list[list[dict[str, Any]]], fp: IO[str], variant: str, slots: int,
                timeout_steps: int | None, partial: bool = False,
                enqueues_first: bool = False, source: str = "e2e",
                release_timeout_steps: int | None = None) -> int:
    """Merge the ranks' logs into ``fp``; returns the number of steps. ``partial``: the
    logs of a failed run, cut to the steps every rank logged (what the ranks saw after
    the last of them stays out). ``enqueues_first``: a segment's enqueues go before the
    events each rank logged after its first enqueue of the segment (ranks that observe
    the environment at the step's polls, ``pdgate live``); what it logged before them
    (a fence or late write seen before admission) stays before them. An enqueue names
    the slot each rank gave it where every rank logged one."""
    ranks = len(logs)
    segs = [_segments(log) for log in logs]
    if partial:
        m = min(len(s) for s in segs)
        segs = [s[:m - 1] + [_Segment(s[m - 1].early, s[m - 1].events, s[m - 1].enqueues, None)]
                for s in segs]
    if len({len(s) for s in segs}) != 1:
        raise ReportError(f"ranks took different numbers of steps: {[len(s) - 1 for s in segs]}")
    t0 = min((rec["t"] for log in logs for rec in log), default=0.0)
    header = Header(variant, ranks, slots, timeout_steps, source, release_timeout_steps)
    writer = TraceWriter(fp, variant, ranks, slots, source, timeout_steps=timeout_steps,
                         release_timeout_steps=release_timeout_steps)
    ms = (lambda t: (t - t0) * 1000.0)
    def events(k: int, early: bool) -> None:
        for r in range(ranks):
            for rec in (segs[r][k].early if early else segs[r][k].events):
                writer.event(parse_record(rec["ev"], 0, header), ms(rec["t"]))

    for k in range(len(segs[0])):
        events(k, early=True)
        if not enqueues_first:
            events(k, early=False)
        enq = [[(e["req"], e["room"], e["payload"]) for e in s[k].enqueues] for s in segs]
        if any(e != enq[0] for e in enq):
            raise ReportError(f"ranks enqueued different requests before step {k}")
        every = [s[k].enqueues for s in segs]
        for i, e in enumerate(segs[0][k].enqueues):
            writer.event(Enqueue(e["req"], e["room"], e["payload"], _slots(every, i)), ms(e["t"]))
        if enqueues_first:
            events(k, early=False)
        if segs[0][k].step is None:
            break
        steps = [s[k].step["rec"] for s in segs]
        if any(st["step"] != k or st["error"] for st in steps):
            raise ReportError(f"step {k}: a rank logged step {steps[0]['step']} or an error")
        writer.step(StepRecord(k, tuple(
            RankStep(r, tuple(int(q) for q in st["queue"]), tuple(st["local"]), tuple(st["gated"]),
                     tuple(st["reduced"]), tuple((int(q), d, p) for q, d, p in st["popped"]))
            for r, st in enumerate(steps))), ms(segs[0][k].step["t"]))
    n = len(segs[0]) - 1
    writer.end(n)
    return n


def gate_holds(logs: list[list[dict[str, Any]]]) -> int:
    """(rank, step, request) triples where the receiver said Success and the gate held it."""
    return sum(1 for log in logs for rec in log if rec["k"] == "step"
               for lo, ga in zip(rec["rec"]["local"], rec["rec"]["gated"]) if lo == 4 and ga == 3)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile of ``values`` in ms, rounded to the microsecond (None when empty)."""
    return round(float(np.percentile(values, q)), 3) if values else None


def figures(results: list[dict[str, Any]], logs: list[list[dict[str, Any]]],
            served: int) -> dict[str, Any]:
    """The e2e figures from every rank's result file and log."""
    by_req: dict[int, list[dict[str, Any]]] = {}
    for res in results:
        for rec in res["results"]:
            by_req.setdefault(rec["req"], []).append(rec)
    ranks = len(results)
    starts = {res["rank"]: res["step_starts"] for res in results}
    committed = aborted = disagree = 0
    exact = True
    lat_ms, lat_steps, total_bytes, t_end = [], [], 0, 0.0
    for recs in by_req.values():
        kinds = {r["decision"] == COMMIT for r in recs}
        if len(recs) != ranks or len(kinds) != 1 or len({r["step"] for r in recs}) != 1:
            disagree += 1
            continue
        t_end = max(t_end, *(r["t_pop"] for r in recs))
        if kinds != {True}:
            aborted += 1
            continue
        committed += 1
        exact &= all(r["kv_ok"] and r["row_ok"] and r["token_ok"] for r in recs)
        total_bytes += sum(r["kv_bytes"] for r in recs)
        landed = [r for r in recs if r["t_last_byte"] is not None]
        if len(landed) == ranks:
            last = max(r["t_last_byte"] for r in recs)
            lat_ms.append((max(r["t_pop"] for r in recs) - last) * 1000)
            # The first step in which every rank had its own last byte before the step
            # started; committing in that step is a latency of one step.
            first = max(next((k for k, t in enumerate(starts[r["rank"]]) if t > r["t_last_byte"]),
                             r["step"]) for r in recs)
            lat_steps.append(recs[0]["step"] - first + 1)
    t_start = min((rec["t"] for log in logs for rec in log if rec["k"] == "enq"), default=t_end)
    seconds = max(t_end - t_start, 1e-9)
    return {
        "ranks": ranks, "requests": served, "committed": committed, "aborted": aborted,
        "lost": served - committed - aborted - disagree, "disagree": disagree,
        "byte_exact": bool(exact and committed > 0), "gate_holds": gate_holds(logs),
        "commit_latency_p50_ms": percentile(lat_ms, 50), "commit_latency_p99_ms": percentile(lat_ms, 99),
        "commit_latency_max_steps": max(lat_steps) if lat_steps else None,
        "kv_bytes": total_bytes, "seconds": round(seconds, 4),
        "mb_per_s": round(total_bytes / seconds / 1e6, 2),
        "steps": results[0]["steps"] if results else 0,
        "dropped_frames": sum(r["dropped"] for r in results),
        "rejected_frames": sum(r.get("rejected", 0) for r in results),
        "foreign_writes": sum(r.get("foreign_writes", 0) for r in results),
        "rank_digest_seconds": round(sum(r.get("digest_seconds", 0.0) for r in results), 4),
        "broken_connections": sum(r.get("broken", 0) for r in results),
        "abort_reasons": _reasons(results),
    }


def _reasons(results: list[dict[str, Any]], most: int = 5) -> dict[str, int]:
    """Why requests aborted, as each rank's receiver said (rank r's endpoint and port
    numbers blanked so that one cause is one entry): the most frequent ``most``."""
    import re
    from collections import Counter
    found = Counter(re.sub(r"\d+", "N", rec["why"]) for res in results
                    for rec in res["results"] if rec.get("why"))
    return dict(found.most_common(most))
