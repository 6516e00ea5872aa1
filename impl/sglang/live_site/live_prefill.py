"""Inside the live SGLang 0.5.23 prefill (``pdgate live``), set by the environment:

- ``PDGATE_LIVE_PATCH=strict``: strict's prefill side (impl/sglang/prefill_patch.py: the
  metadata room written after the rest of the row), its counts written at each change
  by each process that loaded the sender to ``$PDGATE_LIVE_LOG_DIR/prefill_patch.PID.json``
  (the parent adds them up and reports them: the patch ran);
- ``PDGATE_LIVE_FAIL_SEND=RANK``: every KV transfer to decode rank RANK returns failure,
  as the engine's would, and the release's own failure path runs from there.
"""
from __future__ import annotations

import json
import os
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


def install(after_import: Callable[[str, Callable[[Any], None]], None]) -> None:
    strict = os.environ.get("PDGATE_LIVE_PATCH") == "strict"
    fail = os.environ.get("PDGATE_LIVE_FAIL_SEND")
    if strict:
        from impl.sglang import prefill_patch
        after_import("sglang.srt.disaggregation.utils", prefill_patch.note_rooms)
    folder = os.environ.get("PDGATE_LIVE_LOG_DIR")

    def at_conn(conn: Any) -> None:
        if strict:
            from impl.sglang.prefill_patch import COUNTS, ON_COUNT, room_last
            room_last(conn)
            if folder:
                write = _counts_writer(os.path.join(folder, f"prefill_patch.{os.getpid()}.json"))
                write(dict(COUNTS))         # the patch loaded in this process: zeros
                ON_COUNT.append(write)
        if fail:
            _fail_sends(conn, int(fail))
    if strict or fail:
        after_import(CONN, at_conn)
