"""The decode-side Mooncake KV receiver: one per request per rank.

States Bootstrapping -> WaitingForInput -> Success | Failed, monotonic (max), Failed
overrides, and latched once Success or Failed is visible (SGLang's receiver), with one
exception the spec makes too (model.spec.machine._latch): a Failed that arrives after
Success while the request is still queued is honoured. That is the late Failed of a
prefill found dead while the gate holds a request whose metadata never came: it
becomes visible at the next step boundary, and the MIN aborts the request on every
rank in that step instead of at strict's timeout (or, under ``gate``, never).

Two views, so that a rank's scheduler sees the network only at step boundaries: the
status and heartbeat threads ``deliver`` into a pending state, and the rank's own
thread calls ``observe()`` once per step, which makes the pending state visible and
returns what changed (the environment events a trace records). ``poll()`` returns
only the visible state, so a step's poll never races the status thread.

A Success may carry the prefill's digest of what it wrote (impl.mooncake.digest); the
rank's thread takes it once (``take_digest``) to check the landed bytes before the
gate can see them, and a mismatch is delivered as Failed like any other.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from impl.mooncake.engine import MooncakeError

BOOTSTRAPPING, WAITING, SUCCESS, FAILED = 1, 2, 4, 0


class KVTransferFailed(MooncakeError):
    """Why a receiver reports Failed (prefill said so, prefill died, bad bootstrap...)."""

    def __init__(self, room: int, reason: str):
        self.room = room
        self.reason = reason
        super().__init__(f"KV transfer of room {room} failed: {reason}")


@dataclass(frozen=True)
class Observed:
    """What became visible at one ``observe()``: receiver result and/or fence."""
    kv_done: bool = False
    failed: bool = False
    fenced: bool = False

    def __bool__(self) -> bool:
        return self.kv_done or self.failed or self.fenced


class MooncakeKVReceiver:
    """Implements impl.decode's KVReceiver protocol over the Mooncake transport."""

    def __init__(self, room: int, rank: int, slot: int, pages: tuple[int, ...]):
        self.room = room
        self.rank = rank
        self.slot = slot
        self.pages = pages
        self._lock = threading.Lock()
        self._pending = BOOTSTRAPPING
        self._visible = BOOTSTRAPPING
        self._reason: str | None = None
        self._pending_fence = False
        self._fenced = False
        self._landed = False
        self._fence_taken = False
        self._left = False                     # clear()ed: the request left the queue
        self.success_at: float | None = None   # monotonic time the Success status arrived
        self._digest: bytes | None = None      # the pending Success's digest, until taken

    # -- called by the transport (any thread) --------------------------------------
    def deliver(self, state: int, reason: str | None = None, at: float | None = None,
                digest: bytes | None = None) -> bool:
        """Advance the pending state; returns False if it was ignored (latched, backwards,
        or a Failed for a request that already left the queue)."""
        with self._lock:
            if self._pending == FAILED or self._pending == SUCCESS and (state != FAILED or self._left):
                return False
            if state == FAILED:
                self._pending, self._reason = FAILED, reason or "failed"
                return True
            if state <= self._pending:
                return False
            self._pending = state
            if state == SUCCESS:
                self.success_at, self._digest = at, digest
            return True

    def take_digest(self) -> bytes | None:
        """The digest of a pending Success, once (None: no Success, none sent, or taken)."""
        with self._lock:
            digest = self._digest if self._pending == SUCCESS and not self._left else None
            self._digest = None if digest is not None else self._digest
            return digest

    def enter_queue(self) -> None:
        """The request enters the transfer queue (its XFER sent, or its failure pending):
        WaitingForInput is visible at once, being the rank's own action rather than news
        from the network; a pending failure becomes visible at the next ``observe``."""
        with self._lock:
            if self._pending == BOOTSTRAPPING:
                self._pending = WAITING
            if self._visible == BOOTSTRAPPING:
                self._visible = WAITING

    def deliver_fence(self) -> None:
        with self._lock:
            self._pending_fence = True

    # -- called by the rank's scheduler thread -----------------------------------------
    def observe(self) -> Observed:
        """Make pending changes visible (latched values never change again)."""
        with self._lock:
            before, fenced_before = self._visible, self._fenced
            if before != FAILED and not self._left:   # Success still yields to a late Failed
                self._visible = self._pending
            self._fenced = self._pending_fence
            now = self._visible
        changed = now != before
        return Observed(kv_done=changed and now == SUCCESS, failed=changed and now == FAILED,
                        fenced=self._fenced and not fenced_before)

    def poll(self) -> int:
        return self._visible

    @property
    def fenced(self) -> bool:
        return self._fenced

    def mark_landed(self) -> None:
        """The rank's own thread saw the whole metadata row land: no write is pending."""
        self._landed = True

    def mark_fence_taken(self) -> None:
        """The rank's own thread took the fence (after the request left the queue)."""
        self._fence_taken = True

    def writes_fenced(self) -> bool:
        """impl.decode's optional hook: True once no write for this request can still
        land in its slot (row landed, or prefill acknowledged the abort). Set only by the
        rank's own thread, so the queue frees slots at the step boundary the trace records."""
        return self._landed or self._fence_taken

    def failure_exception(self) -> Exception | None:
        if self._visible != FAILED:
            return None
        return KVTransferFailed(self.room, self._reason or "failed")

    def clear(self) -> None:
        """Called when the request leaves the queue (the transport forgets it separately):
        from now on nothing the network says changes what this rank decided."""
        with self._lock:
            self._left = True
