"""Every socket pdgate opens listens on the configured host (127.0.0.1 here), gloo's
store included; the only others are Mooncake's own P2P listeners (docs/MOONCAKE.md),
which bind every interface whatever the host. Listed from /proc while e2e and replay run."""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from impl.decode.collective import rendezvous_store
from impl.mooncake.cluster import Cluster
from impl.ranks import run_ranks
from tests.listeners import is_loopback, listening, port_of

WORKLOAD = ["--seed", "1", "--page-bytes", "4096", "--min-pages", "1", "--max-pages", "2"]
RANK_ARGS = ["--pages", "64", "--slots", "8", "--inflight", "4"]


def test_the_checker_sees_a_store_on_every_interface():
    """torch's own TCPStore master listens on [::]: the listing must say so (else the
    checks below could not fail), and ours on the host only."""
    theirs = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    assert any(not is_loopback(a) and port_of(a) == theirs.port for a in listening(os.getpid()))
    ours = rendezvous_store("127.0.0.1", 0, 1, is_master=True, timeout_s=5)
    assert [a for a in listening(os.getpid()) if port_of(a) == ours.port] == [f"127.0.0.1:{ours.port}"]
    del theirs, ours


def test_e2e_listeners_bind_the_host_except_mooncakes_own(tmp_path):
    cluster = Cluster(2, tmp_path, WORKLOAD, RANK_ARGS, timeout_s=60)
    try:
        prefill, endpoint = cluster.start_prefill(0, 2)
        ready = cluster.start_ranks()
        sessions = [prefill_session(prefill), *(r["session"] for r in ready)]
        for child, session in zip([prefill, *cluster.decode], sessions):
            found = listening(child.proc.pid)
            wide = [a for a in found if not is_loopback(a)]
            # Mooncake: its handshake (rpc) port and its TCP transport's, nothing else.
            assert len(wide) <= 2 and port_of(session) in {port_of(a) for a in wide}, (child.name, found)
            assert any(is_loopback(a) for a in found), (child.name, found)
        assert f"127.0.0.1:{cluster.master_port}" in listening(cluster.decode[0].proc.pid)
        assert all(port_of(a) != cluster.master_port
                   for c in cluster.decode for a in listening(c.proc.pid) if not is_loopback(a))
        assert f"127.0.0.1:{port_of(endpoint)}" in listening(prefill.proc.pid)
    finally:
        cluster.close()


def prefill_session(prefill) -> str:
    return prefill.hello_line["session"]


def _list_listeners(rank: int, world: int, parent: int) -> dict:
    return {"own": listening(os.getpid()), "parent": listening(parent)}


def test_replay_ranks_and_their_store_listen_on_loopback_only():
    before = set(listening(os.getpid()))     # e.g. other tests' Mooncake engines
    outcomes = run_ranks(_list_listeners, 2, (os.getpid(),), deadline_s=60, group_timeout_s=20)
    opened = set(outcomes[0].value["parent"]) - before
    assert opened and all(is_loopback(a) for a in opened), opened        # the store
    for o in outcomes:
        assert all(is_loopback(a) for a in o.value["own"]), o.value       # gloo's pair sockets
