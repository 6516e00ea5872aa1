"""The drop-in gate reads each request's OWN slot: metadata slots in non-ascending order
(what a free list hands out after reuse). A gather that read the rows in sorted slot
order, or in queue position order, would give some request another's room; the data
below is chosen so that either reading changes the gated polls (checked first)."""
from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from impl.decode import MetadataBuffers, apply_metadata_gate, poll_and_all_reduce
from impl.decode import poll_and_all_reduce_with_staging
from impl.scripted import ScriptedReceiver
from model.spec import get_variant, gated_poll

S = 4
SLOTS = [5, 1, 6, 0]                 # queue position -> slot: not ascending
ROOMS = [501, 502, 503, 504]         # expected room per queue position
LANDED = [True, False, False, True]  # whether that request's room row has landed


@pytest.fixture(scope="module")
def gloo1():
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))


def _setup():
    buffers = MetadataBuffers(8)
    for slot, room, landed in zip(SLOTS, ROOMS, LANDED):
        if landed:
            buffers.write_room(slot, room)
    reqs = [SimpleNamespace(req=SimpleNamespace(rid=f"r{i}", bootstrap_room=room, bootstrap_host="10.0.0.2"),
                            kv_receiver=ScriptedReceiver(S), metadata_buffer_index=slot)
            for i, (slot, room) in enumerate(zip(SLOTS, ROOMS))]
    return buffers, reqs


def _want(variant: str, read_slot) -> list[int]:
    """The spec kernel per request, reading the room row at ``read_slot(i)``."""
    buffers, _ = _setup()
    v = get_variant(variant)
    return [gated_poll(v, S, buffers.read_room(read_slot(i)), ROOMS[i], 0) for i in range(len(SLOTS))]


@pytest.mark.parametrize("variant", ["gate", "strict"])
def test_each_request_is_gated_on_its_own_slot(variant, gloo1):
    right = _want(variant, lambda i: SLOTS[i])
    # the readings a wrong gather would do give other polls, so this data can tell
    assert right != _want(variant, lambda i: sorted(SLOTS)[i])
    assert right != _want(variant, lambda i: i)
    buffers, reqs = _setup()
    assert apply_metadata_gate([S] * len(reqs), reqs, buffers, variant) == right
    pollers = [d.kv_receiver for d in reqs]
    assert poll_and_all_reduce(pollers, gloo1, reqs, buffers, variant=variant) == right
    staging = SimpleNamespace(is_done=lambda d: True, advance_scatter=lambda d: None)
    assert poll_and_all_reduce_with_staging(reqs, staging, gloo1, buffers, variant=variant) == right
