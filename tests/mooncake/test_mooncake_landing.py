"""Landing snapshots: a row becomes visible to the gate only at a step boundary, only
once its own room landed, payload first; the events say exactly what the step saw."""
from __future__ import annotations

from impl.decode import MetadataBuffers
from impl.mooncake.landing import Landing, Tracked
from impl.mooncake.receiver import SUCCESS, MooncakeKVReceiver
from impl.mooncake.synth import RequestSpec
from model.spec.events import Fence, KvDone, Land


def setup(slots: int = 4):
    landing, visible = MetadataBuffers(slots), MetadataBuffers(slots)
    spec = RequestSpec(index=7, room=0xABCDEF, n_pages=1, first_token=42)
    rec = MooncakeKVReceiver(spec.room, rank=1, slot=2, pages=(0,))
    rec.enter_queue()
    lan = Landing(1, landing, visible)
    lan.track(Tracked(spec, rec, slot=2, pages=(0,)))
    return lan, landing, visible, spec, rec


def test_row_is_copied_only_once_its_room_landed():
    lan, landing, visible, spec, rec = setup()
    landing.write_first_token(2, spec.first_token)          # payload landed, room not yet
    rec.deliver(SUCCESS, at=1.0)                              # Success outran the row
    assert lan.observe(1.0) == [KvDone(1, 7)]
    assert visible.read_room(2) == 0 and int(visible.output_ids[2, 0]) == 0
    landing.write_room(2, 0x999)                               # someone else's room: ignored
    assert lan.observe(2.0) == []
    landing.write_room(2, spec.room)
    assert lan.observe(3.0) == [Land(1, 7, "payload"), Land(1, 7, "room")]
    assert visible.read_room(2) == spec.room and int(visible.output_ids[2, 0]) == 42
    assert rec.writes_fenced() and lan.observe(4.0) == []


def test_fence_is_an_event_only_after_the_request_left():
    lan, landing, visible, spec, rec = setup()
    rec.deliver_fence()                                       # e.g. a dead prefill's grace ran out
    assert lan.observe(1.0) == []
    assert not rec.writes_fenced()                            # the queue must not free the slot yet
    lan.left(spec.index)
    assert lan.observe(2.0) == [Fence(1, 7)]
    assert rec.writes_fenced()
    landing.write_room(2, spec.room)                          # nothing may land after a fence
    assert lan.observe(3.0) == []
    assert [t.spec.index for t in lan.forget_done()] == [7] and len(lan) == 0
