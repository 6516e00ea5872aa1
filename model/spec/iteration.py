"""One decode scheduler iteration, whole: every rank-agreement point on SGLang's decode
path in the order the event loop reaches them, as ``Point`` configurations
(model/spec/agreement.py), with the variants of the releases that differ.

An iteration takes the per-rank stage of every request and one value per (input, rank,
request) chosen by the environment (what each rank's receivers, allocator and checksum
say this iteration), and returns the next stages and, per rank, the sequence of
(collective, op, shape) it issued. The invariants, by name:

* ``collectives_agree``: every rank issues the same sequence of (collective, op, shape)
  (else gloo/NCCL hang or mix vectors: #36928, #37909);
* ``no_local_decision_after_min``: after a collective, every rank that holds a request
  at the same stage moves it to the same stage (no rank-local ``continue`` after the
  agreed value);
* ``stages_agree``: every rank has every request at the same stage (the inductive
  invariant the proofs use for the other two).

The release line numbers each point models are in docs/PROOFS.md ("The decode
iteration").
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any, Callable, Mapping, Sequence

from model.spec.agreement import (Op, Point, Skip, Stage, contribution, halts, is_member, issues,
                                  next_stage, triggers)
from model.spec.invariants import Violation
from model.spec.kernel import PY, Ops

S = Stage
# Every input the points read, with the values the environment may choose.
INPUTS: dict[str, tuple[int, ...]] = {
    "arrive": (0, 1),        # rank 0's recv_requests returns the request this iteration
    "handshake": (0, 1, 2),  # this rank's receiver: Failed, Bootstrapping, WaitingForInput
    "fits": (0, 1),          # this rank's token budget admits the request (pop_preallocated)
    "transfer": (0, 3, 4),   # this rank's receiver: Failed, Transferring, Success
    "held": (0, 1),          # host staging cannot allocate / HiCache restore pending here
    "corrupt": (0, 1),       # this rank's KV checksum mismatches
    "finish": (0, 1),        # the request finishes in this forward (rank 0's outputs)
    "unresolved": (0, 1),    # this rank has not resolved the prefill dp rank yet (its poll: <= Bootstrapping)
    "bootstrap": (0, 1, 2),  # prefill: this rank's sender: Failed, Bootstrapping, WaitingForInput
    "no_buffer": (0, 1),     # prefill: this rank has no free metadata buffer
    "hold": (0, 1, 2),       # a failed transfer on this rank: release now, hold (prefill notified),
                             # hold a host-staged destination (awaits its drain ack)
    "drained": (0, 1),       # this rank may release a held slot (drain ack, or its deadline passed)
    "retract": (0, 1),       # this rank's check_decode_mem fails: it retracts (drains offloads first)
    "unlanded": (0, 1),      # PP decode: this rank's metadata row has not landed (the gate's flag)
}
ITERATION_NAMES = ("collectives_agree", "no_local_decision_after_min", "stages_agree")

RECV = Point("recv_requests", Op.BROADCAST, (S.ABSENT,), ((1, S.PENDING),), input="arrive", shape=1)
OFFLOAD = Point("offload_progress", Op.MIN, shape=2)            # check_offload_progress qsizes
_HANDSHAKE = ((0, S.GONE), (2, S.READY))


def prealloc(skip: Skip) -> Point:
    """``_update_handshake_waiters``: one MIN over the whole prealloc queue. A request
    whose prefill dp rank this rank has not resolved yet (``_resolve_pending_reqs``,
    rank-local) is in that queue too (``add`` enqueues it before resolving): its
    receiver, not yet ``init``ed, polls at most Bootstrapping (the ``unresolved`` cap).
    So resolution reaches the other ranks only through the MIN; the release's skip
    decides when the MIN is issued."""
    return Point("prealloc_poll", Op.MIN, (S.PENDING, S.PREALLOC, S.READY), _HANDSHAKE, skip,
                 input="handshake", gate="unresolved", gate_value=1)


# pop_preallocated walks the queue in order and ``break``s at the first request that does
# not fit this rank's budget: the later ones wait too (every release)
ADMIT_LOCAL = Point("admission", Op.LOCAL, (S.READY,), ((1, S.TRANSFER),), input="fits", halt=0)
TRANSFER_MOVES = ((0, S.GONE), (4, S.PREBUILT))
TRANSFER = Point("transfer_poll", Op.MIN, (S.TRANSFER,), TRANSFER_MOVES, Skip.EMPTY, input="transfer")
TRANSFER_VETO = Point("transfer_poll", Op.MIN, (S.TRANSFER,), TRANSFER_MOVES, Skip.EMPTY,
                      input="transfer", veto="held", veto_value=4)
# 0.5.19 on: a failed transfer may keep its slot (deferred release, #35049); the hold
# decision follows the MIN, then resolve_deferred_releases frees held slots
TRANSFER_DEFER = replace(TRANSFER_VETO, moves=((0, S.FAILED), (4, S.PREBUILT)))
_HOLD = ((0, S.GONE), (1, S.HELD), (2, S.HELD))
HOLD_LOCAL = Point("defer_release", Op.LOCAL, (S.FAILED,), _HOLD, input="hold")          # 0.5.19
HOLD_LOCAL_HOST = replace(HOLD_LOCAL, moves=((0, S.GONE), (1, S.HELD), (2, S.HELD_HOST)))  # 0.5.21
HOLD_MAX = Point("defer_release", Op.MAX, (S.FAILED,), _HOLD, Skip.EMPTY, input="hold")   # 0.5.23
RELEASE_LOCAL = Point("deferred_release", Op.LOCAL, (S.HELD,), ((1, S.GONE),), input="drained")
# 0.5.21: only host-staged holds are MIN-reduced, and only ``if host_ready.numel()``
RELEASE_HOST_MIN = Point("deferred_release_host", Op.MIN, (S.HELD_HOST,), ((1, S.GONE),), Skip.EMPTY,
                         input="drained")
RELEASE_MIN = Point("deferred_release", Op.MIN, (S.HELD,), ((1, S.GONE),), Skip.EMPTY, input="drained")
# drain_before_retraction (0.5.21 on): check_offload_progress's MIN, then a MAX of
# "copies pending here", issued only by a rank whose own check_decode_mem fails
DRAIN_PROGRESS = Point("offload_drain_progress", Op.MIN, (S.RUNNING,), (), Skip.LOCAL_FLAG,
                       input="retract", shape=2)
DRAIN = Point("offload_drain", Op.MAX, (S.RUNNING,), (), Skip.LOCAL_FLAG, input="retract", shape=1)
NO_CHECKSUM = Point("prebuilt", Op.LOCAL, (S.PREBUILT,), ((0, S.RUNNING),))
_CHECKSUM_MOVES = ((0, S.RUNNING), (1, S.GONE))
CHECKSUM_LOCAL = Point("kv_checksum", Op.LOCAL, (S.PREBUILT,), _CHECKSUM_MOVES, input="corrupt")
CHECKSUM_MAX = Point("kv_checksum", Op.MAX, (S.PREBUILT,), _CHECKSUM_MOVES, Skip.EMPTY, input="corrupt")
FORWARD = Point("forward", Op.ALL_REDUCE, (S.RUNNING,), ((1, S.GONE),), Skip.EMPTY, input="finish")

# strict: every rank-local fact goes through a gate before the collective, so nothing
# local is left after it; the skips read only agreed stages.
STRICT_PREALLOC = prealloc(Skip.EMPTY)
# agreed admission, FIFO as the releases': the walk stops at the first request some rank
# cannot take (the agreed MIN), so every rank stops at the same one (impl/decode's admit:
# the MIN of the prefix each rank can take)
STRICT_ADMIT = replace(ADMIT_LOCAL, op=Op.MIN, skip=Skip.EMPTY)
STRICT_TRANSFER = Point("transfer_poll", Op.MIN, (S.TRANSFER,), TRANSFER_DEFER.moves, Skip.EMPTY,
                        input="transfer", gate="held", gate_value=3)
# the drain is issued by every rank with a running batch; its MAX of the ranks' retract
# needs is the agreed decision to retract
STRICT_DRAIN = (replace(DRAIN_PROGRESS, skip=Skip.EMPTY), replace(DRAIN, skip=Skip.EMPTY))


@dataclass(frozen=True)
class IterVariant:
    name: str
    releases: str
    points: tuple[Point, ...]
    stages: type[IntEnum] = Stage       # what the stage numbers mean
    runs: int = Stage.RUNNING           # the stage a request reaches before the last point

    def inputs(self) -> tuple[str, ...]:
        """The inputs its points read, in first-use order."""
        names = [n for p in self.points for n in (p.input, p.gate, p.veto) if n]
        return tuple(dict.fromkeys(names))


def _sglang(name: str, releases: str, skip: Skip, transfer: Point, checksum: Point,
            release: tuple[Point, ...] = (), hold: tuple[Point, ...] = (),
            drain: tuple[Point, ...] = ()) -> IterVariant:
    """In event-loop order: process_decode_queue (offload, deferred releases, the queues),
    then the next batch (prebuilt, checksum, retraction's drain), then the forward."""
    return IterVariant(name, releases, (RECV, OFFLOAD, *release, prealloc(skip), ADMIT_LOCAL,
                                        transfer, *hold, checksum, *drain, FORWARD))


ITER_VARIANTS: dict[str, IterVariant] = {v.name: v for v in (
    _sglang("iter-0.5.12", "SGLang 0.5.12", Skip.ALL_READY, TRANSFER, NO_CHECKSUM),
    _sglang("iter-0.5.13", "SGLang 0.5.13 to 0.5.18", Skip.ALL_READY_NO_LOCAL_FAIL, TRANSFER_VETO,
            NO_CHECKSUM),
    _sglang("iter-0.5.19", "SGLang 0.5.19", Skip.ALL_READY_NO_LOCAL_FAIL, TRANSFER_DEFER, NO_CHECKSUM,
            (RELEASE_LOCAL,), (HOLD_LOCAL,)),
    # 0.5.20: 0.5.19's per-rank hold and release, with 0.5.21's prealloc poll (its
    # all-ready skip removed: "receiver polling observes asynchronous failures")
    _sglang("iter-0.5.20", "SGLang 0.5.20", Skip.EMPTY, TRANSFER_DEFER, NO_CHECKSUM,
            (RELEASE_LOCAL,), (HOLD_LOCAL,)),
    _sglang("iter-0.5.21", "SGLang 0.5.21 and 0.5.22", Skip.EMPTY, TRANSFER_DEFER, CHECKSUM_LOCAL,
            (RELEASE_HOST_MIN, RELEASE_LOCAL), (HOLD_LOCAL_HOST,), (DRAIN_PROGRESS, DRAIN)),
    _sglang("iter-0.5.23", "SGLang 0.5.23", Skip.EMPTY, TRANSFER_DEFER, CHECKSUM_MAX,
            (RELEASE_MIN,), (HOLD_MAX,), (DRAIN_PROGRESS, DRAIN)),
    IterVariant("iter-strict", "this project", (RECV, OFFLOAD, RELEASE_MIN, STRICT_PREALLOC, STRICT_ADMIT,
                                                STRICT_TRANSFER, HOLD_MAX, CHECKSUM_MAX, *STRICT_DRAIN,
                                                FORWARD)),
)}


class PStage(IntEnum):
    """A request's place on a prefill rank (issue 19 item 2, first points)."""
    ABSENT = 0
    BOOTSTRAP = 1    # in PrefillBootstrapQueue
    WAITING = 2      # bootstrapped, in the waiting queue (metadata buffer taken)
    INFLIGHT = 3     # prefilled, KV being sent (disagg_prefill_inflight_queue)
    GONE = 4


P = PStage
P_RECV = Point("recv_requests", Op.BROADCAST, (P.ABSENT,), ((1, P.BOOTSTRAP),), input="arrive", shape=1)
_BOOTSTRAP_MOVES = ((0, P.GONE), (2, P.WAITING))
# pop_bootstrapped: the MIN, then a rank without a free metadata buffer keeps the request
# (0.5.13 on: ``continue``, #37909; 0.5.12: ``break``, so the later requests stay too,
# a Failed one among them)
P_BOOTSTRAP = Point("bootstrap_poll", Op.MIN, (P.BOOTSTRAP,), _BOOTSTRAP_MOVES, Skip.EMPTY,
                    input="bootstrap", veto="no_buffer", veto_value=2)
P_BOOTSTRAP_BREAK = replace(P_BOOTSTRAP, halt=2)
P_STRICT_BOOTSTRAP = Point("bootstrap_poll", Op.MIN, (P.BOOTSTRAP,), _BOOTSTRAP_MOVES, Skip.EMPTY,
                           input="bootstrap", gate="no_buffer", gate_value=1)
P_FORWARD = Point("forward", Op.ALL_REDUCE, (P.WAITING,), ((0, P.INFLIGHT),), Skip.EMPTY)
P_INFLIGHT = Point("inflight_poll", Op.MIN, (P.INFLIGHT,), ((0, P.GONE), (4, P.GONE)), Skip.EMPTY,
                   input="transfer")
# resolve_waiting_queue_bootstrap (0.5.14 on): the MIN over the waiting queue's
# non-aborted requests (``if not candidates: return``); Failed leaves
P_WAITING = Point("waiting_bootstrap", Op.MIN, (P.WAITING,), ((0, P.GONE),), Skip.EMPTY, input="bootstrap")
for _v in (IterVariant("prefill-0.5.12", "SGLang 0.5.12 (prefill)",
                       (P_RECV, P_BOOTSTRAP_BREAK, P_FORWARD, P_INFLIGHT), PStage, P.INFLIGHT),
           IterVariant("prefill-0.5.13", "SGLang 0.5.13 (prefill)",
                       (P_RECV, P_BOOTSTRAP, P_FORWARD, P_INFLIGHT), PStage, P.INFLIGHT),
           IterVariant("prefill-0.5.18", "SGLang 0.5.14 to 0.5.23 (prefill)",
                       (P_RECV, P_BOOTSTRAP, P_WAITING, P_FORWARD, P_INFLIGHT), PStage, P.INFLIGHT),
           IterVariant("prefill-strict", "this project (prefill)",
                       (P_RECV, P_STRICT_BOOTSTRAP, P_WAITING, P_FORWARD, P_INFLIGHT), PStage, P.INFLIGHT)):
    ITER_VARIANTS[_v.name] = _v


def get_iter_variant(name: str) -> IterVariant:
    try:
        return ITER_VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown iteration variant {name!r} (known: {', '.join(ITER_VARIANTS)})") from None


Stages = tuple[tuple[int, ...], ...]          # [rank][request]
Inputs = Mapping[str, Sequence[Sequence[Any]]]   # name -> [rank][request]
Record = tuple[str, str, int]                 # (collective, op, shape)


@dataclass(frozen=True)
class PointResult:
    point: str
    issued: tuple[bool, ...]                  # per rank
    before: Stages
    after: Stages


@dataclass(frozen=True)
class IterationResult:
    stages: Stages
    records: tuple[tuple[Record, ...], ...]   # per rank, in issue order
    points: tuple[PointResult, ...]


def initial_stages(ranks: int, requests: int) -> Stages:
    return tuple((int(S.ABSENT),) * requests for _ in range(ranks))


def _value(inputs: Inputs, name: str | None, k: int, r: int) -> int:
    return 0 if name is None else inputs[name][k][r]


@dataclass(frozen=True)
class Folds:
    """The reductions over a list that apply_point needs beside the kernel's Ops: Python's
    here, Z3's in model/encoding/iteration.py (the bounded search runs apply_point itself)."""
    ops: Ops
    minimum: Callable[[list[Any]], Any]
    maximum: Callable[[list[Any]], Any]
    some: Callable[[list[Any]], Any]
    count: Callable[[list[Any]], Any]


PYF = Folds(PY, min, max, any, lambda xs: sum(map(bool, xs)))


def reduce_over(p: Point, column: list[Any], f: Folds = PYF) -> Any:
    """The collective's value for one request from every rank's contribution."""
    if p.op is Op.MIN:
        return f.minimum(column)
    if p.op is Op.MAX:
        return f.maximum(column)
    return column[0]          # BROADCAST, ALL_REDUCE: rank 0's


def point_values(p: Point, stages: Sequence[Sequence[Any]], inputs: Inputs, f: Folds = PYF
                 ) -> tuple[tuple[Any, ...], list[Any], list[list[Any]]]:
    """One point's collective on every rank: who issued it, its shapes, and the value each
    rank acts on per request (the reduced one; a LOCAL point's own)."""
    ops, ranks, reqs = f.ops, len(stages), len(stages[0]) if stages else 0
    local = [[_value(inputs, p.input, k, r) for r in range(reqs)] for k in range(ranks)]
    issued = tuple(issues(p, f.some([triggers(p, stages[k][r], local[k][r], ops) for r in range(reqs)]), ops)
                   for k in range(ranks))
    shapes = [p.shape if p.shape is not None else f.count([is_member(p, s, ops) for s in stages[k]])
              for k in range(ranks)]
    contrib = [[contribution(p, issued[k], stages[k][r], local[k][r], _value(inputs, p.gate, k, r), ops)
                for r in range(reqs)] for k in range(ranks)]
    reduced = [[reduce_over(p, [c[r] for c in contrib], f) if p.collective else contrib[k][r]
                for r in range(reqs)] for k in range(ranks)]
    return issued, shapes, reduced


def act(p: Point, stages: Sequence[Sequence[Any]], inputs: Inputs, issued: Sequence[Any],
        values: Sequence[Sequence[Any]], f: Folds = PYF) -> tuple[tuple[Any, ...], ...]:
    """Every rank moves its members on the values it was given (and its veto); a
    halting point's walk stops at its first halting member (queue order: request order)."""
    def row(k: int) -> tuple[Any, ...]:
        reqs = range(len(stages[k]))
        veto = [_value(inputs, p.veto, k, r) for r in reqs]
        stops = [halts(p, issued[k], stages[k][r], values[k][r], veto[r], f.ops) for r in reqs]
        return tuple(next_stage(p, issued[k], stages[k][r], values[k][r], veto[r], f.ops,
                                f.some(stops[:r]) if p.halt is not None else None) for r in reqs)
    return tuple(row(k) for k in range(len(stages)))


def apply_point(p: Point, stages: Sequence[Sequence[Any]], inputs: Inputs,
                f: Folds = PYF) -> tuple[tuple[tuple[Any, ...], ...], tuple[Any, ...], list[Any]]:
    """One point on every rank: the next stages, who issued the collective, its shapes."""
    issued, shapes, reduced = point_values(p, stages, inputs, f)
    return act(p, stages, inputs, issued, reduced, f), issued, shapes


def run_iteration(v: IterVariant, stages: Stages, inputs: Inputs) -> IterationResult:
    records: list[list[Record]] = [[] for _ in stages]
    results = []
    for p in v.points:
        after, issued, shapes = apply_point(p, stages, inputs)
        for k, did in enumerate(issued):
            if did:            # (PY's ops give plain bools here)
                records[k].append((p.name, p.op.value, shapes[k]))
        results.append(PointResult(p.name, issued, stages, after))
        stages = after
    return IterationResult(stages, tuple(tuple(r) for r in records), tuple(results))


def check_inputs(v: IterVariant, inputs: Mapping[str, object], ranks: int, requests: int) -> None:
    """Raise ValueError naming the first input that is missing, of the wrong shape or
    outside its domain."""
    check_grid(inputs, {name: INPUTS[name] for name in v.inputs()}, ranks, requests)


def check_grid(inputs: Mapping[str, object], domains: Mapping[str, tuple[int, ...]], ranks: int,
               requests: int) -> None:
    """Each named input one list per rank of one value per request, in its domain;
    ValueError naming the first that is not."""
    for name, domain in domains.items():
        rows = inputs.get(name)
        if not isinstance(rows, (list, tuple)) or len(rows) != ranks:
            raise ValueError(f"input {name!r} must list {ranks} ranks")
        for k, row in enumerate(rows):
            if not isinstance(row, (list, tuple)) or len(row) != requests:
                raise ValueError(f"input {name!r} rank {k} must list {requests} requests")
            for x in row:
                if isinstance(x, bool) or x not in domain:
                    raise ValueError(f"input {name!r} rank {k} holds {x!r}, outside {domain}")


# -- the invariants ---------------------------------------------------------------------
def collectives_agree(res: IterationResult) -> list[Violation]:
    first = res.records[0]
    for k, rec in enumerate(res.records[1:], 1):
        if rec != first:
            i = next((j for j, (a, b) in enumerate(zip(first, rec)) if a != b), min(len(first), len(rec)))
            show = lambda rs: "end of iteration" if i >= len(rs) else "{} {} shape {}".format(*rs[i])
            return [Violation("collectives_agree", f"collective {i}: rank 0 issues {show(first)}, "
                              f"rank {k} issues {show(rec)}", (0, k))]
    return []


def no_local_decision_after_min(res: IterationResult, v: IterVariant) -> list[Violation]:
    for p, pr in zip(v.points, res.points):
        if not p.collective:
            continue
        holders = [k for k, did in enumerate(pr.issued) if did]
        for r in range(len(pr.before[0]) if pr.before else 0):
            held = [k for k in holders if pr.before[k][r] in p.members]
            moved = {(pr.before[k][r], pr.after[k][r]) for k in held}
            if len({before for before, _ in moved}) < len(moved):   # same stage, other move
                where = ", ".join(f"rank {k}: {v.stages(pr.after[k][r]).name}" for k in held)
                return [Violation("no_local_decision_after_min", f"after {p.name} ({p.op.value}) "
                                  f"request {r} moves differently ({where})", tuple(held), (r,))]
    return []


def stages_agree(stages: Stages, names: type[IntEnum] = Stage) -> list[Violation]:
    for k, row in enumerate(stages[1:], 1):
        if row != stages[0]:
            r = next(i for i, (a, b) in enumerate(zip(stages[0], row)) if a != b)
            return [Violation("stages_agree", f"request {r}: rank 0 {names(stages[0][r]).name}, "
                              f"rank {k} {names(row[r]).name}", (0, k), (r,))]
    return []


def iteration_violations(res: IterationResult, v: IterVariant) -> list[Violation]:
    """Every invariant this iteration breaks, in ITERATION_NAMES order."""
    return [*collectives_agree(res), *no_local_decision_after_min(res, v), *stages_agree(res.stages, v.stages)]
