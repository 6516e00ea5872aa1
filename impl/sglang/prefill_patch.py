"""strict's prefill side, for SGLang's Mooncake sender (0.5.23): the metadata room is
written only after the rest of the request's transfer completed.

The decode gate reads the room as "the metadata row landed" (model/spec assumption A1:
the payload, then the room). SGLang's ``MooncakeKVManager.send_aux`` writes every
metadata buffer of the row, the room among them, as one batch (its order on the wire is
the engine's; in 0.5.23 the KV checksum buffer even comes after the room), and
``send_aux_tcp`` sends them one message each, the room before the checksum. A decode rank
may then see the room while the first token or the checksum is still on its way: the
room-first traces of ``pdgate conform``, which no decode-side patch can repair
(``strict-no-room-order``). Here:

- ``send_aux`` issues the row without the room first and the room alone after it, only
  if the first transfer returned 0 (a failed row never shows its room: the request is
  Failed, never half-landed). The KV pages were written before ``send_aux`` is called,
  by the same transfer worker (the release's own order), so the room is the last write;
- ``send_aux_tcp`` sends the room's message last, on the same socket (ZeroMQ keeps a
  socket's order, and the decode thread applies them in order).

Aborts are fenced by the release itself since 0.5.19 (the deferred KV release: decode
keeps an aborted request's slot until the prefill's drain ack, and a transfer that
failed while possibly still writing poisons that ack, ``_poison_unsettled_send``);
``release_fences`` checks the wheel still does, and the patch leaves it alone.

The room buffer is recognised by address: ``MetadataBuffers.get_buf_infos`` is wrapped
to note where each process's ``bootstrap_room`` tensor lies.
"""
from __future__ import annotations

import ast
import threading
from typing import Any, Callable

_ROOM_SPANS: list[tuple[int, int]] = []     # (address, bytes) of every bootstrap_room
_LOCAL = threading.local()                   # per transfer worker: inside send_aux?
COUNTS = {"rows": 0, "room_last": 0, "room_withheld": 0}
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


def install_prefill(utils: Any, conn: Any) -> None:
    """Both patches, on modules already loaded (the live prefill installs each as its
    module is imported: impl/sglang/live_site/sitecustomize.py)."""
    note_rooms(utils)
    room_last(conn)


def release_fences(conn_source: str) -> list[str]:
    """What the release's sender lacks of the abort fence this patch relies on (empty:
    it has it): a ``_poison_unsettled_send`` method that poisons the deferred release's
    ack, called where a KV chunk or the metadata row failed to send."""
    tree = ast.parse(conn_source)
    methods = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    missing = []
    poison = methods.get("_poison_unsettled_send")
    if poison is None or "poison_deferred_ack_room" not in ast.unparse(poison):
        missing.append("_poison_unsettled_send poisoning the deferred release's ack")
    worker = methods.get("transfer_worker")
    calls = ast.unparse(worker) if worker is not None else ""
    if calls.count("self._poison_unsettled_send(") < 2:
        missing.append("transfer_worker poisoning the ack after a failed chunk and row")
    return missing
