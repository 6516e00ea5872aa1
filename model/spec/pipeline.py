"""Pipeline parallel decode (and prefill) as PP stages x TP ranks (issue 19 item 3).

Each PP stage is one TP group running the iteration's ``Point`` mechanism
(model/spec/agreement.py, model/spec/iteration.py's point_values/act); a point's
``across`` says where the value each (stage, rank) acts on comes from:

* ``GROUP``: its own stage's TP collective (apply_point over that stage's ranks);
* ``ALL``: one collective over every (stage, rank) (the strict designs);
* ``RING``: each stage's TP collective, then SGLang's PP ring (``_pp_pd_get_decode_
  transferred_ids``, ``_pp_pd_get_bootstrapped_ids``): a request moves only where every
  stage's value moves it, an intersection by rid, and each stage applies its own value;
  a ``union`` value (a bad rid) that any stage's value is goes to every stage first;
* ``PP0``: stage 0's TP collective, forwarded to the later stages as a list that each
  zips with its own queue (0.5.22 and 0.5.23 prefill ``pp_sync_polls``): by position, not by rid.

A state is one row of stages per (stage, rank), flattened stage-major: row s*T + k is
TP rank k of PP stage s. Queue order is request order on every row (requests arrive
in one forwarded list), so two rows agree on a queue's requests and their order
exactly when they agree on the stages: ``stages_agree`` over every row is the
invariant "every (stage, rank) agrees on the request list and its order".

The invariants, by name (PP_NAMES):

* ``collectives_agree``: the ranks of each stage issue the same TP collectives, and at
  a PP0 point stage s receives exactly when stage s-1 sends (else the P2P hangs);
* ``positions_agree``: at a PP0 point, the queue of every (stage, rank) lists the same
  requests in the same positions as stage 0's, so the forwarded value at a position is
  the value of the request there (else it lands on another request);
* ``stages_agree``: every (stage, rank) holds every request at the same stage.

Release facts (from the wheels; docs/PROOFS.md, "Pipeline parallel", with line numbers):

* decode, every release: each stage TP-MINs its (ungated) transfer polls (``get_rids``),
  keeps Success and Failed alike as "finished" and intersects with the previous stage's
  list; the last stage's list goes round the ring and each stage calls
  ``pop_transferred(rids)``, which polls and TP-MINs its whole queue again (the second
  MIN) and pops the listed rids on its own result. Up to 0.5.22 the first MIN is issued
  on an empty queue too (a shape-0 tensor); 0.5.23's ``all_reduce_flags`` skips it.
  0.5.12's second MIN is ungated and its commit keeps a request whose metadata row has
  not landed on this rank (a rank-local ``continue``); from 0.5.13 the second MIN is the
  metadata-gated one. 0.5.23 then MAX-reduces its failed requests' hold flags.
* prefill bootstrap, 0.5.12 to 0.5.21: the same ring by rid (``_pp_pd_get_bootstrapped_ids``),
  good = WaitingForInput on every stage (an intersection), bad = Failed on some stage
  (a union, ``union``). 0.5.12 to 0.5.16 then poll and TP-MIN the whole queue again and
  act on their own value for the listed rids; 0.5.17 to 0.5.21 apply the consensus
  (``poll_and_all_reduce_pp``, #31869), TP-MINing only the unlisted requests for a
  Failed. 0.5.22 and 0.5.23 forward PP0's polls by position (``poll_and_all_reduce_prefill_pp``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any, Sequence

from model.spec.agreement import Across, Op, Point, Skip, any_of, is_member, issues, triggers
from model.spec.invariants import Violation
from model.spec.iteration import (INPUTS, PYF, Folds, Inputs, PointResult, PStage, Record, Stages,
                                  act, apply_point, point_values, stages_agree)

STAY = -2        # a value no point moves on: "not in the consensus / no forwarded value"
PP_NAMES = ("collectives_agree", "positions_agree", "stages_agree")


class QStage(IntEnum):
    """A request's place on a PP decode stage's rank."""
    TRANSFER = 0     # in DecodeTransferQueue
    CHECKED = 1      # in this round's consensus list (the rids pop_transferred checks)
    PREBUILT = 2     # transferred, for the next prebuilt batch
    GONE = 3         # aborted (0.5.23: its slot held or freed, out of the queue either way)
    FAILED = 4       # 0.5.23: the second MIN said Failed; the hold flags' MAX comes next


class BStage(IntEnum):
    """A request's place on a PP prefill stage's rank under the bootstrap ring (0.5.12 to
    0.5.21); the numbers of PStage, and CHECKED."""
    ABSENT = 0
    BOOTSTRAP = 1    # in PrefillBootstrapQueue
    WAITING = 2      # bootstrapped, in the waiting queue
    GONE = 4         # failed bootstrap, aborted
    CHECKED = 5      # in this round's consensus lists (0.5.12 to 0.5.16: good or bad; 0.5.17 on: good)


Q, B = QStage, BStage


def consensus(p: Point, skip: Skip) -> Point:
    """A queue's PP ring: each stage's ``get_rids`` TP-MIN (issued on an empty queue up to
    0.5.22: ``poll_and_all_reduce`` has no empty test; skipped from 0.5.23), then the
    lists intersected (``union``: united) by rid round the stages."""
    return replace(p, skip=skip, across=Across.RING)


# decode: Success and Failed both count as finished (one list, an intersection)
_FINISHED = Point("transfer_consensus", Op.MIN, (Q.TRANSFER,), ((0, Q.CHECKED), (4, Q.CHECKED)), input="transfer")


def pop(failed: int = Q.GONE, **local: Any) -> Point:
    """``pop_transferred(rids)``: this stage's TP-MIN over its whole queue (an early return
    only on an empty one), the checked rids moved on that value."""
    return Point("transfer_poll", Op.MIN, (Q.TRANSFER, Q.CHECKED), ((0, failed), (3, Q.TRANSFER), (4, Q.PREBUILT)),
                 Skip.EMPTY, input="transfer", moving=(Q.CHECKED,), **local)


# 0.5.12: ungated, and _commit_transfer_to_req keeps a request whose room has not landed here
POP_COMMIT = pop(veto="unlanded", veto_value=4)
POP_GATED = pop(gate="unlanded", gate_value=3)
# the round's list is dropped: a checked request kept by the commit is back in the queue
REQUEUE = Point("requeue", Op.LOCAL, (Q.CHECKED,), ((0, Q.TRANSFER),))
# 0.5.23: the failed requests' hold flags MAX-reduced (all_reduce_flags skips an empty list);
# held or freed, the request leaves the queue
HOLD_MAX = Point("defer_release", Op.MAX, (Q.FAILED,), ((0, Q.GONE),), Skip.EMPTY)
# strict: one gated MIN over every (stage, rank), its value applied as is (no second poll)
STRICT_TRANSFER = Point("transfer_poll", Op.MIN, (Q.TRANSFER,), ((0, Q.GONE), (4, Q.PREBUILT)), Skip.EMPTY,
                        input="transfer", gate="unlanded", gate_value=3, across=Across.ALL)

# prefill bootstrap ring (0.5.12 to 0.5.21): good = WaitingForInput on every stage, bad =
# Failed on any (the union wins)
_BOOT_RING = Point("bootstrap_consensus", Op.MIN, (B.BOOTSTRAP,), ((0, B.CHECKED), (2, B.CHECKED)),
                   input="bootstrap", union=(0,))
# 0.5.13 to 0.5.16: pop_bootstrapped(rids_to_check) polls and TP-MINs the whole queue, acts on
# its own value for the listed rids, keeps one it has no metadata buffer for (continue);
# 0.5.12 stops its walk there (break): the requests after it stay too, a Failed one included
BOOT_POP_OWN = Point("bootstrap_poll", Op.MIN, (B.BOOTSTRAP, B.CHECKED), ((0, B.GONE), (2, B.WAITING)),
                     Skip.EMPTY, input="bootstrap", veto="no_buffer", veto_value=2, moving=(B.CHECKED,))
BOOT_POP_BREAK = replace(BOOT_POP_OWN, halt=2)
BOOT_REQUEUE = Point("requeue", Op.LOCAL, (B.CHECKED,), ((0, B.BOOTSTRAP),))
# 0.5.17 to 0.5.21 (#31869): bad leaves at once; the unlisted are TP-MINed (``if uncovered``)
# for a Failed; good is popped unless this rank has no metadata buffer for it
_BOOT_RING_APPLIED = Point("bootstrap_consensus", Op.MIN, (B.BOOTSTRAP,), ((0, B.GONE), (2, B.CHECKED)),
                           input="bootstrap", union=(0,))
BOOT_UNCOVERED = Point("bootstrap_uncovered", Op.MIN, (B.BOOTSTRAP,), ((0, B.GONE),), Skip.EMPTY,
                       input="bootstrap")
BOOT_POP_AGREED = Point("bootstrap_pop", Op.LOCAL, (B.CHECKED,), ((0, B.WAITING), (1, B.BOOTSTRAP)),
                        input="no_buffer")
_BOOTSTRAP_MOVES = ((0, PStage.GONE), (2, PStage.WAITING))
PP0_BOOTSTRAP = Point("bootstrap_poll", Op.MIN, (PStage.BOOTSTRAP,), _BOOTSTRAP_MOVES, Skip.EMPTY,
                      input="bootstrap", veto="no_buffer", veto_value=2, across=Across.PP0)
STRICT_BOOTSTRAP = Point("bootstrap_poll", Op.MIN, (PStage.BOOTSTRAP,), _BOOTSTRAP_MOVES, Skip.EMPTY,
                         input="bootstrap", gate="no_buffer", gate_value=1, across=Across.ALL)


@dataclass(frozen=True)
class PPVariant:
    name: str
    releases: str
    points: tuple[Point, ...]
    stages: type[IntEnum]
    initial: int                 # every request's stage at the start (already queued)
    done: int                    # where the nonvacuity witness takes a request
    transient: tuple[int, ...] = ()   # stages a request leaves within the iteration it enters

    def inputs(self) -> tuple[str, ...]:
        names = [n for p in self.points for n in (p.input, p.gate, p.veto) if n]
        return tuple(dict.fromkeys(names))


PP_VARIANTS: dict[str, PPVariant] = {v.name: v for v in (
    PPVariant("pp-0.5.12", "SGLang 0.5.12 (decode, pp > 1)",
              (consensus(_FINISHED, Skip.NEVER), POP_COMMIT, REQUEUE), QStage, Q.TRANSFER, Q.PREBUILT, (Q.CHECKED,)),
    PPVariant("pp-0.5.13", "SGLang 0.5.13 to 0.5.22 (decode, pp > 1)",
              (consensus(_FINISHED, Skip.NEVER), POP_GATED), QStage, Q.TRANSFER, Q.PREBUILT, (Q.CHECKED,)),
    PPVariant("pp-0.5.23", "SGLang 0.5.23 (decode, pp > 1)",
              (consensus(_FINISHED, Skip.EMPTY), pop(Q.FAILED, gate="unlanded", gate_value=3), HOLD_MAX),
              QStage, Q.TRANSFER, Q.PREBUILT, (Q.CHECKED, Q.FAILED)),
    PPVariant("pp-strict", "this project (decode, pp > 1)", (STRICT_TRANSFER,), QStage, Q.TRANSFER, Q.PREBUILT),
    PPVariant("pp-prefill-0.5.12", "SGLang 0.5.12 (prefill, pp > 1)",
              (consensus(_BOOT_RING, Skip.NEVER), BOOT_POP_BREAK, BOOT_REQUEUE), BStage, B.BOOTSTRAP, B.WAITING,
              (B.CHECKED,)),
    PPVariant("pp-prefill-0.5.13", "SGLang 0.5.13 to 0.5.16 (prefill, pp > 1)",
              (consensus(_BOOT_RING, Skip.NEVER), BOOT_POP_OWN, BOOT_REQUEUE), BStage, B.BOOTSTRAP, B.WAITING,
              (B.CHECKED,)),
    PPVariant("pp-prefill-0.5.18", "SGLang 0.5.17 to 0.5.21 (prefill, pp > 1)",
              (consensus(_BOOT_RING_APPLIED, Skip.NEVER), BOOT_UNCOVERED, BOOT_POP_AGREED), BStage, B.BOOTSTRAP,
              B.WAITING, (B.CHECKED,)),
    PPVariant("pp-prefill-0.5.23", "SGLang 0.5.22 and 0.5.23 (prefill, pp > 1)", (PP0_BOOTSTRAP,), PStage,
              PStage.BOOTSTRAP, PStage.WAITING),
    PPVariant("pp-prefill-strict", "this project (prefill, pp > 1)", (STRICT_BOOTSTRAP,), PStage,
              PStage.BOOTSTRAP, PStage.WAITING),
)}


def get_pp_variant(name: str) -> PPVariant:
    try:
        return PP_VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown pipeline variant {name!r} (known: {', '.join(PP_VARIANTS)})") from None


@dataclass(frozen=True)
class PipelineResult:
    stages: Stages                            # [stage * T + rank][request]
    records: tuple[tuple[Record, ...], ...]   # per row, in issue order
    points: tuple[PointResult, ...]
    pp: int                                   # PP stages (rows = pp * T)


def initial_pp_stages(v: PPVariant, pp: int, ranks: int, requests: int) -> Stages:
    return tuple((int(v.initial),) * requests for _ in range(pp * ranks))


def _rows(xs: Sequence[Any], s: int, t: int) -> list[Any]:
    return list(xs[s * t:(s + 1) * t])


def _group_inputs(inputs: Inputs, s: int, t: int) -> dict[str, Any]:
    return {name: _rows(rows, s, t) for name, rows in inputs.items()}


def positions(p: Point, row: Sequence[Any], f: Folds) -> list[Any]:
    """Each request's index in this row's queue of p's members (meaningful for members)."""
    return [f.count([is_member(p, row[j], f.ops) for j in range(r)]) for r in range(len(row))]


def forwarded(p: Point, row0: Sequence[Any], values0: Sequence[Any], row: Sequence[Any], f: Folds) -> list[Any]:
    """The value a later stage's rank gives each request when stage 0's list is zipped
    with its own queue: the value of stage 0's request at the same position (STAY where
    stage 0's list is shorter)."""
    ops, pos0, pos = f.ops, positions(p, row0, f), positions(p, row, f)
    out = []
    for r in range(len(row)):
        v: Any = STAY
        for r0 in range(len(row0)):
            v = ops.ite(ops.and_(is_member(p, row0[r0], ops), ops.eq(pos0[r0], pos[r])), values0[r0], v)
        out.append(v)
    return out


def ring_value(p: Point, column: Sequence[Any], s: int, ops: Any) -> Any:
    """What stage s acts on after the ring, given each stage's TP-MIN for one request: a
    ``union`` value any stage carries (the first), else its own value where every stage's
    moves the request (the intersection), else STAY."""
    moved = lambda x: any_of(ops, *[ops.eq(x, key) for key, _ in p.moves])
    out = ops.ite(ops.and_(*[moved(x) for x in column]), column[s], STAY)
    for u in reversed(p.union):
        out = ops.ite(any_of(ops, *[ops.eq(x, u) for x in column]), u, out)
    return out


def apply_pp_point(p: Point, pp: int, stages: Sequence[Sequence[Any]], inputs: Inputs, f: Folds = PYF
                   ) -> tuple[tuple[tuple[Any, ...], ...], tuple[Any, ...], list[Any], list[str]]:
    """One point on every (stage, rank): next stages, who issued, shapes, the op recorded."""
    ops, t = f.ops, len(stages) // pp
    if p.across is Across.ALL:
        after, issued, shapes = apply_point(p, stages, inputs, f)
        return after, issued, shapes, [p.op.value] * len(stages)
    groups = [(_rows(stages, s, t), _group_inputs(inputs, s, t)) for s in range(pp)]
    vals = [point_values(p, rows, inp, f) for rows, inp in groups]
    ops_used = [p.op.value] * len(stages)
    if p.across is Across.RING:
        values = [[[ring_value(p, [vals[x][2][k][r] for x in range(pp)], s, ops) for r in range(len(stages[0]))]
                   for k in range(t)] for s in range(pp)]
        issued_by = [vals[s][0] for s in range(pp)]
    elif p.across is Across.PP0:
        issued_by, values = [vals[0][0]], [vals[0][2]]
        for s in range(1, pp):       # no TP collective here: a receive, where the queue is not empty
            rows = groups[s][0]
            issued_by.append(tuple(issues(p, f.some([triggers(p, x, 0, ops) for x in row]), ops) for row in rows))
            values.append([forwarded(p, groups[0][0][k], vals[0][2][k], rows[k], f) for k in range(t)])
            ops_used[s * t:(s + 1) * t] = ["pp_recv"] * t
    else:
        issued_by, values = [vals[s][0] for s in range(pp)], [vals[s][2] for s in range(pp)]
    after, issued, shapes = [], [], []
    for s, (rows, inp) in enumerate(groups):
        after += act(p, rows, inp, issued_by[s], values[s], f)
        issued += issued_by[s]
        shapes += vals[s][1]
    return tuple(after), tuple(issued), shapes, ops_used


def run_pipeline(v: PPVariant, pp: int, stages: Stages, inputs: Inputs) -> PipelineResult:
    records: list[list[Record]] = [[] for _ in stages]
    results = []
    for p in v.points:
        after, issued, shapes, used = apply_pp_point(p, pp, stages, inputs)
        for k, did in enumerate(issued):
            if did:
                records[k].append((p.name, used[k], shapes[k]))
        results.append(PointResult(p.name, issued, stages, after))
        stages = after
    return PipelineResult(stages, tuple(tuple(r) for r in records), tuple(results), pp)


def check_pp_inputs(v: PPVariant, inputs: dict, pp: int, ranks: int, requests: int) -> None:
    """ValueError naming the first input missing, misshapen or outside its domain."""
    rows_n = pp * ranks
    for name in v.inputs():
        rows = inputs.get(name)
        if not isinstance(rows, (list, tuple)) or len(rows) != rows_n:
            raise ValueError(f"input {name!r} must list {rows_n} (stage, rank) rows")
        for k, row in enumerate(rows):
            if not isinstance(row, (list, tuple)) or len(row) != requests:
                raise ValueError(f"input {name!r} row {k} must list {requests} requests")
            for x in row:
                if isinstance(x, bool) or x not in INPUTS[name]:
                    raise ValueError(f"input {name!r} row {k} holds {x!r}, outside {INPUTS[name]}")


# -- the invariants ---------------------------------------------------------------------
def _where(k: int, t: int) -> str:
    return f"stage {k // t} rank {k % t}"


def collectives_agree(res: PipelineResult) -> list[Violation]:
    t = len(res.stages) // res.pp
    for k, rec in enumerate(res.records):
        first = res.records[(k // t) * t]
        if rec != first:
            return [Violation("collectives_agree", f"{_where(k, t)} issues {[list(x) for x in rec]}, "
                              f"{_where((k // t) * t, t)} issues {[list(x) for x in first]}", ((k // t) * t, k))]
    return []


def positions_agree(res: PipelineResult, v: PPVariant) -> list[Violation]:
    t = len(res.stages) // res.pp
    for p, pr in zip(v.points, res.points):
        if p.across is not Across.PP0:
            continue
        queue = lambda k: [r for r, x in enumerate(pr.before[k]) if x in p.members]
        for k in range(t, len(pr.before)):
            src = k - t                          # the previous stage's same TP rank sends
            if pr.issued[k] != pr.issued[src]:
                return [Violation("positions_agree", f"at {p.name}: {_where(src, t)} "
                                  f"{'sends' if pr.issued[src] else 'sends nothing'}, {_where(k, t)} "
                                  f"{'receives' if pr.issued[k] else 'receives nothing'}", (src, k))]
            if queue(k) != queue(k % t):
                bad = next((i for i, (a, b) in enumerate(zip(queue(k % t), queue(k))) if a != b),
                           min(len(queue(k)), len(queue(k % t))))
                return [Violation("positions_agree", f"at {p.name}: position {bad} is request "
                                  f"{queue(k % t)[bad] if bad < len(queue(k % t)) else None} on stage 0, "
                                  f"request {queue(k)[bad] if bad < len(queue(k)) else None} on {_where(k, t)}",
                                  (k % t, k))]
    return []


def rows_agree(res: PipelineResult, v: PPVariant) -> list[Violation]:
    """stages_agree over every (stage, rank), its rows named by stage and rank."""
    t = len(res.stages) // res.pp
    out = stages_agree(res.stages, v.stages)
    for x in out:
        k, r = x.ranks[1], x.reqs[0]
        out = [Violation(x.invariant, f"request {r}: {_where(0, t)} {v.stages(res.stages[0][r]).name}, "
                         f"{_where(k, t)} {v.stages(res.stages[k][r]).name}", x.ranks, x.reqs)]
    return out


def pipeline_violations(res: PipelineResult, v: PPVariant) -> list[Violation]:
    """Every invariant this iteration breaks, in PP_NAMES order."""
    return [*collectives_agree(res), *positions_agree(res, v), *rows_agree(res, v)]
