"""A deterministic synthetic workload shared by the prefill process and the checkers.

Both ends derive a request's page count, first token, KV bytes (per TP rank) and
metadata row from ``(seed, index)``: prefill writes them, decode ranks regenerate them
to check what landed byte for byte. Nothing here touches the network.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

ROOM_FIELD = "bootstrap_room"
TOKEN_FIELD = "output_ids"


@dataclass(frozen=True)
class RequestSpec:
    index: int
    room: int           # 64-bit, non-zero
    n_pages: int
    first_token: int    # int32, what prefill writes in output_ids[slot, 0]


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def make_requests(n: int, seed: int, min_pages: int = 4, max_pages: int = 16) -> list[RequestSpec]:
    """``n`` requests with distinct non-zero rooms; page counts in [min_pages, max_pages]."""
    if n < 0 or not 1 <= min_pages <= max_pages:
        raise ValueError(f"bad workload: n={n}, pages {min_pages}..{max_pages}")
    out, seen = [], set()
    for i in range(n):
        rng = np.random.default_rng(_seed("req", seed, i))
        room = int(rng.integers(1, 2**63, dtype=np.int64)) * 2 + int(rng.integers(0, 2))
        while room in seen or room == 0:
            room = (room * 6364136223846793005 + 1) % 2**64
        seen.add(room)
        out.append(RequestSpec(i, room, int(rng.integers(min_pages, max_pages + 1)),
                               int(rng.integers(1, 2**31 - 1))))
    return out


_BASE_BYTES = 8 << 20
_base: np.ndarray | None = None


def _base_block() -> np.ndarray:
    """8 MiB of fixed random bytes that every page is cut from (generated once)."""
    global _base
    if _base is None:
        _base = np.frombuffer(np.random.default_rng(0x5EED).bytes(_BASE_BYTES), dtype=np.uint8)
    return _base


def kv_page(spec: RequestSpec, rank: int, page: int, page_bytes: int) -> np.ndarray:
    """Page ``page`` of the request's KV shard for one TP rank (a fresh array).

    A slice of the random base block at an offset hashed from (room, rank, page),
    stamped with those three numbers: distinct per page, cheap to regenerate."""
    if not 24 <= page_bytes <= _BASE_BYTES:
        raise ValueError(f"page_bytes must be in 24..{_BASE_BYTES}, got {page_bytes}")
    off = _seed("kv", spec.room, rank, page) % (_BASE_BYTES - page_bytes + 1)
    out = _base_block()[off:off + page_bytes].copy()
    out[:24] = np.frombuffer(np.array([spec.room, rank, page], dtype=np.uint64).tobytes(), np.uint8)
    return out


def kv_bytes(spec: RequestSpec, rank: int, page_bytes: int) -> np.ndarray:
    """The request's KV shard for one TP rank: n_pages x page_bytes uint8."""
    return np.stack([kv_page(spec, rank, j, page_bytes) for j in range(spec.n_pages)])


def metadata_row(spec: RequestSpec, field: str, item_bytes: int) -> bytes:
    """The bytes prefill writes in one field of the request's metadata row."""
    if field == ROOM_FIELD:
        return spec.room.to_bytes(8, "little") + bytes(item_bytes - 8)
    # shake_128, not a numpy Generator per row: ~50x faster, and the prefill builds
    # every request's row of every field when the first rank says HELLO.
    row = bytearray(hashlib.shake_128(repr(("meta", spec.room, field)).encode()).digest(item_bytes))
    if field == TOKEN_FIELD:
        row[0:4] = spec.first_token.to_bytes(4, "little", signed=True)
    return bytes(row)
