"""Control frames between decode ranks and a prefill (docs/MOONCAKE.md has the tables).

Every decoder here checks types, lengths and ranges and raises ``FrameError`` (one
line) before the caller touches any buffer; the caller logs and drops the frame.

Every frame also carries the rank it is from or for and an HMAC tag (impl.mooncake.auth);
the transports check the tag before any decoder here runs. Sizes are capped twice:
ZMQ's MAXMSGSIZE on every socket (a bigger frame drops the connection) and the checks
here.

decode -> prefill (ZMQ DEALER -> ROUTER), multipart ``[kind, rank, body, tag]``:
  HELLO  JSON: rank, session, status endpoint, KV pool and metadata field layout,
         and optionally ``digest``: the transfer digest scheme it asks for
  XFER   ``<QHII`` room, rank, slot, n_pages + n_pages x ``<I`` page index
  ABORT  ``<QH`` room, rank
  PING   ``<HQ`` rank, sequence number
prefill -> decode replies ``[kind, body, tag]``: HELLO_OK (JSON: prefill_rank, session,
and ``digest`` if it will send them), ERROR (text), PONG.
prefill -> decode status (PUSH -> PULL), SGLang's three ASCII parts and the tag
``[room, status, prefill_rank, tag]`` with status Failed=0, Success=4 or FENCED=5; a
Success to a rank that negotiated a digest is ``[room, 4, prefill_rank, digest, tag]``
(impl.mooncake.digest: 32 bytes over the KV pages and metadata row it wrote). Peers
that do not ask for digests (no ``digest`` in HELLO) see the three-part frames.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from impl.mooncake.digest import DIGEST_BYTES, SCHEME as DIGEST_SCHEME

HELLO, HELLO_OK, XFER, ABORT, PING, PONG, ERROR = (
    b"HELLO", b"HELLO_OK", b"XFER", b"ABORT", b"PING", b"PONG", b"ERROR")
STATUS_FAILED, STATUS_SUCCESS, STATUS_FENCED = 0, 4, 5
STATUS_VALUES = (STATUS_FAILED, STATUS_SUCCESS, STATUS_FENCED)

MAX_JSON_BYTES = 16 * 1024
MAX_PAGES = 1 << 16
MAX_RANKS = 1 << 12
MAX_FIELDS = 32
_U64 = (1 << 64) - 1
_RANK = struct.Struct("<H")
# ZMQ_MAXMSGSIZE per socket: the largest single part each may receive.
MAX_TO_PREFILL_PART = 18 + 4 * MAX_PAGES + 64      # the largest XFER body, with slack
MAX_REPLY_PART = MAX_JSON_BYTES + 1024
MAX_STATUS_PART = 64                               # 20 digits, or a 32-byte tag
_XFER_HEAD = struct.Struct("<QHII")
_ABORT = struct.Struct("<QH")
_PING = struct.Struct("<HQ")


class FrameError(ValueError):
    """A malformed or out-of-range frame; ``str()`` is one line."""


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FrameError(f"{what} must be an integer in {lo}..{hi}, got {value!r}")
    return value


def _str(value: Any, what: str, max_len: int = 256) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise FrameError(f"{what} must be a non-empty string of at most {max_len} characters")
    return value


def _parts(frames: Sequence[bytes], n: int, what: str) -> Sequence[bytes]:
    if len(frames) != n or not all(isinstance(f, (bytes, bytearray, memoryview)) for f in frames):
        raise FrameError(f"{what}: expected {n} byte frames, got {len(frames)}")
    return frames


def encode_rank(rank: int) -> bytes:
    return _RANK.pack(rank)


def decode_rank(part: bytes) -> int:
    if len(part) != _RANK.size:
        raise FrameError(f"rank part must be {_RANK.size} bytes, got {len(part)}")
    return _RANK.unpack(part)[0]


# -- HELLO: one decode rank's registration ---------------------------------------
@dataclass(frozen=True)
class FieldLayout:
    """One registered metadata field: ``slots`` rows of ``item_bytes`` from ``addr``."""
    name: str
    addr: int
    item_bytes: int
    slots: int


@dataclass(frozen=True)
class Hello:
    rank: int
    session: str            # the decode rank's Mooncake session id (host:rpc_port)
    status_endpoint: str    # where prefill pushes status frames (tcp://host:port)
    kv_addr: int
    page_bytes: int
    pages: int
    fields: tuple[FieldLayout, ...]
    room_field: str = "bootstrap_room"
    digest: str | None = None       # the digest scheme this rank asks for (None: none)

    def encode(self) -> list[bytes]:
        body = {"rank": self.rank, "session": self.session, "status": self.status_endpoint,
                "kv": [self.kv_addr, self.page_bytes, self.pages], "room_field": self.room_field,
                "fields": [[f.name, f.addr, f.item_bytes, f.slots] for f in self.fields]}
        if self.digest is not None:
            body["digest"] = self.digest
        return [HELLO, json.dumps(body).encode()]

    @property
    def slots(self) -> int:
        return self.fields[0].slots


def _json(body: bytes, what: str) -> dict:
    if len(body) > MAX_JSON_BYTES:
        raise FrameError(f"{what}: body of {len(body)} bytes exceeds {MAX_JSON_BYTES}")
    try:
        obj = json.loads(bytes(body).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise FrameError(f"{what}: body is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise FrameError(f"{what}: body must be a JSON object")
    return obj


def _digest_scheme(obj: dict, what: str) -> str | None:
    """The optional ``digest`` entry: absent, or a scheme this build knows."""
    scheme = obj.get("digest")
    if scheme is not None and scheme != DIGEST_SCHEME:
        raise FrameError(f"{what}: digest scheme {str(scheme)[:40]!r} is not {DIGEST_SCHEME!r}")
    return scheme


def decode_hello(body: bytes) -> Hello:
    obj = _json(body, "HELLO")
    kv = obj.get("kv")
    if not isinstance(kv, list) or len(kv) != 3:
        raise FrameError("HELLO: kv must be [addr, page_bytes, pages]")
    fields_raw = obj.get("fields")
    if not isinstance(fields_raw, list) or not 0 < len(fields_raw) <= MAX_FIELDS:
        raise FrameError(f"HELLO: fields must be a list of 1..{MAX_FIELDS} entries")
    fields = []
    for f in fields_raw:
        if not isinstance(f, list) or len(f) != 4:
            raise FrameError("HELLO: each field must be [name, addr, item_bytes, slots]")
        fields.append(FieldLayout(_str(f[0], "HELLO field name", 64), _int(f[1], "field addr", 1, _U64),
                                  _int(f[2], "field item_bytes", 1, 1 << 20),
                                  _int(f[3], "field slots", 1, 1 << 24)))
    if len({f.slots for f in fields}) != 1 or len({f.name for f in fields}) != len(fields):
        raise FrameError("HELLO: fields must have distinct names and the same number of slots")
    hello = Hello(_int(obj.get("rank"), "HELLO rank", 0, MAX_RANKS - 1),
                  _str(obj.get("session"), "HELLO session"),
                  _str(obj.get("status"), "HELLO status endpoint"),
                  _int(kv[0], "kv addr", 1, _U64), _int(kv[1], "kv page_bytes", 1, 1 << 30),
                  _int(kv[2], "kv pages", 1, 1 << 24), tuple(fields),
                  _str(obj.get("room_field"), "HELLO room_field", 64),
                  _digest_scheme(obj, "HELLO"))
    if hello.room_field not in {f.name for f in fields}:
        raise FrameError(f"HELLO: room field {hello.room_field!r} is not among the fields")
    if not hello.status_endpoint.startswith("tcp://"):
        raise FrameError("HELLO: status endpoint must be tcp://host:port")
    return hello


def encode_hello_ok(prefill_rank: int, session: str, digest: str | None = None) -> list[bytes]:
    body: dict[str, Any] = {"prefill_rank": prefill_rank, "session": session}
    if digest is not None:
        body["digest"] = digest
    return [HELLO_OK, json.dumps(body).encode()]


def decode_hello_ok(body: bytes) -> tuple[int, str, str | None]:
    """(prefill_rank, session, digest scheme the prefill will send or None)."""
    obj = _json(body, "HELLO_OK")
    return (_int(obj.get("prefill_rank"), "HELLO_OK prefill_rank", 0, MAX_RANKS - 1),
            _str(obj.get("session"), "HELLO_OK session"), _digest_scheme(obj, "HELLO_OK"))


# -- XFER / ABORT / PING ----------------------------------------------------------
@dataclass(frozen=True)
class Xfer:
    room: int
    rank: int
    slot: int
    pages: tuple[int, ...]

    def encode(self) -> list[bytes]:
        head = _XFER_HEAD.pack(self.room, self.rank, self.slot, len(self.pages))
        return [XFER, head + struct.pack(f"<{len(self.pages)}I", *self.pages)]


def decode_xfer(body: bytes) -> Xfer:
    if len(body) < _XFER_HEAD.size:
        raise FrameError(f"XFER: body of {len(body)} bytes is shorter than its {_XFER_HEAD.size}-byte header")
    room, rank, slot, n = _XFER_HEAD.unpack_from(body)
    if not 0 < n <= MAX_PAGES:
        raise FrameError(f"XFER: page count {n} outside 1..{MAX_PAGES}")
    if len(body) != _XFER_HEAD.size + 4 * n:
        raise FrameError(f"XFER: body of {len(body)} bytes does not hold {n} page indices")
    if room == 0:
        raise FrameError("XFER: room 0 is reserved for an empty slot")
    return Xfer(room, rank, slot, struct.unpack_from(f"<{n}I", body, _XFER_HEAD.size))


def encode_abort(room: int, rank: int) -> list[bytes]:
    return [ABORT, _ABORT.pack(room, rank)]


def decode_abort(body: bytes) -> tuple[int, int]:
    if len(body) != _ABORT.size:
        raise FrameError(f"ABORT: body must be {_ABORT.size} bytes, got {len(body)}")
    return _ABORT.unpack(body)


def encode_ping(rank: int, seq: int, kind: bytes = PING) -> list[bytes]:
    return [kind, _PING.pack(rank, seq)]


def decode_ping(body: bytes) -> tuple[int, int]:
    if len(body) != _PING.size:
        raise FrameError(f"PING/PONG: body must be {_PING.size} bytes, got {len(body)}")
    return _PING.unpack(body)


# -- status: [room, status, prefill_rank(, digest)] -------------------------------
@dataclass(frozen=True)
class Status:
    room: int
    status: int
    prefill_rank: int
    digest: bytes | None = None      # Success only, to a rank that negotiated one

    def encode(self) -> list[bytes]:
        parts = [str(self.room).encode("ascii"), str(self.status).encode("ascii"),
                 str(self.prefill_rank).encode("ascii")]
        return parts if self.digest is None else [*parts, self.digest]


def _ascii_int(part: bytes, what: str, lo: int, hi: int) -> int:
    raw = bytes(part)
    if not 0 < len(raw) <= 20 or not raw.isdigit():
        raise FrameError(f"status: {what} must be 1..20 ASCII digits, got {raw[:24]!r}")
    return _int(int(raw), f"status {what}", lo, hi)


def decode_status(frames: Sequence[bytes]) -> Status:
    """Three parts, or four for a Success carrying its digest (exactly DIGEST_BYTES)."""
    room_b, status_b, rank_b, *rest = _parts(frames, 4 if len(frames) == 4 else 3, "status")
    status = _ascii_int(status_b, "status", 0, 9)
    if status not in STATUS_VALUES:
        raise FrameError(f"status: value {status} is not Failed(0), Success(4) or FENCED(5)")
    digest = bytes(rest[0]) if rest else None
    if digest is not None and (status != STATUS_SUCCESS or len(digest) != DIGEST_BYTES):
        raise FrameError(f"status: a digest must be {DIGEST_BYTES} bytes on a Success, got "
                         f"{len(digest)} bytes on status {status}")
    return Status(_ascii_int(room_b, "room", 1, _U64), status,
                  _ascii_int(rank_b, "prefill_rank", 0, MAX_RANKS - 1), digest)
