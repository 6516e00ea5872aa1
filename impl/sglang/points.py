"""``pdgate conform --points``: each release's own ``pop_preallocated`` (decode) and
``pop_bootstrapped`` (prefill) run on T ranks, compared with ``run_iteration`` of the
iteration variant that models the release, restricted to the points that code covers.

One process loads a release (the stub layer, impl.sglang.stubs); each rank is a thread
with its own queue object built from the scenario (impl.sglang.pointfakes) and a fake
gloo group (impl.sglang.threadgroup) that records every collective the rank issues and
really reduces it, reporting a rank left waiting instead of hanging. A scenario is the
stages of every request on every rank and the spec's inputs for the covered points.

Verdicts per (release, scenario): ``matches`` (per rank the same (op, shape) sequence and
the same place for every request), ``reproduces I`` (that, and the spec and the
release's run both break invariant I: the collectives (collectives_agree, the release's
run hung or mismatched there) or the places (stages_agree)), ``differs`` (the first
difference, in one line).
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from impl.sglang import fakes, pointfakes as pf, stubs, threadgroup as tg
from impl.sglang.iteration_facts import MODELLED_BY, PREFILL_MODELLED_BY
from impl.sglang.pointscenarios import (DECODE_START, Scenario, fixed_scenarios, no_buffer,
                                        random_scenarios, trace_scenarios)
from impl.sglang.wheels import open_wheel
from model.spec.agreement import Stage
from model.spec.iteration import (ITER_VARIANTS, IterVariant, PStage, check_inputs,
                                  iteration_violations, run_iteration, stages_agree)

__all__ = ["Scenario", "check", "compare", "fixed_scenarios", "load", "no_buffer",
           "random_scenarios", "run_points", "run_release", "table", "trace_scenarios"]

S, P = Stage, PStage
# the points each queue method runs, in the variants' names
COVERED = {"decode": ("prealloc_poll", "admission"),
           "prefill": ("bootstrap_poll",)}


def covered(v: IterVariant, side: str) -> IterVariant:
    """The variant cut to the points ``side``'s queue method runs."""
    return IterVariant(v.name, v.releases, tuple(p for p in v.points if p.name in COVERED[side]),
                       v.stages, v.runs)


def variant_of(version: str, side: str) -> str:
    return MODELLED_BY[version] if side == "decode" else PREFILL_MODELLED_BY[version]


# -- one release loaded, its queues run -------------------------------------------------
@dataclass
class Loaded:
    version: str
    decode: Any
    prefill: Any
    utils: Any
    recorder: stubs.Recorder
    server_args: fakes.ServerArgs
    sources: dict[str, str]                 # decode.py, prefill.py (their __init__ defaults)


class _Address:
    """``sglang.srt.utils.network.NetworkAddress``: host:port as text."""

    def __init__(self, host: Any, port: Any, *args: Any, **kw: Any):
        self.host, self.port = host, port

    def to_host_port_str(self) -> str:
        return f"{self.host}:{self.port}"


def load(version: str, source: str | None = None) -> Loaded:
    """The release's decode and prefill modules through the stub layer (``source``: a
    tree whose modules replace the wheel's, e.g. edited), their collectives on the
    thread groups (their log quiet: a failed handshake logs)."""
    logging.getLogger("sglang").setLevel(logging.CRITICAL + 1)
    wheel = open_wheel(version, source)
    args, parallel = pf.server_args(), [None]
    provided = fakes.provided(args, parallel)
    provided["sglang.srt.utils.network"] = {"NetworkAddress": _Address}
    # no Mamba state pool: its capacity never stops an admission (0.5.23)
    provided["sglang.srt.mem_cache.allocation"] = {"ensure_mamba_capacity": lambda *a, **kw: True}
    recorder = stubs.install(wheel.source_of, provided)
    fakes._Recording._recorder = recorder
    mods = [importlib.import_module(f"sglang.srt.disaggregation.{m}") for m in ("decode", "prefill", "utils")]
    for m in mods:
        m.dist = tg.FakeDist()
    sources = {m: wheel.source_of(f"sglang.srt.disaggregation.{m}")[0] for m in ("decode", "prefill")}
    return Loaded(version, *mods, recorder, args, sources)


@dataclass
class Run:
    """What the release's code did on every rank."""
    records: list[list[tuple[str, int]]]
    places: list[list[int]]
    errors: list[str | None]
    hung: bool = field(default=False)


def _host(k: int) -> str:
    return f"10.0.{k}.1"


def _decode_rank(rel: Loaded, sc: Scenario, k: int, hub: tg.Hub) -> tuple[Any, list[Any]]:
    d = rel.decode
    group = tg.Group(hub, k, sc.ranks)
    sched = pf.Scheduler(rel.server_args, tg.Group(None, 0, 1), group)
    rows = sc.inputs
    attrs = dict(queue=[], pending_reqs=[], retracted_queue=[], held_rebootstrap_reqs=[],
                 _ensure_retry_count={}, _max_ensure_retries=15, _ensure_last_attempt_time={},
                 _ensure_retry_interval=1.0, _prefill_dp_rank_queries={}, kv_manager=pf.KvManager(),
                 scheduler=sched, transfer_queue=fakes._Recording(), tree_cache=fakes.TreeCache(),
                 gloo_group=group, tp_rank=k, tp_size=sc.ranks, dp_size=1, pp_size=1, pp_rank=0,
                 num_reserved_decode_tokens=0, max_total_num_tokens=10 * pf.LONG,
                 req_to_token_pool=pf.TokenPool(8), token_to_kv_pool_allocator=pf.KvAllocator(),
                 token_to_kv_pool=fakes._Recording(), draft_token_to_kv_pool=None,
                 req_to_metadata_buffer_idx_allocator=pf.Allocator(8), is_mla_backend=False,
                 enable_staging=False, transfer_backend="mooncake")
    q = pf.build(d.DecodePreallocQueue, attrs, rel.sources["decode"])
    q.metadata_buffers = fakes._Recording()
    q.transfer_queue.queue = []
    q._pre_alloc = lambda req, *a, **kw: q.req_to_token_pool.req_to_token[0]   # the KV pool
    reqs = []
    for r, stage in enumerate(sc.stages[k]):
        length = pf.SHORT if rows["fits"][k][r] else pf.LONG
        req = pf.Req(str(r), 100 + r, _host(k), length)
        reqs.append(req)
        if stage not in DECODE_START:
            continue                            # ABSENT, or past this queue
        if stage != S.PENDING:
            req.disagg_prefill_dp_rank = 0      # resolved before this iteration
        q.add(req)
        dr = q.queue[-1]
        dr.waiting_for_input = stage == S.READY
    return q, reqs


def _decode_places(q: Any, reqs: list[Any], out: Any, start: Sequence[int]) -> list[int]:
    """Where each request is after the call; one the queue never held stays at ``start``."""
    pre, failed = out if out is not None else ([], [])
    gone = {id(dr.req) for dr in failed}
    moved = {id(dr.req) for dr in pre}
    pending = {id(dr.req) for dr in q.pending_reqs}
    held = {id(dr.req): dr for dr in q.queue}
    places = []
    for req, was in zip(reqs, start):
        if id(req) in gone:
            places.append(S.GONE)
        elif id(req) in moved:
            places.append(S.TRANSFER)
        elif id(req) in held and held[id(req)].waiting_for_input:
            places.append(S.READY)
        elif id(req) in held:
            # resolving the dp rank is not a move in the spec (it lifts the poll's cap at
            # Bootstrapping): a request still handshaking keeps the place it started at
            places.append(S.PENDING if id(req) in pending or was == S.PENDING else S.PREALLOC)
        else:
            places.append(S.GONE if was in DECODE_START else was)   # left unaccounted: gone
    return [int(x) for x in places]


def _prefill_rank(rel: Loaded, sc: Scenario, k: int, hub: tg.Hub) -> tuple[Any, list[Any]]:
    group = tg.Group(hub, k, sc.ranks)
    sched = pf.Scheduler(rel.server_args, tg.Group(None, 0, 1), group)
    reqs, queue = [], []
    for r, stage in enumerate(sc.stages[k]):
        req = pf.Req(str(r), 100 + r, _host(k))
        req.disagg_kv_sender = pf.Sender(sc.inputs["bootstrap"][k][r])
        reqs.append(req)
        if stage == P.BOOTSTRAP:
            queue.append(req)
    attrs = dict(queue=queue, scheduler=sched, tp_rank=k, tp_size=sc.ranks, pp_size=1, pp_rank=0,
                 gloo_group=group, req_to_metadata_buffer_idx_allocator=pf.Allocator(sc.free[k]),
                 token_to_kv_pool=fakes._Recording(), metadata_buffers=fakes._Recording(),
                 kv_manager=pf.KvManager(), transfer_backend="mooncake", pp_poll_sync_work_list=[])
    return pf.build(rel.prefill.PrefillBootstrapQueue, attrs, rel.sources["prefill"]), reqs


def _prefill_places(q: Any, reqs: list[Any], out: Any, start: Sequence[int]) -> list[int]:
    """Popped: WAITING; still queued: BOOTSTRAP; dropped from the queue otherwise: GONE
    (a failed bootstrap); one the queue never held stays at ``start``."""
    popped = {id(r) for r in (out or [])}
    held = {id(r) for r in q.queue}
    places = []
    for req, was in zip(reqs, start):
        if was != P.BOOTSTRAP:
            places.append(was)
        else:
            places.append(P.WAITING if id(req) in popped else P.BOOTSTRAP if id(req) in held else P.GONE)
    return [int(x) for x in places]


def run_release(rel: Loaded, sc: Scenario, timeout_s: float = 5.0) -> Run:
    """The release's own queue method on every rank, one thread each."""
    hub = tg.Hub(sc.ranks, timeout_s)
    if sc.side == "decode":
        resolved = {f"{_host(k)}:8998": {100 + r for r in range(sc.requests) if sc.inputs["resolved"][k][r]}
                    for k in range(sc.ranks)}
        handshake = {(f"{_host(k)}:8998", 100 + r): sc.inputs["handshake"][k][r]
                     for k in range(sc.ranks) for r in range(sc.requests)}
        rel.decode.CommonKVReceiver = pf.resolver(resolved)
        rel.decode.get_kv_class = lambda *a, **kw: (
            lambda mgr=None, bootstrap_addr=None, bootstrap_room=None, **x:
            pf.Receiver(handshake[(bootstrap_addr, bootstrap_room)], mgr))
        built = [_decode_rank(rel, sc, k, hub) for k in range(sc.ranks)]
        bodies = [q.pop_preallocated for q, _ in built]
        place = _decode_places
    else:
        built = [_prefill_rank(rel, sc, k, hub) for k in range(sc.ranks)]
        bodies = [q.pop_bootstrapped for q, _ in built]
        place = _prefill_places
    outs = tg.run_threads(hub, bodies, deadline_s=10 * timeout_s + 10)
    records = [[(op, shape[0] if shape else 0) for op, shape in rec] for rec in hub.records]
    hung = any(e and ("Hang" in e or "Mismatch" in e) for e in hub.errors)
    places = [place(q, reqs, out, sc.stages[k]) for k, ((q, reqs), out) in enumerate(zip(built, outs))]
    return Run(records, places, list(hub.errors), hung)


# -- the comparison ---------------------------------------------------------------------
def _show(rec: Sequence[tuple[str, int]], i: int, names: Sequence[str] = ()) -> str:
    if i >= len(rec):
        return "nothing"
    name = f"{names[i]} " if i < len(names) else ""
    return f"{name}{rec[i][0].upper()} shape {rec[i][1]}"


def compare(sc: Scenario, variant: str | IterVariant, run: Run) -> dict:
    """The row's verdict: the spec's run of ``variant`` (a name in ITER_VARIANTS, or a
    configuration of the spec's points) cut to the covered points, on the scenario,
    against what the release's code did."""
    v = covered(ITER_VARIANTS[variant] if isinstance(variant, str) else variant, sc.side)
    variant = v.name
    inputs = {n: sc.inputs[n] for n in v.inputs()}
    check_inputs(v, inputs, sc.ranks, sc.requests)
    res = run_iteration(v, sc.stages, inputs)
    names = v.stages
    row: dict[str, Any] = {"scenario": sc.name, "side": sc.side, "variant": variant, "ranks": sc.ranks,
                           "records": run.records, "places": run.places, "errors": run.errors,
                           "spec_records": [[list(x) for x in r] for r in res.records],
                           "spec_places": [list(r) for r in res.stages], "invariant": None}
    for k in range(sc.ranks):
        spec = [(op, n) for _, op, n in res.records[k]]
        if spec != run.records[k]:
            i = next((j for j, (a, b) in enumerate(zip(spec, run.records[k])) if a != b),
                     min(len(spec), len(run.records[k])))
            spec_names = [nm for nm, _, _ in res.records[k]]
            return {**row, "verdict": "differs", "detail": f"rank {k} collective {i}: spec "
                    f"{_show(spec, i, spec_names)}, release {_show(run.records[k], i)}"}
    crashed = [(k, e) for k, e in enumerate(run.errors) if e and not run.hung]
    if crashed:
        k, e = crashed[0]
        return {**row, "verdict": "differs", "detail": f"rank {k} raised {e}"}
    spec_broken = [x.invariant for x in iteration_violations(res, v)]
    if run.hung:                 # the places are those of a run cut short: not compared
        if "collectives_agree" in spec_broken:
            hang = next(e for e in run.errors if e)
            return {**row, "verdict": "reproduces", "invariant": "collectives_agree",
                    "detail": hang}
        return {**row, "verdict": "differs", "detail": f"the release hangs ({next(e for e in run.errors if e)}), "
                "the spec's ranks issue alike"}
    for k in range(sc.ranks):
        for r in range(sc.requests):
            if run.places[k][r] != res.stages[k][r]:
                return {**row, "verdict": "differs", "detail": f"rank {k} request {r}: spec "
                        f"{names(res.stages[k][r]).name}, release {names(run.places[k][r]).name}"}
    seen = {"collectives_agree": bool(collectives_agree_of(run)),
            "stages_agree": bool(stages_agree(tuple(map(tuple, run.places)), names))}
    if len(v.points) == 1 and v.points[0].collective:     # the run's moves are the point's
        seen["no_local_decision_after_min"] = local_decision(sc, run, v.points[0].members)
    both = [i for i in spec_broken if seen.get(i, False)]
    if both:
        detail = next(x.detail for x in iteration_violations(res, v) if x.invariant == both[0])
        return {**row, "verdict": "reproduces", "invariant": both[0], "also": both[1:], "detail": detail}
    return {**row, "verdict": "matches", "detail": ""}


def local_decision(sc: Scenario, run: Run, members: Sequence[int]) -> bool:
    """Ranks that held a request at the same stage and all issued the collective moved
    it to different places (the release's run, where its code is that one point)."""
    for r in range(sc.requests):
        held = [k for k in range(sc.ranks) if sc.stages[k][r] in members and run.records[k]]
        moves = {(sc.stages[k][r], run.places[k][r]) for k in held}
        if len({before for before, _ in moves}) < len(moves):
            return True
    return False


def collectives_agree_of(run: Run) -> list[int]:
    """The ranks whose collective sequence is not rank 0's (the release's own run)."""
    return [k for k, rec in enumerate(run.records) if rec != run.records[0]]


def check(versions: Sequence[str], scenarios: Sequence[Scenario], *, variant: str | None = None,
          timeout_s: float = 5.0, source: str | None = None) -> list[dict]:
    """Every release on every scenario; ``variant``: compare with it instead of the
    release's own (for the decode scenarios, or the prefill ones when it is a prefill
    variant): a wrong variant must differ. Each row keeps its ``run`` (``compare`` it
    with another variant without running the release again)."""
    rows = []
    try:
        for version in versions:
            rel = load(version, source)
            for sc in scenarios:
                name = variant if variant and (ITER_VARIANTS[variant].stages is S) == (sc.side == "decode") \
                    else variant_of(version, sc.side)
                run = run_release(rel, sc, timeout_s)
                rows.append({"release": version, **compare(sc, name, run),
                             "stub_reads": rel.recorder.reads, "run": run})
    finally:
        stubs.purge()               # the next import of sglang is nobody's release
    return rows


def describe(row: dict) -> str:
    if row["verdict"] == "reproduces":
        return f"reproduces {row['invariant']}: {row['detail']}"
    if row["verdict"] == "differs":
        return f"differs: {row['detail']}"
    return "matches"


def table(rows: Sequence[dict]) -> list[str]:
    """One line per (release, scenario)."""
    width = max(len(r["scenario"]) for r in rows)
    return [f"{r['release']:<8} {r['side']:<8} {r['scenario']:<{width}}  {r['variant']:<15} {describe(r)}"
            for r in rows]


# -- pdgate conform --points ------------------------------------------------------------
_NOT_WITH_POINTS = ("swap", "patch", "deferred", "source", "emit_diff", "local_release",
                    "reorder_rooms", "reads")


def _points_args(args: Any) -> tuple[list[str], list[Scenario]]:
    """The releases and scenarios ``args`` ask for; ValueError (one line) otherwise."""
    from impl.sglang.conform import _versions
    given = [f"--{n.replace('_', '-')}" for n in _NOT_WITH_POINTS if getattr(args, n, None)]
    if given:
        raise ValueError(f"--points does not combine with {', '.join(given)}")
    if args.variant is not None and args.variant not in ITER_VARIANTS:
        raise ValueError(f"--points: unknown iteration variant {args.variant!r} "
                         f"(known: {', '.join(ITER_VARIANTS)})")
    args.seed = 0 if args.seed is None else args.seed
    args.random = 6 if args.random is None else args.random
    if not 0 <= args.random <= 1000:
        raise ValueError("--random must be in [0, 1000]")
    if not 0 < args.collective_timeout <= 600:
        raise ValueError("--collective-timeout must be in (0, 600] seconds")
    versions = _versions(args.sglang)
    unknown = [v for v in versions if v not in MODELLED_BY]
    if unknown:
        raise ValueError(f"--points: no iteration variant models {', '.join(unknown)} "
                         f"(modelled: {', '.join(MODELLED_BY)})")
    traced = [sc for path in args.trace for sc in trace_scenarios(path, COVERED)]
    return versions, fixed_scenarios() + random_scenarios(args.seed, args.random) + traced


def run_points(args: Any) -> int:
    """The table; exit 1 if a release differs from its variant, 2 on bad input."""
    import json
    import sys
    from pathlib import Path
    from impl.sglang.wheels import MissingRelease
    from model.spec.trace import TraceInputError
    try:
        versions, scenarios = _points_args(args)
        if args.json:
            Path(args.json).open("a", encoding="utf-8").close()      # writable before any work
    except (ValueError, MissingRelease, OSError, TraceInputError) as exc:
        msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"pdgate conform: {msg}", file=sys.stderr)
        return 2
    try:
        rows = check(versions, scenarios, variant=args.variant, timeout_s=args.collective_timeout)
    except Exception as exc:          # the harness itself failed (a release it cannot build): one line
        print(f"pdgate conform: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr)
        return 1
    return report(rows, table(rows), args.json)


def report(rows: list[dict], lines: list[str], json_path: str | None) -> int:
    """Print a verdict table and its counts, write the rows (``--json``); exit status 1
    where some row differs (``--points`` and ``--pp``)."""
    import json
    from pathlib import Path
    for line in lines:
        print(line)
    if json_path:
        Path(json_path).write_text(json.dumps([{k: x for k, x in r.items() if k != "run"} for r in rows],
                                              indent=1) + "\n", encoding="utf-8")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("matches", "reproduces", "differs")}
    print(f"{len(rows)} checks: {counts['matches']} match, {counts['reproduces']} reproduce, "
          f"{counts['differs']} differ")
    return 1 if counts["differs"] else 0
