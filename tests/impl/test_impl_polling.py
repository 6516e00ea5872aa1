"""The drop-in poll_and_all_reduce[_with_staging]: SGLang's shapes, the gate only when
asked, and the same never-hang agreement as the queue."""
from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from impl.decode import (BadPollValue, CollectiveLengthMismatch, MetadataBuffers, PeerAbortedStep,
                         apply_metadata_gate, poll_and_all_reduce, poll_and_all_reduce_with_staging)
from impl.decode.lockstep import LockstepGroup, run_ranks
from impl.scripted import ScriptedReceiver

S, T, W = 4, 3, 2      # Success, Transferring, WaitingForInput


@pytest.fixture(scope="module")
def gloo1():
    """A real one-rank gloo group that does not touch the global default group."""
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))


def reqs_for(states, rooms_landed, buffers):
    out = []
    for i, (state, landed) in enumerate(zip(states, rooms_landed)):
        if landed:
            buffers.write_room(i, 100 + i)
        out.append(SimpleNamespace(req=SimpleNamespace(rid=f"r{i}", bootstrap_room=100 + i,
                                                       bootstrap_host="10.0.0.2"),
                                   kv_receiver=ScriptedReceiver(state), metadata_buffer_index=i))
    return out


def test_ungated_and_gated_on_a_real_gloo_group(gloo1):
    buffers = MetadataBuffers(8)
    reqs = reqs_for([S, S, W], [True, False, False], buffers)
    pollers = [d.kv_receiver for d in reqs]
    assert poll_and_all_reduce(pollers, gloo1) == [S, S, W]           # header first, no capacity
    assert poll_and_all_reduce(pollers, gloo1, reqs, buffers) == [S, T, W]
    assert poll_and_all_reduce(pollers, gloo1, reqs, buffers, variant="strict") == \
        apply_metadata_gate([S, S, W], reqs, buffers, "strict")


def test_staging_holds_success_until_the_scatter_is_done(gloo1):
    buffers = MetadataBuffers(4)
    reqs = reqs_for([S, S], [True, True], buffers)
    reqs[0].kv_receiver.require_staging = True
    done: set[str] = set()
    handler = SimpleNamespace(is_done=lambda d: d.req.rid in done,
                              advance_scatter=lambda d: done.add(d.req.rid) if advanced else None)
    advanced = False
    assert poll_and_all_reduce_with_staging(reqs, handler, gloo1, buffers) == [T, S]
    advanced = True
    assert poll_and_all_reduce_with_staging(reqs, handler, gloo1, buffers) == [S, S]


def test_two_ranks_disagreeing_fail_together_not_hang():
    group = LockstepGroup(2, timeout_s=5)
    bufs = [MetadataBuffers(4), MetadataBuffers(4)]
    reqs = [reqs_for([S, S], [True, True], bufs[0]), reqs_for([S], [True], bufs[1])]
    out = run_ranks([lambda k=k: poll_and_all_reduce([d.kv_receiver for d in reqs[k]], None,
                                                     reqs[k], bufs[k], exchange=group.exchange(k))
                     for k in range(2)])
    assert all(isinstance(e, CollectiveLengthMismatch) and e.lengths == (2, 1) for e in out)
    reqs[1] = reqs_for([S, 9], [True, True], bufs[1])
    out = run_ranks([lambda k=k: poll_and_all_reduce([d.kv_receiver for d in reqs[k]], None,
                                                     reqs[k], bufs[k], exchange=group.exchange(k))
                     for k in range(2)])
    assert isinstance(out[1], BadPollValue) and isinstance(out[0], PeerAbortedStep)
