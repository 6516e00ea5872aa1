"""The transfer digest: the prefill's digest of what it wrote rides in the authenticated
Success, and the rank's Landing checks its pages and row against it before the gate
can see that Success. The exact bytes pass; one flipped byte anywhere, or a missing,
truncated or garbage digest, does not."""
from __future__ import annotations

import json
import os

import pytest
import torch
import zmq

from impl.decode import MetadataBuffers
from impl.mooncake import auth
from impl.mooncake import frames as fr
from impl.mooncake.decode import BufferSpec, DecodeTransport
from impl.mooncake.digest import DIGEST_BYTES, SCHEME, digest_key, transfer_digest
from impl.mooncake.landing import FOREIGN_WRITE, DigestCheck, Landing, Tracked
from impl.mooncake.prefill import PrefillServer
from impl.mooncake.receiver import FAILED, SUCCESS
from impl.mooncake.synth import make_requests
from model.spec.events import Fail, KvDone
from tests.mooncake.conftest import PAGE_BYTES, SECRET
from tests.mooncake.test_mooncake_transport import sealed, wait_for

PAGES, SLOTS = 64, 8
KEY0 = auth.rank_key(SECRET, 0)


class TorchRank:
    """Rank 0 as impl.mooncake.rank builds it: torch pool, landing and visible rows."""

    def __init__(self, engine, digests: bool = True):
        self.pool = torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8)
        self.landing, self.visible = MetadataBuffers(SLOTS), MetadataBuffers(SLOTS)
        info = self.landing.buf_infos()
        self.transport = DecodeTransport(
            0, engine, BufferSpec("kv", self.pool.data_ptr(), PAGE_BYTES, PAGES),
            [BufferSpec(n, p, item, total // item)
             for n, p, total, item in zip(info.names, info.ptrs, info.data_lens, info.item_lens)],
            heartbeat_s=0.05, heartbeat_misses=40, digests=digests, key=KEY0)
        self.lan = Landing(0, self.landing, self.visible,
                           DigestCheck(digest_key(KEY0), self.pool, tuple(info.names)))
        self.next_page = 0

    def start(self, spec, slot: int, endpoint: str) -> Tracked:
        pages = tuple(range(self.next_page, self.next_page + spec.n_pages))
        self.next_page += spec.n_pages
        rec = self.transport.start(spec.room, slot, pages, endpoint)
        t = Tracked(spec, rec, slot, pages)
        self.lan.track(t)
        return t

    def written(self, t: Tracked) -> bool:
        """The prefill's Success came in and its row is in the landing buffer."""
        return t.receiver.success_at is not None and self.landing.read_room(t.slot) == t.spec.room

    def events(self, t: Tracked) -> list:
        return [e for e in self.lan.observe(1.0) if e.req == t.spec.index and
                isinstance(e, (KvDone, Fail))]


@pytest.fixture
def served(engines):
    pe, de = engines
    specs = make_requests(SLOTS, seed=11, min_pages=2, max_pages=4)
    server = PrefillServer(pe, specs, ranks=1, page_bytes=PAGE_BYTES, secret=SECRET)
    ranks: list[TorchRank] = []

    def rank(digests: bool = True) -> TorchRank:
        ranks.append(TorchRank(de, digests))
        return ranks[-1]
    yield server, rank, specs
    for r in ranks:
        r.transport.close()
    server.close(close_engine=False)


def _flip_page(r: TorchRank, t: Tracked, which: int) -> None:
    r.pool[t.pages[which], PAGE_BYTES // 2] ^= 0x01


def _flip_row(r: TorchRank, t: Tracked, name: str) -> None:
    r.landing.fields[name][t.slot].view(torch.uint8)[-1] ^= 0x01


TAMPER = [("first page", lambda r, t: _flip_page(r, t, 0)),
          ("last page", lambda r, t: _flip_page(r, t, -1)),
          ("output_ids row", lambda r, t: _flip_row(r, t, "output_ids")),
          ("hidden states row", lambda r, t: _flip_row(r, t, "output_hidden_states")),
          ("room row, upper byte", lambda r, t: _flip_row(r, t, "bootstrap_room"))]


def test_the_exact_bytes_pass_and_one_flipped_byte_anywhere_fails(served):
    server, rank, specs = served
    r = rank()
    cases = [("untouched", None)] + TAMPER
    tracked = [r.start(specs[i], i, server.endpoint) for i in range(len(cases))]
    for t in tracked:
        wait_for(lambda: r.written(t), what=f"room {t.spec.room} written")
    for (_, tamper), t in zip(cases, tracked):
        if tamper is not None:
            tamper(r, t)
    events = r.lan.observe(1.0)                 # one step boundary sees all of them
    for (what, tamper), t in zip(cases, tracked):
        seen = [e for e in events if e.req == t.spec.index and isinstance(e, (KvDone, Fail))]
        if tamper is None:
            assert seen == [KvDone(0, t.spec.index)] and t.receiver.poll() == SUCCESS, what
        else:
            assert seen == [Fail(0, t.spec.index)] and t.receiver.poll() == FAILED, what
            assert t.receiver.failure_exception().reason == FOREIGN_WRITE, what
    assert r.lan.foreign_writes == len(TAMPER)
    assert r.transport.dropped == 0 and server.dropped == 0


def test_a_write_after_the_success_is_seen_but_before_the_row_lands_is_caught(served):
    """Success first, row later (async visibility): the Success is visible, the gate
    holds, and the check runs when the row lands: a late Failed, honoured while queued."""
    server, rank, specs = served
    r = rank()
    server.faults.metadata_delay_s[0] = 0.4
    t = r.start(specs[0], 0, server.endpoint)
    wait_for(lambda: t.receiver.success_at is not None, what="Success")
    assert r.events(t) == [KvDone(0, t.spec.index)]           # the row is not there yet
    _flip_page(r, t, 0)                                       # someone writes the pool now
    wait_for(lambda: r.written(t), what="the delayed row")
    assert r.events(t) == [Fail(0, t.spec.index)] and r.lan.foreign_writes == 1
    assert t.receiver.poll() == FAILED


def test_without_a_negotiated_digest_nothing_is_checked(served):
    """A rank that does not ask (an older peer) gets three-part Successes: compatible."""
    server, rank, specs = served
    r = rank(digests=False)
    t = r.start(specs[0], 0, server.endpoint)
    wait_for(lambda: r.written(t), what="room written")
    _flip_page(r, t, 0)
    assert r.events(t) == [KvDone(0, t.spec.index)] and r.lan.foreign_writes == 0


def _push(r: TorchRank, parts: list[bytes]) -> None:
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(r.transport.status_endpoint)
    push.send_multipart(sealed(auth.STATUS, parts))
    push.close(linger=1000)


@pytest.mark.parametrize("digest, dropped, outcome", [
    (None, 1, "without the agreed digest"),      # missing
    (b"\x07" * (DIGEST_BYTES - 1), 1, None),     # truncated: malformed, dropped
    (b"\x07" * (DIGEST_BYTES + 1), 1, None),     # too long: malformed, dropped
    (os.urandom(DIGEST_BYTES), 0, FOREIGN_WRITE),  # garbage of the right size: no match
])
def test_a_missing_truncated_or_garbage_digest_never_passes(served, digest, dropped, outcome):
    """Frames from the key holder (a buggy prefill), racing the real Success held back."""
    server, rank, specs = served
    r = rank()
    server.faults.stall_s = 0.5
    t = r.start(specs[0], 0, server.endpoint)
    room = str(t.spec.room).encode()
    _push(r, [room, b"4", b"0"] + ([] if digest is None else [digest]))
    wait_for(lambda: r.transport.dropped == dropped and (
        dropped or t.receiver.success_at is not None), what="the forged Success handled")
    wait_for(lambda: r.landing.read_room(t.slot) == t.spec.room, what="the real row")
    wait_for(lambda: (r.lan.observe(1.0), t.receiver.poll())[1] in (SUCCESS, FAILED),
             what="a decision")
    if outcome is None:           # dropped, and the real Success (with its digest) passes
        assert t.receiver.poll() == SUCCESS and r.lan.foreign_writes == 0
    else:
        assert t.receiver.poll() == FAILED
        assert outcome in t.receiver.failure_exception().reason
    assert r.transport.dropped == dropped


def test_digest_frames_and_negotiation_decode_or_fail_in_one_line():
    d = bytes(range(DIGEST_BYTES))
    st = fr.Status(5, fr.STATUS_SUCCESS, 0, d)
    assert fr.decode_status(st.encode()) == st and len(st.encode()) == 4
    assert fr.decode_status(fr.Status(5, fr.STATUS_SUCCESS, 0).encode()).digest is None
    for bad in ([b"5", b"4", b"0", d[:-1]], [b"5", b"4", b"0", d + b"x"], [b"5", b"4", b"0", b""],
                [b"5", b"0", b"0", d], [b"5", b"5", b"0", d], [b"5", b"4", b"0", d, d]):
        with pytest.raises(fr.FrameError) as exc:
            fr.decode_status(bad)
        assert "\n" not in str(exc.value)
    assert fr.decode_hello_ok(fr.encode_hello_ok(1, "h:2", SCHEME)[1]) == (1, "h:2", SCHEME)
    with pytest.raises(fr.FrameError, match="digest scheme"):
        fr.decode_hello_ok(b'{"prefill_rank": 0, "session": "h:1", "digest": "crc32"}')
    with pytest.raises(fr.FrameError, match="digest scheme"):
        fr.decode_hello_ok(b'{"prefill_rank": 0, "session": "h:1", "digest": [1]}')
    hello = fr.Hello(0, "h:1", "tcp://h:2", 4096, 4096, 4,
                     (fr.FieldLayout("bootstrap_room", 8, 64, 2),), digest=SCHEME)
    assert fr.decode_hello(hello.encode()[1]) == hello
    for bad in ("blake2b-256", "", 7, None):
        body = json.loads(hello.encode()[1])
        body["digest"] = bad
        if bad is None:                    # an older rank: no digest asked for
            assert fr.decode_hello(json.dumps(body).encode()).digest is None
            continue
        with pytest.raises(fr.FrameError, match="digest scheme"):
            fr.decode_hello(json.dumps(body).encode())


def test_the_digest_covers_every_byte_once_in_any_chunking():
    key, page = digest_key(KEY0), bytes(range(256)) * 4
    rows = [("a", b"\1" * 64), ("b", b"\2" * 64)]
    whole = transfer_digest(key, 9, 1024, [page * 2], 2, rows)
    assert transfer_digest(key, 9, 1024, [page, page], 2, rows) == whole
    assert transfer_digest(key, 10, 1024, [page * 2], 2, rows) != whole           # another room
    assert transfer_digest(digest_key(auth.rank_key(SECRET, 1)), 9, 1024, [page * 2], 2,
                           rows) != whole                                         # another rank
    assert transfer_digest(key, 9, 1024, [page * 2], 2, rows[::-1]) != whole      # rows swapped
    assert transfer_digest(key, 9, 1024, [page * 2], 2, [("a", b"\1" * 63 + b"\2"), ("b",
                           b"\2" * 64)]) != whole
    with pytest.raises(ValueError, match="KV bytes"):
        transfer_digest(key, 9, 1024, [page], 2, rows)                            # a short read


# -- the whole deployment, without a namespace: a keyless engine writes a rank's pool --
E2E_WORKLOAD = ["--seed", "5", "--page-bytes", "4096", "--min-pages", "1", "--max-pages", "3"]
E2E_RANKS = ["--pages", "128", "--slots", "16", "--inflight", "4", "--step-ms", "2",
             "--collective-timeout-s", "10"]
E2E_REQUESTS = 12


def _run(tmp_path, during=None) -> dict:
    from impl.e2e import E2EConfig, run_e2e, timeout_steps_for
    # Rank 0 gets its rows 0.6 s after its Success (as async NVLink/RDMA allow): a
    # window, well inside strict's timeout, in which its KV pages are written and not
    # yet checked, so the attacker below is on time without racing the rank.
    cfg = E2EConfig(2, E2E_REQUESTS, "strict", [(0, 0.6)], E2E_WORKLOAD, E2E_RANKS,
                    timeout_steps_for("strict", 2.0, None), 16, timeout_s=90,
                    work_dir=str(tmp_path / "work"), during=during, netns=False)
    return run_e2e(cfg)


def test_a_keyless_overwrite_of_a_rank_pool_aborts_that_request_on_every_rank(tmp_path, engines):
    from impl.e2e import run_ok
    engine = engines[0]
    buf = torch.zeros(4096, dtype=torch.uint8)
    region = engine.register("attacker", buf.data_ptr(), buf.nbytes)
    attack: dict = {}

    def overwrite(cluster, prefill):
        """Wait for the prefill's write of request 0's first page (rank 0's page 0), then
        put 0xEE over it, through Mooncake, with no key."""
        te, session = engine._te, cluster.ready[0]["session"]
        addr = te.get_first_buffer_address(session)           # the KV pool
        import time
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            attack["read"] = te.transfer_sync_read(session, buf.data_ptr(), addr, 4096)
            if attack["read"] != 0 or buf.any():
                break
        buf.fill_(0xEE)
        attack["write"] = te.transfer_sync_write(session, buf.data_ptr(), addr, 4096)
    try:
        out = _run(tmp_path, overwrite)
    finally:
        engine.unregister(region)
    assert attack == {"read": 0, "write": 0}, attack           # the write went through
    assert out["foreign_writes"] == 1 and out["aborted"] == 1, out
    assert out["committed"] == E2E_REQUESTS - 1 and out["byte_exact"], out
    assert out["disagree"] == 0 and out["lost"] == 0, out
    assert any(reason.startswith("foreign write") for reason in out["abort_reasons"]), out
    assert out["disturbed"] and not run_ok(out)


def test_the_same_run_untouched_commits_everything(tmp_path):
    from impl.e2e import run_ok
    out = _run(tmp_path)
    assert out["foreign_writes"] == 0 and out["committed"] == E2E_REQUESTS, out
    assert out["byte_exact"] and run_ok(out), out
