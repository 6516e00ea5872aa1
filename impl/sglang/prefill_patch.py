"""strict's prefill side, for SGLang's Mooncake sender (0.5.23): the metadata room is
written only after the rest of the request's transfer completed, and a failed
request's abort is acknowledged only once every write of it has settled.

**The room last.** The decode gate reads the room as "the metadata row landed" (model/spec
assumption A1: the payload, then the room). SGLang's ``MooncakeKVManager.send_aux``
writes every metadata buffer of the row, the room among them, as one batch (its order on
the wire is the engine's; in 0.5.23 the KV checksum buffer even comes after the room),
and ``send_aux_tcp`` sends them one message each, the room before the checksum. A decode
rank may then see the room while the first token or the checksum is still on its way:
the room-first traces of ``pdgate conform``, which no decode-side patch can repair
(``strict-no-room-order``). Here:

- ``send_aux`` issues the row without the room first and the room alone after it, only
  if the first transfer returned 0 (a failed row never shows its room: the request is
  Failed, never half-landed). The KV pages were written before ``send_aux`` is called,
  by the same transfer worker (the release's own order), so the room is the last write;
- ``send_aux_tcp`` sends the room's message last, on the same socket (ZeroMQ keeps a
  socket's order, and the decode thread applies them in order).

**The abort fence.** 0.5.19+ holds a failed request's decode slot until the prefill's
ABORT_ACK, which the sender sends once the room's transfer drained
(``_maybe_ack_drained_abort``), "or 30 s regardless" on the decode. A failed send is the
hole: ``batch_transfer_sync`` returns -1 on its wall-clock timeout with the batch still
running (its handle dropped), so the sender cannot tell a write that failed from one
still writing; 0.5.23 then never acks the room (``_poison_unsettled_send``) and the
decode frees the slot at its timeout, while the write may still land in it (the
``deferred`` counterexample, #35049). Strict on the decode keeps only the ack (no
timeout, impl/sglang/patch.py); here the ack becomes something the sender can give:

- ``_transfer_data`` submits each block as its own engine transfer
  (``transfer_submit_write``) and polls each one's status (``transfer_check_status``:
  completed, failed, still running, timed out) instead of one ``batch_transfer_sync``
  that drops a running batch. It returns once every block completed or failed (settled)
  or the engine reports one timed out, or ``WAIT_S`` passed (it may still be writing:
  unsettled). The per-block submission trades the engine's batching for a status per
  write: not measured at production scale;
- ``_poison_unsettled_send(room)`` no longer poisons: the unsettled writes of the
  room's destinations become the room's, and its ACK waits for them
  (``_maybe_ack_drained_abort`` returns until they settle; a watcher thread polls them
  and sends the ACK then). The failure itself is reported at once, so the decode aborts
  the request without waiting, and only its slot waits. A write still unsettled after
  ``SETTLE_S`` poisons the room as 0.5.23 does: the ACK never comes, the slot is held for
  good on a strict decode (a lost slot, never a reuse).

Unsettled writes are attributed to a room by destination session: the release sends a
room's chunks in one transfer worker, one chunk at a time, and reports the failure
before the next chunk, so the writes a destination left unsettled when a room's send
failed are that room's (a later failure to the same destination, before they settle,
waits for them too: conservative).

The room buffer is recognised by address: ``MetadataBuffers.get_buf_infos`` is wrapped
to note where each process's ``bootstrap_room`` tensor lies.
"""
from __future__ import annotations

import ast
import threading
import time
from typing import Any, Callable

_ROOM_SPANS: list[tuple[int, int]] = []     # (address, bytes) of every bootstrap_room
_LOCAL = threading.local()                   # per transfer worker: inside send_aux?
COUNTS = {"rows": 0, "room_last": 0, "room_withheld": 0, "settled_failures": 0,
          "acks_deferred": 0, "acks_released": 0, "poisoned": 0}
# called with a copy of COUNTS after each change, under the lock (the live prefill writes
# them to a file at once: a deployment torn down right after its last row keeps its count)
ON_COUNT: list[Callable[[dict[str, int]], None]] = []
_COUNT_LOCK = threading.Lock()


def _count(name: str) -> None:
    with _COUNT_LOCK:
        COUNTS[name] += 1
        for listener in ON_COUNT:
            listener(dict(COUNTS))


def in_room(address: int) -> bool:
    return any(start <= address < start + size for start, size in _ROOM_SPANS)


def _note_rooms(own: Callable[..., Any]) -> Callable[..., Any]:
    def get_buf_infos(self: Any) -> Any:
        room = self.bootstrap_room
        span = (int(room.data_ptr()), int(room.nbytes))
        if span not in _ROOM_SPANS:
            _ROOM_SPANS.append(span)
        return own(self)
    return get_buf_infos


def _room_last_transfer(own: Callable[..., int]) -> Callable[..., int]:
    """``_transfer_data`` that, inside ``send_aux``, splits off the room's block."""
    def transfer(self: Any, session: Any, blocks: list) -> int:
        if not getattr(_LOCAL, "aux", False):
            return own(self, session, blocks)
        if not _ROOM_SPANS:
            raise RuntimeError("pdgate prefill patch: no MetadataBuffers noted its room "
                               "(note_rooms was installed after the buffers were listed)")
        room = [b for b in blocks if in_room(int(b[0]))]
        rest = [b for b in blocks if not in_room(int(b[0]))]
        _count("rows")
        ret = own(self, session, rest) if rest else 0
        if ret != 0:
            _count("room_withheld")
            return ret
        if room:
            _count("room_last")
            return own(self, session, room)
        return ret
    return transfer


def _inside_aux(own: Callable[..., Any]) -> Callable[..., Any]:
    def send_aux(self: Any, *args: Any, **kwargs: Any) -> Any:
        _LOCAL.aux = True
        try:
            return own(self, *args, **kwargs)
        finally:
            _LOCAL.aux = False
    return send_aux


def _room_message_last(own_tcp: Callable[..., Any], own_send: Callable[..., Any]
                       ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``send_aux_tcp`` and ``send_aux_data_to_endpoint``: the room's message is held
    back until the row's other messages are sent."""
    def send_aux_tcp(self: Any, *args: Any, **kwargs: Any) -> Any:
        _LOCAL.held = []
        try:
            out = own_tcp(self, *args, **kwargs)
            held, _LOCAL.held = _LOCAL.held, None
            _count("rows")
            for call_args, call_kwargs in held:
                _count("room_last")
                own_send(self, *call_args, **call_kwargs)
            return out
        finally:
            _LOCAL.held = None

    def send_aux_data_to_endpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        held = getattr(_LOCAL, "held", None)
        index = kwargs.get("buffer_index", args[3] if len(args) > 3 else None)
        if held is not None and index is not None and in_room(
                int(self.kv_args.aux_data_ptrs[int(index)])):
            held.append((args, kwargs))
            return None
        return own_send(self, *args, **kwargs)
    return send_aux_tcp, send_aux_data_to_endpoint


WAIT_S = 30.0          # a transfer call waits this long for a running write (the engine's default timeout)
SETTLE_S = 600.0       # a failed room's ACK waits this long for its writes, then never comes
POLL_S = 0.0005
_FAILED_ID = (0, 2**64 - 1)      # transfer_submit_write's "nothing submitted" (-1 as uint64)


class _Writes:
    """Engine writes that had not settled when their transfer call returned: by
    destination session until a failed room claims them, then by room until they
    settle (its ACK then goes out) or SETTLE_S passes (the room is poisoned)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_session: dict[str, list[tuple[Any, int]]] = {}
        self.by_room: dict[int, tuple[Any, list[tuple[Any, int]], float]] = {}
        self.watcher: threading.Thread | None = None

    def note(self, session: str, engine: Any, ids: list[int]) -> None:
        with self.lock:
            self.by_session.setdefault(session, []).extend((engine, i) for i in ids)

    def claim(self, manager: Any, room: int, sessions: set[str]) -> bool:
        """The unsettled writes to ``sessions`` become ``room``'s; True if there are any."""
        with self.lock:
            writes = [w for s in sessions for w in self.by_session.pop(s, [])]
            if not writes:
                return False
            self.by_room[room] = (manager, writes, time.monotonic() + SETTLE_S)
            if self.watcher is None:
                self.watcher = threading.Thread(target=self._watch, daemon=True,
                                                name="pdgate-settle")
                self.watcher.start()
            return True

    def pending(self, room: int) -> bool:
        with self.lock:
            return room in self.by_room

    @staticmethod
    def _open(writes: list[tuple[Any, int]]) -> list[tuple[Any, int]]:
        return [(e, i) for e, i in writes if e.transfer_check_status(i) not in (1, -1)]

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S * 20)
            done, poisoned = [], []
            with self.lock:
                for session in list(self.by_session):
                    self.by_session[session] = self._open(self.by_session[session])
                    if not self.by_session[session]:
                        del self.by_session[session]
                for room, (manager, writes, deadline) in list(self.by_room.items()):
                    still = self._open(writes)
                    if not still:
                        done.append((manager, room))
                    elif time.monotonic() > deadline:
                        poisoned.append((manager, room))
                    else:
                        self.by_room[room] = (manager, still, deadline)
                        continue
                    del self.by_room[room]
            for manager, room in done:           # outside the lock: the ACK sends a message
                _count("acks_released")
                manager._maybe_ack_drained_abort(room)
            for manager, room in poisoned:
                _count("poisoned")
                manager.poison_deferred_ack_room(room)


WRITES = _Writes()


def _settling_transfer(self: Any, session: str, blocks: list) -> int:
    """``_transfer_data`` with a status per write: 0 iff every block completed; -1 once
    every block settled with one failed, or one timed out or ran past WAIT_S (still
    possibly writing: noted in WRITES for the room whose failure this is)."""
    if not blocks:
        return 0
    engine = self.engine.engine             # mooncake.engine.TransferEngine
    ids, ret = [], 0
    for src, dst, length in blocks:
        batch = engine.transfer_submit_write(session, int(src), int(dst), int(length))
        if batch in _FAILED_ID or batch < 0:
            ret = -1                        # not submitted: nothing of it in flight
            break
        ids.append(batch)
    deadline = time.monotonic() + WAIT_S
    running = ids
    while running:
        status = [engine.transfer_check_status(i) for i in running]
        ret = -1 if any(st == -1 for st in status) else ret
        timed_out = [i for i, st in zip(running, status) if st == -2]
        running = [i for i, st in zip(running, status) if st == 0]
        if timed_out or (running and time.monotonic() > deadline):
            WRITES.note(session, engine, timed_out + running)
            return -1
        if running:
            time.sleep(POLL_S)
    return ret


def _claim_unsettled(own: Callable[..., Any]) -> Callable[..., Any]:
    """``_poison_unsettled_send``: the room's ACK waits for its unsettled writes instead
    of never coming (see module doc)."""
    def claim(self: Any, room: int) -> None:
        infos = getattr(self, "transfer_infos", {}).get(room, {})
        sessions = {getattr(t, "mooncake_session_id", None) for t in infos.values()}
        if WRITES.claim(self, room, sessions - {None}):
            _count("acks_deferred")
        else:
            _count("settled_failures")
    claim._pdgate_own = own               # type: ignore[attr-defined]
    return claim


def _ack_when_settled(own: Callable[..., Any]) -> Callable[..., Any]:
    def maybe_ack(self: Any, room: int) -> None:
        if WRITES.pending(room):
            return                          # the watcher sends it once the writes settled
        own(self, room)
    return maybe_ack


def settle_writes(conn: Any) -> None:
    """Patch a loaded release's ``disaggregation.mooncake.conn``: writes settle before
    a failed room is acknowledged; idempotent."""
    manager = conn.MooncakeKVManager
    if "_pdgate_settle" in vars(manager):
        return
    manager._transfer_data = _settling_transfer
    manager._poison_unsettled_send = _claim_unsettled(manager._poison_unsettled_send)
    manager._maybe_ack_drained_abort = _ack_when_settled(manager._maybe_ack_drained_abort)
    manager._pdgate_settle = True


def note_rooms(utils: Any) -> None:
    """Patch a loaded release's ``disaggregation.utils``: MetadataBuffers note where
    their room lies (before any buffer lists itself to a sender); idempotent."""
    buffers = utils.MetadataBuffers
    if "_pdgate_rooms" not in vars(buffers):
        buffers.get_buf_infos = _note_rooms(buffers.get_buf_infos)
        buffers._pdgate_rooms = True


def room_last(conn: Any) -> None:
    """Patch a loaded release's ``disaggregation.mooncake.conn``: MooncakeKVManager
    writes the room last; idempotent."""
    manager = conn.MooncakeKVManager
    if "_pdgate_room_last" in vars(manager):
        return
    manager._transfer_data = _room_last_transfer(manager._transfer_data)
    manager.send_aux = _inside_aux(manager.send_aux)
    manager.send_aux_tcp, manager.send_aux_data_to_endpoint = _room_message_last(
        manager.send_aux_tcp, manager.send_aux_data_to_endpoint)
    manager._pdgate_room_last = True


def release_fences(conn_source: str) -> list[str]:
    """What the release's sender lacks of the ACK channel the abort fence builds on
    (empty: it has it): a drain ack that a pending room can hold back
    (``_maybe_ack_drained_abort``), a ``_poison_unsettled_send`` the transfer worker calls
    where a KV chunk or the metadata row failed to send, and ``_transfer_data`` as the one
    place its writes go to the engine."""
    tree = ast.parse(conn_source)
    methods = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    text = {name: ast.unparse(methods[name]) if name in methods else ""
            for name in ("transfer_worker", "_poison_unsettled_send", "_transfer_data")}
    worker = text["transfer_worker"]       # "" where the release lacks it: every check fails
    missing = []
    if "_maybe_ack_drained_abort" not in worker:
        missing.append("transfer_worker acking a drained abort (_maybe_ack_drained_abort)")
    if "poison_deferred_ack_room" not in text["_poison_unsettled_send"]:
        missing.append("_poison_unsettled_send poisoning the deferred release's ack")
    if worker.count("self._poison_unsettled_send(") < 2:
        missing.append("transfer_worker calling _poison_unsettled_send after a failed chunk and row")
    if "batch_transfer_sync" not in text["_transfer_data"]:
        missing.append("_transfer_data sending through the engine's batch_transfer_sync")
    return missing
