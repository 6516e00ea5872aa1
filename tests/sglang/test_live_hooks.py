"""The decode ranks' hooks of ``pdgate live`` (impl/sglang/live_site/live_hooks.py) on a
minimal stand-in for SGLang's decode module (its queue calls the module's
``poll_and_all_reduce``, which gates through ``utils._apply_metadata_gate``, as 0.5.23's
does): what the rank logs, the late-room fault, health checks kept out; and the log
turned into a trace the spec replays, while the same queue without its gate is refused."""
from __future__ import annotations

import importlib
import io
import json
import sys
import time
import types

import pytest
import torch

from impl.sglang.live_trace import trace_from_logs
from model.spec.validate import validate

SITE = "impl/sglang/live_site"


class _Buffers:
    def __init__(self):
        self.bootstrap_room = torch.zeros((4, 1), dtype=torch.int64)
        self.output_ids = torch.zeros((4, 16), dtype=torch.int32)


class _Allocator:
    """SGLang's ReqToMetadataIdxAllocator: a FIFO of free slots."""

    def __init__(self, size=4):
        self.size, self.free_slots = size, list(range(size))

    def alloc(self):
        return self.free_slots.pop(0)

    def free(self, idx):
        self.free_slots.append(idx)


class _Receiver:
    def __init__(self, value):
        self.value = value

    def poll(self):
        return self.value


class _Req:
    def __init__(self, rid, room):
        self.rid, self.bootstrap_room, self.output_ids, self.finished_reason = rid, room, [], None


class _DecodeReq:
    def __init__(self, req, slot, value):
        self.req, self.metadata_buffer_index, self.kv_receiver = req, slot, _Receiver(value)


def _modules(gate: bool, arrive=None):
    """``arrive(buffers)``, if given, runs as the gate starts: a write that lands between
    the receiver's poll and the gate's read."""
    utils = types.ModuleType("fake_utils")

    def apply_gate(polls, decode_reqs, buffers):
        if arrive is not None:
            arrive(buffers)
        for i, p in enumerate(polls):
            if gate and p == 4 and int(buffers.bootstrap_room[decode_reqs[i].metadata_buffer_index, 0]) == 0:
                polls[i] = 3

    def poll_and_all_reduce(pollers, group, decode_reqs=None, metadata_buffers=None):
        polls = [int(p.poll()) for p in pollers]
        utils._apply_metadata_gate(polls, decode_reqs, metadata_buffers)
        return polls                    # one rank: the MIN is its own vector
    utils._apply_metadata_gate, utils.poll_and_all_reduce = apply_gate, poll_and_all_reduce
    utils._is_fake_transfer = lambda req: req.rid.startswith("HEALTH_CHECK")
    decode = types.ModuleType("fake_decode")
    decode.poll_and_all_reduce = lambda *a, **k: utils.poll_and_all_reduce(*a, **k)

    class Queue:
        def __init__(self):
            self.queue, self.tp_rank, self.metadata_buffers = [], 0, _Buffers()
            self.req_to_metadata_buffer_idx_allocator = _Allocator()

        def add(self, d):
            self.queue.append(d)

        def extend(self, ds):
            self.queue.extend(ds)

        def pop_transferred(self):
            if not self.queue:
                return []
            polls = decode.poll_and_all_reduce([d.kv_receiver for d in self.queue], None,
                                               decode_reqs=self.queue,
                                               metadata_buffers=self.metadata_buffers)
            keep = []
            for d, p in zip(self.queue, polls):
                if p == 4:
                    d.req.output_ids.append(int(self.metadata_buffers.output_ids[
                        d.metadata_buffer_index, 0]))            # what its commit read
                elif p == 0:
                    d.req.finished_reason = None
                else:
                    keep.append(d)
                if p in (0, 4):
                    self.metadata_buffers.bootstrap_room[d.metadata_buffer_index, 0] = 0
                    self.req_to_metadata_buffer_idx_allocator.free(d.metadata_buffer_index)
            self.queue = keep
    decode.DecodeTransferQueue = Queue
    return decode, utils


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(SITE)
    monkeypatch.setenv("PDGATE_LIVE_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("PDGATE_LIVE_LATE_ROOM", "0:50")
    sys.modules.pop("live_hooks", None)
    module = importlib.import_module("live_hooks")
    yield module, tmp_path
    sys.modules.pop("live_hooks", None)


def _log(folder) -> list[dict]:
    return [json.loads(x) for x in (folder / "rank0.jsonl").read_text().splitlines()]


def _run(hooks, gate: bool) -> list[dict]:
    live_hooks, folder = hooks
    decode, utils = _modules(gate)
    live_hooks.wrap(decode, utils)
    q = decode.DecodeTransferQueue()
    d = _DecodeReq(_Req("a", 77), 1, 2)
    q.extend([d])                                      # how 0.5.23's scheduler queues
    q.extend([_DecodeReq(_Req("HEALTH_CHECK_x", 0), 2, 4)])      # a fake transfer
    q.pop_transferred()
    d.kv_receiver.value = 4
    q.metadata_buffers.output_ids[1, 0] = 77 % 100
    q.metadata_buffers.bootstrap_room[1, 0] = 77       # the room lands with the KV ...
    q.pop_transferred()                               # ... and the fault hides it for 50 ms
    time.sleep(0.2)
    q.pop_transferred()
    return _log(folder)


def test_the_rank_log_of_a_late_room(hooks):
    log = _run(hooks, gate=True)
    steps = [r["rec"] for r in log if r["k"] == "step"]
    assert [s["queue"] for s in steps] == [[0], [0], [0]]       # the health check left out
    assert [s["local"] for s in steps] == [[2], [4], [4]]
    assert [s["gated"] for s in steps] == [[2], [3], [4]]       # held while the room was hidden
    assert steps[2]["popped"] == [[0, 1, 77]]
    kinds = [r["ev"]["kind"] for r in log if r["k"] == "env"]
    assert kinds == ["kv_done", "land", "land"]
    trace = io.StringIO()
    trace_from_logs([log], trace, "deferred", None)
    result = validate(trace.getvalue().splitlines())
    assert result.ok, result.message


def test_a_queue_without_the_gate_is_refused(hooks):
    log = _run(hooks, gate=False)       # commits while its room is hidden: reads 0
    trace = io.StringIO()
    trace_from_logs([log], trace, "deferred", None)
    result = validate(trace.getvalue().splitlines())
    assert not result.ok and "gated" in result.message


def test_a_room_landing_between_poll_and_gate_is_hidden_before_it_counts(hooks, monkeypatch):
    """The fault rank hides a room the gate has not acted on even when it appeared after
    the poll's read: hidden at the next poll instead, it would be logged as landed and
    then vanish (a trace no spec rank produces: the CI failure of 072cb78)."""
    live_hooks, folder = hooks
    monkeypatch.setattr(live_hooks, "_late_room", lambda: (0, None))     # 0:never
    arrivals = []

    def arrive(buffers):
        if not arrivals:
            arrivals.append(1)
            buffers.bootstrap_room[1, 0] = 77
    decode, utils = _modules(True, arrive)
    live_hooks.wrap(decode, utils)
    q = decode.DecodeTransferQueue()
    d = _DecodeReq(_Req("a", 77), 1, 3)                # Transferring when the room arrives
    q.extend([d])
    q.pop_transferred()
    assert int(q.metadata_buffers.bootstrap_room[1, 0]) == 0      # hidden at once
    d.kv_receiver.value = 4
    q.pop_transferred()
    q.pop_transferred()
    log = _log(folder)
    steps = [r["rec"] for r in log if r["k"] == "step"]
    assert [s["gated"] for s in steps] == [[3], [3], [3]]       # held: the room never lands
    assert [r["ev"]["kind"] for r in log if r["k"] == "env"] == ["kv_done"]
    trace = io.StringIO()
    trace_from_logs([log], trace, "strict", None)
    result = validate(trace.getvalue().splitlines())
    assert result.ok, result.message


class _Acks:
    """0.5.19+'s ``kv_mgr``: which rooms the prefill acknowledged (drained abort)."""

    def __init__(self):
        self.rooms = set()

    def is_abort_release_safe(self, room, required_acks):
        return room in self.rooms


def _failed_then_reused(hooks, monkeypatch, acked: bool, write_after: bool):
    """Request a (room 77) fails and its slot is freed at once (acknowledged by the
    prefill or not); request c takes the same slot; a's row then lands in it when
    ``write_after`` (a late write). Returns the rank log."""
    live_hooks, folder = hooks
    monkeypatch.setattr(live_hooks, "_late_room", lambda: None)
    decode, utils = _modules(True)
    live_hooks.wrap(decode, utils)
    q = decode.DecodeTransferQueue()
    alloc = q.req_to_metadata_buffer_idx_allocator
    acks = _Acks()
    slot = alloc.alloc()
    a = _DecodeReq(_Req("a", 77), slot, 0)                # its transfer failed
    a.kv_receiver.kv_mgr, a.kv_receiver.abort_notified = acks, True
    a.kv_receiver.bootstrap_infos = [None]
    if acked:
        acks.rooms.add(77)
    q.extend([a])
    q.pop_transferred()                                   # aborted, slot freed
    alloc.free_slots.remove(slot)                         # the allocator hands it out again
    c = _DecodeReq(_Req("c", 88), slot, 2)
    q.extend([c])
    if write_after:
        q.metadata_buffers.output_ids[slot, 0] = 7
        q.metadata_buffers.bootstrap_room[slot, 0] = 77   # a's row, late
    q.pop_transferred()
    return _log(folder)


def _replay(log, variant):
    trace = io.StringIO()
    trace_from_logs([log], trace, variant, 4 if variant == "strict" else None)
    return validate(trace.getvalue().splitlines())


def test_enqueues_name_their_slot_and_the_pool_its_size(hooks, monkeypatch):
    log = _failed_then_reused(hooks, monkeypatch, acked=True, write_after=False)
    assert log[0] == {"k": "pool", "slots": 4, "t": log[0]["t"]}
    assert [(r["req"], r["slot"]) for r in log if r["k"] == "enq"] == [(0, 0), (1, 0)]
    fence = [r for r in log if r["k"] == "env" and r["ev"]["kind"] == "fence"]
    assert [(f["ev"]["req"], f["why"]) for f in fence] == [(0, "ack")]
    assert _replay(log, "strict").ok                      # reused after the prefill's ack


def test_a_slot_reused_without_the_prefills_ack_is_refused(hooks, monkeypatch):
    log = _failed_then_reused(hooks, monkeypatch, acked=False, write_after=False)
    assert not [r for r in log if r["k"] == "env" and r["ev"]["kind"] == "fence"]
    result = _replay(log, "strict")
    assert not result.ok and "slot 0 on rank 0 is still held by request 0" in result.message
    assert _replay(log, "gate").ok                        # 0.5.13 frees it at once


def test_a_late_write_into_the_reused_slot_is_the_old_requests_land(hooks, monkeypatch):
    log = _failed_then_reused(hooks, monkeypatch, acked=False, write_after=True)
    lands = [(r["ev"]["req"], r["ev"]["field"], r["value"]) for r in log
             if r["k"] == "env" and r["ev"]["kind"] == "land"]
    assert lands[:2] == [(0, "payload", 7), (0, "room", 7)]     # a's, read from c's slot
    result = _replay(log, "gate")                 # allowed, and c now reads a's row
    assert result.ok, result.message


def test_a_write_after_the_ack_is_refused(hooks, monkeypatch):
    """The fence is what the prefill's ack says; a write seen after it (a prefill that
    acknowledged too early) is logged, and the replay refuses it."""
    log = _failed_then_reused(hooks, monkeypatch, acked=True, write_after=True)
    result = _replay(log, "strict")       # fenced, its slot freed: the spec forgot it
    assert not result.ok and "request 0 has no write in flight" in result.message
