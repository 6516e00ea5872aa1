"""One decode TP rank as a process (``python -m impl.mooncake.rank``), driven by ``pdgate e2e``.

It joins a gloo group with the other decode ranks, registers its KV pool and landing
metadata buffers with Mooncake, and runs the scheduler loop: observe the network
(``Landing``), admit requests (all ranks agree how many with one MIN), start their
receivers, ``DecodeTransferQueue.pop_transferred()``, check every commit byte for byte.

stdin, one JSON object per line: ``{"cmd": "serve", "endpoint", "offset", "count"}``
(requests ``offset..offset+count-1`` of the seeded workload, from that prefill) and
``{"cmd": "quit"}``. stdout, one JSON object per line: ``ready``, then ``idle`` once
every served request has left the queue, then ``result`` (path of the result file).
Its log (one JSON line per step, enqueue and environment event) is merged into the
e2e trace by ``impl.mooncake.report``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from impl.decode import (Aborted, Committed, DecodeRequest, DecodeTransferQueue, GlooExchange,
                         MetadataBuffers, Req, SlotAllocator, StepTrace)
from impl.decode.collective import rendezvous_store
from impl.mooncake.auth import receive_key
from impl.mooncake.decode import BufferSpec, DecodeTransport
from impl.decode.timeouts import GATE_TIMEOUT_S, steps_for
from impl.mooncake.engine import Engine
from impl.mooncake.digest import digest_key
from impl.mooncake.landing import DigestCheck, Landing, Tracked
from impl.mooncake.stdio import StdinLines
from impl.mooncake.synth import RequestSpec, kv_page, make_requests, metadata_row
from model.cli import number
from model.spec.trace import event_record


class RankLog:
    """The rank's JSONL log; also impl.decode's tracer (one line per protocol step)."""

    def __init__(self, path: str):
        self.fp = open(path, "w", encoding="utf-8")

    def write(self, obj: dict[str, Any]) -> None:
        obj["t"] = time.monotonic()
        self.fp.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def record(self, rec: StepTrace) -> None:
        self.write({"k": "step", "rec": rec.to_json()})


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


class DecodeRank:
    def __init__(self, a: argparse.Namespace):
        import torch.distributed as dist
        self.a, self.rank = a, a.rank
        dev = torch.device(a.device)
        self.log = RankLog(a.log)
        self.landing_bufs = MetadataBuffers(a.slots, device=dev)
        self.visible = MetadataBuffers(a.slots, device=dev)
        self.pool = torch.empty((a.pages, a.page_bytes), dtype=torch.uint8, device=dev)
        self.pool.fill_(0)            # touch every page now, not during the first transfers
        self.stdin = StdinLines()
        key = receive_key(self.stdin, "key")          # out of band, before anything listens
        self.engine = Engine(a.host)
        info = self.landing_bufs.buf_infos()
        fields = [BufferSpec(n, p, item, total // item)
                  for n, p, total, item in zip(info.names, info.ptrs, info.data_lens, info.item_lens)]
        self.transport = DecodeTransport(
            self.rank, self.engine, BufferSpec("kv", self.pool.data_ptr(), a.page_bytes, a.pages),
            fields, host=a.host, heartbeat_s=a.heartbeat_ms / 1000, heartbeat_misses=a.heartbeat_misses,
            fence_grace_s=a.fence_grace_s, connect_timeout_s=a.connect_timeout_s,
            hello_wait_max_s=a.collective_timeout_s / 2, key=key)
        # Our own store (bound to --host, not every interface), not init_method="tcp://".
        store = rendezvous_store(a.host, a.master_port, a.world, is_master=self.rank == 0,
                                 timeout_s=a.collective_timeout_s)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=a.world,
                                timeout=datetime.timedelta(seconds=a.collective_timeout_s))
        self.exchange = GlooExchange(None, a.collective_timeout_s)
        self.queue = DecodeTransferQueue(None, self.visible, SlotAllocator(a.slots), a.variant,
                                         timeout_steps=a.timeout_steps or (
                                             steps_for(a.gate_timeout_s, a.step_ms / 1000)
                                             if a.variant == "strict" else None),
                                         collective_timeout_s=a.collective_timeout_s, tracer=self.log)
        self.landing = Landing(self.rank, self.landing_bufs, self.visible,
                               DigestCheck(digest_key(key), self.pool, tuple(info.names)))
        self.free_pages: deque[int] = deque(range(a.pages))
        self.backlog: deque[tuple[RequestSpec, str]] = deque()
        self.outstanding = 0            # served requests not yet popped
        self.quitting = False
        self.results: list[dict[str, Any]] = []
        self.step_starts: list[float] = []
        self.arrived: dict[int, float] = {}     # request -> when its serve command was read
        self.phase: list[dict[str, Any]] = []      # outcomes since the last idle report
        self.unchecked: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
        # ^ committed, row and KV not yet checked: (outcome record, the row read at commit)
        self.held: dict[int, Tracked] = {}               # ...and left the landing tracker
        self.busy = False                          # served requests not all decided yet
        kv_page(RequestSpec(0, 1, 1, 0), 0, 0, a.page_bytes)   # build the shared random block now

    # -- commands -----------------------------------------------------------------------
    def read_commands(self) -> None:
        for line in self.stdin.poll():
            cmd = json.loads(line) if line else {}
            if cmd.get("cmd") == "quit":
                self.quitting = True
            elif cmd.get("cmd") == "serve":
                specs = make_requests(cmd["offset"] + cmd["count"], self.a.seed,
                                      self.a.min_pages, self.a.max_pages)[cmd["offset"]:]
                now = time.monotonic()
                for s in specs:
                    self.backlog.append((s, cmd["endpoint"]))
                    self.arrived[s.index] = now
                self.outstanding += len(specs)
        if self.stdin.closed:                 # the parent is gone
            self.quitting = True

    # -- one scheduler step ----------------------------------------------------------------
    def admissible(self) -> int:
        """How many backlog requests this rank could admit now (in order)."""
        room = min(self.queue.allocator.available_size(), self.a.inflight - len(self.queue))
        if self.backlog and room > 0:
            self.verify(need_pages=self.backlog[0][0].n_pages)
        n, pages = 0, len(self.free_pages)
        for s, _ in self.backlog:
            if n >= room or s.n_pages > pages:
                break
            n, pages = n + 1, pages - s.n_pages
        return n

    def admit(self, spec: RequestSpec, endpoint: str) -> None:
        slot = self.queue.allocator.alloc()
        pages = tuple(self.free_pages.popleft() for _ in range(spec.n_pages))
        receiver = self.transport.start(spec.room, slot, pages, endpoint)
        self.queue.add(DecodeRequest(Req(str(spec.index), spec.room, endpoint), receiver, slot))
        self.landing.track(Tracked(spec, receiver, slot, pages, t_enq=time.monotonic()))
        self.log.write({"k": "enq", "req": spec.index, "room": spec.room, "payload": spec.first_token})

    def step(self) -> bool:
        """One scheduler step; False once all ranks agreed to stop."""
        now = time.monotonic()
        self.step_starts.append(now)
        self.read_commands()
        for ev in self.landing.observe(now):
            self.log.write({"k": "env", "ev": event_record(ev)})
        self.queue.release_fenced()
        self.release_pages()
        want = torch.tensor([self.admissible(), 0 if self.quitting else 1], dtype=torch.int64)
        admit, go = self.exchange.all_reduce_min(want).tolist()
        if not go:
            return False
        for _ in range(admit):
            self.admit(*self.backlog.popleft())
        for res in self.queue.pop_transferred():
            self.settle(res)
        if self.outstanding == 0 and not self.backlog and len(self.queue) == 0 and self.busy:
            self.busy = False
            self.release_pages()
            self.verify()
            emit({"idle": True, "step": self.queue.steps, "outcomes": [
                {k: rec.get(k) for k in ("req", "decision", "step", "local", "kv_ok", "row_ok",
                                         "token_ok", "t_enq", "t_pop")} for rec in self.phase]})
            self.phase = []
        elif self.outstanding:
            self.busy = True
        return True

    def settle(self, res: Committed | Aborted) -> None:
        idx = int(res.decode_req.req.rid)
        t = self.landing.left(idx)
        self.outstanding -= 1
        rec = {"rank": self.rank, "req": idx, "room": t.spec.room, "step": self.queue.steps - 1,
               "decision": res.decision.name.lower(), "t_pop": time.monotonic(),
               "t_last_byte": t.t_last_byte, "local": t.receiver.poll(), "t_enq": t.t_enq,
               # when it arrived, its Success came in (I/O thread), its row was seen, and
               # when the step that popped it started (the e2e's true timeline)
               "t_arrive": self.arrived.pop(idx, None), "t_success": t.receiver.success_at,
               "t_row_seen": t.t_land, "t_step": self.step_starts[-1]}
        if isinstance(res, Committed):
            rec.update(token_ok=res.first_token == t.spec.first_token, row_ok=None, kv_ok=None,
                       kv_bytes=len(t.pages) * self.a.page_bytes)
            self.unchecked[idx] = (rec, res.fields)      # the queue's own copy of the row
        else:
            failed = t.receiver.failure_exception()    # None: the MIN or strict's timeout
            rec["why"] = failed.reason[:200] if failed is not None else "another rank or the timeout"
            if not t.done:
                self.transport.abort(t.spec.room)    # ask for a fence before reuse
        self.results.append(rec)
        self.phase.append(rec)

    def verify(self, need_pages: int | None = None) -> None:
        """Byte-for-byte check of committed requests' metadata rows (as the queue read
        them at commit) and KV pages, oldest first, then free the pages. A test harness's
        check, so it runs when pages run short or the rank goes idle, never in the step
        that committed: it stays out of the transfer window that bench_e2e measures.
        The pages stay allocated until checked, so nothing can overwrite them before."""
        pb = self.a.page_bytes
        while self.held and (need_pages is None or len(self.free_pages) < need_pages):
            idx, t = next(iter(self.held.items()))
            del self.held[idx]
            rec, fields = self.unchecked.pop(idx)
            rec["row_ok"] = all(row.cpu().contiguous().view(torch.uint8).numpy().tobytes()
                                == metadata_row(t.spec, name, row.nbytes)
                                for name, row in fields.items())
            rec["kv_ok"] = all(
                np.array_equal(self.pool[p].cpu().numpy(), kv_page(t.spec, self.rank, j, pb))
                for j, p in enumerate(t.pages))
            self.free_pages.extend(t.pages)

    def release_pages(self) -> None:
        for t in self.landing.forget_done():
            self.transport.forget(t.spec.room)
            if t.spec.index in self.unchecked:
                self.held[t.spec.index] = t          # committed: free once its KV is checked
            else:
                self.free_pages.extend(t.pages)

    def run(self) -> None:
        emit({"ready": True, "status_endpoint": self.transport.status_endpoint,
              "session": self.engine.session_id})
        deadline = time.monotonic() + self.a.lifetime_s
        interval = self.a.step_ms / 1000
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            if not self.step():
                break
            rest = interval - (time.monotonic() - t0)
            if rest > 0:
                time.sleep(rest)
        else:
            raise TimeoutError(f"rank {self.rank}: still running after --lifetime-s {self.a.lifetime_s}")

    def write_result(self) -> None:
        self.release_pages()
        self.verify()
        path = self.a.log + ".result.json"
        with open(path, "w", encoding="utf-8") as fp:
            json.dump({"rank": self.rank, "steps": self.queue.steps, "results": self.results,
                       "step_starts": self.step_starts, "dropped": self.transport.dropped,
                       "rejected": self.transport.rejected,
                       "foreign_writes": self.landing.foreign_writes,
                       "digest_seconds": self.landing.digest_seconds,
                       "broken": self.transport.broken.count,
                       "slots": self.a.slots}, fp)
        self.log.fp.close()
        emit({"result": path})


def add_rank_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by the rank process and ``pdgate e2e`` (which forwards them). Each
    range is what a run can use: outside it healthy requests would abort (a heartbeat
    window of 0) or the rank could not start (a pool bigger than memory)."""
    p.add_argument("--variant", choices=("gate", "strict"), default="strict")
    p.add_argument("--gate-timeout-s", type=number(0, 86_400, above=True), default=GATE_TIMEOUT_S,
                   help="strict's gate timeout in seconds, converted at --step-ms to an agreed "
                        f"step count (default {GATE_TIMEOUT_S:g})")
    p.add_argument("--timeout-steps", type=number(1, 10**9, integer=True), default=None,
                   help="strict's bound as a step count instead (overrides --gate-timeout-s)")
    p.add_argument("--slots", type=number(1, 1 << 16, integer=True), default=64,
                   help="metadata slots per rank")
    p.add_argument("--pages", type=number(1, 1 << 20, integer=True), default=512,
                   help="KV pages per rank")
    p.add_argument("--inflight", type=number(1, 1 << 16, integer=True), default=16,
                   help="most requests in the queue")
    p.add_argument("--step-ms", type=number(0, 10_000, above=True), default=2.0,
                   help="scheduler step period")
    p.add_argument("--device", default="cpu", help="cpu or cuda (KV pool and metadata buffers)")
    p.add_argument("--host", default="127.0.0.1", help="address every socket binds to")
    p.add_argument("--heartbeat-ms", type=number(10, 60_000), default=100.0,
                   help="ping period per prefill, 10..60000 ms")
    p.add_argument("--heartbeat-misses", type=number(2, 10_000, integer=True), default=50,
                   help="silent heartbeats before a prefill is declared dead, 2..10000 (and "
                        "at least 8 of its slowest recent PONGs; a killed prefill is found "
                        "at once by its closed connection)")
    p.add_argument("--fence-grace-s", type=number(0, 3600), default=30.0,
                   help="after a prefill died, wait this long before reusing its slots")
    p.add_argument("--collective-timeout-s", type=number(0, 3600, above=True), default=20.0)
    p.add_argument("--connect-timeout-s", type=number(0, 60, above=True), default=1.0,
                   help="bound on a prefill accepting the handshake's connection; one "
                        "that accepts but answers slowly gets the heartbeat window")


def main(argv: list[str] | None = None) -> int:
    from impl.mooncake.prefill_main import add_workload_arguments
    p = argparse.ArgumentParser(prog="impl.mooncake.rank")
    add_workload_arguments(p)
    add_rank_arguments(p)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--lifetime-s", type=float, default=300.0)
    a = p.parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("impl.mooncake.rank: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    try:
        rank = DecodeRank(a)
    except ValueError as exc:        # no key on stdin, or a bad one: one line
        print(f"impl.mooncake.rank: {exc}", file=sys.stderr)
        return 2
    try:
        rank.run()
        rank.write_result()
    finally:
        rank.transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
