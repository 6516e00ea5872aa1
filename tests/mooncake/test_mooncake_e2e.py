"""End to end over real Mooncake: one set of decode ranks (T=2, strict) serves a clean
prefill, then prefills that are killed, frozen or drop one rank's metadata, then a
fresh prefill again. The ranks are shared (process start and engine teardown cost
seconds); the trace of the whole session must replay in the spec at the end.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from impl.mooncake.cluster import Cluster
from impl.mooncake.report import figures, load_log, write_trace
from model.spec.validate import validate

RANKS, TIMEOUT_STEPS, SLOTS = 2, 400, 64
WORKLOAD = ["--seed", "3", "--page-bytes", "4096", "--min-pages", "2", "--max-pages", "6"]
RANK_ARGS = ["--variant", "strict", "--timeout-steps", str(TIMEOUT_STEPS), "--slots", str(SLOTS),
             "--pages", "512", "--inflight", "16", "--step-ms", "2",
             # heartbeats slower than strict's timeout, so a frozen prefill meets the timeout
             "--heartbeat-ms", "100", "--heartbeat-misses", "30", "--fence-grace-s", "0.5",
             "--collective-timeout-s", "30"]
PHASE_TIMEOUT = 30.0
served: list[int] = []


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e")
    c = Cluster(RANKS, work, WORKLOAD, RANK_ARGS, timeout_s=240)
    try:
        c.start_ranks()
        yield c
    finally:
        c.close()


def by_request(reports: list[list[dict]]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for rank_report in reports:
        for rec in rank_report:
            out.setdefault(rec["req"], []).append(rec)
    return out


def serve(cluster: Cluster, offset: int, count: int, extra: list[str] = (),
          during=None) -> tuple[dict[int, list[dict]], object]:
    prefill, endpoint = cluster.start_prefill(offset, count, list(extra))
    cluster.serve(endpoint, offset, count)
    if during is not None:
        during(prefill)
    outcomes = by_request(cluster.wait_idle(PHASE_TIMEOUT))
    served.extend(range(offset, offset + count))
    assert sorted(outcomes) == list(range(offset, offset + count)), "a request was lost"
    for req, recs in outcomes.items():
        assert len(recs) == RANKS, f"request {req} decided on {len(recs)} ranks"
        assert len({r["step"] for r in recs}) == 1, f"request {req} left in different steps"
        assert len({r["decision"] for r in recs}) == 1, f"request {req}: {recs}"
    return outcomes, prefill


def assert_all(outcomes: dict[int, list[dict]], decision: str) -> None:
    for req, recs in outcomes.items():
        assert recs[0]["decision"] == decision, f"request {req}: {recs}"
        if decision == "commit":
            assert all(r["kv_ok"] and r["row_ok"] and r["token_ok"] for r in recs), recs


def wait_for_kv(prefill, timeout: float = 10.0) -> None:
    """Until the prefill has written some KV (so the fault lands mid-transfer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        prefill.send("stats")
        if prefill.read(5, "stats")["kv_bytes"] > 0:
            return
        time.sleep(0.01)
    raise AssertionError("prefill wrote no KV in time")


def test_clean_prefill_commits_byte_exact(cluster):
    outcomes, prefill = serve(cluster, 0, 12)
    assert_all(outcomes, "commit")
    prefill.kill()


def test_prefill_killed_mid_transfer_aborts_everywhere_then_ranks_keep_serving(cluster):
    def kill(prefill):
        wait_for_kv(prefill)
        prefill.signal(signal.SIGKILL)
    outcomes, _ = serve(cluster, 100, 8, ["--stall-ms", "400"], during=kill)
    assert_all(outcomes, "abort_failed")
    assert any(r["local"] == 0 for recs in outcomes.values() for r in recs)   # heartbeat: Failed
    fresh, prefill = serve(cluster, 200, 8)
    assert_all(fresh, "commit")
    prefill.kill()


def test_frozen_prefill_meets_the_agreed_timeout_on_every_rank(cluster):
    frozen = []

    def freeze(prefill):
        wait_for_kv(prefill)
        prefill.signal(signal.SIGSTOP)
        frozen.append(prefill)
    try:
        outcomes, _ = serve(cluster, 300, 6, ["--stall-ms", "300"], during=freeze)
    finally:
        for p in frozen:
            p.kill()                      # SIGCONT then SIGKILL
    assert_all(outcomes, "abort_failed")
    # strict's timeout counts only steps the gate holds a latched Success on every rank:
    # a transfer frozen mid-way (some rank still WaitingForInput) never ages, so the
    # receivers' own heartbeat timeout reports Failed and the MIN aborts it everywhere
    for recs in outcomes.values():
        locals_ = [r["local"] for r in recs]
        assert 0 in locals_ or all(p == 4 for p in locals_), locals_


def test_metadata_dropped_to_one_rank_aborts_on_every_rank(cluster):
    outcomes, prefill = serve(cluster, 400, 4, ["--drop-metadata", "1"])
    assert_all(outcomes, "abort_failed")
    for recs in outcomes.values():      # both receivers said Success: the gate held rank 1
        assert [r["local"] for r in recs] == [4, 4]
    prefill.kill()


def test_session_trace_replays_in_the_spec(cluster, tmp_path):
    outcomes, prefill = serve(cluster, 500, 6)
    assert_all(outcomes, "commit")
    prefill.send("quit")
    prefill.close(30)
    results = cluster.finish()
    logs = [load_log(str(Path(cluster.workdir) / f"rank{r}.jsonl")) for r in range(RANKS)]
    trace = tmp_path / "session.ndjson"
    with open(trace, "w", encoding="utf-8") as fp:
        write_trace(logs, fp, "strict", SLOTS, TIMEOUT_STEPS)
    with open(trace, encoding="utf-8") as fp:
        check = validate(fp)
    assert check.ok, check.message
    assert check.first_violation is None
    figs = figures(results, logs, len(served))
    assert figs["lost"] == 0 and figs["disagree"] == 0
    assert figs["committed"] == 12 + 8 + 6 and figs["byte_exact"]
    assert figs["committed"] + figs["aborted"] == len(served)
