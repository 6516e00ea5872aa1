"""Shared Mooncake fixtures: engines cost ~1 s to tear down, so tests share them."""
from __future__ import annotations

import os

os.environ.setdefault("MC_TRANSFER_TIMEOUT", "2")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np
import pytest

from impl.mooncake.auth import new_secret, rank_key
from impl.mooncake.decode import BufferSpec, DecodeTransport
from impl.mooncake.engine import Engine
from impl.mooncake.prefill import PrefillServer
from impl.mooncake.synth import make_requests

PAGE_BYTES = 4096
PAGES = 256
SLOTS = 16
SECRET = new_secret()          # the test deployment's; each rank gets rank_key(SECRET, r)


@pytest.fixture(scope="session")
def engines() -> tuple[Engine, Engine]:
    """(prefill engine, decode engine), one pair for the whole session."""
    return Engine(), Engine()


class DecodeRank:
    """One decode rank's buffers and transport, as a test sees them."""

    def __init__(self, engine: Engine, rank: int = 0, key: bytes | None = None, **kw):
        self.pool = np.zeros((PAGES, PAGE_BYTES), np.uint8)
        self.ids = np.zeros((SLOTS, 16), np.int32)
        self.room = np.zeros((SLOTS, 8), np.uint64)
        self.transport = DecodeTransport(
            rank, engine, BufferSpec("kv", self.pool.ctypes.data, PAGE_BYTES, PAGES),
            [BufferSpec("output_ids", self.ids.ctypes.data, 64, SLOTS),
             BufferSpec("bootstrap_room", self.room.ctypes.data, 64, SLOTS)],
            key=rank_key(SECRET, rank) if key is None else key, **kw)
        self.next_page = 0

    def pages(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next_page, self.next_page + n))
        self.next_page += n
        return out


@pytest.fixture
def link(engines):
    """A fresh prefill server and decode rank on the shared engines."""
    pe, de = engines
    specs = make_requests(8, seed=7, min_pages=2, max_pages=4)
    server = PrefillServer(pe, specs, ranks=1, page_bytes=PAGE_BYTES, secret=SECRET)
    rank = DecodeRank(de, heartbeat_s=0.05, heartbeat_misses=4, fence_grace_s=0.2)
    yield server, rank, specs
    rank.transport.close()
    server.close(close_engine=False)
