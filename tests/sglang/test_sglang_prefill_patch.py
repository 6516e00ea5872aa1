"""strict's prefill side (impl/sglang/prefill_patch.py) on SGLang 0.5.23's own Mooncake
sender, loaded from its wheel through the stub layer: the release writes the metadata
room in the same batch as the rest of the row (and, over TCP, before the KV checksum);
patched, the room is written last and only after the rest returned 0. The abort fence:
the release never acknowledges a failed send (its decode frees the slot at its
timeout); patched, a failed room's ACK goes out once its writes settled (at once where
they had), waits while one may still be writing, and never comes where one never
settles."""
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
    if patched:            # the room order alone (settle_writes replaces _transfer_data)
        prefill_patch.note_rooms(utils)
        prefill_patch.room_last(types.SimpleNamespace(MooncakeKVManager=Recorded))
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
    # a sender without transfer_worker: its def line is not the drained abort's ack
    renamed = source.replace("def transfer_worker(", "def other_worker(")
    assert "transfer_worker acking a drained abort (_maybe_ack_drained_abort)" in prefill_patch.release_fences(renamed)


# --- the abort fence: a failed room's ACK waits until its writes settled -------------

ACK_METHODS = ("_maybe_ack_drained_abort", "register_deferred_ack_target",
               "poison_deferred_ack_room", "_send_abort_acks")


def _common_methods(wheel) -> dict:
    """0.5.23's own drain-ack methods of ``CommonKVManager`` (common/conn.py, which needs
    msgspec and zmq to import: its methods are compiled from the wheel's text alone)."""
    import ast
    tree = ast.parse(wheel.source_of("sglang.srt.disaggregation.common.conn")[0])
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CommonKVManager")
    body = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in ACK_METHODS]
    ns: dict = {}
    future = ast.parse("from __future__ import annotations").body
    exec(compile(ast.Module(body=[*future, *body], type_ignores=[]), "<common/conn.py>",
                 "exec"), ns)
    return {name: ns[name] for name in ACK_METHODS}


class _Engine:
    """Mooncake's TransferEngine as strict's sender uses it: one transfer per block, a
    status each (1 completed, -1 failed, 0 running, -2 timed out while still writing)."""

    def __init__(self, status: int):
        self.status, self.submitted, self.checked = status, [], []

    def transfer_submit_write(self, session, src, dst, length):
        self.submitted.append((session, src, dst, length))
        return 1000 + len(self.submitted)

    def transfer_check_status(self, batch):
        self.checked.append(batch)
        return self.status


def _sender(loaded, status: int, patched: bool):
    conn, _, wheel = loaded
    sent: list = []

    class Sender(conn.MooncakeKVManager):
        def __init__(self):
            self.engine = types.SimpleNamespace(engine=_Engine(status))
            self.enable_deferred_decode_kv_release = True
            self.transfer_infos = {5: {"ep": types.SimpleNamespace(mooncake_session_id="s")}}
            self._staging_outstanding, self._deferred_ack_targets = {}, {}
            self._deferred_ack_poisoned_rooms = set()

        def _send_abort_ack(self, room, target):
            sent.append(room)
    for name, fn in _common_methods(wheel).items():
        setattr(Sender, name, fn)
    if patched:
        prefill_patch.settle_writes(types.SimpleNamespace(MooncakeKVManager=Sender))
    return Sender(), sent


def _fail_and_abort(m) -> None:
    """What 0.5.23's transfer worker and bootstrap thread do after a failed send: poison
    (or not), report Failed; the decode's ABORT registers its ack target."""
    m._poison_unsettled_send(5)
    m.register_deferred_ack_target(5, types.SimpleNamespace(ip="d", port=1, generation=0))
    m._maybe_ack_drained_abort(5)


def _wait(cond, seconds=5.0) -> bool:
    import time
    end = time.monotonic() + seconds
    while time.monotonic() < end and not cond():
        time.sleep(0.01)
    return cond()


def test_the_release_never_acks_a_failed_send(loaded):
    m, sent = _sender(loaded, -1, patched=False)
    _fail_and_abort(m)
    assert sent == [] and 5 in m._deferred_ack_poisoned_rooms     # the decode's 30 s decide


def test_patched_a_failed_write_that_settled_is_acked_at_once(loaded):
    m, sent = _sender(loaded, -1, patched=True)
    assert m._transfer_data("s", [(1, 2, 3), (4, 5, 6)]) == -1
    assert len(m.engine.engine.submitted) == 2                   # one transfer per block
    _fail_and_abort(m)
    assert sent == [5] and not m._deferred_ack_poisoned_rooms


def test_patched_a_completed_write_returns_0(loaded):
    m, _ = _sender(loaded, 1, patched=True)
    assert m._transfer_data("s", [(1, 2, 3)]) == 0


def test_patched_a_write_still_running_holds_the_ack_until_it_settles(loaded, monkeypatch):
    m, sent = _sender(loaded, -2, patched=True)       # the engine timed out, still writing
    assert m._transfer_data("s", [(1, 2, 3)]) == -1   # the failure is reported at once
    _fail_and_abort(m)
    assert sent == [] and not m._deferred_ack_poisoned_rooms    # the ACK waits
    m.engine.engine.status = -1                       # the write settled (it failed)
    assert _wait(lambda: sent == [5])


def test_patched_a_write_that_never_settles_poisons_the_room(loaded, monkeypatch):
    monkeypatch.setattr(prefill_patch, "SETTLE_S", 0.2)
    m, sent = _sender(loaded, -2, patched=True)
    m._transfer_data("s", [(1, 2, 3)])
    _fail_and_abort(m)
    assert _wait(lambda: 5 in m._deferred_ack_poisoned_rooms) and sent == []
