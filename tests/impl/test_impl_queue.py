"""DecodeTransferQueue on T in-process ranks (LockstepGroup): bad input leaves every rank
exactly as it was, disagreement raises on every rank at once, strict's rules hold."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from impl.decode import (Aborted, BadPollValue, CollectiveLengthMismatch, Committed,
                         DecodeRequest, DecodeTransferQueue, Decision, DuplicateRequest,
                         DuplicateRoom, FAKE_BOOTSTRAP_HOST, MetadataBuffers, PeerAbortedStep,
                         QueueContentMismatch, Req, SlotAllocator, SlotInUse, SlotOutOfRange,
                         ZeroRoom)
from impl.decode.collective import AdaptiveMessage, digest
from impl.decode.lockstep import LockstepGroup, run_ranks
from impl.scripted import ScriptedReceiver
from model.spec import KVPoll

SUCCESS, FAILED = int(KVPoll.Success), int(KVPoll.Failed)


def make(ranks=2, slots=4, variant="strict", timeout_steps=None, torch_path=False):
    g = LockstepGroup(ranks, timeout_s=5)
    qs = [DecodeTransferQueue(None, MetadataBuffers(slots), SlotAllocator(slots), variant,
                              timeout_steps=timeout_steps, exchange=g.exchange(k))
          for k in range(ranks)]
    for q in qs:        # the path device (cuda) buffers take, exercised here on cpu tensors
        q._on_cpu = not torch_path
    return qs


both_paths = pytest.mark.parametrize("torch_path", [False, True], ids=["numpy", "torch"])


def snap(q):
    return q.snapshot(), q.buffers.bootstrap_room.clone(), q.buffers.output_ids.clone()


def same(a, b):
    return a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


def enqueue_all(qs, rid, room):
    return [q.enqueue(Req(rid, room), ScriptedReceiver()) for q in qs]


def land(q, d, token):
    q.buffers.write_first_token(d.metadata_buffer_index, token)
    q.buffers.write_room(d.metadata_buffer_index, d.req.bootstrap_room)
    d.kv_receiver.landed |= {"room", "payload"}


def step(qs):
    return run_ranks([q.pop_transferred for q in qs])


@pytest.mark.parametrize("bad, error", [
    (lambda q: q.enqueue(Req("z", 0), ScriptedReceiver()), ZeroRoom),
    (lambda q: q.enqueue(Req("dup", 11), ScriptedReceiver()), DuplicateRoom),
    (lambda q: q.enqueue(Req("a", 12), ScriptedReceiver()), DuplicateRequest),
    (lambda q: q.add(DecodeRequest(Req("x", 13), ScriptedReceiver(), 9)), SlotOutOfRange),
    (lambda q: q.add(DecodeRequest(Req("x", 13), ScriptedReceiver(), 0)), SlotInUse),
])
def test_bad_adds_raise_typed_errors_and_change_nothing(bad, error):
    [q] = make(1)
    q.enqueue(Req("a", 11), ScriptedReceiver())
    before = snap(q)
    with pytest.raises(error):
        bad(q)
    assert same(before, snap(q))


@both_paths
def test_bad_poll_raises_locally_and_peers_abort_the_step_unchanged(torch_path):
    qs = make(2, torch_path=torch_path)
    ds = enqueue_all(qs, "a", 11)
    step(qs)
    ds[1].kv_receiver.state = 7
    before = [snap(q) for q in qs]
    out = step(qs)
    assert isinstance(out[1], BadPollValue) and "polled 7" in str(out[1])
    assert isinstance(out[0], PeerAbortedStep) and "[1]" in str(out[0])
    assert all(same(b, snap(q)) for b, q in zip(before, qs))


@both_paths
def test_commit_reads_the_row_and_frees_the_zeroed_slot(torch_path):
    qs = make(2, variant="gate", torch_path=torch_path)
    ds = enqueue_all(qs, "a", 2**64 - 3)
    for q, d in zip(qs, ds):
        d.kv_receiver.state = SUCCESS
    land(qs[0], ds[0], 42)
    assert step(qs) == [[], []]              # rank 1's row has not landed: gate holds
    land(qs[1], ds[1], 42)
    for q in qs:
        q.buffers.cached_tokens[0, 0] = 3
    out = step(qs)
    for q, [r] in zip(qs, out):
        assert isinstance(r, Committed) and r.first_token == 42 and r.slot == 0
        assert int(r.fields["cached_tokens"][0]) == 3
        assert q.buffers.read_room(0) == 0 and q.allocator.free_list()[-1] == 0


@both_paths
def test_fake_transfers_bypass_the_gate(torch_path):
    qs = make(2, torch_path=torch_path)
    ds = [q.enqueue(Req("f", 0, FAKE_BOOTSTRAP_HOST), ScriptedReceiver(SUCCESS)) for q in qs]
    out = step(qs)
    assert all(isinstance(r[0], Committed) for r in out)


@both_paths
def test_strict_timeout_aborts_on_every_rank_in_the_same_step(torch_path):
    qs = make(3, timeout_steps=2, torch_path=torch_path)
    ds = enqueue_all(qs, "a", 5)
    for d in ds:
        d.kv_receiver.state = SUCCESS       # KV done, the metadata never lands
    assert step(qs) == [[], [], []]
    assert step(qs) == [[], [], []]
    out = step(qs)
    assert [r[0].decision for r in out] == [Decision.ABORT_FAILED] * 3


def test_strict_holds_a_stale_room_and_fences_slot_reuse():
    qs = make(2, slots=1)
    ds = enqueue_all(qs, "a", 5)
    for d in ds:
        d.kv_receiver.state = FAILED
    assert all(isinstance(r[0], Aborted) for r in step(qs))
    assert [q.allocator.available_size() for q in qs] == [0, 0]      # quarantined
    ds[0].kv_receiver.fenced = ds[1].kv_receiver.fenced = True
    assert [q.release_fenced() for q in qs] == [[0], [0]]
    ds = enqueue_all(qs, "b", 6)
    qs[0].buffers.write_room(0, 5)            # a late, foreign room: strict must hold
    for d in ds:
        d.kv_receiver.state = SUCCESS
    assert step(qs) == [[], []]


def test_length_mismatch_raises_on_every_rank_naming_ranks_and_lengths():
    qs = make(2)
    qs[0].enqueue(Req("a", 5), ScriptedReceiver())
    before = [snap(q) for q in qs]
    out = step(qs)
    for e in out:
        assert isinstance(e, CollectiveLengthMismatch) and e.lengths == (1, 0)
        assert "rank 0: 1, rank 1: 0" in str(e)
    assert all(same(b, snap(q)) for b, q in zip(before, qs))


def test_same_length_other_requests_raise_content_mismatch():
    qs = make(2)
    qs[0].enqueue(Req("a", 5), ScriptedReceiver())
    qs[1].enqueue(Req("b", 6), ScriptedReceiver())
    out = step(qs)
    assert all(isinstance(e, QueueContentMismatch) for e in out)


def _adaptive_round(group, lengths, values_of=lambda k, n: [k % 5] * n):
    """One AdaptiveMessage.reduce per rank; records every collective's size."""
    sizes = []

    class Recording:
        def __init__(self, ex):
            self.ex = ex

        def all_reduce_min(self, msg):
            sizes.append(msg.numel())
            return self.ex.all_reduce_min(msg)

        def all_gather_rows(self, row):
            return self.ex.all_gather_rows(row)

    def rank(k, msg):
        vals = np.array(values_of(k, lengths[k]), dtype=np.uint8)
        fp = digest(torch.arange(lengths[k], dtype=torch.int64))
        return lambda: msg.reduce(Recording(group.exchange(k)), vals, lengths[k], fp, True)
    return rank, sizes


def test_adaptive_message_follows_the_agreed_length_and_stays_same_shape_on_every_rank():
    g = LockstepGroup(2, timeout_s=5)
    msgs = [AdaptiveMessage() for _ in range(2)]
    header = 25
    # (length, shape after): grows past the shape, shrinks once at a quarter
    for n, shape_after in [(3, 64), (64, 64), (65, 128), (300, 512), (200, 512), (128, 128),
                           (100, 128), (0, 64)]:
        before = msgs[0].shape
        rank, sizes = _adaptive_round(g, [n, n])
        out = run_ranks([rank(k, m) for k, m in enumerate(msgs)])
        assert [o.tolist() for o in out] == [[0] * n] * 2            # the MIN of 0s and 1s
        assert [m.shape for m in msgs] == [shape_after] * 2
        grew = [before + header] * 2 + [shape_after + header] * 2   # header only, then values
        assert sorted(sizes) == (sorted(grew) if n > before else [before + header] * 2)
    # lengths on both sides of the shape: one header-only collective, then the mismatch
    rank, sizes = _adaptive_round(g, [64, 65])
    out = run_ranks([rank(k, m) for k, m in enumerate(msgs)])
    assert all(isinstance(o, CollectiveLengthMismatch) and "rank 0: 64, rank 1: 65" in str(o)
               for o in out)
    assert [m.shape for m in msgs] == [64, 64] and len(sizes) == 2


def test_a_queue_longer_than_the_message_grows_it_and_still_pops_right():
    qs = make(2, slots=300, variant="gate")
    for i in range(200):
        enqueue_all(qs, f"r{i}", 1000 + i)
    assert step(qs) == [[], []]                                   # grew 64 -> 256
    assert [q._message.shape for q in qs] == [256, 256]
    for q in qs:
        d = q.queue[150]
        d.kv_receiver.state = SUCCESS
        land(q, d, 7)
    out = step(qs)
    assert [[(r.decode_req.req.rid, r.first_token) for r in o] for o in out] == [[("r150", 7)]] * 2
