"""Pipeline parallel decode (and prefill) as PP stages x TP ranks (issue 19 item 3).

Each PP stage is one TP group running the iteration's ``Point`` mechanism
(model/spec/agreement.py, model/spec/iteration.py's point_values/act); a point's
``across`` says where the value each (stage, rank) acts on comes from:

* ``GROUP``: its own stage's TP collective (apply_point over that stage's ranks);
* ``ALL``: one collective over every (stage, rank) (the strict designs);
* ``RING``: each stage's TP collective, then SGLang's PP ring (``_pp_pd_get_decode_
  transferred_ids``): a request moves only where every stage's value moves it, an
  intersection by rid; each stage then applies its own value;
* ``PP0``: stage 0's TP collective, forwarded to the later stages as a list that each
  zips with its own queue (0.5.23 prefill ``pp_sync_polls``): by position, not by rid.

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

Release facts (from the wheels; docs/PROOFS.md, "Pipeline parallel"): decode's
transferred-rids ring is the same code in 0.5.12 to 0.5.23: stage s TP-MINs its
(ungated) polls, keeps Success and Failed alike as "finished", intersects with the
previous stage's list; the last stage's list goes round the ring and each stage calls
``pop_transferred(rids)``, which polls and TP-MINs again (the second MIN) and acts on
its own result. 0.5.12's second MIN is ungated; from 0.5.13 it is the metadata-gated
one (``_poll_with_metadata_gate``: a rank whose metadata row has not landed caps
Success at Transferring before the MIN), the first is not. Prefill's bootstrap poll
forwards PP0's list by position only in 0.5.23 (``poll_and_all_reduce_prefill_pp``).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Sequence

from model.spec.agreement import Across, Op, Point, Skip, any_of, is_member, issues, triggers
from model.spec.invariants import Violation
from model.spec.iteration import (INPUTS, PYF, Folds, Inputs, PointResult, PStage, Record, Stages,
                                  act, apply_point, point_values, stages_agree)

STAY = -2        # a value no point moves on: "not in the consensus / no forwarded value"
PP_NAMES = ("collectives_agree", "positions_agree", "stages_agree")


class QStage(IntEnum):
    """A request's place in a PP decode stage's transfer queue."""
    TRANSFER = 0     # in DecodeTransferQueue
    CHECKED = 1      # in this round's consensus list (the rids pop_transferred checks)
    PREBUILT = 2     # transferred, for the next prebuilt batch
    GONE = 3         # aborted


Q = QStage
# the first MIN (get_rids): Success and Failed both count as finished
CONSENSUS = Point("transfer_consensus", Op.MIN, (Q.TRANSFER,), ((0, Q.CHECKED), (4, Q.CHECKED)),
                  Skip.EMPTY, input="transfer", across=Across.RING)
_POP_MOVES = ((0, Q.GONE), (3, Q.TRANSFER), (4, Q.PREBUILT))
# the second MIN (pop_transferred over the checked rids): the same polls, this stage's ranks
POP = Point("transfer_poll", Op.MIN, (Q.CHECKED,), _POP_MOVES, Skip.EMPTY, input="transfer")
POP_GATED = Point("transfer_poll", Op.MIN, (Q.CHECKED,), _POP_MOVES, Skip.EMPTY, input="transfer",
                  gate="unlanded", gate_value=3)
# strict: one gated MIN over every (stage, rank), its value applied as is (no second poll)
STRICT_TRANSFER = Point("transfer_poll", Op.MIN, (Q.TRANSFER,), ((0, Q.GONE), (4, Q.PREBUILT)), Skip.EMPTY,
                        input="transfer", gate="unlanded", gate_value=3, across=Across.ALL)
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
    PPVariant("pp-0.5.12", "SGLang 0.5.12 (decode, pp > 1)", (CONSENSUS, POP), QStage, Q.TRANSFER, Q.PREBUILT,
              (Q.CHECKED,)),
    PPVariant("pp-0.5.13", "SGLang 0.5.13 to 0.5.23 (decode, pp > 1)", (CONSENSUS, POP_GATED), QStage,
              Q.TRANSFER, Q.PREBUILT, (Q.CHECKED,)),
    PPVariant("pp-strict", "this project (decode, pp > 1)", (STRICT_TRANSFER,), QStage, Q.TRANSFER, Q.PREBUILT),
    PPVariant("pp-prefill-0.5.23", "SGLang 0.5.23 (prefill, pp > 1)", (PP0_BOOTSTRAP,), PStage,
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
        keys = [value for value, _ in p.moves]
        moved = lambda x: any_of(ops, *[ops.eq(x, key) for key in keys])
        agreed = [[ops.and_(*[moved(vals[s][2][k][r]) for s in range(pp)]) for r in range(len(stages[0]))]
                  for k in range(t)]
        values = [[[ops.ite(agreed[k][r], vals[s][2][k][r], STAY) for r in range(len(stages[0]))]
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
