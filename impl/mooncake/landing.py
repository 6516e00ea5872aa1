"""What one decode rank sees of the network, taken once per scheduler step.

Prefill writes metadata rows into *landing* buffers (registered with Mooncake); the
queue's gate reads its own *visible* buffers. At each step boundary ``Landing.observe``
makes the receivers' pending states visible and copies every row whose room has landed
from landing to visible (payload fields first, the room last). So each step sees a
snapshot, and the environment events it returns (kv_done, fail, land, fence) are
exactly what that step saw, in order: the trace of a real run replays in the spec.
A deployment without tracing can register the queue's buffers directly instead.

With a ``DigestCheck``, a Success that carries the prefill's digest is checked once its
row is here (landed this step, or earlier), before the receiver's state is made
visible: the request's KV pages in the pool and its row (the visible copy once
copied, else the landing one, copied right after) must hash to the digest, or the
receiver gets Failed ("foreign write") in the same step, so the gate never sees a
Success together with a row over wrong bytes, and the MIN aborts the request on every
rank. What it cannot see: a
write after the check (before the model reads the pages), and any read.
"""
from __future__ import annotations

import hmac
import time
from dataclasses import dataclass

import numpy as np
import torch

from impl.decode import MetadataBuffers
from impl.mooncake.digest import transfer_digest
from impl.mooncake.receiver import FAILED, MooncakeKVReceiver
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


FOREIGN_WRITE = "foreign write: the KV pages or metadata row differ from what the prefill wrote"


@dataclass(frozen=True)
class DigestCheck:
    """What a rank hashes: its KV pool (pages x page bytes, uint8) and the metadata
    fields in its HELLO order, under its digest key."""
    key: bytes
    pool: torch.Tensor
    fields: tuple[str, ...]

    def matches(self, t: Tracked, rows: MetadataBuffers, digest: bytes) -> bool:
        if self.pool.is_cuda:       # one gather and one copy to the host
            idx = torch.tensor(t.pages, dtype=torch.long, device=self.pool.device)
            pages = list(self.pool.index_select(0, idx).cpu().numpy())
        else:                       # views, no copy (and no torch op: its thread pool
            host = self.pool.numpy()    # stalled whole steps on the loaded box)
            pages = [host[p] for p in t.pages]
        got = transfer_digest(self.key, t.spec.room, self.pool.shape[1],
                              [memoryview(p) for p in pages], len(t.pages),
                              [(n, memoryview(rows.fields[n][t.slot].cpu().contiguous()
                                              .view(torch.uint8).numpy())) for n in self.fields])
        return hmac.compare_digest(got, digest)


class Landing:
    def __init__(self, rank: int, landing: MetadataBuffers, visible: MetadataBuffers,
                 digest: DigestCheck | None = None):
        if landing.size != visible.size:
            raise ValueError("landing and visible metadata buffers differ in size")
        self.rank, self.landing, self.visible = rank, landing, visible
        self.digest = digest
        self.foreign_writes = 0         # Successes whose bytes did not match their digest
        self.digest_seconds = 0.0       # spent checking, in this rank's steps
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
            row_here = t.landed or not t.done and int(rooms[t.slot]) == t.spec.room
            if row_here and not t.left:
                self._check(t)
            seen = t.receiver.observe()
            if not t.left:                   # after leaving, the spec has no receiver
                if seen.kv_done:
                    events.append(KvDone(r, idx))
                elif seen.failed:
                    events.append(Fail(r, idx))
            if row_here and not t.landed:
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

    def _check(self, t: Tracked) -> None:
        """Check a pending Success's digest against what landed (once)."""
        digest = t.receiver.take_digest() if self.digest is not None else None
        if digest is None:
            return
        t0 = time.perf_counter()
        ok = self.digest.matches(t, self.visible if t.landed else self.landing, digest)
        self.digest_seconds += time.perf_counter() - t0
        if not ok:
            self.foreign_writes += 1
            t.receiver.deliver(FAILED, FOREIGN_WRITE)
