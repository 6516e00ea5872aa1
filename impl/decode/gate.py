"""The metadata gate and the pop decisions, vectorized by running the spec's own kernel
(``model.spec.kernel``) on tensors: the kernel is written over a small algebra (``Ops``),
and ``TORCH`` below is that algebra on torch tensors. So there is no second copy of the
rules here, only a different arithmetic (and the tests check the two agree).

Rooms travel as int64 tensors holding the uint64 bits: equality and "is zero", the only
operations the kernel applies to rooms, are the same on both.
"""
from __future__ import annotations

import dataclasses
from operator import attrgetter
from typing import Any, Callable, Sequence

import numpy as np
import torch

from impl.decode.errors import BadPollValue, RoomOutOfRange, SlotOutOfRange
from model.spec.kernel import Decision, Ops, gated_poll, pop_decision
from model.spec.kvpoll import KVPoll
from model.spec.variants import Variant, get_variant

FAKE_BOOTSTRAP_HOST = "2.2.2.2"     # SGLang's fake transfers: no metadata, no gate


def is_fake_transfer(host: object, fake_backend: bool) -> bool:
    """SGLang's ``_is_fake_transfer``: the fake host, or no host with the ``fake`` backend."""
    return host == FAKE_BOOTSTRAP_HOST or (host is None and fake_backend)
POLL_SET = frozenset(int(p) for p in KVPoll)
_MAX_POLL = max(POLL_SET)
_POLL_BYTES = bytes(sorted(POLL_SET))


# The kernel mixes arrays with Python bools (constant parts of a rule): those fold here
# instead of becoming array ops. Python's True/False are singletons, so ``is`` tells them
# from array elements (numpy's bool_ is not a bool).
def _and(*xs: Any) -> Any:
    out: Any = True
    for x in xs:
        if x is False:
            return False
        if x is not True:
            out = x if out is True else out & x
    return out


def _ite(c: Any, a: Any, b: Any) -> Any:
    if c is True or c is False:
        return a if c else b
    return torch.where(c, a, b)


def _np_ite(c: Any, a: Any, b: Any) -> Any:
    if c is True or c is False:
        return a if c else b
    return np.where(c, a, b)


def _not(x: Any) -> Any:
    return (x is False) if (x is True or x is False) else ~x


TORCH = Ops(ite=_ite, and_=_and, not_=_not, eq=lambda a, b: a == b, ge=lambda a, b: a >= b,
            false=False)
# The same algebra on numpy arrays: for cpu tensors (zero-copy views), numpy's per-op
# overhead is a few times lower than torch's at these sizes (bench/bench_gate.py).
NUMPY = Ops(ite=_np_ite, and_=_and, not_=_not, eq=lambda a, b: a == b, ge=lambda a, b: a >= b,
            false=False)


def _backend(t: torch.Tensor, backend: str | None) -> str:
    if backend is None:
        return "numpy" if t.device.type == "cpu" else "torch"
    if backend not in ("numpy", "torch"):
        raise ValueError(f"backend must be numpy or torch, got {backend!r}")
    return backend


def resolve_variant(variant: str | Variant, timeout_steps: int | None = None,
                    release_timeout_steps: int | None = None) -> Variant:
    """A spec variant by name (or as given), with strict's timeout and the deferred
    variants' release timeout overridden where given (by name only).

    The queue reads only the Variant's fields, so it runs every variant of the spec: the
    deployable ones (gate, strict) and, for conformance replays, SGLang's history and
    strict's ablations. Unknown names raise ValueError."""
    if isinstance(variant, Variant):      # as given (a trace's own variant): no overrides
        return variant
    return get_variant(variant, timeout_steps, release_timeout_steps)


def gate_tensor(v: Variant, local: torch.Tensor, room_seen: torch.Tensor,
                expected: torch.Tensor, age: torch.Tensor | int = 0,
                real: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """Per-request value each rank puts into the MIN (``kernel.gated_poll`` on tensors).

    ``real`` masks out fake transfers, which keep their local poll (no gate).
    ``backend``: "numpy" (default on cpu) or "torch" (default elsewhere)."""
    if _backend(local, backend) == "numpy":
        return torch.from_numpy(gate_array(v, *_numpy_views(local, room_seen, expected, age, real)))
    gated = gated_poll(v, local, room_seen, expected, age, TORCH)
    if not isinstance(gated, torch.Tensor):
        gated = local
    gated = gated.to(torch.uint8) if gated.dtype != torch.uint8 else gated
    return gated if real is None else torch.where(real, gated, local)


def decide_tensor(v: Variant, reduced: torch.Tensor, room_seen: torch.Tensor,
                  expected: torch.Tensor, real: torch.Tensor | None = None,
                  backend: str | None = None) -> torch.Tensor:
    """Per-request ``Decision`` after the MIN (``kernel.pop_decision`` on tensors).

    A fake transfer decides as if its room matched: commit on Success, abort on Failed."""
    if _backend(reduced, backend) == "numpy":
        return torch.from_numpy(decide_array(v, *_numpy_views(reduced, room_seen, expected, real)))
    if real is not None:
        room_seen = torch.where(real, room_seen, 1)
        expected = torch.where(real, expected, 1)
    out = pop_decision(v, reduced, room_seen, expected, TORCH)
    return out if isinstance(out, torch.Tensor) else torch.full_like(reduced, int(out),
                                                                     dtype=torch.int64)


def _numpy_views(*xs: Any) -> tuple:
    return tuple(x.numpy() if isinstance(x, torch.Tensor) else x for x in xs)


def numpy_ops_knowing(array: np.ndarray, value: int) -> Ops:
    """NUMPY, with ``array == value`` worked out once: for an array that does not change
    while these Ops are in use (the queue's expected rooms between queue changes). When
    no element matches, the comparison is Python's False, so the kernel folds the rule
    that depends on it away instead of evaluating it per element at every step."""
    known = array == value
    answer: Any = known if known.any() else False

    def eq(a: Any, b: Any) -> Any:
        if a is array and type(b) is int and b == value:
            return answer
        return a == b
    return dataclasses.replace(NUMPY, eq=eq)


def gate_array(v: Variant, local: np.ndarray, room_seen: np.ndarray, expected: np.ndarray,
               age: np.ndarray | int = 0, real: np.ndarray | None = None,
               ops: Ops = NUMPY) -> np.ndarray:
    """``gate_tensor`` on numpy arrays (cpu tensors' zero-copy views): uint8 gated polls.
    ``ops``: NUMPY, or ``numpy_ops_knowing`` for this ``expected``."""
    gated = gated_poll(v, local, room_seen, expected, age, ops)
    if not isinstance(gated, np.ndarray):
        gated = local
    gated = gated if gated.dtype == np.uint8 else gated.astype(np.uint8)
    return gated if real is None else np.where(real, gated, local)


def decide_array(v: Variant, reduced: np.ndarray, room_seen: np.ndarray, expected: np.ndarray,
                 real: np.ndarray | None = None) -> np.ndarray:
    """``decide_tensor`` on numpy arrays: int64 ``Decision`` values."""
    if real is not None:
        room_seen = np.where(real, room_seen, 1)
        expected = np.where(real, expected, 1)
    out = pop_decision(v, reduced, room_seen, expected, NUMPY)
    if isinstance(out, np.ndarray):
        return out.astype(np.int64, copy=False)
    return np.full(reduced.shape, int(out), dtype=np.int64)


# Representatives of every (room_seen == 0, room_seen == expected, expected == 0) case the
# kernel can tell apart (it only compares rooms for equality, with each other and with 0).
_ROOM_CASES = ((0, 0), (0, 1), (1, 1), (1, 2), (1, 0))


def may_pop(v: Variant) -> np.ndarray:
    """For each reduced poll value 0..4, whether the spec's ``pop_decision`` can let a
    request leave. Lets a step whose MIN holds only other values skip the decisions;
    derived from the kernel itself, so it cannot disagree with it."""
    return np.array([any(pop_decision(v, r, s, e) != int(Decision.KEEP) for s, e in _ROOM_CASES)
                     for r in range(_MAX_POLL + 1)], dtype=bool)


def poll_bytes(polls: Sequence[Any], rid_of: Callable[[int], str] | None = None) -> bytearray:
    """The polls as bytes, refusing anything that is not a KVPoll int.

    ``bytearray`` does the type and 0..255 check and ``translate`` the KVPoll check, both
    at C speed (a bool counts as the int it is); the slow loop only names the offender."""
    try:
        raw = bytearray(polls)
        if not raw.translate(None, _POLL_BYTES):       # nothing left once valid polls go
            return raw
    except (TypeError, ValueError):
        pass
    for i, p in enumerate(polls):
        if not isinstance(p, int) or int(p) not in POLL_SET:
            raise BadPollValue(rid_of(i) if rid_of is not None else None, p)
    raise AssertionError("unreachable")


def check_polls(polls: Sequence[Any], rid_of: Callable[[int], str] | None = None) -> torch.Tensor:
    """The polls as a uint8 tensor (see ``poll_bytes``)."""
    raw = poll_bytes(polls, rid_of)
    return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


_SLOT = attrgetter("metadata_buffer_index")
_ROOM = attrgetter("req.bootstrap_room")
_HOST = attrgetter("req.bootstrap_host")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _all_ints(values: Sequence[Any]) -> bool:
    """Every value an int (not a bool), checked per distinct type at C speed."""
    return all(t is int or (issubclass(t, int) and t is not bool) for t in set(map(type, values)))


def rooms_tensor(rooms: Sequence[int], device: torch.device | str = "cpu",
                 rid_of: Callable[[int], str] | None = None) -> torch.Tensor:
    """Expected rooms (0..2^64-1) as an int64 tensor with the same bits."""
    try:
        if not _all_ints(rooms):
            raise TypeError("not an int")
        arr = np.fromiter(rooms, np.uint64, count=len(rooms))
        return torch.from_numpy(arr).view(torch.int64).to(device)
    except (TypeError, ValueError, OverflowError):
        for i, r in enumerate(rooms):
            if not _is_int(r) or not 0 <= r < 2**64:
                raise RoomOutOfRange(rid_of(i) if rid_of is not None else str(i), r) from None
        raise


def gather_rooms(room_column: torch.Tensor, slots: torch.Tensor, check: bool = True) -> torch.Tensor:
    """The one gather: the sentinel each queued request's slot holds now."""
    if check and slots.numel():
        bad = (slots < 0) | (slots >= room_column.shape[0])
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise SlotOutOfRange(int(slots[i]), room_column.shape[0])
    return room_column.index_select(0, slots)


def apply_metadata_gate(polls: list[int], decode_reqs: Sequence[Any], metadata_buffers: Any,
                        variant: str | Variant = "gate", ages: Sequence[int] | None = None,
                        ) -> list[int]:
    """SGLang's ``_apply_metadata_gate`` shape, vectorized: returns the gated polls and
    also writes them into ``polls`` (SGLang mutates in place). See ``gate_decode_reqs``."""
    gated = gate_decode_reqs(polls, decode_reqs, metadata_buffers, variant, ages)
    polls[:] = gated.tolist()
    return polls


def gate_decode_reqs(polls: list[int], decode_reqs: Sequence[Any], metadata_buffers: Any,
                     variant: str | Variant = "gate", ages: Sequence[int] | None = None,
                     ) -> torch.Tensor:
    """The gated polls (uint8 tensor) for SGLang's argument shapes: one gather, no .item().

    ``decode_reqs[i].req.bootstrap_room`` / ``.req.bootstrap_host`` /
    ``.metadata_buffer_index`` and ``metadata_buffers.bootstrap_room`` (size, 8) are
    read as SGLang lays them out. ``ages`` (steps polled so far) feeds strict's timeout.
    Raises a DecodeInputError with ``polls`` untouched on bad input.
    """
    v = resolve_variant(variant)
    n = len(polls)
    if len(decode_reqs) != n:
        raise ValueError(f"{n} polls for {len(decode_reqs)} decode requests")
    local = check_polls(polls)
    if n == 0:
        return local
    room_col = room_column_of(metadata_buffers)
    dev = room_col.device
    # C-level attribute reads (map + attrgetter + fromiter): no per-request bytecode
    slot_list = list(map(_SLOT, decode_reqs))
    if not _all_ints(slot_list):
        bad = next(x for x in slot_list if not _is_int(x))
        raise SlotOutOfRange(bad, int(room_col.shape[0]))
    slots = torch.from_numpy(np.fromiter(slot_list, np.int64, count=n)).to(dev)
    expected = rooms_tensor(list(map(_ROOM, decode_reqs)), dev,
                            lambda i: decode_reqs[i].req.rid)
    hosts = list(map(_HOST, decode_reqs))
    real = (torch.tensor([h != FAKE_BOOTSTRAP_HOST for h in hosts], device=dev)
            if FAKE_BOOTSTRAP_HOST in set(hosts) else None)
    age = torch.tensor(list(ages), dtype=torch.int64, device=dev) if ages is not None else 0
    local = local.to(dev)
    seen = gather_rooms(room_col, slots)
    return gate_tensor(v, local, seen, expected, age, real)


def room_column_of(metadata_buffers: Any) -> torch.Tensor:
    """Column 0 of ``bootstrap_room`` as int64 (ours or an SGLang MetadataBuffers)."""
    col = getattr(metadata_buffers, "room_column", None)
    if col is not None:
        return col
    room = metadata_buffers.bootstrap_room
    return (room.view(torch.int64) if room.dtype == torch.uint64 else room.to(torch.int64))[:, 0]


__all__ = ["FAKE_BOOTSTRAP_HOST", "is_fake_transfer", "TORCH", "Decision", "apply_metadata_gate", "check_polls",
           "decide_tensor", "gate_tensor", "gather_rooms", "resolve_variant", "rooms_tensor"]
