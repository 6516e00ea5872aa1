"""Fit the simulator to real ``pdgate e2e`` runs (``pdgate calibrate``).

From an e2e JSON's ``timeline`` (impl/mooncake/timeline.py: true per-request, per-rank
times) this fits, in ms:
- the MIN all-reduce: ``alpha + beta x queued`` from each step's pop delay (step start
  -> the MIN returned) regressed on its queue length, and the residuals in step order;
- the step: the rest of each measured step period after that, in step order (traces:
  slow steps come in stretches);
- with runs at other rank counts, how much longer a step gets per doubling of the
  ranks (the median period's relative growth; else 0: one run cannot tell);
- the KV transfer per (request, rank): enqueue -> Success (``transfer``), and the
  prefill writer's KV write alone (``writer``), each as base + per page times the
  exp of a common factor per request and a per-rank noise (the measured log residuals;
  their correlation is reported), and the measured table for replay;
- the metadata lag (room written -> after Success) per rank, and the writer's room
  write, push and XFER delays; from runs with a metadata delay, how long a delayed
  row waited behind the prefill's queue.
Everything comes from the JSON; nothing is assumed but the shapes above.
"""
from __future__ import annotations

import gzip
import json
import math
from typing import Any

import numpy as np

from sim.errors import SimInputError

VERSION = 1
MAX_FILE_BYTES = 16 << 20
PAGES_DEFAULT = 512      # rank.py's --pages, for e2e JSONs from before setup.pages


def load_e2e(path: str) -> dict[str, Any]:
    """An e2e JSON (``.gz`` too) with a timeline; SimInputError naming the file otherwise."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as fp:
            text = fp.read(MAX_FILE_BYTES + 1)
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise SimInputError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if len(text) > MAX_FILE_BYTES:
        raise SimInputError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise SimInputError(f"{path}: not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("timeline"), dict) or \
            not isinstance(doc.get("setup"), dict):
        raise SimInputError(f"{path}: not a pdgate e2e JSON with a timeline and setup "
                            f"(written by this version's pdgate e2e)")
    reqs = doc["timeline"].get("requests")
    if not isinstance(reqs, list) or not reqs:
        raise SimInputError(f"{path}: its timeline has no requests")
    return doc


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


class _Run:
    """One e2e run's complete committed timelines, as arrays (ms)."""

    def __init__(self, doc: dict[str, Any], path: str):
        setup = doc["setup"]
        self.ranks = int(setup.get("ranks", 0))
        self.page_bytes = int(setup.get("page_bytes") or 0)
        self.delay = [float(setup.get("metadata_delay_ms", {}).get(str(r), 0.0)) for r in range(self.ranks)]
        keys = ("enq", "kv", "room", "success", "pop", "step_start")
        rows = []
        for r in doc["timeline"]["requests"]:
            if not isinstance(r, dict) or not r.get("committed"):
                continue
            vals = [[_num(v) for v in r.get(k) or []] for k in keys]
            if any(len(v) != self.ranks or None in v for v in vals):
                continue
            rows.append((vals, _num(r.get("kv_bytes")) or 0.0, _num(r.get("commit"))))
        if len(rows) < 10 or self.ranks < 1:
            raise SimInputError(f"{path}: fewer than 10 committed requests with a complete timeline")
        for name, k in zip(keys, range(len(keys))):
            setattr(self, name, np.array([v[k] for v, _, _ in rows]))
        self.pages = np.array([b for _, b, _ in rows]) / max(self.page_bytes, 1)
        self.commit = np.array([c for _, _, c in rows])
        tl = doc["timeline"]
        cols = [[_num(x) for x in tl.get(k) or []] for k in ("step_ms", "step_cost_ms", "step_queue")]
        n = min(len(c) for c in cols)
        if n < 10 or any(None in c[:n] for c in cols):
            raise SimInputError(f"{path}: its timeline has fewer than 10 steps with a period, a "
                                f"pop delay and a queue length (written by an older pdgate e2e?)")
        self.periods, self.costs, self.step_queue = (np.array(c[:n]) for c in cols)


def check_setup(doc: dict[str, Any], path: str) -> None:
    """A held-out run's setup and figures, as ``--validate`` uses them."""
    s = doc["setup"]
    ok = (all(isinstance(s.get(k), int) and not isinstance(s.get(k), bool) and 1 <= s[k] <= hi
              for k, hi in (("ranks", 1024), ("requests", 10**6), ("inflight", 1 << 20)))
          and isinstance(s.get("metadata_delay_ms") or {}, dict)
          and all(str(r).isdigit() and int(r) < s["ranks"] and _num(v) is not None and 0 <= v <= 1e7
                  for r, v in (s.get("metadata_delay_ms") or {}).items())
          and all(doc.get(f"{m}_p{q}_ms") is None or _num(doc.get(f"{m}_p{q}_ms")) is not None
                  for m in ("gate_delay", "enqueue_commit") for q in (50, 90, 99)))
    if not ok:
        raise SimInputError(f"{path}: malformed setup (ranks 1..1024, requests 1..10^6, inflight, "
                            f"metadata_delay_ms RANK -> ms) or latency figures")


def _run(doc: dict[str, Any], path: str) -> _Run:
    """``doc`` as a run; a malformed field is one line naming the file."""
    try:
        return _Run(doc, path)
    except SimInputError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
        raise SimInputError(f"{path}: malformed e2e timeline or setup ({type(exc).__name__})") from None


def _linear(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares intercept and slope (slope 0 when x does not vary), both >= 0."""
    if len(x) < 2 or float(np.ptp(x)) == 0.0:
        return max(float(np.median(y)), 0.0), 0.0
    slope, icpt = np.polyfit(x, y, 1)
    slope = max(float(slope), 0.0)
    return max(float(np.median(y - slope * x)), 0.0), slope


def _factors(times: np.ndarray, pages: np.ndarray) -> dict[str, Any]:
    """base + per_page x pages, times exp(common + noise) from the log residuals."""
    base, per_page = _linear(np.repeat(pages, times.shape[1]), times.reshape(-1))
    pred = np.maximum(base + per_page * pages, 1e-3)
    resid = np.log(np.maximum(times, 1e-3) / pred[:, None])
    common = resid.mean(axis=1)
    noise = resid - common[:, None]
    var_c, var_e = float(np.var(common)), float(np.var(noise))
    corr = (float(np.mean([np.corrcoef(times[:, 0], times[:, k])[0, 1] for k in range(1, times.shape[1])]))
            if times.shape[1] > 1 else 1.0)
    return {"base_ms": round(base, 6), "per_page_ms": round(per_page, 6),
            "common": [round(float(x), 5) for x in common],
            "noise": [round(float(x), 5) for x in noise.reshape(-1)],
            "log_share_common": round(var_c / (var_c + var_e), 4) if var_c + var_e > 0 else 1.0,
            "correlation": round(corr, 4) if math.isfinite(corr) else None}


def _writer(run: _Run) -> dict[str, Any]:
    """The prefill writer's KV write times (each job's KV end - when the writer took it:
    the later of its enqueue + XFER delay and the previous job's last write) and the
    metadata write, push and XFER delays."""
    plain = [k for k in range(run.ranks) if run.delay[k] == 0]
    room = float(np.median(run.room[:, plain] - run.kv[:, plain])) if plain else 0.05
    push = float(np.median(run.success[:, plain] - run.room[:, plain])) if plain else 0.1
    # every job in the order the writer finished them
    jobs = sorted((run.kv[i, k], i, k) for i in range(len(run.kv)) for k in range(run.ranks))
    kv_end = np.array([j[0] for j in jobs])
    enq = np.array([run.enq[i, k] for _, i, k in jobs])
    last = np.array([run.room[i, k] if run.delay[k] == 0 else run.kv[i, k] for _, i, k in jobs])
    prev = np.concatenate([[-np.inf], np.maximum.accumulate(last)[:-1]])
    idle = enq > prev          # the writer was idle when it arrived: kv_end - enq = delay + write
    busy_write = kv_end[~idle] - prev[~idle]
    typical = float(np.median(busy_write)) if len(busy_write) else 0.0
    xfer_delay = max(float(np.median(kv_end[idle] - enq[idle])) - typical, 0.0) if idle.any() else 0.0
    start = np.maximum(enq + xfer_delay, prev)
    service = np.maximum(kv_end - start, 1e-3)
    table = np.empty_like(run.kv)
    for (_, i, k), s in zip(jobs, service):
        table[i, k] = s
    return {"xfer_delay_ms": round(xfer_delay, 6), "room_ms": round(max(room, 0.0), 6),
            "push_ms": round(max(push, 0.0), 6), "service": table}


def setup_key(setup: dict[str, Any]) -> tuple:
    """What makes two e2e runs the same setup (their seeds aside)."""
    delays = setup.get("metadata_delay_ms") or {}
    return (setup.get("ranks"), setup.get("inflight"), setup.get("page_bytes"),
            setup.get("min_pages"), setup.get("max_pages"),
            tuple(sorted((str(r), float(ms)) for r, ms in delays.items())))


def _pooled(runs: list[_Run], name: str) -> np.ndarray:
    """One field of several runs of one setup, end to end (traces stay in step order
    within each run: a stretch of slow steps stays a stretch)."""
    return np.concatenate([getattr(run, name) for run in runs])


def fit(docs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The calibration (a JSON-able dict) from e2e runs. The first is the main one; every
    run of its setup (another seed: a repeat) is pooled with it for the steps, transfers
    and lags, so one run's luck weighs less; runs at other rank counts give the steps'
    growth with the ranks, runs with a metadata delay the delayed rows' waits."""
    runs = [_run(doc, path) for path, doc in docs]
    main_key = setup_key(docs[0][1]["setup"])
    pool = [run for run, (_, doc) in zip(runs, docs) if setup_key(doc["setup"]) == main_key]
    main, setup = runs[0], docs[0][1]["setup"]
    # the pops' delay after the step began: alpha + beta x queued, and its residuals in
    # step order; the rest of each step period after it, in step order
    queue, costs, periods = (_pooled(pool, k) for k in ("step_queue", "costs", "periods"))
    alpha, beta = _linear(queue, costs)
    resid = costs - (alpha + beta * queue)
    rest = np.maximum(periods - costs, 0.0)
    # more ranks, slower steps (gloo, and here ranks sharing cores): the median period's
    # relative growth per doubling of the ranks, from runs at other rank counts
    medians: dict[int, list[float]] = {}
    for run in runs:
        medians.setdefault(run.ranks, []).append(float(np.median(run.periods)))
    base = float(np.mean(medians[main.ranks]))
    x = np.array([math.log2(t) - math.log2(main.ranks) for t in medians if t != main.ranks])
    y = np.array([np.mean(v) / base - 1 for t, v in medians.items() if t != main.ranks])
    growth = float(np.dot(x, y) / np.dot(x, x)) if len(x) else 0.0
    # a delayed row's wait behind the prefill's queue (room written - KV written - delay),
    # from every run with a metadata delay (none: sim/engine.py's backlog estimate)
    waits = [float(run.room[i, k] - run.kv[i, k] - run.delay[k]) for run in runs
             for k in range(run.ranks) if run.delay[k] > 0 for i in range(len(run.kv))]
    xfer = _pooled(pool, "success") - _pooled(pool, "enq")
    pages = _pooled(pool, "pages")
    writers = [_writer(run) for run in pool]
    service = np.concatenate([w["service"] for w in writers])
    writer = {k: round(float(np.median([w[k] for w in writers])), 6)
              for k in ("xfer_delay_ms", "room_ms", "push_ms")}
    plain = [k for k in range(main.ranks) if main.delay[k] == 0] or list(range(main.ranks))
    lag = np.maximum(_pooled(pool, "room") - _pooled(pool, "success"), 0.0)
    setup = {**setup, "pages": setup.get("pages", PAGES_DEFAULT)}
    return {
        "version": VERSION, "sources": [p for p, _ in docs],
        "pooled": [p for (p, doc) in docs if setup_key(doc["setup"]) == main_key],
        "setup": {k: setup.get(k) for k in ("ranks", "requests", "variant", "arrivals", "step_ms",
                                            "slots", "inflight", "pages", "min_pages", "max_pages",
                                            "metadata_delay_ms")},
        "allreduce": {"alpha_ms": round(alpha, 6), "beta_ms": round(beta, 6),
                      "residual_ms": [round(float(v), 4) for v in resid]},
        "step_rest_ms": [round(float(v), 4) for v in rest],
        "step_growth_per_rank_doubling": round(growth, 6), "ranks_seen": sorted(medians),
        "transfer": {**_factors(xfer, pages),
                     "replay_ms": [[round(float(v), 4) for v in row] for row in xfer]},
        "writer": {**writer, **_factors(service, pages)},
        # the lag without an injected delay (a delayed rank's own lag is its delay)
        "lag_ms": [round(float(v), 4) for v in lag[:, plain].reshape(-1)],
        "delayed_wait_ms": [round(max(v, 0.0), 4) for v in waits],
    }
