"""Figures the simulator reports, checked against their definitions rather than against
another path through the same code: Student's t quantiles and the interval they give,
the p50/p99 keys, per-rank overrides' range, and the late writes of a failed transfer,
which hold a reused slot whichever rank failed (on the fast path and the per-request
timeline path alike)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from sim.compare import mean_ci, t975
from sim.dists import parse_rank_dists
from sim.engine import Simulation
from sim.errors import SimInputError
from sim.results import summarize, ttft_ms
from tests.sim.helpers import config, run, workload


def test_t_quantiles_and_the_interval_are_students():
    assert t975(1) == pytest.approx(12.706, abs=1e-3) and t975(2) == pytest.approx(4.303, abs=1e-3)
    assert t975(10) == pytest.approx(2.228, abs=1e-3) and t975(10_000) == 1.96
    m, lo, hi = mean_ci([1.0, 2.0, 3.0, 6.0])
    half = 3.182 * np.std([1.0, 2.0, 3.0, 6.0], ddof=1) / 2
    assert m == 3.0 and (lo, hi) == pytest.approx((3.0 - half, 3.0 + half), abs=1e-2)
    assert all(math.isnan(x) for x in mean_ci([5.0])[1:])


def test_a_rank_override_one_past_the_last_rank_is_refused():
    assert [d.text for d in parse_rank_dists(["exp:1", "3=const:2"], 4, "--metadata-lag")][3] == "const:2"
    with pytest.raises(SimInputError, match="rank 4 out of range 0..3"):
        parse_rank_dists(["exp:1", "4=const:2"], 4, "--metadata-lag")


def test_the_summary_percentiles_are_the_runs_own():
    data, _ = run(config(variant="strict", ranks=2, seed=4), workload(150, 10.0, 4))
    s, ttft = summarize(data, wall_clock=False), ttft_ms(data)
    assert len(ttft) > 100
    assert s["ttft_p50_ms"] == pytest.approx(np.percentile(ttft, 50), abs=1e-6)
    assert s["ttft_p99_ms"] == pytest.approx(np.percentile(ttft, 99), abs=1e-6)
    assert s["ttft_p99_ms"] > s["ttft_p50_ms"]


@pytest.mark.parametrize("spans", [False, True], ids=["fast", "timeline"])
def test_a_failed_transfers_late_write_holds_its_slot_whichever_rank_failed(spans):
    """One slot, every transfer failing on some rank, late writes of 200 ms: strict
    reuses the slot only after the late write landed, so each request costs >= 200 ms."""
    cfg = config(variant="strict", ranks=2, slots=1, fail_prob=1.0, late_write="const:200",
                 fence_delay="const:1", seed=2)
    wl = workload(24, 50.0, 2)
    data = Simulation(cfg, wl, record_spans=spans).run()
    assert np.all(data.outcome >= 0) and not np.any(~np.isnan(data.commit_ms))
    assert data.sim_ms >= 23 * 200
