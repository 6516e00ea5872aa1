"""The closed form: with constant latencies the measured gate delay equals the slowest
rank's metadata lag beyond its KV completion, rounded up to a step, plus one all-reduce.

Derivation in our timing model (docs/SIMULATOR.md): the request is enqueued at the
prefill's end E, and the scheduler polls at E + j*P with P = all-reduce alpha + idle
step (beta = 0; nothing runs yet). Every rank's KV lands at K = E + X; choose X a
multiple of P so K is a poll instant. Rank k's row is visible at K + lag_k (plus, for
strict, the separate room write: one transfer overhead later). The gate holds until the
first poll instant s >= K + L (an event at a poll instant is seen by it), L = max lag;
the commit takes effect one all-reduce later. So gate delay = ceil(L / P) * P + alpha.
All numbers are binary fractions, so the float arithmetic is exact.
"""
import math

import numpy as np
import pytest

from sim.workload import Workload
from tests.sim.helpers import config, one_request, run

ALPHA, FWD, X = 0.25, 0.75, 3.0
P = ALPHA + FWD


def closed_form(lags: list[float]) -> float:
    return math.ceil(max(lags) / P) * P + ALPHA


def _cfg(variant: str, lags: list[float], **kw):
    return config(variant=variant, ranks=len(lags), lag=[f"const:{x}" for x in lags],
                  forward=f"const:{FWD}", idle_step=f"const:{FWD}", allreduce_alpha_ms=ALPHA,
                  allreduce_beta_ms=0.0, prefill_base_ms=10.0, prefill_ms_per_token=0.0,
                  te_overhead_ms=X, te_per_range_ms=0.0, kv_bytes_per_token=0, **kw)


@pytest.mark.parametrize("lags", [[0.0, 0.0], [0.5, 2.25, 1.0], [2.0, 1.0], [0.125] * 4,
                                  [7.5, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 1.0]])
@pytest.mark.parametrize("variant", ["gate", "gate-noclear"])
def test_gate_delay_matches_the_closed_form(variant, lags):
    data, _ = run(_cfg(variant, lags), one_request())
    assert data.divergence is None
    delay = data.commit_ms[0] - data.kv_all_ms[0]
    assert delay == closed_form(lags)


@pytest.mark.parametrize("lags", [[0.5, 2.25, 1.0], [0.0, 0.0]])
def test_strict_adds_the_separate_room_write(lags):
    # strict writes the room after the payload completed: one more transfer overhead (X).
    data, _ = run(_cfg("strict", lags, timeout_steps=50), one_request())
    assert data.commit_ms[0] - data.kv_all_ms[0] == closed_form([x + X for x in lags])


def test_every_isolated_request_gets_the_same_delay():
    lags = [1.5, 0.25, 4.0]
    wl = Workload(np.arange(5) * 1000.0, np.full(5, 100), np.full(5, 3), "spaced")
    data, _ = run(_cfg("gate", lags), wl)
    delays = data.commit_ms - data.kv_all_ms
    assert list(delays) == [closed_form(lags)] * 5
