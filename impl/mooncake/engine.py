"""A thin, checked wrapper around ``mooncake.engine.TransferEngine`` (0.3.13.post1).

Mooncake reports failures as return codes, and over TCP it accepts writes from a local
buffer that was never registered (RDMA would not: ../shared/reference/mooncake-cpu.md).
So this wrapper keeps its own registry of registered ranges, checks every local range
of every write against it before calling Mooncake, and turns return codes into typed
errors. It owns no sockets or threads of its own.
"""
from __future__ import annotations

import bisect
import os
import threading
from dataclasses import dataclass
from typing import Sequence

# Quiet glog (~10 lines per engine otherwise); callers may override before import.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


class MooncakeError(RuntimeError):
    """Base class of every error this package raises about the transfer engine."""


class MooncakeUnavailable(MooncakeError):
    """The mooncake wheel (or libibverbs1) is not importable here."""


class EngineInitError(MooncakeError):
    pass


class RegistrationError(MooncakeError):
    """Registering, unregistering, or a write from/to a range that is not registered."""


class TransferError(MooncakeError):
    """Mooncake returned a failure code for a write (peer dead, frozen, remote range bad)."""


@dataclass(frozen=True)
class Region:
    """One registered local range."""
    name: str
    addr: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.addr + self.nbytes

    def contains(self, addr: int, nbytes: int) -> bool:
        return nbytes >= 0 and self.addr <= addr and addr + nbytes <= self.end


@dataclass(frozen=True)
class Write:
    """One contiguous copy: ``nbytes`` from local ``src`` to the peer's ``dst``."""
    src: int
    dst: int
    nbytes: int


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise MooncakeUnavailable(
            f"mooncake transfer engine not importable ({exc}); install the 'mooncake-cpu' extra "
            f"and Debian libibverbs1") from None
    return TransferEngine


class Engine:
    """One initialized TransferEngine in P2PHANDSHAKE mode plus its registered ranges."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp"):
        self._te = _import_engine()()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise EngineInitError(f"TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) "
                                  f"returned {rc}")
        self.host = host
        self.session_id = f"{host}:{self._te.get_rpc_port()}"
        self._regions: dict[int, Region] = {}
        self._starts: list[int] = []          # sorted region addresses, for bisect
        self._lock = threading.Lock()

    # -- registration -------------------------------------------------------------
    def register(self, name: str, addr: int, nbytes: int) -> Region:
        """Register ``[addr, addr+nbytes)``; overlapping an existing region is an error."""
        if addr <= 0 or nbytes <= 0:
            raise RegistrationError(f"register {name}: bad range addr={addr:#x} nbytes={nbytes}")
        region = Region(name, addr, nbytes)
        with self._lock:
            for r in self._regions.values():
                if addr < r.end and r.addr < region.end:
                    raise RegistrationError(f"register {name}: overlaps registered region {r.name}")
            rc = self._te.register_memory(addr, nbytes)
            if rc != 0:
                raise RegistrationError(f"register {name}: register_memory returned {rc}")
            self._regions[addr] = region
            bisect.insort(self._starts, addr)
        return region

    def unregister(self, region: Region) -> None:
        with self._lock:
            if self._regions.get(region.addr) != region:
                raise RegistrationError(f"unregister {region.name}: not registered")
            rc = self._te.unregister_memory(region.addr)
            del self._regions[region.addr]
            self._starts.remove(region.addr)
        if rc != 0:
            raise RegistrationError(f"unregister {region.name}: unregister_memory returned {rc}")

    def regions(self) -> list[Region]:
        with self._lock:
            return sorted(self._regions.values(), key=lambda r: r.addr)

    def _holder(self, addr: int, nbytes: int) -> Region | None:
        """The region holding ``[addr, addr+nbytes)`` (regions never overlap, so only the
        last one starting at or below ``addr`` can); caller holds the lock."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        r = self._regions[self._starts[i]]
        return r if r.contains(addr, nbytes) else None

    def check_local(self, addr: int, nbytes: int) -> Region:
        """The registered region holding the whole local range, else RegistrationError."""
        with self._lock:
            r = self._holder(addr, nbytes)
        if r is None:
            raise RegistrationError(f"local range {addr:#x}+{nbytes} is not inside a registered region")
        return r

    # -- transfers ----------------------------------------------------------------
    def write(self, session: str, writes: Sequence[Write]) -> None:
        """One batched synchronous write; every local range is checked first.

        Raises RegistrationError before anything is sent, TransferError if Mooncake fails.
        """
        if not writes:
            return
        with self._lock:              # one lock for the batch: this is the writer's hot path
            for w in writes:
                if w.nbytes <= 0 or w.dst <= 0:
                    raise RegistrationError(f"write to {session}: bad entry {w}")
                if self._holder(w.src, w.nbytes) is None:
                    raise RegistrationError(f"local range {w.src:#x}+{w.nbytes} is not inside "
                                            f"a registered region")
        rc = self._te.batch_transfer_sync_write(
            session, [w.src for w in writes], [w.dst for w in writes], [w.nbytes for w in writes])
        if rc != 0:
            total = sum(w.nbytes for w in writes)
            raise TransferError(f"batch write of {len(writes)} ranges ({total} bytes) to {session} "
                                f"failed with code {rc}")

    def raw_batch_write(self, session: str, writes: Sequence[Write]) -> int:
        """Mooncake's batch_transfer_sync_write with no checks: the benchmark baseline."""
        return self._te.batch_transfer_sync_write(
            session, [w.src for w in writes], [w.dst for w in writes], [w.nbytes for w in writes])

    def close(self) -> None:
        """Unregister everything; the engine itself is torn down when garbage-collected."""
        for region in self.regions():
            try:
                self.unregister(region)
            except RegistrationError:
                pass
