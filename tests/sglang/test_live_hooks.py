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
                    d.req.output_ids.append(int(self.metadata_buffers.bootstrap_room[
                        d.metadata_buffer_index, 0]) % 100)      # what its commit read
                else:
                    keep.append(d)
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
