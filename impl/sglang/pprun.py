"""``pdgate conform --pp``: each release's own PP decode transfer consensus run on
PP stages x TP ranks threads, compared per (stage, rank) with the ``pp-*`` variant of
model/spec/pipeline.py that models the release (impl/sglang/pp_facts.py MODELLED_BY).

What runs, from the release's wheel (``SchedulerPPMixin`` of scheduler_pp_mixin.py and
decode.py's ``DecodeTransferQueue``): ``_pp_pd_get_decode_transferred_ids`` (stage 0's
``get_rids``: poll + TP-MIN of its transfer queue, Success and Failed kept alike; a later
stage receives the previous list and intersects), ``_pp_pd_send_consensus_release_ids``
(the last stage sends its list round the ring; a middle stage forwards what it got) and
``process_decode_transfer_queue`` -> ``pop_transferred(rids)`` (the second poll + TP-MIN,
gated from 0.5.13), and the P2P helpers ``_pp_send_pyobj_to_next_stage`` /
``_pp_recv_pyobj_from_prev_stage`` (TP rank 0 sends / receives, then broadcasts to its
stage) over fakes of the primitives they call (``point_to_point_pyobj``,
``broadcast_pyobj`` / ``attn_cp_tp_broadcast_pyobj``: ``Ring``, every op recorded, a
missing message a ``Hang`` after the timeout). Read only: ``event_loop_pp_disagg_decode``
(the microbatch loop; the driver ``stage_body`` calls those functions in its order for
one microbatch; the prefill loop's bootstrap ring the same way). Prefill
(impl/sglang/ppprefill.py): 0.5.12 to 0.5.21's bootstrap ring and ``pop_bootstrapped``
with its consensus; 0.5.22 and 0.5.23's ``pop_bootstrapped`` with ``pp_size`` 2 whole
(``poll_and_all_reduce_prefill_pp``, ``pp_sync_polls``), the PP group's
``send_object`` / ``recv_object`` faked by ``Ring``.

Verdicts per (release, scenario), as conform --points: ``matches`` (per (stage, rank) the
same TP collectives and every request at the same place), ``reproduces I`` (that, and the
spec and the release's run both break I), ``differs`` (the first difference).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from impl.sglang import fakes, stubs, threadgroup as tg
from impl.sglang.pp_facts import MIXIN, MODELLED_BY
from impl.sglang.release import _call_with
from impl.sglang.wheels import open_wheel
from model.spec.pipeline import (PP_VARIANTS, QStage, check_pp_inputs, initial_pp_stages,
                                 pipeline_violations, run_pipeline)

Q = QStage
SUCCESS, FAILED = 4, 0


@dataclass(frozen=True)
class PPScenario:
    name: str
    pp: int
    ranks: int                                   # TP ranks per stage
    inputs: dict[str, list[list[int]]]           # transfer, unlanded: [stage*T+rank][request]
    stages: tuple[tuple[int, ...], ...] = ()     # QStage per row and request (default: all TRANSFER)

    @property
    def requests(self) -> int:
        return len(self.inputs["transfer"][0])


def pp_scenario(name: str, transfer: list[list[int]], unlanded: list[list[int]] | None = None,
                pp: int = 2, gone: Sequence[tuple[int, int]] = ()) -> PPScenario:
    """``gone``: (row, request) pairs not in that row's transfer queue."""
    rows, n = len(transfer), len(transfer[0])
    stages = tuple(tuple(int(Q.GONE if (k, r) in gone else Q.TRANSFER) for r in range(n)) for k in range(rows))
    return PPScenario(name, pp, rows // pp, {
        "transfer": transfer, "unlanded": unlanded or [[0] * n for _ in range(rows)]},
        stages if gone else ())


def fixed_pp_scenarios() -> list[PPScenario]:
    """2 stages x 2 TP ranks (rows stage-major: s0r0, s0r1, s1r0, s1r1)."""
    S, F, T = SUCCESS, FAILED, 3
    return [
        pp_scenario("all-success", [[S, S]] * 4),
        pp_scenario("one-transferring", [[S, S], [S, T], [S, S], [S, S]]),   # r1 out of the ring
        # nothing finished: the ring's list is empty, pop_transferred still MINs its queue
        pp_scenario("all-transferring", [[T]] * 4),
        pp_scenario("all-failed", [[F]] * 4),
        # induction:pp_agree's universe: stage 0 Success, stage 1 Failed (the ring's "finished")
        pp_scenario("stage-split-failure", [[S], [S], [F], [F]]),
        # induction:pp_agree_no_failure: all Success, stage 1 rank 1's metadata row not landed
        pp_scenario("gated-second-min", [[S]] * 4, [[0], [0], [0], [1]]),
        # one TP rank of stage 0 no longer holds the request (aborted there alone)
        pp_scenario("queue-split", [[S]] * 4, gone=[(1, 0)]),
    ]


# -- the fake ring between stages ------------------------------------------------------
class Ring:
    """P2P messages between stages (``(src, dst)`` FIFO) and each stage's broadcast of
    what its TP rank 0 received; every op recorded per (stage, rank) row."""

    def __init__(self, pp: int, ranks: int, timeout_s: float):
        self.pp, self.ranks, self.timeout_s = pp, ranks, timeout_s
        self.boxes: dict[tuple[int, int], list[Any]] = {}
        self.casts: dict[tuple[int, int], Any] = {}
        self.records: list[list[tuple[str, int]]] = [[] for _ in range(pp * ranks)]
        self._recvs = [0] * (pp * ranks)
        self._cv = threading.Condition()

    def _wait(self, ready: Any, what: str) -> Any:
        end = time.monotonic() + self.timeout_s
        with self._cv:
            while not ready():
                left = end - time.monotonic()
                if left <= 0:
                    raise tg.Hang(what)
                self._cv.wait(min(left, 0.05))
            return ready()

    # the primitives the mixin's own _pp_send_pyobj_to_next_stage /
    # _pp_recv_pyobj_from_prev_stage call, by global rank (stage * T + TP rank)
    def point_to_point(self, data: Any, rank: int, src: int, dst: int) -> Any:
        s, k = divmod(rank, self.ranks)
        if rank == src:
            self.records[rank].append(("send", dst // self.ranks))
            with self._cv:
                self.boxes.setdefault((src, dst), []).append(list(data))
                self._cv.notify_all()
            return []
        if rank != dst:
            raise tg.CollectiveError(f"rank {rank} in a point-to-point from {src} to {dst}")
        self.records[rank].append(("recv", src // self.ranks))
        box = self.boxes.setdefault((src, dst), [])
        self._wait(lambda: bool(box), f"stage {s} rank {k} waits for stage {src // self.ranks}'s list, none sent")
        with self._cv:
            return box.pop(0)

    def broadcast(self, data: Any, s: int, k: int) -> Any:
        """TP rank 0's ``data`` to every TP rank of stage s (one broadcast per call)."""
        row = s * self.ranks + k
        self.records[row].append(("bcast", s))
        seq = self._recvs[row]
        self._recvs[row] += 1
        if k == 0:
            with self._cv:
                self.casts[(s, seq)] = [data]
                self._cv.notify_all()
            return data
        return self._wait(lambda: self.casts.get((s, seq)),
                          f"stage {s} rank {k} waits for its stage's broadcast {seq}")[0]

    # the PP group's per-rank object P2P (GroupCoordinator.send_object / recv_object):
    # TP rank k of stage s to TP rank k of the next stage, used by 0.5.23's pp_sync_polls
    def send_object(self, s: int, k: int, data: Any, dst: int) -> list:
        self.records[s * self.ranks + k].append(("pp_send", len(data)))
        with self._cv:
            self.boxes.setdefault((s, dst, k), []).append(list(data))
            self._cv.notify_all()
        return []

    def recv_object(self, s: int, k: int, src: int) -> Any:
        box = self.boxes.setdefault((src, s, k), [])
        self.records[s * self.ranks + k].append(("pp_recv", 0))
        self._wait(lambda: bool(box), f"stage {s} rank {k} waits in pp_recv for stage {src}, nothing sent")
        with self._cv:
            return box.pop(0)


# -- one release loaded, its mixin and queue built per (stage, rank) --------------------
@dataclass
class PPLoaded:
    version: str
    decode: Any
    utils: Any
    mixin: Any
    recorder: stubs.Recorder
    server_args: fakes.ServerArgs
    parallel: list


class _PPGroup:
    def __init__(self, s: int, pp: int):
        self.is_first_rank, self.is_last_rank = s == 0, s == pp - 1
        self.rank_in_group, self.world_size = s, pp


def load_pp(version: str, source: str | None = None) -> PPLoaded:
    logging.getLogger("sglang").setLevel(logging.CRITICAL + 1)
    wheel = open_wheel(version, source)
    args, parallel = fakes.ServerArgs(), [None]
    stubs.REAL_EXTRA.add(MIXIN)
    recorder = stubs.install(wheel.source_of, fakes.provided(args, parallel))
    fakes._Recording._recorder = recorder
    decode = importlib.import_module("sglang.srt.disaggregation.decode")
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    for m in (decode, utils):
        m.dist = tg.FakeDist()
    return PPLoaded(version, decode, utils, load_mixin(), recorder, args, parallel)


def load_mixin() -> Any:
    """The loaded release's scheduler PP mixin (``stubs.REAL_EXTRA`` holding MIXIN when
    the stub layer was installed), its collectives and P2P helpers on the fakes."""
    mixin = _import_without_tqdm(MIXIN)
    mixin.dist = tg.FakeDist()
    _install_p2p(mixin)
    return mixin


def _import_without_tqdm(name: str) -> Any:
    """0.5.12's mixin imports tqdm (a progress bar for its chunk-size profiling, never
    called here); a stand-in module when it is not installed, removed afterwards."""
    import sys
    import types
    added = "tqdm" not in sys.modules and importlib.util.find_spec("tqdm") is None
    if added:
        sys.modules["tqdm"] = types.ModuleType("tqdm")
        sys.modules["tqdm"].tqdm = lambda it=None, *a, **kw: it     # type: ignore[attr-defined]
    try:
        return importlib.import_module(name)
    finally:
        if added:
            del sys.modules["tqdm"]


def _fallback(self: Any, name: str) -> Any:
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    fakes._Recording._recorder.note(f"fake Scheduler.{name}")
    return stubs.make_stub(f"fake Scheduler.{name}", fakes._Recording._recorder)()


def _stage_rank(rel: PPLoaded, sc: PPScenario, s: int, k: int, hub: tg.Hub, ring: Ring) -> tuple[Any, list]:
    """The mixin object of (stage s, TP rank k): its own transfer queue holding every
    request, each receiver polling this row's ``transfer`` input, its metadata row
    landed unless ``unlanded``."""
    u, d, row = rel.utils, rel.decode, s * sc.ranks + k
    group = tg.Group(hub, k, sc.ranks)
    rel.parallel[0] = fakes.Parallel(group, k, sc.ranks)
    slots = sc.requests
    buffers = _call_with(u.MetadataBuffers, {"size": slots, "hidden_size": 16,
                                             "hidden_states_dtype": torch.float32,
                                             "max_sampling_mask_tokens": 16})
    allocator = u.ReqToMetadataIdxAllocator(slots)
    sched = fakes.Scheduler(rel.server_args)
    queue = _call_with(d.DecodeTransferQueue, {
        "gloo_group": group, "req_to_metadata_buffer_idx_allocator": allocator, "tp_rank": k,
        "metadata_buffers": buffers, "scheduler": sched, "tree_cache": fakes.TreeCache()})
    kv_mgr, reqs = fakes.KvManager(False), []
    for r in range(sc.requests):
        if sc.stages and sc.stages[row][r] != Q.TRANSFER:
            reqs.append(fakes.Req(str(r), 100 + r))    # never queued here: stays GONE
            continue
        slot = allocator.alloc()
        recv = fakes.KvReceiver(kv_mgr)
        recv.state = sc.inputs["transfer"][row][r]
        req = fakes.Req(str(r), 100 + r)
        if not sc.inputs["unlanded"][row][r]:
            buffers.bootstrap_room[slot, 0] = 100 + r
            buffers.output_ids[slot, 0] = 7
            recv.landed |= {"room", "payload"}
        queue.add(d.DecodeRequest(req=req, kv_receiver=recv, metadata_buffer_index=slot))
        reqs.append(req)
    return mixin_of(rel.mixin, s, k, sc.pp, sc.ranks, group, disagg_decode_transfer_queue=queue), reqs


def mixin_of(mixin: Any, s: int, k: int, pp: int, ranks: int, group: tg.Group, **queues: Any) -> Any:
    """The release's ``SchedulerPPMixin`` as (stage s, TP rank k) with these queues: its
    TP group ``group``, its PP group and parallel state; any other attribute a recorded stub."""
    cls = type("PPScheduler", (mixin.SchedulerPPMixin,), {"__getattr__": _fallback})
    m = object.__new__(cls)
    m.__dict__.update(
        pp_group=_PPGroup(s, pp), pp_rank=s, pp_size=pp, tp_rank=k, tp_size=ranks,
        attn_tp_cpu_group=group, tp_cpu_group=group,
        attn_cp_cpu_group=tg.Group(None, 0, 1), enable_hisparse=False, waiting_queue=[],
        attn_tp_rank=k, attn_cp_rank=0, attn_dp_rank=0, attn_tp_size=ranks, attn_cp_size=1,
        attn_tp_group=_TPGroup(s, k, ranks), ps=_parallel_of(s, k, pp, ranks), **queues)
    return m


class _TPGroup:
    """``attn_tp_group`` (0.5.12 to 0.5.19 broadcast from its first rank)."""

    def __init__(self, s: int, k: int, ranks: int):
        self.rank, self.ranks = s * ranks + k, [s * ranks + j for j in range(ranks)]


class _Where(threading.local):
    """The (stage, TP rank) of the calling thread: what the fake P2P primitives and
    ``get_parallel`` (0.5.19+ mixin) answer for."""
    ring: Any = None
    s: int = 0
    k: int = 0
    pp: int = 1
    ranks: int = 1


_WHERE = _Where()


def _point_to_point_pyobj(data: Any, rank: int, group: Any, src: int, dst: int, async_send: bool = False) -> Any:
    return _WHERE.ring.point_to_point(data, rank, src, dst)


def _broadcast_pyobj(data: Any, rank: int = 0, group: Any = None, src: int = 0, *a: Any, **kw: Any) -> Any:
    return _WHERE.ring.broadcast(data, _WHERE.s, _WHERE.k)


def _parallel_of(s: int, k: int, pp: int, ranks: int) -> Any:
    """The parallel state of (stage s, TP rank k): ``self.ps`` (0.5.13 to 0.5.20),
    ``get_parallel()`` (0.5.19 on; only it from 0.5.21)."""
    p = fakes.Parallel(None, k, ranks)
    p.attn_cp_rank, p.attn_dp_rank, p.attn_cp_size = 0, 0, 1
    p.pp_rank, p.pp_size = s, pp
    return p


def _parallel() -> Any:
    return _parallel_of(_WHERE.s, _WHERE.k, _WHERE.pp, _WHERE.ranks)


def _install_p2p(mixin: Any) -> None:
    """The mixin's module-level P2P names (which exist depends on the release)."""
    mixin.point_to_point_pyobj = _point_to_point_pyobj
    mixin.broadcast_pyobj = _broadcast_pyobj
    mixin.attn_cp_tp_broadcast_pyobj = lambda data, *a, **kw: _broadcast_pyobj(data)
    mixin.get_parallel = _parallel


# (the stage's list, the consensus sent round the ring, the queue popped with it)
DECODE_RING = ("_pp_pd_get_decode_transferred_ids", "_pp_pd_send_consensus_release_ids",
               "process_decode_transfer_queue")
PREFILL_RING = ("_pp_pd_get_bootstrapped_ids", "_pp_pd_send_consensus_bootstrapped_ids",
                "process_bootstrapped_queue")


def stage_body(m: Any, last: bool, ring: tuple[str, str, str] = DECODE_RING) -> Any:
    """One microbatch of the PP disagg event loop's consensus for one queue, in its
    order: the stage's list (recv + intersect on a later stage), sent on (not the last
    stage); the last stage sends its list round the ring as the consensus; each stage
    receives the consensus, pops its queue with it, and a middle stage forwards it."""
    get, send_consensus, process = (getattr(m, name) for name in ring)
    mine = get()
    if not last:
        m._pp_send_pyobj_to_next_stage(mine, async_send=True)
    mbs = [mine]
    if last:
        send_consensus(mbs, 0, None, mine)
    consensus = m._pp_recv_pyobj_from_prev_stage()
    process(consensus)
    if not last:                      # the next microbatch forwards it down the stages
        send_consensus(mbs, 0, consensus, mine)
    return consensus


@dataclass
class PPRun:
    records: list[list[tuple[str, int]]]        # TP collectives per (stage, rank)
    ring: list[list[tuple[str, int]]]           # P2P ops per (stage, rank)
    places: list[list[int]]
    errors: list[str | None]
    hung: bool = field(default=False)


def _places(m: Any, reqs: list) -> list[int]:
    held = {id(dr.req) for dr in m.disagg_decode_transfer_queue.queue}
    popped = {id(r) for r in m.waiting_queue}
    return [int(Q.PREBUILT if id(r) in popped else Q.TRANSFER if id(r) in held else Q.GONE) for r in reqs]


def run_rows(bodies: Sequence[Any], hubs: list[tg.Hub], ranks: int, timeout_s: float
             ) -> tuple[list[Any], list[list[tuple[str, int]]], list[str | None], bool]:
    """One thread per (stage, rank) body (row s*ranks + k); each stage's hub sees only
    its own ranks finish. Returns each body's value, the TP collectives per row, each
    row's error (one line) and whether a row hung or mismatched."""
    outs: list[Any] = [None] * len(bodies)
    errors: list[str | None] = [None] * len(bodies)

    def body(row: int) -> None:
        s, k = divmod(row, ranks)
        try:
            outs[row] = bodies[row]()
        except Exception as exc:
            errors[row] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            hubs[s].finish(k, errors[row])

    tg.join_rows([lambda r=r: body(r) for r in range(len(bodies))], timeout_s, ranks, errors)
    records = [[(op, shape[0] if shape else 0) for op, shape in rec] for h in hubs for rec in h.records]
    hung = any(e and ("Hang" in e or "Mismatch" in e or "still running" in e) for e in errors)
    return outs, records, errors, hung


def in_ring(ring: Ring, s: int, k: int, pp: int, ranks: int, body: Any) -> Any:
    """``body`` run as (stage s, TP rank k): what the fake P2P primitives answer for."""
    _WHERE.ring, _WHERE.s, _WHERE.k, _WHERE.pp, _WHERE.ranks = ring, s, k, pp, ranks
    return body()


def run_pp_release(rel: PPLoaded, sc: PPScenario, timeout_s: float = 2.0) -> PPRun:
    ring = Ring(sc.pp, sc.ranks, timeout_s)
    hubs = [tg.Hub(sc.ranks, timeout_s) for _ in range(sc.pp)]
    built = [_stage_rank(rel, sc, s, k, hubs[s], ring) for s in range(sc.pp) for k in range(sc.ranks)]
    bodies = [lambda row=row: in_ring(ring, *divmod(row, sc.ranks), sc.pp, sc.ranks,
                                      lambda: stage_body(built[row][0], row // sc.ranks == sc.pp - 1))
              for row in range(len(built))]
    _, records, errors, hung = run_rows(bodies, hubs, sc.ranks, timeout_s)
    return PPRun(records, ring.records, [_places(m, reqs) for m, reqs in built], errors, hung)


# -- the comparison ---------------------------------------------------------------------
def compare_pp(sc: Any, variant: str, run: PPRun) -> dict:
    """The verdict of the release's run against ``variant``'s run_pipeline on the
    scenario (a PPScenario, or ppprefill's PPPrefillScenario with its own ``stages``):
    per (stage, rank) every TP collective's op and shape (a receive's shape is not
    recorded), then every request's place."""
    v = PP_VARIANTS[variant]
    inputs = {n: sc.inputs[n] for n in v.inputs()}
    check_pp_inputs(v, inputs, sc.pp, sc.ranks, sc.requests)
    start = getattr(sc, "stages", None) or initial_pp_stages(v, sc.pp, sc.ranks, sc.requests)
    res = run_pipeline(v, sc.pp, start, inputs)
    row: dict[str, Any] = {"scenario": sc.name, "variant": variant, "pp": sc.pp, "ranks": sc.ranks,
                           "records": run.records, "ring": run.ring, "places": run.places,
                           "errors": run.errors, "spec_places": [list(r) for r in res.stages],
                           "invariant": None}
    where = lambda k: f"stage {k // sc.ranks} rank {k % sc.ranks}"
    for k, rec in enumerate(run.records):
        spec = [(name, op, n) for name, op, n in res.records[k]]
        # a run cut short by a hang: its records a prefix of the spec's
        for i in range(len(rec) if run.hung else max(len(spec), len(rec))):
            a = spec[i] if i < len(spec) else None
            b = rec[i] if i < len(rec) else None
            same = a is not None and b is not None and a[1] == b[0] and (
                a[1] == "pp_recv" or a[2] == b[1])
            if not same:
                sa = f"{a[0]} {a[1].upper()} shape {a[2]}" if a else "nothing"
                sb = f"{b[0].upper()} shape {b[1]}" if b else "nothing"
                return {**row, "verdict": "differs", "detail": f"{where(k)} collective {i}: spec {sa}, release {sb}"}
    crashed = [(k, e) for k, e in enumerate(run.errors) if e and not run.hung]
    if crashed:
        return {**row, "verdict": "differs", "detail": f"{where(crashed[0][0])} raised {crashed[0][1]}"}
    broken = pipeline_violations(res, v)
    if run.hung:
        hang = [x.invariant for x in broken if x.invariant in ("collectives_agree", "positions_agree")]
        if hang:
            return {**row, "verdict": "reproduces", "invariant": hang[0],
                    "detail": next(e for e in run.errors if e)}
        return {**row, "verdict": "differs", "detail": f"the release hangs ({next(e for e in run.errors if e)})"}
    for k in range(len(run.places)):
        for r in range(sc.requests):
            if run.places[k][r] != res.stages[k][r]:
                return {**row, "verdict": "differs", "detail": f"{where(k)} request {r}: spec "
                        f"{v.stages(res.stages[k][r]).name}, release {v.stages(run.places[k][r]).name}"}
    seen = {"collectives_agree": any(rec != run.records[(k // sc.ranks) * sc.ranks]
                                     for k, rec in enumerate(run.records)),
            "stages_agree": any(p != run.places[0] for p in run.places),
            # a later stage acted on a request otherwise than stage 0 did (held by both)
            "positions_agree": any(start[k][r] == start[k % sc.ranks][r] and
                                   run.places[k][r] != run.places[k % sc.ranks][r]
                                   for k in range(sc.ranks, len(run.places)) for r in range(sc.requests))}
    both = [x for x in broken if seen.get(x.invariant, False)]
    if both:
        return {**row, "verdict": "reproduces", "invariant": both[0].invariant, "detail": both[0].detail}
    return {**row, "verdict": "matches", "detail": ""}


def check_pp(versions: Sequence[str], scenarios: Sequence[PPScenario], *, variant: str | None = None,
             timeout_s: float = 2.0, source: str | None = None) -> list[dict]:
    """Every release on every scenario, against its decode pp-* variant or ``variant``."""
    rows = []
    try:
        for version in versions:
            rel = load_pp(version, source)
            for sc in scenarios:
                run = run_pp_release(rel, sc, timeout_s)
                name = variant or MODELLED_BY[version][0]
                rows.append({"release": version, **compare_pp(sc, name, run), "run": run})
    finally:
        stubs.REAL_EXTRA.discard(MIXIN)
        stubs.purge()
    return rows


def pp_table(rows: Sequence[dict]) -> list[str]:
    from impl.sglang.points import describe
    width = max(len(r["scenario"]) for r in rows)
    return [f"{r['release']:<8} {r.get('side', 'pp-decode'):<10} {r['scenario']:<{width}}  {r['variant']:<17} {describe(r)}"
            for r in rows]


# -- pdgate conform --pp ----------------------------------------------------------------
_NOT_WITH_PP = ("points", "swap", "patch", "deferred", "source", "emit_diff", "local_release",
                "reorder_rooms", "reads", "trace", "seed", "random")


def run_pp(args: Any) -> int:
    """The table; exit 1 if a release differs from its variant, 2 on bad input."""
    import json
    import sys
    from pathlib import Path
    from impl.sglang.conform import _versions
    from impl.sglang.wheels import MissingRelease
    try:
        given = [f"--{n.replace('_', '-')}" for n in _NOT_WITH_PP if getattr(args, n, None)]
        if given:
            raise ValueError(f"--pp does not combine with {', '.join(given)}")
        decode = [n for n, v in PP_VARIANTS.items() if not n.startswith("pp-prefill")]
        if args.variant is not None and args.variant not in decode:
            raise ValueError(f"--pp: unknown PP decode variant {args.variant!r} (known: {', '.join(decode)})")
        if not 0 < args.collective_timeout <= 600:
            raise ValueError("--collective-timeout must be in (0, 600] seconds")
        versions = _versions(args.sglang)
        unknown = [v for v in versions if v not in MODELLED_BY]
        if unknown:
            raise ValueError(f"--pp: no pp-* variant models {', '.join(unknown)}")
        if args.json:
            Path(args.json).open("a", encoding="utf-8").close()
    except (ValueError, MissingRelease, OSError) as exc:
        msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"pdgate conform: {msg}", file=sys.stderr)
        return 2
    try:
        timeout = min(args.collective_timeout, 2.0)
        rows = check_pp(versions, fixed_pp_scenarios(), variant=args.variant, timeout_s=timeout)
        if args.variant is None:        # prefill: the bootstrap ring, or forwarding by position (0.5.22 on)
            from impl.sglang import ppprefill
            rows += ppprefill.check_prefill(versions, timeout_s=timeout)
    except Exception as exc:          # the harness itself failed: one line
        print(f"pdgate conform: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr)
        return 1
    from impl.sglang.points import report
    return report(rows, list(pp_table(rows)), args.json)
