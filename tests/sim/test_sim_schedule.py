"""The fast schedule (queued requests' events delivered when a step needs them, the
scheduler running ahead of SimPy's clock, timelines laid out with numpy) is the same
simulation as the eager one (a SimPy event per delivery batch and per scheduler action,
events one at a time, decode steps one at a time): identical outcomes, steps and
times on every fault mix."""
import numpy as np
import pytest

from sim.dists import parse_dist
from sim.draws import stream
from sim.steptimes import StepTimes
from sim.engine import Simulation
from tests.sim.helpers import config, workload

CASES = [
    dict(variant="gate", ranks=8),
    dict(variant="strict", ranks=8, fail_prob=0.1, late_write="exp:30"),
    dict(variant="strict", ranks=4, lost_metadata_prob=0.02, timeout_steps=40, request_pool=4, slots=5,
         fail_prob=0.1, late_write="exp:40"),
    dict(variant="gate", ranks=4, fail_prob=0.05, lost_metadata_prob=0.01),
    dict(variant="ungated", ranks=8, lag="exp:3"),
    dict(variant="gate-noclear", ranks=2, fail_prob=0.2, late_write="exp:50"),
    dict(variant="gate", ranks=8, forward="const:5", idle_step="exp:1", kv_jitter="exp:2"),
    # local admission under slot pressure (the queues come to differ) and deferred release
    dict(variant="deferred-local", ranks=4, request_pool=8, slots=3, fail_prob=0.2, late_write="exp:50"),
    dict(variant="deferred", ranks=4, request_pool=8, slots=3, fail_prob=0.2, late_write="exp:50"),
]


def _same(a, b):
    assert np.array_equal(a.outcome, b.outcome)
    assert np.allclose(a.commit_ms, b.commit_ms, rtol=0, atol=1e-9, equal_nan=True)
    assert (a.protocol_steps, a.decode_steps, a.stuck) == (b.protocol_steps, b.decode_steps, b.stuck)
    assert (a.divergence is None) == (b.divergence is None)
    if a.divergence is not None:
        assert a.divergence.step == b.divergence.step
        assert a.divergence.violation.invariant == b.divergence.violation.invariant
    assert a.sim_ms == pytest.approx(b.sim_ms, abs=1e-9)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 3])
def test_fast_schedule_is_the_eager_simulation(case, seed):
    cfg = config(seed=seed, **case)
    for wl in (workload(300, 20.0, seed), workload(200, 4.0, seed, burstiness=0.3)):
        fast = Simulation(cfg, wl).run()
        _same(fast, Simulation(cfg, wl, eager=True).run())
        # the per-request timeline builder (used with stalls and Perfetto spans)
        _same(fast, Simulation(cfg, wl, record_spans=True).run())


@pytest.mark.parametrize("dist", ["const:25", "exp:3", "uniform:0,2"])
def test_step_times_advance_is_next_one_at_a_time(dist):
    """Decode steps taken together (StepTimes.advance) consume the same draws in the same
    order, and reach the same sums, as steps taken one by one (across block ends too)."""
    d = parse_dist(dist, "--forward")
    batched, single = StepTimes(d, stream(1, "forward")), StepTimes(d, stream(1, "forward"))
    rng = np.random.default_rng(7)
    t_b = t_s = 0.0
    for _ in range(3000):
        until, most = t_b + float(rng.exponential(40.0)), int(rng.integers(0, 12))
        t_b, taken = batched.advance(t_b, until, most)
        k = 0
        while k < most:
            t_s += single.next()
            k += 1
            if t_s >= until:
                break
        assert (t_b, taken) == (t_s, k)
        if rng.random() < 0.3:           # a step taken alone in between
            t_b += batched.next()
            t_s += single.next()
    assert batched.next() == single.next()
