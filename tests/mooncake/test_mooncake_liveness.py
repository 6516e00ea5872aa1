"""Liveness under load: a prefill (or a rank) that stops running for a while is slow,
not dead. Each run freezes a child with SIGSTOP for longer than the heartbeat period
while requests are in flight, then lets it go on. A killed or permanently frozen
prefill is still found (tests/mooncake/test_mooncake_e2e.py, test_mooncake_transport.py)."""
from __future__ import annotations

import signal
import time

from impl.e2e import E2EConfig, run_e2e, run_ok, timeout_steps_for

WORKLOAD = ["--seed", "8", "--page-bytes", "4096", "--min-pages", "1", "--max-pages", "4"]
REQUESTS = 150


def _config(tmp_path, during, misses: int | None = None) -> E2EConfig:
    rank_args = ["--pages", "256", "--inflight", "8", "--step-ms", "2",
                 "--collective-timeout-s", "20", "--heartbeat-ms", "100"]
    if misses is not None:
        rank_args += ["--heartbeat-misses", str(misses)]
    return E2EConfig(2, REQUESTS, "strict", [], WORKLOAD, rank_args,
                     timeout_steps_for("strict", 2.0, None), 16, timeout_s=90,
                     work_dir=str(tmp_path / "work"), during=during)


def _freeze(child, seconds: float, prefill) -> None:
    """Once the prefill wrote some KV (requests in flight), stop ``child`` for ``seconds``."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        prefill.send("stats")
        if prefill.read(10, "stats")["kv_bytes"] > 0:
            break
        time.sleep(0.005)
    child.signal(signal.SIGSTOP)
    time.sleep(seconds)
    child.signal(signal.SIGCONT)


def test_a_prefill_frozen_for_fifteen_heartbeats_is_waited_for(tmp_path):
    out = run_e2e(_config(tmp_path, lambda cluster, prefill: _freeze(prefill, 1.5, prefill)))
    assert out["committed"] == REQUESTS and out["aborted"] == 0, out
    assert run_ok(out), out


def test_the_same_freeze_past_a_short_window_aborts(tmp_path):
    """The sibling: a window of 5 heartbeats (the old default) declares it dead."""
    out = run_e2e(_config(tmp_path, lambda cluster, prefill: _freeze(prefill, 1.5, prefill),
                          misses=5))
    assert out["aborted"] > 0 and out["lost"] == 0 and out["disagree"] == 0, out
    assert any("missed heartbeats" in why for why in out["abort_reasons"]), out  # said, not only logged
    assert not run_ok(out)


def test_a_rank_that_did_not_run_does_not_count_that_time_as_prefill_silence(tmp_path):
    """Rank 1 itself stopped for 10 heartbeats of a 5-heartbeat window: on waking it
    hears the PONGs that came meanwhile, not a dead prefill."""
    out = run_e2e(_config(tmp_path, lambda cluster, prefill: _freeze(cluster.decode[1], 1.0,
                                                                     prefill), misses=5))
    assert out["committed"] == REQUESTS and out["aborted"] == 0, out
    assert run_ok(out), out
