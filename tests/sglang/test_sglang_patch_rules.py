"""The strict patch's bookkeeping, each rule alone: the quarantine's hold and release
(a freed held slot loses its room; per-rank release frees only fenced slots; agreed
release never frees outside the agreed collective) on plain objects, and the timeout's
ageing inside a real 0.5.23 queue on one gloo rank (a request the gate holds ages and
times out after exactly timeout_steps held steps; a slow KV transfer never ages)."""
from __future__ import annotations

import datetime
import types

import torch
import torch.distributed as dist

from impl.ranks import run_ranks
from impl.sglang.patch import _Quarantine
from model.spec.events import Enqueue, KvDone, Land
from model.spec.kernel import Decision


class _Allocator:
    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, idx: int) -> None:
        self.freed.append(idx)


class _AckChannel:
    """SGLang's ``kv_mgr`` as 0.5.19+ has it: the prefill's abort ack per room."""

    def __init__(self) -> None:
        self.acked: set[int] = set()

    def is_abort_release_safe(self, room: int, required_acks: int) -> bool:
        return room in self.acked and required_acks == 1


def _quarantine(agreed: bool):
    """Slots 0/1: receivers with ``writes_fenced`` (fenced, pending); 2: SGLang's
    receiver waiting for the prefill's abort ack; 3: a receiver with no way to tell
    (never fenced); 4: the same, whose MIN was Success (its writes returned)."""
    buffers = types.SimpleNamespace(bootstrap_room=torch.tensor([[11 * (i + 1)] * 8 for i in range(5)]))
    q = _Quarantine(_Allocator(), buffers, agreed)
    fenced, pending = (types.SimpleNamespace(writes_fenced=lambda v=v: v) for v in (True, False))
    channel = _AckChannel()
    sglang = types.SimpleNamespace(kv_mgr=channel, abort_notified=True, bootstrap_infos=[None])
    q.receiver_of = {0: fenced, 1: pending, 2: sglang, 3: object(), 4: object()}
    q.room_of = {2: 33, 3: 44, 4: 55}
    q.settled = {4}
    return q, buffers, pending, channel


def test_per_rank_release_frees_fenced_slots_at_once_and_holds_the_rest_zeroing_them_on_release():
    q, buffers, pending, channel = _quarantine(agreed=False)
    for idx in range(5):
        q.free(idx)
    assert q.real.freed == [0, 4] and list(q.held) == [1, 2, 3]
    q.release_fenced()
    assert q.real.freed == [0, 4] and list(q.held) == [1, 2, 3]   # still receiving writes
    pending.writes_fenced = lambda: True
    channel.acked.add(33)                                          # the prefill's drain ack
    q.release_fenced()
    assert q.real.freed == [0, 4, 1, 2] and list(q.held) == [3]   # 3: no way to know, kept
    assert buffers.bootstrap_room[1].tolist() == [0] * 8          # a late write is gone


def test_agreed_release_holds_every_slot_until_the_collective():
    q, buffers, _, _ = _quarantine(agreed=True)
    for idx in range(5):
        q.free(idx)
    q.release_fenced()
    assert q.real.freed == [] and sorted(q.held) == [0, 1, 2, 3, 4]

    def one_rank(what, start):                 # the MIN over one rank: its own flags
        return None
    q.release_agreed(one_rank, types.SimpleNamespace(all_reduce=lambda *a, **k: None,
                                                     ReduceOp=types.SimpleNamespace(MIN=0)), None)
    assert sorted(q.real.freed) == [0, 4] and list(q.held) == [1, 2, 3]
    assert buffers.bootstrap_room[0].tolist() == [0] * 8 and buffers.bootstrap_room[1, 0] == 22


def test_an_abort_without_the_ack_is_never_fenced():
    """SGLang's receiver without ``writes_fenced`` (the hole the audit found: it counted
    as fenced): an abort the prefill did not acknowledge, or never sent, stays held."""
    from impl.sglang.patch import writes_fenced
    channel = _AckChannel()
    recv = types.SimpleNamespace(kv_mgr=channel, abort_notified=True, bootstrap_infos=[None])
    assert not writes_fenced(recv, 7, settled=False)
    channel.acked.add(7)
    assert writes_fenced(recv, 7, settled=False)
    recv.abort_notified = False                       # no abort sent: no ack will come
    assert not writes_fenced(recv, 7, settled=False)
    assert writes_fenced(recv, 7, settled=True)       # Success: every write had returned
    assert not writes_fenced(None, 7, settled=False)


def ageing_body(rank: int, world: int) -> list:
    from impl.sglang.release import SGLangRank
    from impl.sglang.runner import Job, _load
    release = _load(Job("0.5.23", "patch", False, None), 3.0)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    h = SGLangRank(release, rank, world, group, 2)
    for ev in (Enqueue(0, 77, 5), KvDone(rank, 0), Land(rank, 0, "payload"),   # room never lands
               Enqueue(1, 88, 6)):                                           # KV still on its way
        h.apply(ev)
    return [h.step().popped for _ in range(7)]


def test_the_patch_times_out_a_held_request_after_timeout_steps_and_never_a_slow_transfer():
    (out,) = [o.value for o in run_ranks(ageing_body, 1, deadline_s=120)]
    timeout = 4                                          # strict's default timeout_steps
    assert out[:timeout] == [[]] * timeout
    assert out[timeout] == [[0, int(Decision.ABORT_FAILED), 0]]
    assert out[timeout + 1:] == [[], []]                 # request 1 never aged


def step_release_body(rank: int, world: int) -> list:
    """Per-rank mode: a failed request's slot is held, then freed by the next step once its
    receiver says fenced, with nobody calling release_fenced in between (a live worker's
    scheduler does not)."""
    from model.spec.events import Fail
    from impl.sglang.release import SGLangRank
    from impl.sglang.runner import Job, _load
    release = _load(Job("0.5.23", "patch-local", False, None), 3.0)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    h = SGLangRank(release, rank, world, group, 2)
    h.apply(Enqueue(0, 77, 5))
    h.apply(Fail(rank, 0))
    free = [len(h.step().popped), h.allocator.available_size()]
    h.receivers[0].fenced = True                 # the abort acknowledged, unseen until a step
    free.append(h.allocator.available_size())
    h.step()
    free.append(h.allocator.available_size())
    return free


def test_a_step_frees_a_held_slot_once_fenced_without_a_release_call():
    (out,) = [o.value for o in run_ranks(step_release_body, 1, deadline_s=120)]
    assert out == [1, 1, 1, 2]
