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
import time
from dataclasses import dataclass
from typing import Sequence

# Quiet glog (~10 lines per engine otherwise); callers may override before import.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


YIELD_POLL_S = 150e-6     # a write's first 150 us: poll with sched_yield, then sleep


def transfer_timeout_s() -> float:
    """Mooncake's own bound on one transfer (MC_TRANSFER_TIMEOUT, default 30 s)."""
    try:
        return max(1.0, float(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))
    except ValueError:
        return 30.0


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
        """Write every range and return once all of them landed; local ranges are checked
        first. Raises RegistrationError before anything is sent, TransferError if Mooncake
        fails any range, once every submitted range finished or MC_TRANSFER_TIMEOUT passed.

        Each range is submitted on its own (``transfer_submit_write``) and the wait sleeps
        between status checks: ``batch_transfer_sync_write`` busy-waits a whole core until
        the batch completes (measured: caller CPU = wall time), which on a small host takes
        that core from the transport threads and the decode ranks that do the real work.
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
        self.submit_and_wait(session, writes)

    def submit_and_wait(self, session: str, writes: Sequence[Write]) -> None:
        """``write`` without the local checks (also the benchmark's second baseline)."""
        ids, bad = [], None
        for w in writes:
            tid = self._te.transfer_submit_write(session, w.src, w.dst, w.nbytes)
            if tid < 0:
                bad = f"submit failed with code {tid}"
                break
            ids.append(tid)
        failed = self._wait_all(ids)
        if bad or failed:
            total = sum(w.nbytes for w in writes)
            raise TransferError(f"write of {len(writes)} ranges ({total} bytes) to {session} "
                                f"failed: {bad or failed}")

    def _wait_all(self, ids: list[int]) -> str | None:
        """Wait until every submitted transfer finished; None if all succeeded, else why
        not. A transfer to a frozen peer stays pending, so the wait gives up after
        MC_TRANSFER_TIMEOUT, as Mooncake's own sync write does (measured: it returns -1)."""
        start = time.monotonic()
        deadline = start + transfer_timeout_s()
        failed = None
        for tid in ids:
            nap = 20e-6
            while True:
                st = self._te.transfer_check_status(tid)
                if st == 1:
                    break
                if st < 0:
                    failed = failed or f"transfer failed with code {st}"
                    break
                now = time.monotonic()
                if now > deadline:
                    return f"transfer still pending after MC_TRANSFER_TIMEOUT={transfer_timeout_s():g} s"
                if now - start < YIELD_POLL_S:    # small writes finish within this: no sleep
                    os.sched_yield()              # overshoot, and others still get the core
                else:
                    time.sleep(nap)
                    nap = min(nap * 2, 1e-4)
        return failed

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
