"""Inside the live SGLang 0.5.23 prefill (``pdgate live``), set by the environment:

- ``PDGATE_LIVE_PATCH=strict``: strict's prefill side (impl/sglang/prefill_patch.py: the
  metadata room written after the rest of the row; a failed room's ABORT_ACK only once
  its writes settled), its counts written at each change by each process that loaded
  the sender to ``$PDGATE_LIVE_LOG_DIR/prefill_patch.PID.json`` (the parent adds them up
  and reports them: the patch ran);
- ``PDGATE_LIVE_FAIL_SEND=RANK``: every KV transfer to decode rank RANK returns failure,
  as the engine's would, and the release's own failure path runs from there;
- ``PDGATE_LIVE_LATE_WRITE=RANK:MS``: the first metadata row sent to decode rank RANK
  once ``$PDGATE_LIVE_LOG_DIR/armed`` exists (the driver writes it after its warm-up
  request) is reported failed at once, as ``batch_transfer_sync`` reports a write that
  ran past its timeout, while the write itself is still on its way: it lands MS ms
  later, or, if the prefill writes another row into the same decode slot before that,
  right after that row (the worst moment: the new tenant's row is overwritten before
  its Success is sent). The engine is wrapped (``_LateEngine``), so the release's
  ``batch_transfer_sync`` and strict's per-write status see the same write: running,
  then timed out, and failed once it landed. What happened goes to
  ``$PDGATE_LIVE_LOG_DIR/late_write.json``.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable

CONN = "sglang.srt.disaggregation.mooncake.conn"


def _counts_writer(path: str) -> Callable[[dict[str, int]], None]:
    """Writes the counts it is given to ``path`` atomically (a reader never sees half)."""
    def write(counts: dict[str, int]) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fp:
            json.dump(counts, fp)
        os.replace(tmp, path)
    return write


def _failing(own: Callable[..., int], rank: int, position: int) -> Callable[..., int]:
    """A KV send that fails where its destination is decode rank ``rank`` (the
    destination's tp rank is the call's ``position``-th argument or ``dst_tp_rank``)."""
    def send(self: Any, *args: Any, **kwargs: Any) -> int:
        dst = kwargs.get("dst_tp_rank", args[position] if len(args) > position else None)
        if dst is not None and int(dst) == rank:
            return -1
        return own(self, *args, **kwargs)
    return send


def _fail_sends(conn: Any, rank: int) -> None:
    manager = conn.MooncakeKVManager
    # send_kvcache_slice: prefill TP 1 to decode TP 2 (this deployment); its 5th argument
    manager.send_kvcache_slice = _failing(manager.send_kvcache_slice, rank, 4)


class _LateWrite:
    """The one delayed metadata row (see module doc): held, then written."""

    def __init__(self, rank: int, ms: float, folder: str):
        self.rank, self.delay_s, self.folder = rank, ms / 1000.0, folder
        self.local = threading.local()           # per transfer worker: the row being sent
        self.lock = threading.Lock()
        self.key: tuple[str, int] | None = None  # (session, decode slot) of the held row
        self.held: list[tuple[str, list, list, list]] = []
        self.real: Any = None
        self.ids: set[int] = set()
        self.landed = False
        self.t_held = 0.0

    def holding(self) -> bool:
        return getattr(self.local, "row", None) is self

    def hold(self, session: str, bufs: list, peers: list, lens: list) -> None:
        with self.lock:
            self.held.append((session, list(bufs), list(peers), list(lens)))

    def fake_id(self) -> int:
        with self.lock:
            self.ids.add(len(self.ids) + 1)
            return (1 << 62) + len(self.ids)

    def status(self, batch: int) -> int | None:
        """A held write's status as the engine would give it: timed out while it is
        still on its way, failed once it landed; None for the engine's own writes."""
        if batch - (1 << 62) not in self.ids:
            return None
        return -1 if self.landed else -2

    def land(self, trigger: str) -> None:
        with self.lock:
            if self.landed or self.real is None:
                return
            for session, bufs, peers, lens in self.held:
                self.real.batch_transfer_sync_write(session, bufs, peers, lens)
            self.landed = True
            report = {"rank": self.rank, "blocks": sum(len(b) for _, b, _, _ in self.held),
                      "slot": self.key[1] if self.key else None, "trigger": trigger,
                      "landed_after_s": round(time.monotonic() - self.t_held, 3)}
        _counts_writer(os.path.join(self.folder, "late_write.json"))(report)

    def send_aux(self, own: Callable[..., int]) -> Callable[..., int]:
        fault = self

        def send_aux(manager: Any, req: Any, *args: Any, **kwargs: Any) -> int:
            if not isinstance(manager.engine.engine, _LateEngine):
                fault.real = manager.engine.engine
                manager.engine.engine = _LateEngine(fault.real, fault)
            session = req.mooncake_session_id
            key = (session, int(req.dst_aux_index))
            info = manager.decode_kv_args_table.get(session)
            mine = (fault.key is None and info is not None and int(info.dst_tp_rank) == fault.rank
                    and os.path.exists(os.path.join(fault.folder, "armed")))
            if mine:
                fault.key, fault.t_held = key, time.monotonic()
                fault.local.row = fault
                timer = threading.Timer(fault.delay_s, fault.land, args=("timer",))
                timer.daemon = True
                timer.start()
            try:
                return own(manager, req, *args, **kwargs)
            finally:
                fault.local.row = None
                if not mine and key == fault.key:      # its slot reused: land it now
                    fault.land("reuse")
        return send_aux


class _LateEngine:
    """The Mooncake engine with the held row's writes taken out (see _LateWrite)."""

    def __init__(self, real: Any, fault: _LateWrite):
        self._real, self._fault = real, fault

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def batch_transfer_sync_write(self, session: str, bufs: list, peers: list, lens: list,
                                  *args: Any) -> int:
        if self._fault.holding():
            self._fault.hold(session, bufs, peers, lens)
            return -1                          # "timed out" (the batch still running)
        return self._real.batch_transfer_sync_write(session, bufs, peers, lens, *args)

    def transfer_submit_write(self, session: str, buf: int, peer: int, length: int,
                              *args: Any) -> int:
        if self._fault.holding():
            self._fault.hold(session, [buf], [peer], [length])
            return self._fault.fake_id()
        return self._real.transfer_submit_write(session, buf, peer, length, *args)

    def transfer_check_status(self, batch: int) -> int:
        held = self._fault.status(batch)
        return self._real.transfer_check_status(batch) if held is None else held


def install(after_import: Callable[[str, Callable[[Any], None]], None]) -> None:
    strict = os.environ.get("PDGATE_LIVE_PATCH") == "strict"
    fail = os.environ.get("PDGATE_LIVE_FAIL_SEND")
    late = os.environ.get("PDGATE_LIVE_LATE_WRITE")
    if strict:
        from impl.sglang import prefill_patch
        after_import("sglang.srt.disaggregation.utils", prefill_patch.note_rooms)
    folder = os.environ.get("PDGATE_LIVE_LOG_DIR")

    def at_conn(conn: Any) -> None:
        if late and folder:
            rank, _, ms = late.partition(":")
            manager = conn.MooncakeKVManager
            manager.send_aux = _LateWrite(int(rank), float(ms), folder).send_aux(manager.send_aux)
        if strict:
            from impl.sglang.prefill_patch import COUNTS, ON_COUNT, room_last, settle_writes
            settle_writes(conn)
            room_last(conn)
            if folder:
                write = _counts_writer(os.path.join(folder, f"prefill_patch.{os.getpid()}.json"))
                write(dict(COUNTS))         # the patch loaded in this process: zeros
                ON_COUNT.append(write)
        if fail:
            _fail_sends(conn, int(fail))
    if strict or fail or late:
        after_import(CONN, at_conn)
