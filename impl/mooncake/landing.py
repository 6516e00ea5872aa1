"""What one decode rank sees of the network, taken once per scheduler step.

Prefill writes metadata rows into *landing* buffers (registered with Mooncake); the
queue's gate reads its own *visible* buffers. At each step boundary ``Landing.observe``
makes the receivers' pending states visible and copies every row whose room has landed
from landing to visible (payload fields first, the room last). So each step sees a
snapshot, and the environment events it returns (kv_done, fail, land, fence) are
exactly what that step saw, in order: the trace of a real run replays in the spec.
A deployment without tracing can register the queue's buffers directly instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from impl.decode import MetadataBuffers
from impl.mooncake.receiver import MooncakeKVReceiver
from impl.mooncake.synth import ROOM_FIELD, RequestSpec
from model.spec.events import PAYLOAD, ROOM, Event, Fail, Fence, KvDone, Land


@dataclass
class Tracked:
    spec: RequestSpec
    receiver: MooncakeKVReceiver
    slot: int
    pages: tuple[int, ...]
    left: bool = False                # popped from the transfer queue on this rank
    landed: bool = False              # the whole row was seen (room after payload)
    fenced: bool = False              # a fence was recorded
    t_enq: float = 0.0                # when this rank admitted it
    t_land: float | None = None       # when this rank saw the row

    @property
    def done(self) -> bool:
        """No write for it can land here any more."""
        return self.landed or self.fenced

    @property
    def t_last_byte(self) -> float | None:
        times = [t for t in (self.receiver.success_at, self.t_land) if t is not None]
        return max(times) if times else None


class Landing:
    def __init__(self, rank: int, landing: MetadataBuffers, visible: MetadataBuffers):
        if landing.size != visible.size:
            raise ValueError("landing and visible metadata buffers differ in size")
        self.rank, self.landing, self.visible = rank, landing, visible
        self._tracked: dict[int, Tracked] = {}      # request index -> tracked, see ``left``
        self._payload_fields = [n for n in visible.fields if n != ROOM_FIELD]

    def track(self, t: Tracked) -> None:
        self._tracked[t.spec.index] = t

    def get(self, index: int) -> Tracked:
        return self._tracked[index]

    def left(self, index: int) -> Tracked:
        """The request left the queue: later events for it come after the queued ones',
        in leaving order (the order impl.decode's quarantine frees slots in)."""
        t = self._tracked.pop(index)
        t.left = True
        self._tracked[index] = t
        return t

    def forget_done(self) -> list[Tracked]:
        """Untrack requests that left and can receive no more writes; returns them."""
        gone = [t for t in self._tracked.values() if t.left and t.done]
        for t in gone:
            del self._tracked[t.spec.index]
        return gone

    def __len__(self) -> int:
        return len(self._tracked)

    def _copy_row(self, slot: int) -> None:
        for name in self._payload_fields:
            self.visible.fields[name][slot].copy_(self.landing.fields[name][slot])
        self.visible.fields[ROOM_FIELD][slot].copy_(self.landing.fields[ROOM_FIELD][slot])

    def observe(self, now: float) -> list[Event]:
        """One step boundary: the events this rank sees now, in the order it sees them."""
        events: list[Event] = []
        if not self._tracked:
            return events
        # Every room at once (one device->host copy on CUDA; a view on CPU), as uint64.
        rooms = self.landing.room_column.cpu().numpy().view(np.uint64)
        for t in list(self._tracked.values()):
            r, idx = self.rank, t.spec.index
            seen = t.receiver.observe()
            if not t.left:                   # after leaving, the spec has no receiver
                if seen.kv_done:
                    events.append(KvDone(r, idx))
                elif seen.failed:
                    events.append(Fail(r, idx))
            if not t.done and int(rooms[t.slot]) == t.spec.room:
                # The room is written only after the payload write returned, so the
                # payload is complete: copy the row, room last.
                self._copy_row(t.slot)
                t.landed, t.t_land = True, now - 1e-9   # visible from this step on
                t.receiver.mark_landed()
                events += [Land(r, idx, PAYLOAD), Land(r, idx, ROOM)]
            if t.left and not t.done and t.receiver.fenced:
                t.fenced = True
                t.receiver.mark_fence_taken()
                events.append(Fence(r, idx))
        return events
