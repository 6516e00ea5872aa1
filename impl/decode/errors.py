"""Typed errors of the decode path. Every one leaves the queue and buffers as they were.

``DecodeInputError`` covers bad input from a caller or a receiver (refused before any
state changes); ``CollectiveError`` covers the MIN agreement across TP ranks (raised on
every rank in the same step, never a hang).
"""
from __future__ import annotations

from typing import Sequence


class DecodeError(Exception):
    """Base class of every error impl.decode raises on purpose."""


class DecodeInputError(DecodeError, ValueError):
    """Bad input; nothing was changed."""


class BadPollValue(DecodeInputError):
    def __init__(self, rid: str | None, value: object):
        self.rid, self.value = rid, value
        who = f"request {rid!r}" if rid is not None else "a poller"
        super().__init__(f"{who}: receiver polled {value!r}, outside KVPoll 0..4")


class SlotOutOfRange(DecodeInputError):
    def __init__(self, index: object, size: int, rid: str | None = None):
        self.index, self.size = index, size
        who = f"request {rid!r}: " if rid is not None else ""
        super().__init__(f"{who}metadata slot {index!r} out of range 0..{size - 1}")


class SlotInUse(DecodeInputError):
    def __init__(self, index: int, owner: str, rid: str):
        super().__init__(f"request {rid!r}: metadata slot {index} is still held by request {owner!r}")


class ZeroRoom(DecodeInputError):
    def __init__(self, rid: str):
        super().__init__(f"request {rid!r}: expected bootstrap_room is 0, which a cleared slot "
                         "also reads; a real transfer needs a non-zero room")


class RoomOutOfRange(DecodeInputError):
    def __init__(self, rid: str, room: object):
        super().__init__(f"request {rid!r}: bootstrap_room {room!r} is not an integer in 0..2^64-1")


class DuplicateRoom(DecodeInputError):
    def __init__(self, room: int, owner: str, rid: str):
        super().__init__(f"request {rid!r}: bootstrap_room {room} is already queued for request "
                         f"{owner!r} (SGLang #40125)")


class DuplicateRequest(DecodeInputError):
    def __init__(self, rid: str):
        super().__init__(f"request {rid!r} is already in the transfer queue")


class SlotsExhausted(DecodeInputError):
    """More requests than metadata slots: the caller's input (admission), not a fault of
    the decode path; a batch of replays goes on with the next trace."""

    def __init__(self, size: int):
        super().__init__(f"all {size} metadata slots are in use")


class SlotNotAllocated(DecodeInputError):
    def __init__(self, index: int):
        super().__init__(f"metadata slot {index} is not allocated (double free?)")


class CollectiveError(DecodeError):
    """The per-step agreement across TP ranks failed; raised on every rank."""


class CollectiveLengthMismatch(CollectiveError):
    """Ranks reduce vectors of different lengths (their queues diverged)."""

    def __init__(self, lengths: Sequence[int]):
        self.lengths = tuple(lengths)
        detail = ", ".join(f"rank {k}: {n}" for k, n in enumerate(self.lengths))
        super().__init__(f"collective length mismatch: ranks hold transfer queues of different "
                         f"lengths ({detail})")


class QueueContentMismatch(CollectiveError):
    """Same length, different requests or order: a MIN would mix requests silently."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = tuple(ranks)
        super().__init__(f"collective content mismatch: ranks {list(self.ranks)} queue other "
                         "requests (or another order) than rank 0")


class PeerAbortedStep(CollectiveError):
    """Another rank refused this step (its own input error) and told the others."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = tuple(ranks)
        super().__init__(f"rank(s) {list(self.ranks)} hit a local input error and abandoned "
                         "this step; no request was popped")


class CollectiveTimeout(CollectiveError):
    def __init__(self, what: str, seconds: float):
        super().__init__(f"{what} did not complete within {seconds:g} s (a peer is gone or "
                         "stuck in another collective); rebuild the process group")


class CollectiveFailed(CollectiveError):
    def __init__(self, what: str, cause: BaseException):
        super().__init__(f"{what} failed: {str(cause).splitlines()[0] if str(cause) else cause!r}")
