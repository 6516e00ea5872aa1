"""Drop-in replacements for SGLang's ``poll_and_all_reduce`` and
``poll_and_all_reduce_with_staging``: every release's call shapes (0.5.12 to 0.5.23), the
gate applied only when ``decode_reqs`` and ``metadata_buffers`` are given, and the
hang-proof collective.

| release | ``poll_and_all_reduce`` | ``..._with_staging`` |
|---|---|---|
| 0.5.12 | ``(pollers, gloo_group)`` | ``(decode_reqs, staging_handler, gloo_group)`` |
| 0.5.13-0.5.18 | ``+ decode_reqs, metadata_buffers, server_args`` | ``+ metadata_buffers, server_args`` |
| 0.5.19-0.5.21 | ``(pollers, gloo_group, decode_reqs, metadata_buffers)`` | ``(..., metadata_buffers)`` |
| 0.5.22-0.5.23 | same | ``+ pollers`` |

Fake transfers (SGLang's ``_is_fake_transfer``) keep their local poll: ``bootstrap_host ==
"2.2.2.2"``, or ``bootstrap_host is None`` with the ``fake`` transfer backend (read from
``server_args`` where the release passes it, else from ``transfer_backend=``). A staging
handler with ``is_failed`` (0.5.18+) turns a failed staging into Failed before the MIN.

Speed: what is constant per queued request (its slot, expected room, fakeness and the
queue's digest) is cached, keyed by the request objects in order: a list comparison,
which checks identity first (the cache holds the objects, so none can be replaced by
another at the same address while cached); a step whose queue holds the same requests
as the last one costs the N ``poll()`` calls plus a few vectorized ops and the one
fixed-shape MIN (``bench/bench_gate.py``). SGLang sets those attributes before a request
enters the transfer queue and never changes them there (code that does must not use the
drop-in), and its ``DecodeRequest`` compares equal only to itself in practice (a
dataclass whose fields include its ``Req`` and receiver, which compare by identity).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from impl.decode.collective import DEFAULT_TIMEOUT_S, GlooExchange, Message, agree_min, digest
from impl.decode.errors import DecodeInputError, PeerAbortedStep, SlotOutOfRange
from impl.decode.gate import (NUMPY, _all_ints, _is_int, gate_array, is_fake_transfer,
                              numpy_ops_knowing, poll_bytes, resolve_variant, room_column_of,
                              rooms_tensor)
from model.spec.kvpoll import KVPoll
from model.spec.variants import Variant

_SUCCESS, _TRANSFERRING, _FAILED = int(KVPoll.Success), int(KVPoll.Transferring), int(KVPoll.Failed)
_CACHED_QUEUES = 16          # (group, buffers) pairs remembered: one per TP rank in-process


@dataclass
class _Queue:
    """The per-request constants of one queue, as numpy arrays."""
    reqs: list                      # the request objects (keeps their ids from reuse)
    buffers: Any                    # the metadata buffers the slots were checked against
    slots: np.ndarray | None
    expected: np.ndarray | None
    real: np.ndarray | None         # None: no fake transfer in the queue
    fingerprint: torch.Tensor
    ops: Any                        # NUMPY knowing which expected rooms are 0


class _Cache:
    """One ``_Queue``, exchange and message per (group, buffers); bounded, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[tuple, _Queue] = {}
        self._exchanges: dict[tuple, GlooExchange] = {}
        self._messages: dict[tuple, Message] = {}

    def exchange(self, group: Any, timeout_s: float) -> GlooExchange:
        key = (id(group), timeout_s)          # the exchange holds the group: ids stay unique
        ex = self._exchanges.get(key)
        if ex is None:
            with self._lock:
                ex = self._exchanges[key] = GlooExchange(group, timeout_s)
                _bound(self._exchanges)
        return ex

    def message(self, owner: Any, capacity: int) -> Message:
        key = (id(owner), capacity)
        msg = self._messages.get(key)
        if msg is None:
            with self._lock:
                msg = self._messages[key] = Message(capacity)
                _bound(self._messages)
        return msg

    def queue(self, owner: Any, buffers: Any, decode_reqs: Sequence[Any], fake_host_none: bool,
              gated: bool) -> _Queue:
        key = (id(owner), id(buffers), fake_host_none, gated)
        q = self._queues.get(key)
        same = decode_reqs if type(decode_reqs) is list else list(decode_reqs)
        if q is not None and q.buffers is buffers and q.reqs == same:   # identity first
            return q
        q = _build_queue(decode_reqs, buffers, fake_host_none, gated)
        with self._lock:
            self._queues[key] = q
            _bound(self._queues)
        return q


def _bound(d: dict) -> None:
    while len(d) > _CACHED_QUEUES:
        del d[next(iter(d))]


_CACHE = _Cache()


def _build_queue(decode_reqs: Sequence[Any], buffers: Any,
                 fake_host_none: bool, gated: bool) -> _Queue:
    """Read the per-request constants once (raises a DecodeInputError on bad ones)."""
    n = len(decode_reqs)
    reqs = list(decode_reqs)
    rid_of: Callable[[int], str] = lambda i: decode_reqs[i].req.rid
    rooms = [d.req.bootstrap_room or 0 for d in reqs]
    expected_t = rooms_tensor(rooms, rid_of=rid_of)
    fingerprint = digest(expected_t)
    if not gated:
        return _Queue(reqs, buffers, None, None, None, fingerprint, NUMPY)
    slot_list = [d.metadata_buffer_index for d in reqs]
    size = int(room_column_of(buffers).shape[0])
    if not _all_ints(slot_list):
        raise SlotOutOfRange(next(x for x in slot_list if not _is_int(x)), size)
    slots = np.fromiter(slot_list, np.int64, count=n)
    bad = (slots < 0) | (slots >= size)
    if bad.any():
        raise SlotOutOfRange(int(slots[int(np.argmax(bad))]), size)
    hosts = [d.req.bootstrap_host for d in reqs]
    fake = [is_fake_transfer(h, fake_host_none) for h in hosts]
    real = ~np.array(fake, dtype=bool) if any(fake) else None
    expected = expected_t.numpy()
    return _Queue(reqs, buffers, slots, expected, real, fingerprint,
                  numpy_ops_knowing(expected, 0))


def fake_backend(server_args: Any, transfer_backend: str | None) -> bool:
    """Whether the transfer backend is ``fake``: the call's ``server_args`` when given,
    else the configured ``transfer_backend``."""
    backend = getattr(server_args, "disaggregation_transfer_backend", None) \
        if server_args is not None else transfer_backend
    return backend == "fake"


def _reduce(polls: Sequence[Any], gloo_group: Any,
            decode_reqs: Sequence[Any] | None, metadata_buffers: Any, variant: str | Variant,
            ages: Sequence[int] | None, capacity: int | None, timeout_s: float, exchange: Any,
            fake_host_none: bool, trace: Callable[[list], None] | None) -> list[int]:
    exchange = exchange or _CACHE.exchange(gloo_group, timeout_s)
    owner = exchange
    gated = decode_reqs is not None and metadata_buffers is not None
    room_col = room_column_of(metadata_buffers) if gated else None
    if capacity is None and gated:
        capacity = int(room_col.shape[0])
    error: DecodeInputError | None = None
    fingerprint = None
    values: Any = None
    n = len(polls)
    try:
        raw = poll_bytes(polls)          # bytes at C speed; refuses non-KVPoll values
        local = np.frombuffer(raw, dtype=np.uint8) if n else np.empty(0, np.uint8)
        values = local
        if decode_reqs is not None:
            if len(decode_reqs) != n:
                raise ValueError(f"{n} polls for {len(decode_reqs)} decode requests")
            q = _CACHE.queue(owner, metadata_buffers, decode_reqs, fake_host_none, gated)
            fingerprint = q.fingerprint
            if gated and n:
                v = resolve_variant(variant)
                seen = room_col.numpy()[q.slots] if room_col.device.type == "cpu" else \
                    room_col.index_select(0, torch.from_numpy(q.slots).to(room_col.device)).cpu().numpy()
                age: Any = np.asarray(ages, dtype=np.int64) if ages is not None else 0
                values = gate_array(v, local, seen, q.expected, age, q.real, q.ops)
    except DecodeInputError as exc:
        error = exc
        values = np.empty(0, np.uint8)
    if trace is not None:
        trace(values.tolist())
    try:
        if capacity is not None:
            reduced_np = _CACHE.message(owner, capacity).reduce(
                exchange, values, int(values.shape[0]), fingerprint, error is None)
            reduced = reduced_np.tolist()
        else:
            reduced = agree_min(exchange, torch.from_numpy(np.ascontiguousarray(values)),
                                fingerprint=fingerprint, ok=error is None).tolist()
    except PeerAbortedStep:
        if error is not None:
            raise error from None
        raise
    return reduced


def poll_and_all_reduce(pollers: Sequence[Any], gloo_group: Any, decode_reqs: Sequence[Any] | None = None,
                        metadata_buffers: Any = None, server_args: Any = None, *,
                        variant: str | Variant = "gate", ages: Sequence[int] | None = None,
                        capacity: int | None = None, transfer_backend: str | None = None,
                        timeout_s: float = DEFAULT_TIMEOUT_S, exchange: Any = None,
                        trace: Callable[[list], None] | None = None) -> list[int]:
    """Poll every poller, gate (when given the requests and buffers), MIN over the group.

    Returns the reduced polls. ``capacity`` fixes the collective's shape (default: the
    number of metadata slots when gated, else a header collective goes first). Raises
    BadPollValue / SlotOutOfRange locally and PeerAbortedStep on the other ranks, and
    CollectiveLengthMismatch / CollectiveTimeout on every rank: never a hang.
    ``exchange`` replaces the gloo group (impl.decode.lockstep, tests); ``trace(gated)``
    sees what each call puts into the MIN (pdgate conform).
    """
    return _reduce([p.poll() for p in pollers], gloo_group, decode_reqs, metadata_buffers, variant, ages,
                   capacity, timeout_s, exchange, fake_backend(server_args, transfer_backend),
                   trace)


def poll_and_all_reduce_with_staging(decode_reqs: Sequence[Any], staging_handler: Any,
                                     gloo_group: Any, metadata_buffers: Any = None,
                                     server_args: Any = None, pollers: Sequence[Any] | None = None,
                                     *, variant: str | Variant = "gate",
                                     ages: Sequence[int] | None = None,
                                     capacity: int | None = None,
                                     transfer_backend: str | None = None,
                                     timeout_s: float = DEFAULT_TIMEOUT_S,
                                     exchange: Any = None,
                                     trace: Callable[[list], None] | None = None) -> list[int]:
    """SGLang's staging-aware poll: advance each staged scatter, Failed where the staging
    failed (handlers with ``is_failed``), hold Success while a receiver's staging is not
    done, then gate and MIN as ``poll_and_all_reduce``."""
    def staging(d: Any) -> bool:
        return bool(getattr(d.kv_receiver, "require_staging", False))

    is_failed = getattr(staging_handler, "is_failed", None)
    for d in decode_reqs:
        if staging(d) and not staging_handler.is_done(d):
            staging_handler.advance_scatter(d)
    polls = [p.poll() for p in (pollers if pollers is not None else
                                [d.kv_receiver for d in decode_reqs])]
    for i, d in enumerate(decode_reqs):
        if not staging(d):
            continue
        if is_failed is not None and is_failed(d):
            polls[i] = _FAILED
        elif polls[i] == _SUCCESS and not staging_handler.is_done(d):
            polls[i] = _TRANSFERRING
    return _reduce(polls, gloo_group, decode_reqs, metadata_buffers, variant, ages,
                   capacity, timeout_s, exchange, fake_backend(server_args, transfer_backend),
                   trace)
