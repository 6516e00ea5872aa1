"""The impl's fast paths against their plain counterparts, on inputs where each fast
path's precondition is only partly true: the queue digest's order sensitivity, the
message header cache, numpy_ops_knowing's folded "expected room is 0", the queue's
ages replaced by 0 when no request reached the timeout, and the quarantine's
fenced-release bookkeeping. Each also checks the plain path itself on the same input
(the answer can differ where it must)."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from impl.decode import (DecodeRequest, DecodeTransferQueue, MetadataBuffers, PeerAbortedStep, Req,
                         RoomOutOfRange, SlotOutOfRange)
from impl.decode.collective import (HEADER, _PAYLOAD, Agreement, Message, agree_min, digest, header,
                                    read_header)
from impl.decode.gate import NUMPY, gate_array, gate_decode_reqs, numpy_ops_knowing, rooms_tensor
from impl.decode.lockstep import LockstepGroup, run_ranks
from impl.scripted import ScriptedReceiver
from model.spec import KVPoll
from model.spec.variants import get_variant
from tests.impl.test_impl_queue import enqueue_all, make, step

ROOMS = st.integers(1, 2**64 - 1)


def _rooms(values):
    return torch.from_numpy(np.array(values, dtype=np.uint64)).view(torch.int64)


@given(st.lists(ROOMS, min_size=2, max_size=40, unique=True), st.data())
def test_the_digest_changes_when_two_rooms_swap_places(rooms, data):
    i = data.draw(st.integers(0, len(rooms) - 2))
    j = data.draw(st.integers(i + 1, len(rooms) - 1))
    swapped = list(rooms)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    assert int(digest(_rooms(rooms))[0]) != int(digest(_rooms(swapped))[0])
    assert int(digest(_rooms(rooms))[0]) == int(digest(_rooms(list(rooms)))[0])


def test_the_digest_tells_a_rotation_and_a_repeated_room_apart():
    base = [5, 6, 7, 8]
    digests = {int(digest(_rooms(r))[0]) for r in (base, base[1:] + base[:1], [5, 5, 7, 8],
                                                    [6, 5, 7, 8], [5, 6, 7, 9], base[:3], [])}
    assert len(digests) == 7


def test_the_header_follows_a_new_digest_of_a_queue_of_the_same_length():
    msg = Message(4)
    values = np.full(3, 3, dtype=np.uint8)
    first = bytes(msg.fill(values, 3, digest(_rooms([1, 2, 3])), True)[:HEADER].numpy())
    again = bytes(msg.fill(values, 3, digest(_rooms([1, 2, 3])), True)[:HEADER].numpy())
    other = bytes(msg.fill(values, 3, digest(_rooms([3, 2, 1])), True)[:HEADER].numpy())
    assert first == again and first != other


def test_every_header_byte_counts_in_the_agreement():
    mine = header(3, digest(_rooms([1, 2, 3])), True)
    assert read_header(mine) == Agreement(ok=True, same=True)
    payload = bytes(mine[1:1 + _PAYLOAD].tolist())
    for i in range(_PAYLOAD):                     # another rank's length or digest: one byte off
        other = bytearray(payload)
        other[i] ^= 1
        theirs = torch.tensor([1, *other, *(255 - b for b in other)], dtype=torch.uint8)
        got = read_header(torch.minimum(mine, theirs))
        assert got.ok and not got.same, i
    assert not read_header(torch.minimum(mine, header(3, digest(_rooms([1, 2, 3])), False))).ok


def test_a_peer_that_aborts_fails_the_header_first_step_on_every_rank():
    g = LockstepGroup(2, timeout_s=5)
    values = torch.tensor([4, 3], dtype=torch.uint8)
    fp = digest(_rooms([1, 2]))
    out = run_ranks([lambda k=k: agree_min(g.exchange(k), values, fingerprint=fp, ok=k == 0)
                     for k in range(2)])
    assert all(isinstance(o, PeerAbortedStep) for o in out), out
    ok = run_ranks([lambda k=k: agree_min(g.exchange(k), values, fingerprint=fp) for k in range(2)])
    assert [o.tolist() for o in ok] == [[4, 3], [4, 3]]


def test_bools_are_refused_as_rooms_and_slots():
    with pytest.raises(RoomOutOfRange):
        rooms_tensor([5, True])
    assert rooms_tensor([5, 2**64 - 1]).tolist() == [5, -1]
    buffers = MetadataBuffers(2)
    reqs = [DecodeRequest(Req("a", 5), ScriptedReceiver(), True)]
    with pytest.raises(SlotOutOfRange):
        gate_decode_reqs([int(KVPoll.Success)], reqs, buffers, "strict")
    reqs = [DecodeRequest(Req("a", 5), ScriptedReceiver(), 1)]
    assert gate_decode_reqs([int(KVPoll.Success)], reqs, buffers, "strict").tolist() == \
        [int(KVPoll.Transferring)]


class _Identity:
    """A one-rank MIN: the message comes back as sent."""
    def all_reduce_min(self, msg):
        return msg


def test_a_queue_exactly_at_the_message_capacity_reduces():
    msg = Message(4)
    values = np.array([4, 3, 2, 0], dtype=np.uint8)
    out = msg.reduce(_Identity(), values, 4, digest(_rooms([1, 2, 3, 4])), True)
    assert out.tolist() == [4, 3, 2, 0]
    with pytest.raises(ValueError):
        msg.reduce(_Identity(), np.zeros(5, np.uint8), 5, None, True)


POLLS = st.sampled_from([int(p) for p in KVPoll])


@given(st.data())
def test_numpy_ops_knowing_zero_rooms_gates_as_plain_numpy(data):
    n = data.draw(st.integers(1, 12))
    expected = np.array(data.draw(st.lists(st.sampled_from([0, 0, 7, 9]), min_size=n, max_size=n)),
                        dtype=np.int64)
    seen = np.array(data.draw(st.lists(st.sampled_from([0, 7, 9]), min_size=n, max_size=n)),
                    dtype=np.int64)
    local = np.array(data.draw(st.lists(POLLS, min_size=n, max_size=n)), dtype=np.uint8)
    for name in ("gate", "strict", "gate-noclear"):
        v = get_variant(name)
        plain = gate_array(v, local, seen, expected, 0, None, NUMPY)
        fast = gate_array(v, local, seen, expected, 0, None, numpy_ops_knowing(expected, 0))
        assert fast.tolist() == plain.tolist(), name


@given(st.lists(st.integers(0, 8), min_size=2, max_size=10), st.data())
def test_ages_fold_to_zero_only_when_no_request_reached_the_timeout(ages, data):
    v = get_variant("strict", 4)
    n = len(ages)
    age = np.array(ages, dtype=np.int64)
    local = np.full(n, int(KVPoll.Success), dtype=np.uint8)
    seen = np.zeros(n, dtype=np.int64)                  # rooms not landed: the gate holds
    expected = np.arange(1, n + 1, dtype=np.int64)
    queue = types.SimpleNamespace(variant=v)
    folded = DecodeTransferQueue._age_input(queue, age)
    assert gate_array(v, local, seen, expected, folded).tolist() == \
        gate_array(v, local, seen, expected, age).tolist()
    timed = [int(KVPoll.Failed) if a >= 4 else int(KVPoll.Transferring) for a in ages]
    assert gate_array(v, local, seen, expected, age).tolist() == timed


def test_a_slot_still_receiving_writes_stays_quarantined_until_fenced():
    qs = make(2, slots=2)
    ds = enqueue_all(qs, "a", 5)
    es = enqueue_all(qs, "b", 6)
    for d in ds + es:
        d.kv_receiver.state = int(KVPoll.Failed)
    step(qs)
    assert [q.allocator.available_size() for q in qs] == [0, 0]      # both quarantined
    ds[0].kv_receiver.fenced = ds[1].kv_receiver.fenced = True        # only a's writes stop
    assert [q.release_fenced() for q in qs] == [[ds[0].metadata_buffer_index]] * 2
    assert [len(q.quarantined) for q in qs] == [1, 1]
    assert [q.release_fenced() for q in qs] == [[], []]               # b still quarantined
    es[0].kv_receiver.fenced = es[1].kv_receiver.fenced = True
    assert [q.release_fenced() for q in qs] == [[es[0].metadata_buffer_index]] * 2
    assert [q.allocator.available_size() for q in qs] == [2, 2]
    # the freed slots take new requests, rooms of the ones that left included
    assert [d.req.rid for d in enqueue_all(qs, "c", 5)] == ["c", "c"]
    assert all(q.buffers.read_room(i) == 0 for q in qs for i in range(2))


def test_ages_count_only_steps_whose_min_was_transferring_or_success():
    qs = make(2, slots=2, timeout_steps=3)
    held = enqueue_all(qs, "held", 5)          # Success, room never lands: the gate holds
    slow = enqueue_all(qs, "slow", 6)          # still WaitingForInput: never ages
    for d in held:
        d.kv_receiver.state = int(KVPoll.Success)
    popped = []
    for _ in range(6):
        popped.append([[r.decode_req.req.rid for r in out] for out in step(qs)])
    assert popped.index([["held"], ["held"]]) == 3      # timed out after 3 held steps
    assert [len(q) for q in qs] == [1, 1] and all(q._age.tolist() == [0] for q in qs)
