"""One decode rank driven by spec events: scripted receivers and real metadata writes.

``RankHarness.apply(event)`` performs a spec event (model.spec.events) on this rank's
real DecodeTransferQueue and MetadataBuffers: ``enqueue`` allocates a slot and queues
the request, ``kv_done``/``fail`` latch its receiver, ``land`` writes the room or the
payload into the slot the rank gave the request (also after it left: a late write),
``fence`` acknowledges an abort, and ``step`` runs ``pop_transferred`` (a collective; so does an agreed ``enqueue``).
Used by ``pdgate replay`` (one process per rank) and by the in-process tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from impl.decode.buffers import MetadataBuffers, SlotAllocator
from impl.decode.queue import DecodeTransferQueue, Req
from impl.decode.trace import ListTracer, StepTrace
from model.spec.events import PAYLOAD, ROOM, Enqueue, Event, Fail, Fence, KvDone, Land, Step
from model.spec.kvpoll import KVPoll
from model.spec.variants import Variant


@dataclass
class ScriptedReceiver:
    """A receiver whose state the script sets; tracks which writes landed."""
    state: int = int(KVPoll.WaitingForInput)
    landed: set[str] = field(default_factory=set)
    fenced: bool = False
    cleared: bool = False

    def poll(self) -> int:
        return self.state

    def failure_exception(self) -> Exception | None:
        return RuntimeError("scripted transfer failure") if self.state == int(KVPoll.Failed) else None

    def clear(self) -> None:
        self.cleared = True

    def writes_fenced(self) -> bool:
        return self.fenced or self.landed >= {ROOM, PAYLOAD}

    def abort_acknowledged(self) -> bool:
        return self.fenced


class RankHarness:
    def __init__(self, rank: int, variant: str | Variant, slots: int, exchange: Any,
                 timeout_steps: int | None = None, collective_timeout_s: float = 10.0):
        self.rank = rank
        self.buffers = MetadataBuffers(slots)
        self.allocator = SlotAllocator(slots)
        self.tracer = ListTracer()
        self.queue = DecodeTransferQueue(None, self.buffers, self.allocator, variant,
                                         timeout_steps=timeout_steps,
                                         collective_timeout_s=collective_timeout_s,
                                         tracer=self.tracer, exchange=exchange)
        self.receivers: dict[int, ScriptedReceiver] = {}
        self.slot_of: dict[int, int] = {}       # kept after a request leaves (late writes)
        self.requests: dict[int, Enqueue] = {}

    def apply(self, ev: Event) -> StepTrace | None:
        """Perform one event; returns this rank's step record for a Step."""
        if isinstance(ev, Step):
            self.queue.pop_transferred()
            return self.tracer.records[-1]
        if isinstance(ev, Enqueue):
            # the queue's admit step: agreed admission takes it on every rank or none
            # (one all-reduce), local admission where this rank has a free slot
            receiver = ScriptedReceiver()
            for d in self.queue.admit([(Req(str(ev.req), ev.room), receiver)]):
                self.receivers[ev.req], self.slot_of[ev.req] = receiver, d.metadata_buffer_index
                self.requests[ev.req] = ev
            return None
        if ev.rank != self.rank:
            return None
        receiver = self.receivers[ev.req]
        if isinstance(ev, KvDone):
            receiver.state = int(KVPoll.Success)
        elif isinstance(ev, Fail):
            receiver.state = int(KVPoll.Failed)
        elif isinstance(ev, Land):
            slot = self.slot_of[ev.req]
            if ev.field == ROOM:
                self.buffers.write_room(slot, self.requests[ev.req].room)
            else:
                self.buffers.write_first_token(slot, self.requests[ev.req].payload)
            receiver.landed.add(ev.field)
            self.queue.release_fenced()
        elif isinstance(ev, Fence):
            receiver.fenced = True
            self.queue.release_fenced()
        return None
