"""The MIN agreement across TP ranks, made impossible to hang or mix silently.

One uint8 all-reduce(MIN) per step, of the same shape on every rank (SGLang #36928's
proposal): a header, then the polls padded to the shape (``capacity`` for a fixed
Message; for the queue's AdaptiveMessage a power of two that follows the agreed length).
The header carries a status byte and the queue's length and content digest twice, as
bytes and as their complements (255 - b): after a MIN, b_min + c_min == 255 at every
position iff all ranks sent the same bytes. So one collective both reduces and proves
the ranks reduced the same queue; on the rare failure a second small collective
(all_gather) names every rank's length. Every collective waits at most ``timeout_s``.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Sequence

import numpy as np
import torch
import torch.distributed as dist

from impl.decode.errors import (CollectiveFailed, CollectiveLengthMismatch, CollectiveTimeout,
                                PeerAbortedStep, QueueContentMismatch)

LEN_BYTES, DIGEST_BYTES = 4, 8
_PAYLOAD = LEN_BYTES + DIGEST_BYTES
HEADER = 1 + 2 * _PAYLOAD               # status, (length, digest), their complements
DEFAULT_TIMEOUT_S = 30.0
_PAD = 255
# odd 64-bit mixing constants, as signed int64 (torch wraps on overflow)
_K1, _K2, _K3 = 0x9E3779B97F4A7C15 - 2**64, 0x632BE59BD9B4E019, 0xD6E8FEB86659FD93 - 2**64


@dataclass(frozen=True)
class Agreement:
    """What one rank learned from the header after the MIN."""
    ok: bool              # every rank sent status 1
    same: bool            # every rank sent the same length and digest


def digest(rooms: torch.Tensor) -> torch.Tensor:
    """An order-sensitive 64-bit fingerprint of the queue (its expected rooms), as a
    1-element int64 tensor; wraps on overflow, which is fine for a fingerprint."""
    if rooms.numel() == 0:
        return torch.zeros(1, dtype=torch.int64)
    w = torch.arange(1, rooms.numel() + 1, dtype=torch.int64, device=rooms.device)
    x = rooms * _K1 + w * _K2           # bind each room to its position...
    x = (x ^ (x >> 31)) * _K3            # ...then mix non-linearly so a sum cannot cancel
    return (x ^ (x >> 29)).sum().reshape(1).cpu()


def header(length: int, fingerprint: torch.Tensor | None, ok: bool) -> torch.Tensor:
    """Status byte, then length and digest bytes, then their complements."""
    fp = fingerprint.numpy().tobytes() if fingerprint is not None else bytes(DIGEST_BYTES)
    payload = length.to_bytes(LEN_BYTES, "big") + fp
    raw = bytes([1 if ok else 0]) + payload + bytes(255 - b for b in payload)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class Message:
    """A reusable fixed-shape buffer for one rank's step message. The header is rebuilt
    only when the queue changed; the padding is never reset because nobody reads it
    (only the first ``length`` values, and only once every rank agreed on ``length``)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buf = torch.full((HEADER + capacity,), _PAD, dtype=torch.uint8)
        self._np = self.buf.numpy()          # same memory; numpy slicing costs less per call
        self._key: tuple | None = None
        self._fingerprint: torch.Tensor | None = None
        self._header = b""
        self._header_np = np.zeros(HEADER, dtype=np.uint8)

    def fill(self, values: torch.Tensor | np.ndarray, length: int,
             fingerprint: torch.Tensor | None, ok: bool) -> torch.Tensor:
        if (length, ok) != self._key or fingerprint is not self._fingerprint:
            self._header_np = header(length, fingerprint, ok).numpy()
            self._header = self._header_np.tobytes()
            self._key, self._fingerprint = (length, ok), fingerprint
        self._np[:HEADER] = self._header_np
        n = min(length, self.capacity)      # a longer queue sends its length, not its values
        if ok and n:
            v = values.numpy() if isinstance(values, torch.Tensor) else values
            self._np[HEADER:HEADER + n] = v if n == length else v[:n]
        return self.buf

    def agreed(self) -> bool:
        """After the MIN, in place: did every rank send status 1 and this rank's length and
        digest? The reduced header equals ours iff so: min(b) == b and min(255 - b) ==
        255 - b means no rank sent less or more than b."""
        return self._key is not None and self._key[1] and \
            self._np[:HEADER].tobytes() == self._header

    def reduce(self, exchange: Any, values: torch.Tensor | np.ndarray, length: int,
               fingerprint: torch.Tensor | None, ok: bool) -> np.ndarray:
        """One step's collective: fill, MIN in place, check the header. Returns the
        reduced values (a view into the buffer, valid until the next fill) or raises the
        error that explains the disagreement on every rank."""
        if length > self.capacity:
            raise ValueError(f"queue of {length} exceeds the collective capacity {self.capacity}")
        exchange.all_reduce_min(self.fill(values, length, fingerprint, ok))
        if self.agreed():
            return self._np[HEADER:HEADER + length]
        disagree(exchange, length, fingerprint, ok)


class AdaptiveMessage:
    """The step message of a queue, shaped by the queue's *agreed* length instead of its
    capacity: ``shape`` values, a power of two >= MIN_SHAPE. It changes only right after
    every rank agreed on a length (grows when the length exceeds it, shrinks when the
    length falls to a quarter), so it is the same function of the same history on every
    rank and every collective still has the same shape on every rank. A queue longer
    than the shape sends its header only; once all ranks agree on that length the
    values go in a second collective of the new shape (rare: doublings only)."""

    MIN_SHAPE = 64

    def __init__(self) -> None:
        self._msg = Message(self.MIN_SHAPE)

    @property
    def shape(self) -> int:
        return self._msg.capacity

    def _next_shape(self, length: int) -> int:
        shape = self.shape
        if length > shape or (shape > self.MIN_SHAPE and length <= shape // 4):
            return max(self.MIN_SHAPE, 1 << max(0, length - 1).bit_length())
        return shape

    def reduce(self, exchange: Any, values: np.ndarray | torch.Tensor, length: int,
               fingerprint: torch.Tensor | None, ok: bool) -> np.ndarray:
        """As ``Message.reduce``; the result is valid until the next call."""
        msg = self._msg
        exchange.all_reduce_min(msg.fill(values, length, fingerprint, ok))
        if not msg.agreed():
            disagree(exchange, length, fingerprint, ok)
        shape = self._next_shape(length)          # every rank agreed on length: same shape
        if shape != msg.capacity:
            self._msg = Message(shape)
        if length <= msg.capacity:
            return msg._np[HEADER:HEADER + length]
        return self._msg.reduce(exchange, values, length, fingerprint, ok)


def read_header(reduced: torch.Tensor) -> Agreement:
    h = bytes(reduced.numpy()[:HEADER])
    same = all(a + b == 255 for a, b in zip(h[1:1 + _PAYLOAD], h[1 + _PAYLOAD:HEADER]))
    return Agreement(ok=h[0] == 1, same=same)


def raise_disagreement(rows: Sequence[Sequence[int]]) -> None:
    """Given every rank's (status, length, digest), raise the error that explains it."""
    aborted = [k for k, r in enumerate(rows) if r[0] != 1]
    if aborted:
        raise PeerAbortedStep(aborted)
    lengths = [r[1] for r in rows]
    if len(set(lengths)) > 1:
        raise CollectiveLengthMismatch(lengths)
    differ = [k for k, r in enumerate(rows) if r[2] != rows[0][2]]
    raise QueueContentMismatch(differ or list(range(len(rows))))


class GlooExchange:
    """Runs the collectives of one step on a (gloo) process group with a timeout each."""

    def __init__(self, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        if timeout_s <= 0:
            raise ValueError(f"collective timeout must be > 0 s, got {timeout_s}")
        self.group = group
        self.timeout_s = timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def _wait(self, what: str, start: Callable[[], Any]) -> None:
        try:
            work = start()
            finished = work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise CollectiveTimeout(what, self.timeout_s) from exc
            raise CollectiveFailed(what, exc) from exc
        if finished is False:            # some backends report a timeout by returning False
            raise CollectiveTimeout(what, self.timeout_s)

    def all_reduce_min(self, msg: torch.Tensor) -> torch.Tensor:
        self._wait(f"all_reduce(MIN) of {msg.numel()} bytes",
                   lambda: dist.all_reduce(msg, op=dist.ReduceOp.MIN, group=self.group,
                                           async_op=True))
        return msg

    def all_gather_rows(self, row: list[int]) -> list[list[int]]:
        mine = torch.tensor(row, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._wait("all_gather of queue headers",
                   lambda: dist.all_gather(out, mine, group=self.group, async_op=True))
        return [t.tolist() for t in out]


def fingerprint_row(length: int, fingerprint: torch.Tensor | None, ok: bool) -> list[int]:
    return [1 if ok else 0, length, int(fingerprint[0]) if fingerprint is not None else 0]


def disagree(exchange: Any, length: int, fingerprint: torch.Tensor | None, ok: bool) -> NoReturn:
    """The ranks did not all send status 1 with the same header: a second, small
    collective learns every rank's (status, length, digest) and raises the same error
    on every rank."""
    raise_disagreement(exchange.all_gather_rows(fingerprint_row(length, fingerprint, ok)))
    raise AssertionError("unreachable")


def agree_min(exchange: GlooExchange, values: torch.Tensor, *, fingerprint: torch.Tensor | None = None,
              ok: bool = True, capacity: int | None = None,
              message: Message | None = None) -> torch.Tensor:
    """Element-wise MIN of ``values`` (uint8) over every rank of the group.

    Raises CollectiveLengthMismatch / QueueContentMismatch / PeerAbortedStep on every
    rank when they disagree, CollectiveTimeout when a peer never arrives. ``ok=False``
    says this rank has a local error: it still takes part, so its peers fail fast too.
    With ``capacity`` the step needs one collective; without it, the header goes first.
    ``message`` (a Message of that capacity) is reused instead of a fresh buffer; the
    result is then a view into it, valid until the next fill.
    """
    length = int(values.numel())
    if capacity is not None and length > capacity:
        raise ValueError(f"queue of {length} exceeds the collective capacity {capacity}")
    if capacity is None:
        head = exchange.all_reduce_min(header(length, fingerprint, ok))
        agreement = read_header(head)
        if agreement.ok and agreement.same:
            body = values.to(torch.uint8).cpu().clone()
            return exchange.all_reduce_min(body) if length else body
        disagree(exchange, length, fingerprint, ok)
    if message is None or message.capacity != capacity:
        message = Message(capacity)
    return torch.from_numpy(message.reduce(exchange, values.cpu(), length, fingerprint, ok))


# -- rendezvous: the gloo store binds the configured host, never every interface ------
def rendezvous_store(host: str, port: int, world: int, *, is_master: bool,
                     timeout_s: float) -> dist.TCPStore:
    """The TCPStore a gloo group meets at, listening on ``host`` only.

    torch's TCPStore master listens on every interface (IPv4 and IPv6) whatever host
    it is given; passing it a socket we bound ourselves (``master_listen_fd``) confines
    it to ``host``. ``port`` 0 picks a free one (read it from ``store.port``). Clients
    just connect. Also points gloo's own pair sockets at the loopback device when
    ``host`` is a loopback address (GLOO_SOCKET_IFNAME, unless the caller set it)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if _is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not is_master:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, world))
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The store owns the descriptor from here on (and closes it): detach it from ours.
    return dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False,
                         timeout=timeout, master_listen_fd=sock.detach())


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"

