"""Attacks on the control plane by a local process without the keys: a forged HELLO for
a rank not yet registered, forged status frames, oversized frames. Each is rejected
and counted; the real ranks are not locked out and their requests land byte-exact."""
from __future__ import annotations

import json

import pytest
import zmq

from impl.mooncake import auth
from impl.mooncake import frames as fr
from impl.mooncake.prefill import PrefillServer
from impl.mooncake.receiver import SUCCESS
from impl.mooncake.synth import kv_bytes, make_requests
from tests.mooncake.conftest import PAGE_BYTES, SECRET, DecodeRank
from tests.mooncake.test_mooncake_transport import settle, wait_for


@pytest.fixture
def two_ranks(engines):
    """A prefill serving ranks 0 and 1; only rank 0 has said HELLO yet."""
    pe, de = engines
    specs = make_requests(6, seed=21, min_pages=2, max_pages=3)
    server = PrefillServer(pe, specs, ranks=2, page_bytes=PAGE_BYTES, secret=SECRET)
    victim = DecodeRank(de, rank=0, heartbeat_s=0.05, heartbeat_misses=20)
    victim.transport.connect(server.endpoint)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    yield server, victim, specs, sock
    sock.close()
    victim.transport.close()
    server.close(close_engine=False)


def forged_hello(victim: DecodeRank, rank: int) -> list[bytes]:
    """A HELLO for ``rank`` pointing at the victim's session and buffers: what would make
    the prefill write another request's KV and row into the victim's memory."""
    hello = victim.transport.hello()
    body = json.loads(hello.encode()[1])
    body["rank"] = rank
    return [fr.HELLO, fr.encode_rank(rank), json.dumps(body).encode()]


def test_forged_hello_is_rejected_and_the_real_rank_still_registers(two_ranks, engines):
    server, victim, specs, sock = two_ranks
    sock.send_multipart(forged_hello(victim, 1))                            # no tag
    sock.send_multipart([*forged_hello(victim, 1), b"\0" * auth.TAG_BYTES])  # a guessed tag
    stolen = auth.rank_key(SECRET, 0)                 # rank 0's key cannot speak for rank 1
    sock.send_multipart(auth.seal(stolen, auth.Channel(auth.TO_PREFILL, 1), forged_hello(victim, 1)))
    wait_for(lambda: server.rejected >= 3, what="the forged HELLOs to be rejected")
    assert server.rejected == 3 and 1 not in server._ranks
    assert not sock.poll(200)                         # no reply of any kind: nothing to learn
    # The real rank 1 (holder of its key) registers and is served byte-exact.
    real = DecodeRank(engines[1], rank=1, heartbeat_s=0.05, heartbeat_misses=20)
    try:
        spec = specs[0]
        rec = real.transport.start(spec.room, 0, real.pages(spec.n_pages), server.endpoint)
        assert settle(rec) == SUCCESS
        assert real.pool[:spec.n_pages].tobytes() == kv_bytes(spec, 1, PAGE_BYTES).tobytes()
        assert not victim.pool.any()                  # nothing was written for rank 1 into rank 0
    finally:
        real.transport.close()


def hello_from(sock, rank: int, body: bytes) -> list[bytes]:
    """Send a HELLO for ``rank`` tagged with its key from ``sock``; the verified reply."""
    key = auth.rank_key(SECRET, rank)
    sock.send_multipart(auth.seal(key, auth.Channel(auth.TO_PREFILL, rank),
                                  [fr.HELLO, fr.encode_rank(rank), body]))
    assert sock.poll(5000), "no reply to HELLO"
    reply = auth.unseal(key, auth.Channel(auth.REPLY, rank), sock.recv_multipart())
    assert reply is not None
    return reply


def test_the_key_holder_may_say_hello_again_but_not_change_its_layout(two_ranks):
    """A HELLO whose reply came late is sent again: the same layout gets HELLO_OK again
    (and the request after it is served); another layout for the rank gets ERROR."""
    server, victim, specs, sock = two_ranks
    hello = victim.transport.hello().encode()[1]
    assert hello_from(sock, 0, hello)[0] == fr.HELLO_OK
    moved = json.loads(hello)
    moved["kv"][0] += PAGE_BYTES                      # the pool somewhere else
    reply = hello_from(sock, 0, json.dumps(moved).encode())
    assert reply[0] == fr.ERROR and b"already registered" in reply[1]
    spec = specs[5]
    rec = victim.transport.start(spec.room, 5, victim.pages(spec.n_pages), server.endpoint)
    assert settle(rec) == SUCCESS and int(victim.room[5, 0]) == spec.room


def test_forged_status_frames_are_rejected_and_the_request_commits(two_ranks):
    server, victim, specs, _ = two_ranks
    server.faults.stall_s = 0.3                       # the forgeries race a live request
    spec = specs[1]
    rec = victim.transport.start(spec.room, 1, victim.pages(spec.n_pages), server.endpoint)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(victim.transport.status_endpoint)
    room = str(spec.room).encode()
    for _ in range(50):                               # Failed for the victim's room, as SGLang's
        push.send_multipart([room, b"0", b"0"])       # three parts: the room is predictable
    push.send_multipart([room, b"0", b"0", b"x" * auth.TAG_BYTES])
    wait_for(lambda: victim.transport.rejected >= 51, what="the forged status to be rejected")
    push.close()
    assert settle(rec) == SUCCESS and int(victim.room[1, 0]) == spec.room
    assert victim.transport.dropped == 0


def test_oversized_frames_cost_the_sender_its_connection_not_the_server(two_ranks):
    server, victim, specs, sock = two_ranks
    sock.send_multipart([fr.XFER, fr.encode_rank(0), b"\0" * (fr.MAX_TO_PREFILL_PART + 1),
                         b"\0" * auth.TAG_BYTES])
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(victim.transport.status_endpoint)
    push.send_multipart([b"1" * (fr.MAX_STATUS_PART + 1), b"0", b"0", b"0" * auth.TAG_BYTES])
    spec = specs[2]
    rec = victim.transport.start(spec.room, 2, victim.pages(spec.n_pages), server.endpoint)
    assert settle(rec) == SUCCESS                     # both servers still serve
    push.close()
    # ZMQ dropped the oversized frames before any handler saw them.
    assert server.rejected == 0 and server.dropped == 0
    assert victim.transport.rejected == 0 and victim.transport.dropped == 0


def test_a_replayed_xfer_is_ignored_before_and_after_its_request_landed(two_ranks):
    """The exact XFER the rank sent (same tag: HMAC is deterministic), replayed on the
    same connection, is dropped without a status: the request commits, and a replay
    once it landed rewrites nothing. An XFER for the room with other pages still fails it."""
    server, victim, specs, _ = two_ranks
    server.faults.stall_s = 0.3
    spec = specs[3]
    pages = victim.pages(spec.n_pages)
    rec = victim.transport.start(spec.room, 3, pages, server.endpoint)
    sock = victim.transport._links[server.endpoint].sock
    xfer = fr.Xfer(spec.room, 0, 3, pages).encode()
    victim.transport._send(sock, xfer)                              # while it is written
    assert settle(rec) == SUCCESS and int(victim.room[3, 0]) == spec.room
    written = server.kv_bytes_written
    victim.room[3] = 0
    victim.transport._send(sock, xfer)                              # after it landed
    wait_for(lambda: server.dropped >= 2, what="the replays to be dropped")
    assert server.kv_bytes_written == written and not victim.room[3].any()
    assert victim.transport.dropped == 0                          # no status for a replay
    other = specs[4]
    rec2 = victim.transport.start(other.room, 4, victim.pages(other.n_pages), server.endpoint)
    assert settle(rec2) == SUCCESS
    moved = fr.Xfer(other.room, 0, 4, victim.pages(other.n_pages)).encode()
    victim.transport._send(sock, moved)                             # not a replay
    wait_for(lambda: server.dropped >= 3, what="the changed XFER to be refused")
    assert server.kv_bytes_written == written + other.n_pages * PAGE_BYTES


def test_garbage_and_oversized_frames_are_counted_as_broken_connections(two_ranks):
    """ZMQ drops these before any handler runs (no frame is rejected or dropped); the
    listeners' monitors count them. A rank's own traffic counts nothing."""
    import socket
    server, victim, specs, sock = two_ranks
    spec = specs[0]
    assert settle(victim.transport.start(spec.room, 0, victim.pages(spec.n_pages),
                                         server.endpoint)) == SUCCESS
    assert server.broken.count == 0 and victim.transport.broken.count == 0
    for endpoint in (server.endpoint, victim.transport.status_endpoint):
        host, port = endpoint[len("tcp://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")      # no ZMTP at all
    sock.send_multipart([fr.XFER, fr.encode_rank(0), b"\0" * (fr.MAX_TO_PREFILL_PART + 1),
                         b"\0" * auth.TAG_BYTES])
    wait_for(lambda: server.broken.count >= 2 and victim.transport.broken.count >= 1,
             what="the broken connections to be counted")
    assert server.rejected == 0 and server.dropped == 0


def test_a_connection_and_frame_flood_does_not_get_a_live_prefill_declared_dead(two_ranks):
    """200 connections of garbage and 20,000 frames with bad tags while a request is
    being written: every frame is rejected, the rank's heartbeats (a 1 s window) still
    get through, and the request commits."""
    import socket
    server, victim, specs, sock = two_ranks
    server.faults.stall_s = 0.5
    spec = specs[4]
    rec = victim.transport.start(spec.room, 4, victim.pages(spec.n_pages), server.endpoint)
    host, port = server.endpoint[len("tcp://"):].rsplit(":", 1)
    raws = [socket.create_connection((host, int(port)), timeout=5) for _ in range(200)]
    for raw in raws:
        raw.sendall(b"\xff" * 64)
    junk = [fr.PING, fr.encode_rank(0), b"\0" * 10, b"\0" * auth.TAG_BYTES]
    for _ in range(20_000):
        sock.send_multipart(junk)
    for raw in raws:
        raw.close()
    assert settle(rec, timeout=15) == SUCCESS
    wait_for(lambda: server.rejected >= 20_000, timeout=30, what="the flood to be rejected")
    wait_for(lambda: server.broken.count >= 200, what="the garbage connections to be counted")
    assert victim.transport._links[server.endpoint].alive
