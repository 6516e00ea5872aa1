"""Events: what the environment does (per rank, nondeterministic) and the protocol step.

Time arrives only as events: ``Step`` is one scheduler step on all ranks together,
and ages and timeouts count Steps (the spec has no clock).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

ROOM, PAYLOAD = "room", "payload"
FIELDS = (ROOM, PAYLOAD)


@dataclass(frozen=True, slots=True)
class Enqueue:
    """A request enters the transfer queue of every rank in the same step (#21297)."""
    req: int
    room: int       # expected bootstrap_room (64-bit, chosen by the client/router)
    payload: int    # what prefill sends in the metadata row (first output token)
    # The slot each rank gave the request, in rank order, where a trace of a real run
    # names them (its allocator's own choice): each must be free on that rank. None:
    # each rank takes the front of its FIFO free list. The encoding's enqueue takes the
    # named slots too (model/encoding/actions.py), and the refinement check offers them
    # (the last free slot of each rank, and a slot that is not free: refused).
    slots: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class KvDone:
    """This rank's KV pages landed: its receiver reports Success (latched)."""
    rank: int
    req: int


@dataclass(frozen=True, slots=True)
class Land:
    """One field of the request's metadata row becomes visible on this rank, in the
    slot this rank gave the request, even if the request has left and the slot was
    reused since (a late write from a previous tenant)."""
    rank: int
    req: int
    field: str


@dataclass(frozen=True, slots=True)
class Fail:
    """This rank's transfer for the request failed: its receiver reports Failed."""
    rank: int
    req: int


@dataclass(frozen=True, slots=True)
class Fence:
    """Prefill acknowledged the request's abort on this rank: no write for it is still
    in flight, so its slot may be reused (#35049)."""
    rank: int
    req: int


@dataclass(frozen=True, slots=True)
class Step:
    """One scheduler step on all ranks: poll -> gate -> MIN -> pop -> clear -> free."""


Event = Union[Enqueue, KvDone, Land, Fail, Fence, Step]
