"""The fault knobs produce the failures the bug corpus describes, and only where the
variant is exposed to them (protocol.md: #23252/#26394, #27374, #35049)."""
import numpy as np
import pytest

from sim.config import Stall
from sim.results import summarize
from tests.sim.helpers import config, run, workload


def _summary(**kw):
    seed = kw.get("seed", 1)
    n = kw.pop("n", 200)
    rate = kw.pop("rate", 20.0)
    data, _ = run(config(**kw), workload(n, rate=rate, seed=seed))
    return summarize(data)


@pytest.mark.parametrize("seed", [1, 2])
def test_ungated_diverges_on_metadata_lag_and_the_gate_does_not(seed):
    lagged = dict(ranks=4, seed=seed, lag="exp:3")
    s = _summary(variant="ungated", **lagged)
    assert s["diverged"] and s["divergence"]["invariant"] == "queues_identical"
    assert s["divergence"]["ranks"] and s["divergence"]["requests"]
    assert not _summary(variant="gate", **lagged)["diverged"]
    # metadata visible with its KV: ungated is safe too
    assert not _summary(variant="ungated", ranks=4, seed=seed, lag="const:0")["diverged"]


@pytest.mark.parametrize("seed", [1, 2])
def test_late_writes_into_reused_slots_break_gate_but_not_strict(seed):
    faults = dict(ranks=4, seed=seed, fail_prob=0.3, late_write="exp:200", slots=2, request_pool=1)
    s = _summary(variant="gate", **faults)
    assert s["diverged"] and s["divergence"]["invariant"] == "outcomes_agree"
    s = _summary(variant="strict", timeout_steps=1000, **faults)
    assert not s["diverged"] and s["committed"] + s["aborted"] == 200


def test_reuse_without_zeroing_breaks_the_gate():
    kw = dict(ranks=4, seed=1, slots=4, request_pool=2, lag="exp:8")
    noclear = _summary(variant="gate-noclear", **kw)
    assert noclear["diverged"] and noclear["divergence"]["invariant"] == "outcomes_agree"
    # the --no-clear override is the same thing
    assert _summary(variant="gate", no_clear=True, **kw)["divergence"] == noclear["divergence"]
    assert not _summary(variant="gate", **kw)["diverged"]


def test_lost_metadata_holds_the_gate_forever_and_strict_times_out():
    kw = dict(ranks=4, seed=1, lost_metadata_prob=0.05, n=100)
    gate = _summary(variant="gate", **kw)
    assert not gate["diverged"] and gate["stuck"] > 0 and gate["undecided"] == gate["stuck"]
    strict = _summary(variant="strict", timeout_steps=200, **kw)
    assert strict["stuck"] == 0 and strict["undecided"] == 0 and not strict["diverged"]
    assert strict["aborted_by_reason"]["abort_failed"] == gate["stuck"]


def test_transfer_failures_abort_on_every_rank():
    s = _summary(variant="gate", ranks=4, seed=1, fail_prob=0.2)
    assert not s["diverged"] and s["aborted"] == s["aborted_by_reason"]["abort_failed"] > 0
    assert s["committed"] + s["aborted"] == 200


def test_a_stalled_rank_delays_commits_by_its_window():
    wl = workload(50, rate=50.0, seed=4)
    base, _ = run(config(variant="gate", ranks=4, seed=4), wl)
    stalled, _ = run(config(variant="gate", ranks=4, seed=4, stalls=(Stall(2, 0.0, 2000.0),)), wl)
    committed = ~np.isnan(base.commit_ms)
    early = committed & (base.commit_ms < 1500.0)
    assert early.any()
    # nothing that would have committed before 1.5 s commits before the stall ends
    assert np.all(stalled.commit_ms[early] >= 2000.0)
    assert not stalled.divergence
