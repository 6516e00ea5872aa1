"""The transport on real Mooncake engines (TCP on loopback), in one process (plus a
frozen peer process for the transfer timeout)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from impl.decode import KVReceiver
from impl.mooncake import frames as fr
from impl.mooncake.engine import RegistrationError, TransferError, Write, transfer_timeout_s
from impl.mooncake.receiver import FAILED, SUCCESS, WAITING
from impl.mooncake.synth import kv_bytes, make_requests
from impl.mooncake import auth
from impl.mooncake.prefill import Faults, PrefillServer
from tests.mooncake.conftest import PAGE_BYTES, SECRET, SLOTS, DecodeRank

KEY0 = auth.rank_key(SECRET, 0)


def sealed(direction: bytes, parts: list[bytes], key: bytes = KEY0, rank: int = 0) -> list[bytes]:
    """Frames as the holder of ``key`` would send them (a compromised or buggy peer)."""
    return auth.seal(key, auth.Channel(direction, rank), parts)


def to_prefill(frame: list[bytes], rank: int = 0, key: bytes = KEY0) -> list[bytes]:
    kind, body = frame
    return sealed(auth.TO_PREFILL, [kind, fr.encode_rank(rank), body], key, rank)


def wait_for(cond, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def settle(receiver, timeout: float = 5.0) -> int:
    """Observe until the receiver latches Success or Failed; returns the poll value."""
    wait_for(lambda: (receiver.observe(), receiver.poll())[1] in (SUCCESS, FAILED),
             timeout, f"room {receiver.room} to latch")
    return receiver.poll()


def test_engine_refuses_unregistered_local_range(engines):
    pe, de = engines
    dst = np.zeros(4096, np.uint8)
    region = de.register("dst", dst.ctypes.data, dst.nbytes)
    try:
        src = np.ones(4096, np.uint8)      # never registered: Mooncake's TCP path would accept it
        with pytest.raises(RegistrationError, match="not inside a registered region"):
            pe.write(de.session_id, [Write(src.ctypes.data, dst.ctypes.data, 4096)])
        assert not dst.any()
        with pytest.raises(RegistrationError, match="overlaps"):
            de.register("again", dst.ctypes.data + 8, 16)
    finally:
        de.unregister(region)


def test_engine_turns_bad_remote_range_into_transfer_error(engines):
    pe, de = engines
    src, dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
    rs, rd = pe.register("src", src.ctypes.data, 4096), de.register("dst", dst.ctypes.data, 4096)
    try:
        pe.write(de.session_id, [Write(src.ctypes.data, dst.ctypes.data, 4096)])
        assert dst.all()
        with pytest.raises(TransferError, match="failed with code"):
            pe.write(de.session_id, [Write(src.ctypes.data, dst.ctypes.data + 100, 4096)])
    finally:
        pe.unregister(rs)
        de.unregister(rd)



def test_engine_write_waits_for_every_range_before_reporting_a_failure(engines):
    """One bad range among good ones: TransferError, and every good range has landed by
    then (nothing of the write is still in flight when the caller fences)."""
    pe, de = engines
    src = (np.arange(3 * 4096) % 251 + 1).astype(np.uint8)
    dst = np.zeros(3 * 4096, np.uint8)
    rs, rd = pe.register("src", src.ctypes.data, src.nbytes), de.register("dst", dst.ctypes.data, dst.nbytes)
    try:
        good = [Write(src.ctypes.data + k * 4096, dst.ctypes.data + k * 4096, 4096) for k in (0, 2)]
        bad = Write(src.ctypes.data + 4096, dst.ctypes.data + dst.nbytes - 100, 4096)
        with pytest.raises(TransferError, match="3 ranges"):
            pe.write(de.session_id, [good[0], bad, good[1]])
        assert np.array_equal(dst[:4096], src[:4096])
        assert np.array_equal(dst[8192:], src[8192:])
    finally:
        pe.unregister(rs)
        de.unregister(rd)

def test_requests_land_byte_exact_with_room_last(link):
    server, rank, specs = link
    started = []
    for slot, spec in enumerate(specs[:4]):
        pages = rank.pages(spec.n_pages)
        started.append((spec, pages, rank.transport.start(spec.room, slot, pages, server.endpoint)))
    for spec, pages, rec in started:
        assert rec.poll() == WAITING or rec.poll() == SUCCESS
        assert settle(rec) == SUCCESS
        assert int(rank.room[rec.slot, 0]) == spec.room
        assert int(rank.ids[rec.slot, 0]) == spec.first_token
        assert np.array_equal(rank.pool[list(pages)], kv_bytes(spec, 0, PAGE_BYTES))
    assert rank.transport.dropped == 0 and server.dropped == 0


def test_receiver_is_monotonic_and_latched(link):
    server, rank, specs = link
    rec = rank.transport.start(specs[0].room, 0, rank.pages(specs[0].n_pages), server.endpoint)
    assert isinstance(rec, KVReceiver)
    assert settle(rec) == SUCCESS
    assert not rec.deliver(WAITING)                     # latched: never backwards
    rec.observe()
    assert rec.poll() == SUCCESS and rec.failure_exception() is None
    rec.clear()                                         # left the queue: decided
    assert not rec.deliver(FAILED, "late failure")
    rec.observe()
    assert rec.poll() == SUCCESS and rec.failure_exception() is None


def test_a_late_failed_overrides_success_while_queued(link):
    server, rank, specs = link
    rec = rank.transport.start(specs[5].room, 5, rank.pages(specs[5].n_pages), server.endpoint)
    assert settle(rec) == SUCCESS
    assert rec.deliver(FAILED, "prefill died")          # still queued (the gate holds it)
    assert not rec.deliver(SUCCESS)
    seen = rec.observe()
    assert seen.failed and rec.poll() == FAILED and "prefill died" in str(rec.failure_exception())
    assert not rec.deliver(FAILED, "again")             # Failed latches for good


HOSTILE_STATUS = [
    [b"garbage"],
    [b"1", b"4"],
    [b"12x", b"4", b"0"],
    [b"1" * 40, b"4", b"0"],
    [b"0", b"4", b"0"],
    [b"99", b"4", b"0"],                  # unknown room
    [b"5", b"3", b"0"],                   # Transferring: not a status a prefill sends
    [b"-1", b"4", b"0"],
    [b"\xff\xfe", b"4", b"0"],
]


def test_hostile_status_frames_are_dropped_and_the_thread_survives(link, caplog):
    server, rank, specs = link
    spec = specs[1]
    # Hold Success back so the hostile frames race a live request.
    server.faults.stall_s = 0.3
    rec = rank.transport.start(spec.room, 1, rank.pages(spec.n_pages), server.endpoint)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(rank.transport.status_endpoint)
    malformed = HOSTILE_STATUS + [[str(spec.room).encode(), b"0", b"3"]]   # wrong prefill rank
    for f in malformed:                              # authenticated, so parsed, then dropped
        push.send_multipart(sealed(auth.STATUS, f))
    forged = [[str(spec.room).encode(), b"0", b"0"],                  # no tag at all
              [str(spec.room).encode(), b"0", b"0", b"\0" * 32],      # a wrong tag
              sealed(auth.STATUS, [str(spec.room).encode(), b"0", b"0"],
                     key=auth.rank_key(SECRET, 1)),                   # another rank's key
              sealed(auth.REPLY, [str(spec.room).encode(), b"0", b"0"])]   # another channel
    for f in forged:
        push.send_multipart(f)
    wait_for(lambda: rank.transport.dropped >= len(malformed)
             and rank.transport.rejected >= len(forged), what="frames to be dropped")
    push.close()
    assert rank.transport.dropped == len(malformed)
    assert rank.transport.rejected == len(forged)
    assert sum("dropped control frame" in r.getMessage() for r in caplog.records) == len(malformed)
    assert settle(rec) == SUCCESS, rec.failure_exception()     # no forged Failed got through
    assert int(rank.room[1, 0]) == spec.room


def test_hostile_prefill_frames_are_dropped_and_nothing_is_written(link):
    server, rank, specs = link
    rank.transport.connect(server.endpoint)
    spec = specs[2]
    dealer = zmq.Context.instance().socket(zmq.DEALER)      # never said HELLO
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.endpoint)
    malformed = [
        [fr.XFER, b"\x00" * 5],
        [fr.XFER, fr.Xfer(spec.room, 0, 0, (1, 2)).encode()[1]],           # rank 0 not this peer
        [fr.HELLO, b"{not json"],
        [fr.HELLO, b'{"rank": 0}'],
        [fr.ABORT, b"\x01"],
        [b"SHUTDOWN", b""],
        [fr.PING, b"\x00" * 3],
    ]
    for f in malformed:                                      # tagged by rank 0's key holder
        dealer.send_multipart(to_prefill(f))
    sock = rank.transport._links[server.endpoint].sock
    for x in (fr.Xfer(12345, 0, 0, (0,)),                                    # unknown room
              fr.Xfer(spec.room, 0, SLOTS + 3, tuple(range(spec.n_pages))),
              fr.Xfer(spec.room, 0, 0, (10**6,) * spec.n_pages)):
        rank.transport._send(sock, x.encode())
    wait_for(lambda: server.dropped >= len(malformed) + 3, what="prefill to drop the frames")
    dealer.close()
    assert server.rejected == 0
    assert not rank.pool.any() and not rank.room.any()
    assert server.kv_bytes_written == 0
    good = specs[3]
    rec = rank.transport.start(good.room, 2, rank.pages(good.n_pages), server.endpoint)
    assert settle(rec) == SUCCESS


def test_start_checks_indices_before_sending(link):
    server, rank, specs = link
    with pytest.raises(ValueError, match="slot"):
        rank.transport.start(specs[0].room, SLOTS, (0,), server.endpoint)
    with pytest.raises(ValueError, match="page indices"):
        rank.transport.start(specs[0].room, 0, (10**6,), server.endpoint)
    with pytest.raises(ValueError, match="room"):
        rank.transport.start(0, 0, (0,), server.endpoint)
    assert server.kv_bytes_written == 0


def test_abort_is_fenced_by_the_prefill(link):
    server, rank, specs = link
    server.faults.drop_metadata.add(0)
    spec = specs[4]
    rec = rank.transport.start(spec.room, 3, rank.pages(spec.n_pages), server.endpoint)
    assert settle(rec) == SUCCESS and int(rank.room[3, 0]) == 0      # Success, no row
    rank.transport.abort(spec.room)
    wait_for(lambda: rec.observe().fenced or rec.fenced, what="FENCED")


def test_dead_prefill_fails_waiting_requests_and_is_fenced_after_grace(engines):
    pe, de = engines
    specs = make_requests(2, seed=9, min_pages=2, max_pages=2)
    server = PrefillServer(pe, specs, ranks=1, page_bytes=PAGE_BYTES, secret=SECRET, faults=Faults(stall_s=1.0))
    rank = DecodeRank(de, heartbeat_s=0.05, heartbeat_misses=4, fence_grace_s=0.2, connect_timeout_s=0.5)
    try:
        rec = rank.transport.start(specs[0].room, 0, rank.pages(2), server.endpoint)
        server._stop.set()                     # the router stops answering heartbeats
        assert settle(rec) == FAILED
        assert "heartbeats" in str(rec.failure_exception())
        wait_for(lambda: rec.observe().fenced or rec.fenced, what="fence after the grace period")
        late = rank.transport.start(specs[1].room, 1, rank.pages(2), server.endpoint)
        assert late.poll() == WAITING             # enters the queue like any request...
        assert settle(late) == FAILED             # ...and fails at the next observation
    finally:
        rank.transport.close()
        server.close(close_engine=False)


def test_closed_prefill_connection_fails_requests_at_once(engines):
    pe, de = engines
    specs = make_requests(1, seed=10, min_pages=2, max_pages=2)
    server = PrefillServer(pe, specs, ranks=1, page_bytes=PAGE_BYTES, secret=SECRET, faults=Faults(stall_s=0.5))
    # heartbeats alone would take 100 s here: only the closed connection can fail it
    rank = DecodeRank(de, heartbeat_s=0.05, heartbeat_misses=2000, fence_grace_s=60)
    try:
        rec = rank.transport.start(specs[0].room, 0, rank.pages(2), server.endpoint)
        time.sleep(0.2)                        # the heartbeat socket is connected by now
        server._stop.set()                     # mid-stall: the router thread stops...
        time.sleep(0.15)
        server._router.close()                 # ...and its socket closes, as when killed
        assert settle(rec, timeout=5) == FAILED
        assert "closed its connection" in str(rec.failure_exception())
    finally:
        rank.transport.close()
        server.close(close_engine=False)


_FROZEN_PEER = """
import json, sys
import numpy as np
from impl.mooncake.engine import Engine
e = Engine()
buf = np.zeros(1 << 20, np.uint8)
e.register("dst", buf.ctypes.data, buf.nbytes)
print(json.dumps({"session": e.session_id, "addr": buf.ctypes.data}), flush=True)
sys.stdin.read()
"""


def test_engine_write_to_a_frozen_peer_fails_after_the_transfer_timeout(engines, tmp_path):
    """The sleeping wait is bounded like Mooncake's sync write: MC_TRANSFER_TIMEOUT (2 s
    in these tests), then TransferError, without burning a core meanwhile."""
    repo = str(Path(__file__).resolve().parents[2])
    peer = subprocess.Popen([sys.executable, "-c", _FROZEN_PEER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, cwd=repo,
                            env=dict(os.environ, PYTHONPATH=repo))
    pe, _ = engines
    src = np.ones(1 << 20, np.uint8)
    region = pe.register("src-frozen", src.ctypes.data, src.nbytes)
    try:
        ready = peer.stdout.readline()
        assert ready, "peer did not start"
        info = json.loads(ready)
        pe.write(info["session"], [Write(src.ctypes.data, info["addr"], 4096)])   # handshake
        peer.send_signal(signal.SIGSTOP)
        t0, cpu0 = time.monotonic(), time.thread_time()
        with pytest.raises(TransferError, match="still pending"):
            pe.write(info["session"], [Write(src.ctypes.data, info["addr"], 1 << 20)])
        waited, cpu = time.monotonic() - t0, time.thread_time() - cpu0
        assert transfer_timeout_s() - 0.1 <= waited < transfer_timeout_s() + 2.0, waited
        assert cpu < 0.5 * waited, (cpu, waited)
    finally:
        peer.send_signal(signal.SIGCONT)
        peer.kill()
        peer.wait(timeout=10)
        pe.unregister(region)


class _SlowHello(PrefillServer):
    """A prefill whose first HELLO takes ``delay`` seconds (a big workload's rows)."""
    delay = 1.0

    def _register(self, hello):
        time.sleep(self.delay)
        return super()._register(hello)


def test_a_slow_hello_reply_is_waited_for_not_taken_for_a_dead_prefill(engines):
    """HELLO_OK slower than connect_timeout_s: the prefill accepted the connection, so
    the rank waits its liveness window (heartbeats) and the request commits."""
    pe, de = engines
    specs = make_requests(1, seed=11, min_pages=2, max_pages=2)
    server = _SlowHello(pe, specs, ranks=1, page_bytes=PAGE_BYTES, secret=SECRET)
    rank = DecodeRank(de, heartbeat_s=0.05, heartbeat_misses=60, connect_timeout_s=0.2)
    try:
        rec = rank.transport.start(specs[0].room, 0, rank.pages(2), server.endpoint)
        assert settle(rec) == SUCCESS
    finally:
        rank.transport.close()
        server.close(close_engine=False)


def test_no_listener_fails_at_once_and_a_silent_one_after_the_window(engines):
    """The sibling: nothing listening fails within connect_timeout_s; a prefill that
    accepts but never answers fails after the liveness window, not before."""
    from impl.mooncake.cluster import free_port
    pe, de = engines
    specs = make_requests(2, seed=12, min_pages=2, max_pages=2)
    rank = DecodeRank(de, heartbeat_s=0.05, heartbeat_misses=20, connect_timeout_s=0.3)
    server = PrefillServer(pe, specs, ranks=1, page_bytes=PAGE_BYTES, secret=SECRET)
    server._stop.set()                          # the router accepts but answers nothing
    try:
        t0 = time.monotonic()
        rec = rank.transport.start(specs[0].room, 0, rank.pages(2), f"tcp://127.0.0.1:{free_port()}")
        assert settle(rec) == FAILED and time.monotonic() - t0 < 2.0
        assert "accepted no connection" in str(rec.failure_exception())
        t0 = time.monotonic()
        rec = rank.transport.start(specs[1].room, 1, rank.pages(2), server.endpoint)
        waited = time.monotonic() - t0
        assert settle(rec) == FAILED and 1.0 - 0.05 <= waited < 5.0, waited
        assert "did not answer HELLO" in str(rec.failure_exception())
    finally:
        rank.transport.close()
        server.close(close_engine=False)


def test_slow_pongs_widen_the_liveness_window_which_narrows_again_slowly(engines):
    """The liveness window is the larger of ``heartbeat_misses`` heartbeats and
    RTT_FACTOR times the slowest recent PONG: one PONG a second late makes the rank wait
    about 8 s, not 0.2 s, before taking a slow (loaded) prefill for a dead one; fast
    PONGs bring it back down by RTT_DECAY each, not at once."""
    from impl.mooncake.decode import RTT_DECAY, RTT_FACTOR, PrefillLink, _Watch
    rank = DecodeRank(engines[1], heartbeat_s=0.05, heartbeat_misses=4)
    t = rank.transport
    link = PrefillLink("tcp://127.0.0.1:1", 0, "s", None, None)    # not one the I/O thread runs
    watch = _Watch(link, None, None)

    def pong(seq: int, rtt: float) -> None:
        link.pings[seq] = time.monotonic() - rtt
        t._on_pong(watch, sealed(auth.REPLY, fr.encode_ping(0, seq, fr.PONG)))
    try:
        assert t.silence_limit(link) == pytest.approx(0.2)
        pong(1, 1.0)
        assert RTT_FACTOR * 1.0 <= t.silence_limit(link) < RTT_FACTOR * 1.05
        pong(2, 0.001)                               # a fast one: the slow one still counts
        assert RTT_FACTOR * RTT_DECAY <= t.silence_limit(link) < RTT_FACTOR * 1.05 * RTT_DECAY
        for seq in range(3, 1000):
            pong(seq, 0.001)
        assert t.silence_limit(link) == pytest.approx(0.2)
        assert not link.pings and t.dropped == 0 and t.rejected == 0
    finally:
        t.close()


def test_a_stalled_io_thread_does_not_take_its_own_silence_for_the_prefills(engines, monkeypatch):
    """The rank's own I/O thread stops (CPU starvation) for three liveness windows right
    after a heartbeat was answered, so no PONG waits for it on waking: it credits the
    stall (``_credit_stall``) and PINGs again, instead of failing a live prefill's request.
    Deterministic, unlike a SIGSTOP of a whole rank, where a slow PONG can widen the
    window past the freeze (tests/mooncake/test_mooncake_liveness.py)."""
    from impl.mooncake.prefill import Faults
    pe, de = engines
    specs = make_requests(1, seed=11, min_pages=2, max_pages=2)
    server = PrefillServer(pe, specs, ranks=1, page_bytes=PAGE_BYTES, secret=SECRET, faults=Faults(stall_s=2.0))
    rank = DecodeRank(de, heartbeat_s=0.05, heartbeat_misses=4)
    t, stall, stalled = rank.transport, {}, []
    real_poll = zmq.Poller.poll

    def poll(self, timeout=None):
        ready = real_poll(self, timeout)
        seconds = stall.pop("s", None) if threading.current_thread() is t._thread and not ready else None
        if seconds is None:
            return ready
        time.sleep(seconds)                   # this thread does not run; the prefill is fine
        stalled.append(seconds)
        return real_poll(self, 0)             # what came meanwhile

    monkeypatch.setattr(zmq.Poller, "poll", poll)
    try:
        rec = t.start(specs[0].room, 0, rank.pages(2), server.endpoint)
        wait_for(lambda: server.endpoint in t._links and t._links[server.endpoint].slowest_rtt > 0, what="a PONG")
        link = t._links[server.endpoint]
        window = t.silence_limit(link)
        assert window < 1.0, window           # three windows stay inside the prefill's 2 s stall
        stall["s"] = 3 * window
        wait_for(lambda: stalled, what="the stall")
        wait_for(lambda: link.last_pong > time.monotonic() - window, what="a PONG after the stall")
        assert link.alive and not t._unreachable, t._unreachable
        assert settle(rec, timeout=10) == SUCCESS
    finally:
        monkeypatch.undo()
        rank.transport.close()
        server.close(close_engine=False)
