"""The e2e's true timeline (impl/mooncake/timeline.py) from rank results, rank logs and
the prefill's write stamps, on hand-made records (no Mooncake run)."""
from __future__ import annotations

import pytest

from impl.mooncake.timeline import timeline


def _rec(rank: int, req: int, *, enq: float, success: float, seen: float, pop: float,
         decision: str = "commit") -> dict:
    return {"rank": rank, "req": req, "room": 100 + req, "step": 3, "decision": decision,
            "t_enq": enq, "t_arrive": 10.0, "t_success": success, "t_row_seen": seen,
            "t_pop": pop, "t_step": pop - 0.001, "kv_bytes": 4096}


def _results(recs_by_rank: list[list[dict]]) -> list[dict]:
    return [{"rank": r, "results": recs, "step_starts": [10.0, 10.002, 10.004, 10.010]}
            for r, recs in enumerate(recs_by_rank)]


def _log() -> list[dict]:
    return [{"k": "step", "t": t, "rec": {"queue": ["0"] * q}}
            for t, q in ((10.001, 1), (10.003, 1), (10.005, 2), (10.011, 0))]


def test_gate_delay_counts_from_the_success_arrival_not_the_step_that_saw_it():
    results = _results([
        [_rec(0, 0, enq=10.0, success=10.010, seen=10.012, pop=10.020)],
        [_rec(1, 0, enq=10.001, success=10.015, seen=10.016, pop=10.021)]])
    landings = [[100, 0, 10.008, 10.009], [100, 1, 10.013, 10.014]]
    out = timeline(results, [_log(), _log()], landings)
    req = out["timeline"]["requests"][0]
    assert req["kv"] == [8.0, 13.0] and req["room"] == [9.0, 14.0]   # ms from the first enqueue
    assert req["success"] == [10.0, 15.0] and req["commit"] == 21.0
    assert out["gate_delay_p50_ms"] == pytest.approx(6.0)              # 21 - max(10, 15)
    assert out["enqueue_commit_p50_ms"] == pytest.approx(21.0)
    assert out["ttft_p50_ms"] == pytest.approx(21.0)                   # arrived at t0
    # rank 0's steps from the first enqueue: periods, pop delays, queue lengths
    assert out["timeline"]["step_ms"] == [2.0, 2.0, 6.0]
    assert out["timeline"]["step_cost_ms"] == [1.0, 1.0, 1.0]
    assert out["timeline"]["step_queue"] == [1, 1, 2]


def test_requests_not_committed_everywhere_have_no_latency():
    results = _results([
        [_rec(0, 0, enq=10.0, success=10.010, seen=10.012, pop=10.020)],
        [_rec(1, 0, enq=10.0, success=10.011, seen=10.012, pop=10.020, decision="abort")]])
    out = timeline(results, [_log(), _log()], [])
    assert out["timeline"]["requests"][0]["committed"] is False
    assert out["gate_delay_p50_ms"] is None and out["enqueue_commit_p99_ms"] is None
    assert out["timeline"]["requests"][0]["kv"] == [None, None]      # no prefill stamps
