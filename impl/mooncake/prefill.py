"""Prefill side of the Mooncake transport (library; ``prefill_main`` runs it as a process).

For each (request, decode rank) it writes the KV pages with one batched Mooncake write,
then the metadata payload fields with a second, then the room on its own once the
payload write has returned (variants.room_after_payload), and pushes Success only
after that last write returned, with the digest of what it wrote for that rank
(impl.mooncake.digest) if the rank asked for one in its HELLO. ``Faults`` bends those
rules on purpose for tests and the e2e demo (Success before the row: what async
NVLink/RDMA visibility does).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from impl.mooncake import auth
from impl.mooncake import frames as fr
from impl.mooncake.digest import digest_key, transfer_digest
from impl.mooncake.engine import Engine, MooncakeError, Write
from impl.mooncake.monitor import BrokenConnections
from impl.mooncake.synth import ROOM_FIELD, RequestSpec, kv_bytes, metadata_row

log = logging.getLogger("pdgate.mooncake.prefill")
MAX_SOURCE_BYTES = 2 << 30


@dataclass
class Faults:
    metadata_delay_s: dict[int, float] = field(default_factory=dict)  # rank -> delay, Success first
    drop_metadata: set[int] = field(default_factory=set)              # ranks: Success, never the row
    stall_s: float = 0.0          # sleep between the KV and the metadata writes (kill window)


@dataclass(frozen=True)
class _FieldCopy:
    """One metadata field's copy for any (request row, slot): precomputed addresses."""
    src_base: int           # this prefill's rows of the field
    dst_base: int           # the decode rank's landing rows
    item_bytes: int

    def write(self, row: int, slot: int) -> Write:
        return Write(self.src_base + row * self.item_bytes,
                     self.dst_base + slot * self.item_bytes, self.item_bytes)


@dataclass
class _Rank:
    hello: fr.Hello
    push: zmq.Socket
    payload: tuple[_FieldCopy, ...] = ()
    room: tuple[_FieldCopy, ...] = ()


@dataclass
class _Job:
    spec: RequestSpec
    rank: int
    xfer: fr.Xfer
    stage: str = "kv"             # kv -> meta -> done
    cancelled: bool = False
    running: bool = False


def merge_runs(writes: list[Write]) -> list[Write]:
    """Coalesce writes contiguous on both sides (fewer, larger Mooncake entries)."""
    out: list[Write] = []
    for w in writes:
        last = out[-1] if out else None
        if last and last.src + last.nbytes == w.src and last.dst + last.nbytes == w.dst:
            out[-1] = Write(last.src, last.dst, last.nbytes + w.nbytes)
        else:
            out.append(w)
    return out


class PrefillServer:
    def __init__(self, engine: Engine, specs: list[RequestSpec], ranks: int, page_bytes: int,
                 *, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 prefill_rank: int = 0, workers: int = 1, faults: Faults | None = None):
        self.engine, self.ranks, self.page_bytes = engine, ranks, page_bytes
        self.prefill_rank, self.faults = prefill_rank, faults or Faults()
        self.specs = {s.room: s for s in specs}
        # Rank r's key, derived once: every frame from or to rank r is tagged with it.
        self._keys = [auth.rank_key(secret, r) for r in range(ranks)]
        self._digest_keys = [digest_key(k) for k in self._keys]
        self.digest_seconds = 0.0         # hashing what was written, for Success frames
        self.dropped = 0                  # authenticated, but malformed or not allowed
        self.rejected = 0                 # failed authentication (or claimed no rank)
        self.kv_bytes_written = 0
        self.write_seconds, self.first_write, self.last_write = 0.0, float("inf"), 0.0
        self.write_log: list[tuple[str, list[Write]]] = []  # what the baseline replays
        # (room, rank) -> [KV batch written, room written], monotonic (one clock for every
        # process on the host): when the bytes landed, not when a rank saw them
        self.landed: dict[tuple[int, int], list[float | None]] = {}
        self._replayed = 0
        total = sum(s.n_pages for s in specs) * page_bytes * ranks
        if total > MAX_SOURCE_BYTES:
            raise ValueError(f"workload needs {total >> 20} MiB of prefill KV, limit "
                             f"{MAX_SOURCE_BYTES >> 20} MiB")
        self._src = np.zeros(max(total, 1), dtype=np.uint8)
        self._src_at: dict[tuple[int, int], int] = {}
        off = 0
        for s in specs:
            for r in range(ranks):
                n = s.n_pages * page_bytes
                self._src[off:off + n] = kv_bytes(s, r, page_bytes).reshape(-1)
                self._src_at[(s.room, r)] = off
                off += n
        self._src_base = self._src.ctypes.data
        self._regions = [engine.register("prefill-kv", self._src_base, self._src.nbytes)]
        self._meta: dict[str, np.ndarray] = {}          # field -> (requests, item_bytes) rows
        self._row_of = {s.room: i for i, s in enumerate(specs)}
        self._filled: set[int] = set()      # rows written into self._meta (at first XFER)
        self._specs_list = list(specs)
        self._ranks: dict[int, _Rank] = {}
        self._identity_rank: dict[bytes, int] = {}
        self._jobs: dict[tuple[int, int], _Job] = {}
        self._lock = threading.Lock()
        self._push_lock = threading.Lock()
        self._work: queue.Queue[_Job | None] = queue.Queue()
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, fr.MAX_TO_PREFILL_PART)
        if port:
            self._router.bind(f"tcp://{host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.endpoint = f"tcp://{host}:{port}"
        self.broken = BrokenConnections(self._router)     # garbage, oversized frames
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, name="prefill-router", daemon=True)]
        self._threads += [threading.Thread(target=self._worker, name=f"prefill-worker-{i}", daemon=True)
                          for i in range(workers)]
        for t in self._threads:
            t.start()

    # -- control frames -------------------------------------------------------------------
    def _drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped <= 20 or self.dropped % 1000 == 0:
            log.warning("prefill: dropped control frame (%d so far): %s", self.dropped, why)

    def _reject(self, why: str) -> None:
        self.rejected += 1
        if self.rejected <= 20 or self.rejected % 1000 == 0:
            log.warning("prefill: rejected unauthenticated frame (%d so far): %s", self.rejected, why)

    def _authenticate(self, parts: list[bytes]) -> tuple[bytes, bytes, int, bytes] | None:
        """[identity, kind, rank, body, tag] -> (identity, kind, rank, body) if the tag
        verifies under that rank's key; else counted as rejected and None."""
        if len(parts) != 5:
            self._reject(f"expected [identity, kind, rank, body, tag], got {len(parts)} frames")
            return None
        ident, kind, rank_b, body, _ = parts
        try:
            rank = fr.decode_rank(rank_b)
        except fr.FrameError as exc:
            self._reject(str(exc))
            return None
        if rank >= self.ranks:
            self._reject(f"frame claims rank {rank}, outside 0..{self.ranks - 1}")
            return None
        if auth.unseal(self._keys[rank], auth.Channel(auth.TO_PREFILL, rank), parts[1:]) is None:
            self._reject(f"{kind[:16]!r} claiming rank {rank}: bad tag")
            return None
        return ident, kind, rank, body

    def _reply(self, ident: bytes, rank: int, parts: list[bytes]) -> None:
        self._router.send_multipart(
            [ident, *auth.seal(self._keys[rank], auth.Channel(auth.REPLY, rank), parts)])

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self.broken.monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self.broken.monitor in ready:
                    self.broken.drain()
                if self._router not in ready:
                    continue
                got = self._authenticate(self._router.recv_multipart())
                if got is None:
                    continue
                ident, kind, rank, body = got
                try:
                    self._handle(ident, kind, rank, body)
                except fr.FrameError as exc:
                    self._drop(f"{kind[:16]!r}: {exc}")
                except Exception as exc:         # never let one frame stop the server
                    self._drop(f"{kind[:16]!r}: {type(exc).__name__}: {exc}")
        except zmq.ContextTerminated:
            pass

    def _handle(self, ident: bytes, kind: bytes, sender: int, body: bytes) -> None:
        """One authenticated frame from rank ``sender``: its body must speak for that rank."""
        def same_rank(rank: int) -> int:
            if rank != sender:
                raise fr.FrameError(f"body names rank {rank}, the frame is tagged by rank {sender}")
            return rank
        if kind == fr.PING:
            rank, seq = fr.decode_ping(body)
            self._reply(ident, same_rank(rank), fr.encode_ping(rank, seq, fr.PONG))
        elif kind == fr.HELLO:
            try:
                hello = fr.decode_hello(body)
                same_rank(hello.rank)
                rank = self._register(hello)
            except fr.FrameError as exc:
                self._reply(ident, sender, [fr.ERROR, str(exc).encode()[:500]])
                raise
            self._identity_rank[ident] = rank
            self._reply(ident, rank, fr.encode_hello_ok(self.prefill_rank, self.engine.session_id,
                                                        hello.digest))
        elif kind == fr.XFER:
            x = fr.decode_xfer(body)
            same_rank(x.rank)
            self._on_xfer(ident, x)
        elif kind == fr.ABORT:
            room, rank = fr.decode_abort(body)
            if self._identity_rank.get(ident) != same_rank(rank):
                raise fr.FrameError(f"ABORT for rank {rank} from a peer that did not HELLO as it")
            self._on_abort(room, rank)
        else:
            raise fr.FrameError("unknown frame kind")

    def _register(self, hello: fr.Hello) -> int:
        if not hello.rank < self.ranks:
            raise fr.FrameError(f"HELLO rank {hello.rank} outside 0..{self.ranks - 1}")
        if hello.page_bytes != self.page_bytes:
            raise fr.FrameError(f"HELLO page_bytes {hello.page_bytes}, prefill uses {self.page_bytes}")
        if hello.room_field != ROOM_FIELD:
            raise fr.FrameError(f"HELLO room field must be {ROOM_FIELD!r}")
        host = hello.status_endpoint[len("tcp://"):].rsplit(":", 1)[0]
        if host != self.host:
            raise fr.FrameError(f"HELLO status endpoint host {host!r} is not {self.host!r}")
        with self._lock:
            known = self._ranks.get(hello.rank)
            if known is not None and known.hello == hello:
                return hello.rank     # the key holder again (its first reply was late): same
            if known is not None:
                raise fr.FrameError(f"HELLO: rank {hello.rank} is already registered "
                                    f"with another layout")
            for f in hello.fields:
                rows = self._meta.get(f.name)
                if rows is not None and rows.shape[1] != f.item_bytes:
                    raise fr.FrameError(f"HELLO field {f.name} has {f.item_bytes}-byte rows, "
                                        f"another rank registered {rows.shape[1]}")
            for f in hello.fields:
                if f.name not in self._meta:
                    self._meta[f.name] = self._build_rows(f.name, f.item_bytes)
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, 100000)
            push.connect(hello.status_endpoint)
            copies = {f.name: _FieldCopy(self._meta[f.name].ctypes.data, f.addr, f.item_bytes)
                      for f in hello.fields}
            self._ranks[hello.rank] = _Rank(
                hello, push, tuple(c for n, c in copies.items() if n != ROOM_FIELD),
                (copies[ROOM_FIELD],))
        return hello.rank

    def _build_rows(self, name: str, item_bytes: int) -> np.ndarray:
        """The field's rows, registered; only those already requested are filled in (the
        rest at their first XFER: filling all of them here made the first HELLO take
        seconds for a big workload, and a rank takes a silent prefill for a dead one)."""
        rows = np.zeros((max(len(self.specs), 1), item_bytes), dtype=np.uint8)
        for i in self._filled:
            rows[i] = np.frombuffer(metadata_row(self._specs_list[i], name, item_bytes), np.uint8)
        self._regions.append(self.engine.register(f"prefill-meta-{name}", rows.ctypes.data,
                                                  rows.nbytes))
        return rows

    def _on_xfer(self, ident: bytes, x: fr.Xfer) -> None:
        if self._identity_rank.get(ident) != x.rank:
            raise fr.FrameError(f"XFER for rank {x.rank} from a peer that did not HELLO as it")
        spec = self.specs.get(x.room)
        if spec is None:
            raise fr.FrameError(f"XFER for unknown room {x.room}")
        hello = self._ranks[x.rank].hello
        problem = None
        if len(x.pages) != spec.n_pages:
            problem = f"{len(x.pages)} pages, request has {spec.n_pages}"
        elif any(p >= hello.pages for p in x.pages) or len(set(x.pages)) != len(x.pages):
            problem = "page indices out of range or repeated"
        elif not x.slot < hello.slots:
            problem = f"slot {x.slot} outside 0..{hello.slots - 1}"
        with self._lock:
            known = self._jobs.get((x.room, x.rank))
            if problem is None and known is not None and known.xfer == x:
                # A replay (XFER carries no sequence number): write nothing again, tell
                # nothing; the request goes on as the first copy said.
                raise fr.FrameError(f"XFER room {x.room} rank {x.rank}: duplicate ignored")
            if problem is None and known is not None:
                problem = "room already requested by this rank with other pages or slot"
            if problem is None:
                job = _Job(spec, x.rank, x)
                self._jobs[(x.room, x.rank)] = job
                self._fill_row(self._row_of[x.room])
        if problem is not None:
            self._send_status(x.rank, x.room, fr.STATUS_FAILED)
            raise fr.FrameError(f"XFER room {x.room} rank {x.rank}: {problem}")
        self._work.put(job)

    def _fill_row(self, i: int) -> None:
        """Request ``i``'s row in every field, once (caller holds the lock)."""
        if i in self._filled:
            return
        for name, rows in self._meta.items():
            rows[i] = np.frombuffer(metadata_row(self._specs_list[i], name, rows.shape[1]), np.uint8)
        self._filled.add(i)

    def _on_abort(self, room: int, rank: int) -> None:
        with self._lock:
            job = self._jobs.get((room, rank))
            if job is None:
                raise fr.FrameError(f"ABORT for room {room} that rank {rank} never requested")
            job.cancelled = True
            idle = not job.running
        if idle:            # not being written now: no write of it is or will be in flight
            self._send_status(rank, room, fr.STATUS_FENCED)

    def _send_status(self, rank: int, room: int, status: int, digest: bytes | None = None) -> None:
        with self._push_lock:
            self._ranks[rank].push.send_multipart(auth.seal(
                self._keys[rank], auth.Channel(auth.STATUS, rank),
                fr.Status(room, status, self.prefill_rank, digest).encode()))

    def digest(self, job: _Job) -> bytes:
        """The digest of the exact source bytes ``job`` writes (KV pages, then its row in
        every field of the rank's HELLO): what the rank must find in its buffers."""
        t0 = time.perf_counter()
        hello, n = self._ranks[job.rank].hello, job.spec.n_pages * self.page_bytes
        off, row = self._src_at[(job.spec.room, job.rank)], self._row_of[job.spec.room]
        out = transfer_digest(self._digest_keys[job.rank], job.spec.room, self.page_bytes,
                              [memoryview(self._src[off:off + n])], job.spec.n_pages,
                              [(f.name, memoryview(self._meta[f.name][row])) for f in hello.fields])
        with self._lock:
            self.digest_seconds += time.perf_counter() - t0
        return out

    def _send_success(self, job: _Job) -> None:
        wants = self._ranks[job.rank].hello.digest is not None
        self._send_status(job.rank, job.spec.room, fr.STATUS_SUCCESS,
                          self.digest(job) if wants else None)

    # -- the writes ----------------------------------------------------------------------
    def kv_writes(self, job: _Job) -> list[Write]:
        kv_addr, pb = self._ranks[job.rank].hello.kv_addr, self.page_bytes
        src = self._src_base + self._src_at[(job.spec.room, job.rank)]
        return merge_runs([Write(src + j * pb, kv_addr + p * pb, pb)
                           for j, p in enumerate(job.xfer.pages)])

    def _meta_writes(self, job: _Job, room_field: bool) -> list[Write]:
        r, row = self._ranks[job.rank], self._row_of[job.spec.room]
        return [c.write(row, job.xfer.slot) for c in (r.room if room_field else r.payload)]

    def _worker(self) -> None:
        while True:
            job = self._work.get()
            if job is None:
                return
            with self._lock:
                if job.cancelled:
                    continue
                job.running = True
            try:
                self._advance(job)
            except MooncakeError as exc:
                log.warning("prefill: room %d rank %d: %s", job.spec.room, job.rank, exc)
                job.stage = "done"
                self._send_status(job.rank, job.spec.room, fr.STATUS_FAILED)
            with self._lock:
                job.running = False
                fence = job.cancelled     # an extra FENCED is harmless; a missing one is not
            if fence:
                self._send_status(job.rank, job.spec.room, fr.STATUS_FENCED)

    def _write(self, session: str, writes: list[Write], kv_bytes: int = 0) -> None:
        t0 = time.perf_counter()
        self.engine.write(session, writes)
        t1 = time.perf_counter()
        with self._lock:
            self.write_seconds += t1 - t0
            self.first_write = min(self.first_write, t0)
            self.last_write = max(self.last_write, t1)
            self.kv_bytes_written += kv_bytes
            self.write_log.append((session, writes))

    def _landed(self, job: _Job, which: int) -> None:
        """Stamp when the KV batch (0) or the room (1) of ``job`` finished writing."""
        now = time.monotonic()
        with self._lock:
            self.landed.setdefault((job.spec.room, job.rank), [None, None])[which] = now

    def _advance(self, job: _Job) -> None:
        """kv (+ payload fields, same batch) -> room alone -> Success. Faults split the
        payload off the KV batch (so it can be late or missing)."""
        session, f = self._ranks[job.rank].hello.session, self.faults
        delay = f.metadata_delay_s.get(job.rank)
        if job.stage == "kv":
            kv = self.kv_writes(job)
            split = bool(f.stall_s or delay or job.rank in f.drop_metadata)
            meta = [] if split else self._meta_writes(job, room_field=False)
            self._write(session, kv + meta, kv_bytes=sum(w.nbytes for w in kv))
            self._landed(job, 0)
            job.stage = "meta" if split else "room"
            if f.stall_s:
                time.sleep(f.stall_s)
            if job.rank in f.drop_metadata:
                job.stage = "done"
                self._send_success(job)
                return
            if delay:
                self._send_success(job)
                timer = threading.Timer(delay, self._work.put, args=(job,))
                timer.daemon = True
                timer.start()
                return
        if job.cancelled:
            return
        if job.stage == "meta":
            self._write(session, self._meta_writes(job, room_field=False))
        # The room goes alone, once the payload write returned (room_after_payload).
        self._write(session, self._meta_writes(job, room_field=True))
        self._landed(job, 1)
        job.stage = "done"
        if not delay:
            self._send_success(job)

    # -- the benchmark baseline and shutdown ----------------------------------------------
    def raw_baseline(self) -> tuple[int, float, float]:
        """Replay every batch written since the last call (KV, payload rows, rooms), in the
        same order, one after another: first with raw batch_transfer_sync_write, then with
        the submit-and-wait primitive ``Engine.write`` uses; returns (bytes, sync seconds,
        submit seconds). Only while the decode side is idle: it rewrites their buffers."""
        with self._lock:
            log_ = self.write_log[self._replayed:]
            self._replayed = len(self.write_log)
        nbytes = sum(w.nbytes for _, writes in log_ for w in writes)
        t0 = time.perf_counter()
        for session, writes in log_:
            if self.engine.raw_batch_write(session, writes) != 0:
                raise MooncakeError(f"baseline write to {session} failed")
        t1 = time.perf_counter()
        for session, writes in log_:
            self.engine.submit_and_wait(session, writes)
        return nbytes, t1 - t0, time.perf_counter() - t1

    def landings(self) -> list[list[float | int | None]]:
        """[room, rank, KV written, room written] per job (times monotonic seconds, None
        for a write that did not happen)."""
        with self._lock:
            return [[room, rank, *times] for (room, rank), times in self.landed.items()]

    def idle(self) -> bool:
        with self._lock:
            return all(j.stage == "done" or j.cancelled for j in self._jobs.values())

    def close(self, close_engine: bool = True) -> None:
        """Stop serving and unregister this server's buffers (``close_engine``: all)."""
        self._stop.set()
        for _ in self._threads[1:]:
            self._work.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self.broken.close()
        self._router.close()
        for r in self._ranks.values():
            r.push.close()
        for region in self._regions:
            self.engine.unregister(region)
        if close_engine:
            self.engine.close()
