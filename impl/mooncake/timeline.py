"""The true timeline of an e2e run, per request and rank: what ``pdgate calibrate`` fits.

A rank's log says when it *saw* things (its step boundaries). The true times come from
where they happened: the prefill stamps when each KV batch and each room write returned
(``PrefillServer.landings``), each rank's I/O thread when Success came in, its scheduler
when a request arrived, was enqueued and popped. Every process reads the same host-wide
monotonic clock, so the times compare directly; here they become ms from the run's first
enqueue.
"""
from __future__ import annotations

from typing import Any

from impl.mooncake.report import percentile

QUANTILES = (50, 90, 99)


def _ms(t: float | None, t0: float) -> float | None:
    return None if t is None else round((t - t0) * 1000.0, 3)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 of ``values`` (None when empty)."""
    return {f"p{q}": percentile(values, q) for q in QUANTILES}


def requests(results: list[dict[str, Any]], landings: list[list[Any]]) -> tuple[float, list[dict[str, Any]]]:
    """(t0, one record per request decided on every rank), times in ms from t0 (the first
    enqueue), per-rank lists in rank order: ``arrive``, ``enq``, ``kv`` and ``room`` (the
    prefill's writes returned), ``success`` (Success came in), ``pop``, ``step_start`` (the
    popping step began); ``commit`` is the last rank's pop, ``committed`` whether every
    rank committed."""
    ranks = len(results)
    by_req: dict[int, dict[int, dict[str, Any]]] = {}
    for res in results:
        for rec in res["results"]:
            by_req.setdefault(rec["req"], {})[res["rank"]] = rec
    written = {(int(room), int(rank)): (kv, rm) for room, rank, kv, rm in landings}
    t0 = min((rec["t_enq"] for recs in by_req.values() for rec in recs.values()), default=0.0)
    out = []
    for req in sorted(by_req):
        recs = by_req[req]
        if len(recs) != ranks:
            continue
        rows = [recs[r] for r in range(ranks)]
        wr = [written.get((rows[r]["room"], r), (None, None)) for r in range(ranks)]
        out.append({
            "req": req, "step": rows[0]["step"], "kv_bytes": rows[0].get("kv_bytes"),
            "committed": all(r["decision"] == "commit" for r in rows),
            "arrive": [_ms(r.get("t_arrive"), t0) for r in rows],
            "enq": [_ms(r["t_enq"], t0) for r in rows],
            "kv": [_ms(w[0], t0) for w in wr], "room": [_ms(w[1], t0) for w in wr],
            "success": [_ms(r.get("t_success"), t0) for r in rows],
            "pop": [_ms(r["t_pop"], t0) for r in rows],
            "step_start": [_ms(r.get("t_step"), t0) for r in rows],
            "commit": _ms(max(r["t_pop"] for r in rows), t0)})
    return t0, out


def latencies(reqs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per committed request with a complete timeline: ``ttft`` (first arrival -> last
    pop), ``gate_delay`` (last rank's Success -> last pop: what the gate and the MIN
    cost), ``enqueue_commit`` (first enqueue -> last pop), in ms."""
    out: dict[str, list[float]] = {"ttft": [], "gate_delay": [], "enqueue_commit": []}
    for r in reqs:
        if not r["committed"] or None in r["success"]:
            continue
        c = r["commit"]
        out["gate_delay"].append(c - max(r["success"]))
        out["enqueue_commit"].append(c - min(r["enq"]))
        if None not in r["arrive"]:
            out["ttft"].append(c - min(r["arrive"]))
    return out


def steps(results: list[dict[str, Any]], log0: list[dict[str, Any]], t0: float
          ) -> tuple[list[float], list[float], list[int]]:
    """Rank 0's steps from the first enqueue on: each period in ms (start to next
    start), the part of it before the MIN returned (its log record is written then: the
    pops' delay), and its queue length."""
    starts = next((r["step_starts"] for r in results if r["rank"] == 0), [])
    recs = [rec for rec in log0 if rec["k"] == "step"]
    keep = [k for k, t in enumerate(starts[:len(recs)]) if t >= t0 and k + 1 < len(starts)]
    return ([round((starts[k + 1] - starts[k]) * 1000.0, 3) for k in keep],
            [round((recs[k]["t"] - starts[k]) * 1000.0, 3) for k in keep],
            [len(recs[k]["rec"]["queue"]) for k in keep])


def timeline(results: list[dict[str, Any]], logs: list[list[dict[str, Any]]],
             landings: list[list[Any]]) -> dict[str, Any]:
    """The JSON's ``timeline`` (requests; rank 0's step periods, pop delays and queue
    lengths) and the latency percentiles (``ttft_p50_ms``, ...)."""
    t0, reqs = requests(results, landings)
    figs: dict[str, Any] = {}
    for name, values in latencies(reqs).items():
        for q, v in percentiles(values).items():
            figs[f"{name}_{q}_ms"] = v
    periods, costs, queues = steps(results, logs[0] if logs else [], t0)
    figs["timeline"] = {"requests": reqs, "step_ms": periods, "step_cost_ms": costs,
                        "step_queue": queues}
    return figs
