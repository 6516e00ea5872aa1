"""What Mooncake's own listeners expose to a local process with no key, and what the
private network namespace of ``pdgate e2e`` (impl.mooncake.netns) leaves of it.

The probe is a keyless Mooncake engine in this test process: it asks a session for its
first registered buffer (a rank's KV pool, the prefill's KV source), writes 0xEE over
a page of it and reads it back. Without the namespace both calls succeed (the check can
say "exposed"); with it, no session answers and the run commits byte-exact."""
from __future__ import annotations

import numpy as np
import pytest

from impl.e2e import E2EConfig, run_e2e, run_ok, timeout_steps_for
from impl.mooncake.cluster import Cluster
from impl.mooncake.netns import problem

WORKLOAD = ["--seed", "4", "--page-bytes", "4096", "--min-pages", "1", "--max-pages", "3"]
RANK_ARGS = ["--pages", "128", "--slots", "16", "--inflight", "4", "--step-ms", "2",
             "--collective-timeout-s", "10"]
PAGE = 4096


@pytest.fixture
def probe(engines):
    """A keyless engine's attack on one session: (write rc, read rc, bytes read back);
    rc None when the session does not even give out a buffer address."""
    engine = engines[0]
    buf = np.zeros(PAGE, np.uint8)
    region = engine.register("probe", buf.ctypes.data, PAGE)

    def attack(session: str) -> tuple[int | None, int | None, bytes]:
        te = engine._te
        addr = te.get_first_buffer_address(session)
        if not addr:
            guess = 1 << 40             # still try a write and a read at a guessed address
            return (te.transfer_sync_write(session, buf.ctypes.data, guess, PAGE),
                    te.transfer_sync_read(session, buf.ctypes.data, guess, PAGE), b"")
        buf[:] = 0xEE
        wrote = te.transfer_sync_write(session, buf.ctypes.data, addr, PAGE)
        buf[:] = 0
        read = te.transfer_sync_read(session, buf.ctypes.data, addr, PAGE)
        return wrote, read, buf.tobytes()
    yield attack
    engine.unregister(region)


def test_without_a_namespace_a_keyless_engine_overwrites_and_reads_a_rank_pool(tmp_path, probe):
    cluster = Cluster(1, tmp_path, WORKLOAD, RANK_ARGS, timeout_s=60)
    try:
        prefill, _ = cluster.start_prefill(0, 2)
        ready = cluster.start_ranks()
        for session in (ready[0]["session"], prefill.hello_line["session"]):
            assert probe(session) == (0, 0, b"\xee" * PAGE), session
    finally:
        cluster.close()


def test_in_a_private_namespace_no_buffer_is_reachable_and_the_run_commits(tmp_path, probe):
    assert problem() is None, problem()        # root, nsenter: CI runs as root
    attempts = []

    def attack(cluster, prefill):
        for session in [r["session"] for r in cluster.ready] + [prefill.hello_line["session"]]:
            attempts.append(probe(session))
    cfg = E2EConfig(2, 24, "strict", [], WORKLOAD, RANK_ARGS, timeout_steps_for("strict", 2.0, None),
                    16, timeout_s=60, work_dir=str(tmp_path / "work"), during=attack, netns=True)
    out = run_e2e(cfg)
    assert len(attempts) == 3
    for wrote, read, got in attempts:
        assert wrote != 0 and read != 0 and got == b"", attempts
    assert out["netns"] and out["committed"] == 24 and out["byte_exact"] and run_ok(out), out
