"""Drop-in replacements for SGLang's ``poll_and_all_reduce`` and
``poll_and_all_reduce_with_staging``: same argument shapes, the gate applied only when
``decode_reqs`` and ``metadata_buffers`` are given, and the hang-proof collective."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from impl.decode.collective import DEFAULT_TIMEOUT_S, GlooExchange, agree_min
from impl.decode.errors import DecodeInputError, PeerAbortedStep
from impl.decode.gate import check_polls, gate_decode_reqs, room_column_of, rooms_tensor
from impl.decode.collective import digest
from model.spec.kvpoll import KVPoll
from model.spec.variants import Variant

_SUCCESS, _TRANSFERRING = int(KVPoll.Success), int(KVPoll.Transferring)


def _reduce(polls: list[int], gloo_group: Any, decode_reqs: Sequence[Any] | None,
            metadata_buffers: Any, variant: str | Variant, ages: Sequence[int] | None,
            capacity: int | None, timeout_s: float, exchange: Any) -> list[int]:
    exchange = exchange or GlooExchange(gloo_group, timeout_s)
    gated = decode_reqs is not None and metadata_buffers is not None
    if capacity is None and gated:
        capacity = int(room_column_of(metadata_buffers).shape[0])
    error: DecodeInputError | None = None
    fingerprint = None
    try:
        values = check_polls(polls)
        if gated:
            values = gate_decode_reqs(polls, decode_reqs, metadata_buffers, variant, ages)
        if decode_reqs is not None:
            fingerprint = digest(rooms_tensor([d.req.bootstrap_room or 0 for d in decode_reqs],
                                              rid_of=lambda i: decode_reqs[i].req.rid))
    except DecodeInputError as exc:
        error = exc
    if error is not None:
        values = torch.empty(0, dtype=torch.uint8)
    try:
        reduced = agree_min(exchange, values, fingerprint=fingerprint, ok=error is None,
                            capacity=capacity)
    except PeerAbortedStep:
        if error is not None:
            raise error from None
        raise
    return reduced.tolist()


def poll_and_all_reduce(pollers: Sequence[Any], gloo_group: Any, decode_reqs: Sequence[Any] | None = None,
                        metadata_buffers: Any = None, *, variant: str | Variant = "gate",
                        ages: Sequence[int] | None = None, capacity: int | None = None,
                        timeout_s: float = DEFAULT_TIMEOUT_S, exchange: Any = None) -> list[int]:
    """Poll every poller, gate (when given the requests and buffers), MIN over the group.

    Returns the reduced polls. ``capacity`` fixes the collective's shape (default: the
    number of metadata slots when gated, else a header collective goes first). Raises
    BadPollValue / SlotOutOfRange locally and PeerAbortedStep on the other ranks, and
    CollectiveLengthMismatch / CollectiveTimeout on every rank: never a hang.
    ``exchange`` replaces the gloo group (impl.decode.lockstep, tests).
    """
    polls = [p.poll() for p in pollers]
    return _reduce(polls, gloo_group, decode_reqs, metadata_buffers, variant, ages, capacity,
                   timeout_s, exchange)


def poll_and_all_reduce_with_staging(decode_reqs: Sequence[Any], staging_handler: Any,
                                     gloo_group: Any, metadata_buffers: Any = None, *,
                                     variant: str | Variant = "gate",
                                     ages: Sequence[int] | None = None,
                                     capacity: int | None = None,
                                     timeout_s: float = DEFAULT_TIMEOUT_S,
                                     exchange: Any = None) -> list[int]:
    """SGLang's staging-aware poll: advance each staged scatter, hold Success while a
    receiver's staging is not done, then gate and MIN as ``poll_and_all_reduce``."""
    def staging_pending(d: Any) -> bool:
        return bool(getattr(d.kv_receiver, "require_staging", False)) and not staging_handler.is_done(d)

    for d in decode_reqs:
        if staging_pending(d):
            staging_handler.advance_scatter(d)
    polls = [d.kv_receiver.poll() for d in decode_reqs]
    for i, d in enumerate(decode_reqs):
        if polls[i] == _SUCCESS and staging_pending(d):
            polls[i] = _TRANSFERRING
    return _reduce(polls, gloo_group, decode_reqs, metadata_buffers, variant, ages, capacity,
                   timeout_s, exchange)
