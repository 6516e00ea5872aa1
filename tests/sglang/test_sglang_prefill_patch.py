"""strict's prefill side (impl/sglang/prefill_patch.py) on SGLang 0.5.23's own Mooncake
sender, loaded from its wheel through the stub layer: the release writes the metadata
room in the same batch as the rest of the row (and, over TCP, before the KV checksum);
patched, the room is written last and only after the rest returned 0."""
from __future__ import annotations

import importlib
import types

import pytest
import torch

from impl.sglang import prefill_patch, stubs
from impl.sglang.wheels import open_wheel

CONN = "sglang.srt.disaggregation.mooncake.conn"


@pytest.fixture(scope="module")
def loaded():
    """The release's modules, loaded once (its sender registers process-wide metrics)."""
    wheel = open_wheel("0.5.23", None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stubs, "REAL", (*stubs.REAL, CONN))
        stubs.install(wheel.source_of, {})
        conn = importlib.import_module(CONN)
        utils = importlib.import_module("sglang.srt.disaggregation.utils")
    yield conn, utils, wheel
    stubs.purge()


@pytest.fixture
def release(loaded, monkeypatch):
    """Per test: a fresh subclass of MetadataBuffers, so each patch starts unpatched."""
    conn, utils, wheel = loaded
    monkeypatch.setattr(prefill_patch, "_ROOM_SPANS", [])
    own = types.SimpleNamespace(MetadataBuffers=type("Buffers", (utils.MetadataBuffers,), {}))
    return conn, own, wheel


def _manager(conn, utils, fail_first: bool = False, patched: bool = False):
    """The release's MooncakeKVManager with its engine calls recorded, and the release's
    own MetadataBuffers (with the KV checksum buffer, after the room as 0.5.23 lists it)."""
    calls: list = []

    class Recorded(conn.MooncakeKVManager):
        def __init__(self):            # no engine: only what send_aux reads
            self.enable_custom_mem_pool, self.custom_mem_pool_type = False, None

        def _transfer_data(self, session, blocks):
            calls.append(("batch", [b[0] for b in blocks]))
            return -1 if fail_first and len(calls) == 1 else 0

        def send_aux_data_to_endpoint(self, **kw):
            calls.append(("message", kw["buffer_index"]))
    if patched:
        prefill_patch.install_prefill(utils, types.SimpleNamespace(MooncakeKVManager=Recorded))
    buffers = utils.MetadataBuffers(4, 8, torch.float32, 4, kv_checksum_enabled=True)
    ptrs, _, item_lens = buffers.get_buf_infos()
    m = Recorded()
    m.kv_args = types.SimpleNamespace(aux_data_ptrs=ptrs, aux_item_lens=item_lens)
    room = ptrs.index(buffers.bootstrap_room.data_ptr())
    return m, calls, Recorded, room, len(ptrs)


def _send(m, tcp: bool):
    req = types.SimpleNamespace(mooncake_session_id="s", dst_aux_index=1, endpoint="127.0.0.1",
                                dst_port=1, room=5)
    dst = list(range(10_000, 10_000 + len(m.kv_args.aux_data_ptrs)))
    return (m.send_aux_tcp if tcp else m.send_aux)(req, 2, dst)


def test_the_release_writes_the_room_with_the_row(release):
    conn, utils, _ = release
    m, calls, _, room, n = _manager(conn, utils)
    assert room < n - 1                     # 0.5.23: the checksum buffer comes after the room
    _send(m, tcp=False)
    assert len(calls) == 1 and len(calls[0][1]) == n      # one batch: the engine's order
    _send(m, tcp=True)
    assert [c[1] for c in calls[1:]] == list(range(n))    # room before the checksum


def test_patched_the_room_is_the_last_write(release):
    conn, utils, _ = release
    m, calls, _, room, n = _manager(conn, utils, patched=True)
    assert _send(m, tcp=False) == 0
    room_addr = m.kv_args.aux_data_ptrs[room] + m.kv_args.aux_item_lens[room] * 2
    assert calls[0][0] == "batch" and room_addr not in calls[0][1] and len(calls[0][1]) == n - 1
    assert calls[1] == ("batch", [room_addr])
    assert _send(m, tcp=True) == 0
    assert [c[1] for c in calls[2:]] == [i for i in range(n) if i != room] + [room]


def test_patched_a_failed_row_never_shows_its_room(release):
    conn, utils, _ = release
    m, calls, _, _, n = _manager(conn, utils, fail_first=True, patched=True)
    assert _send(m, tcp=False) == -1
    assert len(calls) == 1 and len(calls[0][1]) == n - 1      # the room was not written


def test_the_release_fences_its_aborts(release):
    *_, wheel = release
    source = wheel.source_of(CONN)[0]
    assert prefill_patch.release_fences(source) == []
    unfenced = source.replace("self.poison_deferred_ack_room(room)", "pass")
    assert prefill_patch.release_fences(unfenced)          # the check can say no
