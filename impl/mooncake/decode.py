"""Decode side of the Mooncake transport: one ``DecodeTransport`` per decode rank.

It registers the rank's KV pool and metadata fields with its engine, handshakes with
each prefill it is told about (HELLO), starts one ``MooncakeKVReceiver`` per request
(XFER: the request's page indices and metadata slot), and runs one I/O thread that
consumes status frames ``[room, status, prefill_rank]`` and heartbeats every prefill.
Every frame carries an HMAC tag under this rank's key (impl.mooncake.auth): a frame
whose tag does not verify is counted in ``rejected`` and dropped before it is parsed;
an authenticated frame that is malformed or not expected is counted in ``dropped``.
Nothing is touched before a frame passed every check. With ``digests`` (the default)
the HELLO asks for the transfer digest (impl.mooncake.digest); a prefill that agrees
in HELLO_OK must send it on every Success, and a Success without it (or with one not
agreed) is dropped and the request Failed.

A prefill that cannot be reached fails fast: the handshake waits at most
``connect_timeout_s`` for a connection, and for ``retry_s`` after a failed handshake or
a death the endpoint is not tried again, so a whole backlog of requests for a dead
prefill fails in the step that admits it instead of blocking the rank once per request.

A prefill that is reachable but slow (CPU load, a big first HELLO) is not dead: it is
declared dead only when its connection closes (killed) or after it stayed silent for
the liveness window (``silence_limit``): at least ``heartbeat_misses`` heartbeats, and
at least ``RTT_FACTOR`` times the slowest recent PONG, counting only time this rank's
own I/O thread was running, and only after it drained what had arrived.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import zmq
import zmq.utils.monitor

from impl.mooncake import auth
from impl.mooncake import frames as fr
from impl.mooncake.digest import SCHEME as DIGEST_SCHEME
from impl.mooncake.engine import Engine, MooncakeError, Region
from impl.mooncake.monitor import BrokenConnections
from impl.mooncake.receiver import FAILED, SUCCESS, MooncakeKVReceiver

log = logging.getLogger("pdgate.mooncake.decode")
RTT_FACTOR = 8.0        # the liveness window is at least this many slowest recent PONGs
RTT_DECAY = 0.99        # per PONG: how fast a past slow PONG is forgotten


class BootstrapError(MooncakeError):
    """The handshake with a prefill failed or timed out (``reason``: why, short)."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


@dataclass(frozen=True)
class BufferSpec:
    """A buffer to register: base address, page/row size in bytes, number of pages/rows."""
    name: str
    addr: int
    item_bytes: int
    items: int

    @property
    def nbytes(self) -> int:
        return self.item_bytes * self.items


@dataclass
class PrefillLink:
    endpoint: str
    prefill_rank: int
    session: str
    sock: zmq.Socket                      # main thread only: HELLO, XFER, ABORT
    monitor: zmq.Socket                   # I/O thread only: sock's connection events
    alive: bool = True
    connected: bool = False               # the TCP connection is up (monitor events)
    last_pong: float = field(default_factory=time.monotonic)
    slowest_rtt: float = 0.0              # decaying maximum of PING -> PONG times
    pings: dict[int, float] = field(default_factory=dict)    # seq -> sent at
    dead_at: float | None = None        # until fenced after fence_grace_s
    digest: str | None = None           # the digest scheme agreed in HELLO_OK, or None
    died_at: float | None = None        # when it was found dead (kept)


@dataclass
class _Watch:
    link: PrefillLink
    sock: zmq.Socket
    monitor: zmq.Socket


@dataclass
class _Entry:
    receiver: MooncakeKVReceiver
    link: PrefillLink


class DecodeTransport:
    def __init__(self, rank: int, engine: Engine, kv: BufferSpec, fields: list[BufferSpec],
                 room_field: str = "bootstrap_room", host: str = "127.0.0.1",
                 heartbeat_s: float = 0.2, heartbeat_misses: int = 25,
                 fence_grace_s: float = 30.0, connect_timeout_s: float = 1.0,
                 retry_s: float = 5.0, hello_wait_max_s: float = 10.0, digests: bool = True,
                 *, key: bytes):
        if room_field not in {f.name for f in fields}:
            raise ValueError(f"room field {room_field!r} is not among the metadata fields")
        self.rank, self.engine, self.kv, self.fields = rank, engine, kv, fields
        self.room_field, self.host = room_field, host
        self.connect_timeout_s, self.retry_s = connect_timeout_s, retry_s
        # The HELLO blocks the rank's scheduler thread: the other ranks wait for it in
        # their next collective, so the wait stays well inside their timeout.
        self.hello_wait_max_s = hello_wait_max_s
        self.heartbeat_s, self.heartbeat_misses = heartbeat_s, heartbeat_misses
        self.fence_grace_s = fence_grace_s
        self._key = key
        self.digest_scheme = DIGEST_SCHEME if digests else None
        self._rank_part = fr.encode_rank(rank)
        self.dropped = 0                  # authenticated frames that were malformed/unexpected
        self.rejected = 0                 # frames that failed authentication
        self._regions: list[Region] = [engine.register(b.name, b.addr, b.nbytes)
                                       for b in [kv, *fields]]
        self._ctx = zmq.Context.instance()
        self._status = self._ctx.socket(zmq.PULL)
        self._status.setsockopt(zmq.LINGER, 0)
        self._status.setsockopt(zmq.MAXMSGSIZE, fr.MAX_STATUS_PART)
        port = self._status.bind_to_random_port(f"tcp://{host}")
        self.broken = BrokenConnections(self._status)     # garbage, oversized status parts
        self.status_endpoint = f"tcp://{host}:{port}"
        self._unreachable: dict[str, tuple[float, str]] = {}   # endpoint -> (since, why)
        self._links: dict[str, PrefillLink] = {}
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._io_loop, name=f"mooncake-status-{rank}",
                                        daemon=True)
        self._thread.start()

    # -- handshake and requests (the rank's scheduler thread) ---------------------------
    def hello(self) -> fr.Hello:
        layout = tuple(fr.FieldLayout(f.name, f.addr, f.item_bytes, f.items) for f in self.fields)
        return fr.Hello(self.rank, self.engine.session_id, self.status_endpoint, self.kv.addr,
                        self.kv.item_bytes, self.kv.items, layout, self.room_field,
                        self.digest_scheme)

    def _dealer(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, fr.MAX_REPLY_PART)
        return sock

    def _send(self, sock: zmq.Socket, frame: list[bytes], flags: int = 0) -> None:
        """``[kind, body]`` as ``[kind, rank, body, tag]`` under this rank's key."""
        kind, body = frame
        sock.send_multipart(auth.seal(self._key, auth.Channel(auth.TO_PREFILL, self.rank),
                                      [kind, self._rank_part, body]), flags)

    def _open(self, parts: list[bytes], direction: bytes) -> list[bytes] | None:
        """The parts without their tag if it verifies (else counted as rejected)."""
        body = auth.unseal(self._key, auth.Channel(direction, self.rank), parts)
        if body is None:
            self.rejected += 1
            if self.rejected <= 20 or self.rejected % 1000 == 0:
                log.warning("rank %d: rejected unauthenticated frame (%d so far)",
                            self.rank, self.rejected)
        return body

    def connect(self, endpoint: str) -> PrefillLink:
        """Handshake with the prefill at ``endpoint`` (once; cached while it is alive, so
        a prefill restarted on the same endpoint gets a fresh handshake, at most once per
        ``retry_s``). Waits at most ``connect_timeout_s``; raises BootstrapError at once
        while the endpoint is known unreachable."""
        link = self._links.get(endpoint)
        if link is not None and link.alive:
            return link
        now = time.monotonic()
        with self._lock:
            since, why = self._unreachable.get(endpoint, (None, ""))
        if since is not None and now - since < self.retry_s:
            raise BootstrapError(f"rank {self.rank}: prefill {endpoint} {why}")
        try:
            return self._handshake(endpoint)
        except BootstrapError as exc:
            with self._lock:
                self._unreachable[endpoint] = (time.monotonic(), exc.reason)
            raise

    def _handshake(self, endpoint: str) -> PrefillLink:
        sock = self._dealer()
        # Created here, used only by the I/O thread from now on: it sees the connection
        # drop even if the prefill dies before the first heartbeat.
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)

        def fail(why: str) -> BootstrapError:
            monitor.close()
            sock.close()
            return BootstrapError(f"rank {self.rank}: prefill {endpoint} {why}", why)
        sock.connect(endpoint)
        self._send(sock, self.hello().encode())
        link = PrefillLink(endpoint, -1, "", sock, monitor)
        why = self._await_reply(link)
        if why:
            raise fail(why)
        reply = self._open(sock.recv_multipart(), auth.REPLY)
        if reply is None:
            raise fail("answered HELLO with a frame that failed authentication")
        try:
            if len(reply) != 2 or reply[0] != fr.HELLO_OK:
                raise fr.FrameError(f"refused: {reply[-1][:200]!r}")
            link.prefill_rank, link.session, link.digest = fr.decode_hello_ok(reply[1])
            if link.digest != self.digest_scheme and link.digest is not None:
                raise fr.FrameError(f"digest {link.digest!r} was not asked for")
        except fr.FrameError as exc:
            raise fail(f"handshake: {exc}") from None
        link.last_pong = time.monotonic()
        with self._lock:
            self._links[endpoint] = link
            self._unreachable.pop(endpoint, None)
        return link

    def _await_reply(self, link: PrefillLink) -> str | None:
        """Wait for the HELLO reply on ``link.sock``; None once it is there, else why not.
        Nobody accepting the connection within ``connect_timeout_s`` (nothing listens) or
        the connection closing fails at once; a prefill that accepted but is slow to
        answer gets the liveness window, as a silent prefill gets from the heartbeats."""
        poller = zmq.Poller()
        poller.register(link.sock, zmq.POLLIN)
        poller.register(link.monitor, zmq.POLLIN)
        start = time.monotonic()
        connected_at = start
        while True:
            now = time.monotonic()
            if not link.connected and now - start > self.connect_timeout_s:
                return f"accepted no connection within {self.connect_timeout_s:g} s"
            limit = min(self.silence_limit(link), self.hello_wait_max_s)
            if link.connected and now - connected_at > limit:
                return f"did not answer HELLO within {limit:g} s"
            ready = dict(poller.poll(timeout=50))
            if link.sock in ready:
                return None
            if link.monitor in ready:
                event = zmq.utils.monitor.recv_monitor_message(link.monitor)["event"]
                if event == zmq.EVENT_CONNECTED and not link.connected:
                    link.connected, connected_at = True, time.monotonic()
                elif event == zmq.EVENT_DISCONNECTED and link.connected:
                    return "closed its connection during the handshake"

    def silence_limit(self, link: PrefillLink) -> float:
        """How long ``link``'s prefill may stay silent before it is declared dead."""
        return max(self.heartbeat_s * self.heartbeat_misses, RTT_FACTOR * link.slowest_rtt)

    def start(self, room: int, slot: int, pages: tuple[int, ...], endpoint: str) -> MooncakeKVReceiver:
        """Create the request's receiver and send prefill its pages and slot.

        Checks the slot and pages against this rank's own buffers first: a bad index is a
        ValueError and nothing is sent.
        """
        if not 0 < room < 1 << 64:
            raise ValueError(f"room {room} outside 1..2^64-1")
        if not 0 <= slot < self.fields[0].items:
            raise ValueError(f"slot {slot} outside 0..{self.fields[0].items - 1}")
        if not pages or any(not 0 <= p < self.kv.items for p in pages):
            raise ValueError(f"page indices must be in 0..{self.kv.items - 1}")
        with self._lock:
            if room in self._entries:
                raise ValueError(f"room {room} already has a receiver on rank {self.rank}")
        receiver = MooncakeKVReceiver(room, self.rank, slot, tuple(pages))
        receiver.enter_queue()
        try:
            link = self.connect(endpoint)
        except BootstrapError as exc:
            self._never_sent(receiver, str(exc))
            return receiver
        with self._lock:
            self._entries[room] = _Entry(receiver, link)
            alive = link.alive
        if not alive:
            self._never_sent(receiver, f"prefill {endpoint} is unreachable")
            return receiver
        self._send(link.sock, fr.Xfer(room, self.rank, slot, tuple(pages)).encode())
        return receiver

    @staticmethod
    def _never_sent(receiver: MooncakeKVReceiver, why: str) -> None:
        """No XFER went out, so no write can ever land: Failed, and fenced already (its
        slot and pages are free once the request leaves, no grace period)."""
        receiver.deliver(FAILED, why)
        receiver.deliver_fence()

    def abort(self, room: int) -> None:
        """Ask the prefill to stop writing ``room`` here and answer FENCED once nothing is
        in flight (a dead prefill is fenced after ``fence_grace_s`` instead)."""
        with self._lock:
            entry = self._entries.get(room)
        if entry is not None and entry.link.alive:
            self._send(entry.link.sock, fr.encode_abort(room, self.rank))

    def forget(self, room: int) -> None:
        with self._lock:
            self._entries.pop(room, None)

    def receivers(self) -> list[MooncakeKVReceiver]:
        with self._lock:
            return [e.receiver for e in self._entries.values()]

    # -- the I/O thread ------------------------------------------------------------------
    def _drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped <= 20 or self.dropped % 1000 == 0:
            log.warning("rank %d: dropped control frame (%d so far): %s", self.rank, self.dropped, why)

    def _on_status(self, parts: list[bytes]) -> None:
        body = self._open(parts, auth.STATUS)
        if body is None:
            return
        try:
            st = fr.decode_status(body)
        except fr.FrameError as exc:
            self._drop(str(exc))
            return
        with self._lock:
            entry = self._entries.get(st.room)
        if entry is None:
            self._drop(f"status for unknown room {st.room}")
            return
        if st.prefill_rank != entry.link.prefill_rank:
            self._drop(f"status for room {st.room} from prefill rank {st.prefill_rank}, "
                       f"expected {entry.link.prefill_rank}")
            return
        if st.status == fr.STATUS_FENCED:
            entry.receiver.deliver_fence()
        elif st.status == fr.STATUS_SUCCESS and (st.digest is None) != (entry.link.digest is None):
            self._drop(f"Success for room {st.room} {'without' if st.digest is None else 'with'} "
                       f"a digest, {entry.link.digest or 'none'} agreed")
            entry.receiver.deliver(FAILED, "Success without the agreed digest")
        elif st.status == fr.STATUS_SUCCESS:
            entry.receiver.deliver(SUCCESS, at=time.monotonic(), digest=st.digest)
        else:
            entry.receiver.deliver(FAILED, "prefill reported Failed")

    def _watch(self, link: PrefillLink, poller: zmq.Poller) -> _Watch:
        """The I/O thread's side of one link: its own DEALER for PING/PONG, and the
        monitor of the link's DEALER, which reports the TCP connection dropping (a
        killed prefill; a frozen one keeps its connections and misses heartbeats)."""
        sock = self._dealer()
        sock.connect(link.endpoint)
        poller.register(sock, zmq.POLLIN)
        poller.register(link.monitor, zmq.POLLIN)
        return _Watch(link, sock, link.monitor)

    def _credit_stall(self, stalled_s: float) -> None:
        """This I/O thread itself did not run for ``stalled_s`` (CPU load): no PONG
        could be heard meanwhile, so that time does not count as the prefills' silence."""
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.last_pong += stalled_s

    def _heartbeat(self, watches: dict[int, _Watch], poller: zmq.Poller, seq: int) -> None:
        now = time.monotonic()
        with self._lock:
            links = list(self._links.values())
        for link in links:
            w = watches.get(id(link))
            if w is None:
                w = watches[id(link)] = self._watch(link, poller)
            if link.alive:
                try:
                    self._send(w.sock, fr.encode_ping(self.rank, seq), zmq.NOBLOCK)
                    link.pings[seq] = now
                    if len(link.pings) > 4 * self.heartbeat_misses:     # bounded
                        del link.pings[min(link.pings)]
                except zmq.Again:           # not connected, or pings piling up: a miss
                    pass
                limit = self.silence_limit(link)
                if now - link.last_pong > limit:
                    self._mark_dead(link, now, f"missed heartbeats: silent for {limit:g} s")
            elif link.dead_at is not None and now - link.dead_at >= self.fence_grace_s:
                link.dead_at = None
                for e in self._link_entries(link):
                    e.receiver.deliver_fence()

    def _link_entries(self, link: PrefillLink) -> list[_Entry]:
        with self._lock:
            return [e for e in self._entries.values() if e.link is link]

    def _mark_dead(self, link: PrefillLink, now: float, why: str) -> None:
        if not link.alive:
            return
        link.alive, link.dead_at, link.died_at = False, now, now
        with self._lock:
            self._unreachable[link.endpoint] = (now, why)
        log.warning("rank %d: prefill %s %s: failing its requests", self.rank, link.endpoint, why)
        for e in self._link_entries(link):
            e.receiver.deliver(FAILED, f"prefill {link.endpoint} {why}")

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._status, zmq.POLLIN)
        poller.register(self.broken.monitor, zmq.POLLIN)
        watches: dict[int, _Watch] = {}
        seq, next_beat, woke = 0, 0.0, time.monotonic()
        try:
            while not self._stop.is_set():
                timeout = max(1, int((next_beat - time.monotonic()) * 1000))
                ready = poller.poll(timeout=timeout)
                now = time.monotonic()
                late = now - woke - max(timeout / 1000, self.heartbeat_s)
                if late > self.heartbeat_s:       # this thread was starved, not the prefill
                    self._credit_stall(late)
                woke = now
                for sock, _ in ready:             # drain before judging anyone silent
                    if sock is self.broken.monitor:
                        self.broken.drain()
                    else:
                        self._drain(sock, watches)
                if time.monotonic() >= next_beat:
                    seq += 1
                    self._heartbeat(watches, poller, seq)
                    next_beat = time.monotonic() + self.heartbeat_s
        except zmq.ContextTerminated:
            pass
        finally:
            for w in watches.values():
                w.monitor.close()
                w.sock.close()

    def _drain(self, sock: zmq.Socket, watches: dict[int, _Watch], most: int = 10_000) -> None:
        """Handle every frame waiting on ``sock`` (at most ``most``: a flood cannot keep
        this thread from its heartbeats)."""
        for _ in range(most):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._dispatch(sock, parts, watches)
            except Exception as exc:     # never let one frame stop the thread
                self._drop(f"{type(exc).__name__} while handling a frame: {exc}")

    def _dispatch(self, sock: zmq.Socket, parts: list[bytes], watches: dict[int, _Watch]) -> None:
        if sock is self._status:
            self._on_status(parts)
            return
        w = next((w for w in watches.values() if sock in (w.sock, w.monitor)), None)
        if w is not None and sock is w.monitor:
            self._on_monitor(w, parts)
        elif w is not None:
            self._on_pong(w, parts)

    def _on_monitor(self, w: _Watch, parts: list[bytes]) -> None:
        event = zmq.utils.monitor.parse_monitor_message(parts)["event"]
        if event == zmq.EVENT_CONNECTED:
            w.link.connected = True
        elif event == zmq.EVENT_DISCONNECTED and w.link.connected:
            self._mark_dead(w.link, time.monotonic(), "closed its connection")

    def _on_pong(self, w: _Watch, parts: list[bytes]) -> None:
        parts = self._open(parts, auth.REPLY)
        if parts is None:
            return
        if len(parts) != 2 or parts[0] != fr.PONG:
            self._drop(f"unexpected heartbeat reply {parts[:1]!r}")
            return
        try:
            _, seq = fr.decode_ping(parts[1])
        except fr.FrameError as exc:
            self._drop(str(exc))
            return
        now = time.monotonic()
        link = w.link
        sent = link.pings.pop(seq, None)
        if sent is not None:
            link.slowest_rtt = max(now - sent, link.slowest_rtt * RTT_DECAY)
        if link.alive:
            link.last_pong = now

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.broken.close()
        self._status.close()
        for link in self._links.values():
            link.sock.close()
            link.monitor.close()
        for region in self._regions:
            self.engine.unregister(region)
