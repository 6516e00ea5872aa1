"""Inside a live SGLang 0.5.23 decode worker (``pdgate live``): the strict patch, one
fault, and a per-rank log of every protocol step.

Set by the parent through the environment (read once, at import):
- ``PDGATE_LIVE_PATCH=strict``: ``impl.sglang.patch.install("0.5.23")``, with strict's
  timeout of ``PDGATE_LIVE_TIMEOUT_STEPS`` steps.
- ``PDGATE_LIVE_LATE_ROOM=RANK:MS``: on that decode rank, each request's metadata room
  is hidden (its slot's ``bootstrap_room`` zeroed) at the first poll that finds it there
  and written back MS ms later (``never``: not written back): a late metadata write on
  one rank, as in SGLang #35049, made to happen on every request.
- ``PDGATE_LIVE_LOG_DIR``: each rank appends ``rank{tp_rank}.jsonl`` in the e2e log
  shape (impl/mooncake/report.py): ``env`` records (``kv_done``, ``fail``, ``land``,
  ``fence``) as the rank observes them, ``enq`` when a request enters its transfer
  queue (``add`` or ``extend``) with the metadata slot SGLang's allocator gave it here,
  ``step`` with the queue, the receiver polls, what went into the MIN, the MIN and the
  pops; ``pool`` (the allocator's size) once, ``release`` when 0.5.23's deferred release
  frees a held slot (drained by the prefill's ack, or by its timeout).

What the rank reads in its metadata slots: a ``land`` when a request's room first
equals its own in its slot (the row's first token, read from ``output_ids`` then, rides
along as ``value``), also after the request left (a late write: the rank keeps reading
the slots of requests that left before their row was seen), and a ``fence`` when a
slot whose row was not seen whole is given back to the allocator under the strict
patch (which frees only once no write can land: the prefill's abort ack, or its
Success, sent after every write returned); a write seen after that is logged too, and
the replay refuses it.

SGLang's classes are wrapped when ``sglang.srt.disaggregation.decode`` is first
imported (sitecustomize's post-import hook), so the scheduler processes get them before
they build their queues.
"""
from __future__ import annotations

import importlib
import json
import os
import threading
import time
from typing import Any

from impl.sglang.patch import abort_acked, writes_fenced
from impl.sglang.reasons import decision_of
from model.spec.kernel import Decision
from model.spec.kvpoll import KVPoll

SUCCESS, FAILED = int(KVPoll.Success), int(KVPoll.Failed)


def _late_room() -> tuple[int, float | None] | None:
    text = os.environ.get("PDGATE_LIVE_LATE_ROOM")
    if not text:
        return None
    rank, _, ms = text.partition(":")
    return int(rank), None if ms == "never" else float(ms)


class _RankLog:
    """One rank's records, one JSON line each, flushed at once (the rank may be killed)."""

    def __init__(self, folder: str, rank: int):
        self.fp = open(os.path.join(folder, f"rank{rank}.jsonl"), "a", encoding="utf-8")
        self.ids: dict[str, int] = {}             # SGLang rid -> trace request id

    def write(self, rec: dict) -> None:
        rec["t"] = time.time()
        self.fp.write(json.dumps(rec) + "\n")
        self.fp.flush()

    def env(self, kind: str, req: int, rank: int, **extra: Any) -> None:
        self.write({"k": "env", "ev": {"kind": kind, "rank": rank, "req": req, **extra}})


class _Rank:
    """Per transfer queue (one per decode rank): what the rank saw, for its log."""

    def __init__(self, queue: Any):
        self.rank = int(queue.tp_rank)
        folder = os.environ.get("PDGATE_LIVE_LOG_DIR")
        self.log = _RankLog(folder, self.rank) if folder else None
        self.latched: dict[int, int] = {}         # req -> Success/Failed seen
        self.landed: set[int] = set()
        self.hidden: dict[int, int] = {}          # req -> the room taken out of its slot
        self.hidden_once: set[int] = set()
        self.step = 0
        self.cur: dict | None = None
        fault = _late_room()
        self.late_ms = fault[1] if fault and fault[0] == self.rank else -1.0
        self.buffers = getattr(queue, "metadata_buffers", None)
        self.slot_of: dict[int, int] = {}         # req -> its slot here
        self.room_of: dict[int, int] = {}
        self.departed: dict[int, int] = {}        # left, row not seen whole -> its slot (watched)
        self.after_step: list[dict] = []          # records that follow the step record
        self.releasing = False                    # inside 0.5.23's _do_release
        self.tenant: dict[int, int | None] = {}   # slot -> its last request (None: health check)
        self.receiver_of: dict[int, Any] = {}
        self.fenced: set[int] = set()
        allocator = getattr(queue, "req_to_metadata_buffer_idx_allocator", None)
        if self.log is not None and allocator is not None:
            self.log.write({"k": "pool", "slots": int(allocator.size)})
            self._watch_frees(allocator)

    def _write(self, rec: dict, later: bool = False) -> None:
        """A record now, or (``later``, inside a step) after the step's record: what the
        step's pops freed belongs after the step the request left in."""
        if self.log is None:
            return
        if later and self.cur is not None:
            rec["t"] = time.time()
            self.after_step.append(rec)
        else:
            self.log.write(rec)

    def flush_after_step(self) -> None:
        for rec in self.after_step:
            self.log.fp.write(json.dumps(rec) + "\n")
        self.log.fp.flush()
        self.after_step = []

    def _land(self, req: int, slot: int, later: bool = False) -> None:
        """The request's whole row is in ``slot``: the payload, then the room (A1)."""
        value = None
        ids = getattr(self.buffers, "output_ids", None)
        if ids is not None:
            value = int(ids[slot, 0].item())
        self.landed.add(req)
        self.departed.pop(req, None)
        for field in ("payload", "room"):
            self._write({"k": "env", "ev": {"kind": "land", "rank": self.rank, "req": req,
                                            "field": field}, "value": value}, later)

    def scan_departed(self, later: bool = False) -> None:
        """Late writes: the room of a request that left shows in the slot it had."""
        if self.buffers is None:
            return
        col = self.buffers.bootstrap_room
        for req, slot in list(self.departed.items()):
            if int(col[slot, 0].item()) == self.room_of[req] != 0:
                self._land(req, slot, later)

    def _watch_frees(self, allocator: Any) -> None:
        """Every slot given back to SGLang's allocator (instance-wide: the queue's pops,
        0.5.23's deferred release, the strict patch's quarantine)."""
        own_free = allocator.free

        def free(idx: int) -> Any:
            self._freed(int(idx))
            return own_free(idx)
        allocator.free = free

    def _freed(self, slot: int) -> None:
        """SGLang gave ``slot`` back. If its tenant's row was not seen whole here, the slot
        may be reused while a write of it is still on its way, unless the tenant's writes
        are fenced: its receiver reported Success (the prefill sends it after every
        write returned) or the prefill acknowledged its abort (the drain ack). Then the
        rank logs a ``fence``; else nothing (shipped 0.5.23's release timeout, or a
        patch that freed too early: the replay refuses a reuse the spec holds)."""
        if self.log is None:
            return
        self.scan_departed(later=True)            # a write that landed first is logged first
        req = self.tenant.get(slot)
        if req is None:
            return
        recv, room = self.receiver_of.get(req), self.room_of[req]
        why = None              # the patch's rule decides; the label says which part held
        if writes_fenced(recv, room, settled=self.latched.get(req) == SUCCESS):
            why = "ack" if abort_acked(recv, room) else "settled"
        if self.releasing:                        # the trace's release timeout counts these
            self._write({"k": "release", "req": req, "why": why or "timeout"}, later=True)
        if req in self.fenced:
            return
        landed = req in self.landed
        if not landed:
            self.departed.setdefault(req, slot)   # freed by the pop it leaves in
        if why is not None and (not landed or self.releasing):
            # still watched: a write after this is refused. A landed row's fence matters
            # only to a held slot (the spec's deferred variants release on it; strict has
            # forgotten the request: live_trace drops it there)
            self.fenced.add(req)
            self._write({"k": "env", "ev": {"kind": "fence", "rank": self.rank, "req": req},
                         "why": why, "landed": landed}, later=True)

    def popped(self, req: int) -> None:
        """``req`` left this rank's queue: its slot may still receive its row."""
        self.hidden.pop(req, None)
        if req not in self.landed and req not in self.fenced and req in self.slot_of:
            self.departed[req] = self.slot_of[req]

    def rid(self, decode_req: Any) -> int | None:
        """The trace id of a request this rank logged; None for the rest (health checks)."""
        return self.log.ids.get(decode_req.req.rid) if self.log else None

    def enqueue(self, decode_req: Any, fake: Any) -> None:
        """Log a request entering the queue; SGLang's health checks (fake transfers: no
        KV, no metadata) are outside the protocol and stay out of the trace."""
        if self.log is None:
            return
        slot = int(decode_req.metadata_buffer_index)
        if fake is not None and fake(decode_req.req):
            self.tenant[slot] = None
            return
        req = self.log.ids.setdefault(decode_req.req.rid, len(self.log.ids))
        room = int(decode_req.req.bootstrap_room or 0)
        self.slot_of[req], self.room_of[req], self.tenant[slot] = slot, room, req
        self.receiver_of[req] = decode_req.kv_receiver
        self.log.write({"k": "enq", "req": req, "room": room, "payload": None, "slot": slot})

    def _hide(self, decode_req: Any, buffers: Any, req: int) -> None:
        """The late-room fault: take the room out now, put it back after late_ms."""
        col, idx = buffers.bootstrap_room, decode_req.metadata_buffer_index
        room = int(decode_req.req.bootstrap_room or 0)
        col[idx, 0] = 0
        self.hidden[req] = room
        if self.late_ms is None:
            return

        def land() -> None:
            if self.hidden.pop(req, None) is not None:   # still queued: its slot is its own
                col[idx, 0] = room
        timer = threading.Timer(self.late_ms / 1000.0, land)
        timer.daemon = True
        timer.start()

    def _fault_due(self, req: int, buffers: Any) -> bool:
        """This rank hides rooms and has not yet hidden ``req``'s."""
        return self.late_ms != -1.0 and buffers is not None and req not in self.hidden_once

    def _room_seen(self, decode_req: Any, buffers: Any) -> bool:
        seen = int(buffers.bootstrap_room[decode_req.metadata_buffer_index, 0].item())
        return seen != 0 and seen == int(decode_req.req.bootstrap_room or 0)

    def observe(self, decode_req: Any, buffers: Any, value: int) -> int:
        """One receiver poll: log a newly latched outcome; on the fault rank, hide the
        room the moment it first appears in the slot (before any gate reads it)."""
        req = self.rid(decode_req)
        if self.cur is not None:
            self.cur["local"].append(value)
        if req is None:
            if self.cur is not None:
                self.cur["entries"].append((None, decode_req, buffers, value, False))
            return value
        if value in (SUCCESS, FAILED) and req not in self.latched:
            self.latched[req] = value
            if self.log:
                self.log.env("kv_done" if value == SUCCESS else "fail", req, self.rank)
        if self._fault_due(req, buffers) and self._room_seen(decode_req, buffers):
            self.hidden_once.add(req)
            self._hide(decode_req, buffers, req)
        if self.cur is not None:
            before = buffers is not None and self._room_seen(decode_req, buffers)
            self.cur["entries"].append((req, decode_req, buffers, value, before))
        return value

    def after_gate(self, gated: list) -> None:
        """Log the rooms that landed. The slot is read before the gate (at the poll) and
        after it: there both times, it landed; absent both times, it did not (whatever
        the gate did: the replay judges it). Only a room that appeared between the two
        reads is decided by the gate's verdict, since the gate read it in between.

        On the fault rank a room that appeared between the two reads is hidden here,
        unless the gate already passed it: hidden at the next poll instead, it would
        have landed (in the log) and then vanished, which no spec rank does (A1)."""
        if self.cur is None or not self.log:
            return
        self.scan_departed()        # a late write the gate may have read (into a new tenant's slot)
        for (req, decode_req, buffers, value, before), g in zip(self.cur["entries"], gated):
            if req is None or req in self.landed or buffers is None:
                continue
            after = self._room_seen(decode_req, buffers)
            if after and self._fault_due(req, buffers):
                self.hidden_once.add(req)
                if g != SUCCESS:            # the gate has not acted on it: hide it now
                    self._hide(decode_req, buffers, req)
                    continue
            if after and (before or value != SUCCESS or g == SUCCESS):
                self._land(req, decode_req.metadata_buffer_index)


class _Poller:
    """A receiver as the poll function sees it: each poll observed by the rank."""

    def __init__(self, rank: _Rank, real: Any, decode_req: Any, buffers: Any):
        self.rank, self.real, self.decode_req, self.buffers = rank, real, decode_req, buffers

    def poll(self) -> int:
        return self.rank.observe(self.decode_req, self.buffers, int(self.real.poll()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _decision(decode_req: Any, reduced: int) -> tuple[int, int]:
    """(model.spec.kernel.Decision, first token or 0) of a request that left the queue,
    read back from SGLang's own abort messages."""
    if reduced == FAILED:
        return int(Decision.ABORT_FAILED), 0
    reason = decode_req.req.finished_reason
    message = str(getattr(reason, "message", "") or "")
    if type(reason).__name__ == "FINISH_ABORT":
        # the release's own messages; one none of them names is still an abort (after MIN)
        return int(decision_of(message) or Decision.ABORT_ROOM_MISMATCH), 0
    return int(Decision.COMMIT), int(decode_req.req.output_ids[-1])


def wrap(decode: Any, utils: Any = None) -> None:
    """Wrap a freshly imported ``sglang.srt.disaggregation.decode`` (sitecustomize) and
    its ``utils`` module (default: SGLang's)."""
    utils = utils or importlib.import_module("sglang.srt.disaggregation.utils")
    if os.environ.get("PDGATE_LIVE_PATCH") == "strict":
        from impl.sglang.patch import install
        steps = os.environ.get("PDGATE_LIVE_TIMEOUT_STEPS")
        install("0.5.23", timeout_steps=int(steps) if steps else None, observer=_Observer())
    cls = decode.DecodeTransferQueue
    own_add, own_extend, own_pop = cls.add, cls.extend, cls.pop_transferred
    own_poll = decode.poll_and_all_reduce
    own_gate = getattr(utils, "_apply_metadata_gate", None)
    fake = getattr(utils, "_is_fake_transfer", None)

    def rank_of(queue: Any) -> _Rank:
        if not hasattr(queue, "_pdgate_live"):
            queue._pdgate_live = _Rank(queue)
        return queue._pdgate_live

    def add(self: Any, decode_req: Any, *args: Any, **kwargs: Any) -> Any:
        out = own_add(self, decode_req, *args, **kwargs)
        rank_of(self).enqueue(decode_req, fake)
        return out

    def extend(self: Any, decode_reqs: Any, *args: Any, **kwargs: Any) -> Any:
        decode_reqs = list(decode_reqs)
        out = own_extend(self, decode_reqs, *args, **kwargs)
        for decode_req in decode_reqs:
            rank_of(self).enqueue(decode_req, fake)
        return out

    def poll_and_all_reduce(pollers: Any, gloo_group: Any, decode_reqs: Any = None,
                            metadata_buffers: Any = None, *args: Any, **kwargs: Any) -> list:
        queue = _CURRENT.get("queue")
        if queue is None or decode_reqs is None:
            return own_poll(pollers, gloo_group, decode_reqs, metadata_buffers, *args, **kwargs)
        rank = rank_of(queue)
        ours = [_Poller(rank, p, d, metadata_buffers) for p, d in zip(pollers, decode_reqs)]
        reduced = own_poll(ours, gloo_group, decode_reqs, metadata_buffers, *args, **kwargs)
        if rank.cur is not None:
            rank.cur["reduced"] = [int(x) for x in reduced]
        return reduced

    def gate(polls: list, decode_reqs: Any, metadata_buffers: Any) -> None:
        own_gate(polls, decode_reqs, metadata_buffers)
        _note_gated(list(polls))

    def pop_transferred(self: Any, *args: Any, **kwargs: Any) -> Any:
        rank = rank_of(self)
        if rank.log is None:
            return own_pop(self, *args, **kwargs)
        rank.scan_departed()
        before = list(self.queue)
        ours = [i for i, d in enumerate(before) if rank.rid(d) is not None]
        if not ours:
            out = own_pop(self, *args, **kwargs)
            if getattr(self, "_deferred_releases", None):
                # an iteration with nothing queued still counts toward 0.5.23's release
                # timeout of a held slot (the spec counts held steps): an empty step
                rank.log.write({"k": "step", "rec": {
                    "step": rank.step, "queue": [], "local": [], "gated": [], "reduced": [],
                    "popped": [], "hang": None, "error": None}})
                rank.step += 1
            return out
        rank.cur = {"queue": [rank.rid(d) for d in before], "local": [], "entries": [],
                    "gated": None, "reduced": None}
        _CURRENT["queue"], _CURRENT["rank"] = self, rank
        try:
            out = own_pop(self, *args, **kwargs)
        finally:
            _CURRENT.clear()
            cur, rank.cur = rank.cur, None
        left = {id(d) for d in before} - {id(d) for d in self.queue}
        reduced = cur["reduced"] or []
        gated = cur["gated"] if cur["gated"] is not None else cur["local"]
        popped = [[rank.rid(before[i]), *_decision(before[i], reduced[i])]
                  for i in ours if id(before[i]) in left]
        for req, _, _ in popped:
            rank.popped(req)
        rank.log.write({"k": "step", "rec": {
            "step": rank.step, "queue": [cur["queue"][i] for i in ours],
            "local": [cur["local"][i] for i in ours], "gated": [gated[i] for i in ours],
            "reduced": [reduced[i] for i in ours], "popped": popped, "hang": None,
            "error": None}})
        rank.step += 1
        rank.flush_after_step()
        return out

    def do_release(self: Any, decode_req: Any, idx: int) -> Any:
        rank = rank_of(self)
        rank.releasing = True
        try:
            return own_release(self, decode_req, idx)
        finally:
            rank.releasing = False

    cls.add, cls.extend, cls.pop_transferred = add, extend, pop_transferred
    own_release = getattr(cls, "_do_release", None)
    if own_release is not None:          # 0.5.19+: the deferred release of a held slot
        cls._do_release = do_release
    decode.poll_and_all_reduce = poll_and_all_reduce
    if own_gate is not None and os.environ.get("PDGATE_LIVE_PATCH") != "strict":
        utils._apply_metadata_gate = gate


_CURRENT: dict[str, Any] = {}


def _note_gated(gated: list) -> None:
    rank = _CURRENT.get("rank")
    if rank is not None and rank.cur is not None:
        rank.cur["gated"] = [int(x) for x in gated]
        rank.after_gate(rank.cur["gated"])


class _Observer:
    """What the strict patch's poll hands to the MIN, for the rank's log."""

    @staticmethod
    def note(gated: list) -> None:
        _note_gated(gated)
