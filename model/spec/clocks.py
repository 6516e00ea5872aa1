"""Per-rank clocks and wall-clock timeouts (issue 19 item 4).

SGLang checks its timeouts on each rank's own clock (``time.time()`` /
``time.perf_counter()``), so with TP > 1 a request whose wait straddles a deadline can
be timed out on one rank and not yet on another. Where the verdict feeds the poll before
the MIN (the Mooncake receiver's waiting timeout) Failed wins on every rank; where a rank
acts on it alone (the scheduler's abort-on-waiting-timeout, #27221; a deferred slot's
release on that rank's own abort ack or clock, #35049/#38961) the ranks diverge.

The model: a request's stage per rank (``CStage``), each rank's elapsed time on the
request's current timer, and its age in steps on that timer. Each step the environment
draws every rank's elapsed time ``dt[k] >= 1`` (the clock unit is the shortest step,
model/spec/timeouts.py's floor; ``ClockBound`` bounds the skew for the searches), what
every rank's receiver polls (a backend that never reports failure is one that never
chooses Failed), whether prefill's abort ack reaches each rank (a lost ack is one that
never does) and the forward's finish. The decode path's points are
model/spec/agreement.py's ``Point``s; the timeout verdicts are their inputs, computed
here from the clocks by ``verdict``, the one function the spec and the Z3 encoding
(model/encoding/clocks.py) both run.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Mapping, Sequence

from model.spec.agreement import Op, Point, Skip, any_of
from model.spec.invariants import Violation
from model.spec.iteration import (PYF, Folds, IterationResult, IterVariant, PointResult, Record,
                                  apply_point, check_grid, iteration_violations)
from model.spec.kernel import PY, Ops
from model.spec.timeouts import steps_for


class CStage(IntEnum):
    WAITING = 0     # in DecodeTransferQueue, receiver not concluded (Bootstrapping..Transferring)
    HELD = 1        # failed; its KV pages held until prefill acknowledges the abort (#35049)
    QUEUED = 2      # transferred, in the scheduler's waiting queue
    GONE = 3        # freed, finished or aborted


C = CStage
CLOCK_INPUTS: dict[str, tuple[int, ...]] = {
    "poll": (0, 2, 3, 4),   # this rank's receiver: Failed, WaitingForInput, Transferring, Success
    "ack": (0, 1),          # prefill's abort ack has reached this rank (the env's choice each step)
    "finish": (0, 1),       # the request finishes in this forward (rank 0's outputs)
}
DERIVED = ("expired", "release")    # the verdicts, from the clocks (never chosen freely)
LIMITS = ("wait", "release", "queue")
CLOCK_NAMES = ("collectives_agree", "no_local_decision_after_min", "stages_agree", "bounded_wait")


@dataclass(frozen=True)
class Timer:
    """A rank times a request at ``stage`` against ``limit``; where ``polls`` is given only
    while its own receiver polls one of them (the Mooncake receiver checks its waiting
    timeout in WaitingForInput only: a transfer stuck in Transferring never times out, #31800)."""
    stage: int
    limit: str
    polls: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ClockVariant:
    name: str
    releases: str
    iter: IterVariant               # the points, over CStage
    timers: tuple[Timer, ...]


@dataclass(frozen=True)
class ClockBound:
    """Every rank's elapsed time per step lies in [lo, hi] (clock units): the skew per step
    is at most hi - lo. lo = 1 is the unit (the proofs take any dt >= 1, any skew)."""
    lo: int = 1
    hi: int = 2

    def check(self, dt: Sequence[int]) -> None:
        for k, d in enumerate(dt):
            if isinstance(d, bool) or not isinstance(d, int) or not self.lo <= d <= self.hi:
                raise ValueError(f"dt of rank {k} is {d!r}, outside [{self.lo}, {self.hi}]")


Limits = Mapping[str, Any]      # "wait", "release", "queue" -> clock units (ints or Z3 terms)


def limits_from_seconds(wait_s: float = 300.0, release_s: float = 30.0, queue_s: float = 10.0,
                        step_floor_s: float = 0.001) -> dict[str, int]:
    """Deployed timeouts (SGLANG_DISAGGREGATION_WAITING_TIMEOUT 300 s, the deferred release's
    30 s, SGLANG_REQ_WAITING_TIMEOUT as set; #27221 used 10 s) in clock units of the step floor."""
    return {"wait": steps_for(wait_s, step_floor_s), "release": steps_for(release_s, step_floor_s),
            "queue": steps_for(queue_s, step_floor_s)}


# -- the points -------------------------------------------------------------------------
def _poll(failed: int, timer_gates: bool = True) -> Point:
    """DecodeTransferQueue.pop_transferred's MIN: each rank's receiver polls, its own
    timeout verdict caps it at Failed before the MIN (the receiver returns Failed)."""
    return Point("transfer_poll", Op.MIN, (C.WAITING,), ((0, failed), (4, C.QUEUED)), Skip.EMPTY,
                 input="poll", gate="expired" if timer_gates else None, gate_value=0)


RELEASE_LOCAL = Point("deferred_release", Op.LOCAL, (C.HELD,), ((1, C.GONE),), input="release")
# 0.5.23 (resolve_deferred_releases): released only where every rank holding it is acked
# or timed out, the MIN of that flag
RELEASE_MIN = Point("deferred_release", Op.MIN, (C.HELD,), ((1, C.GONE),), Skip.EMPTY, input="release")
# the scheduler's _abort_on_waiting_timeout (0.5.12 to 0.5.19): each rank on its own clock (#27221)
ABORT_LOCAL = Point("abort_on_timeout", Op.LOCAL, (C.QUEUED,), ((1, C.GONE),), input="expired")
# 0.5.21 on: _poll_timeout_aborts on attn-TP rank 0 only, its AbortReqs broadcast with recv_requests
ABORT_BROADCAST = Point("abort_on_timeout", Op.BROADCAST, (C.QUEUED,), ((1, C.GONE),), input="expired", shape=1)
ABORT_MAX = Point("abort_on_timeout", Op.MAX, (C.QUEUED,), ((1, C.GONE),), Skip.EMPTY, input="expired")
FORWARD = Point("forward", Op.ALL_REDUCE, (C.QUEUED,), ((1, C.GONE),), Skip.EMPTY, input="finish")

WAIT_RECEIVER = Timer(C.WAITING, "wait", (2,))         # WaitingForInput only (#31800)
WAIT_ANY = Timer(C.WAITING, "wait")                     # strict: whatever the receiver says
RELEASE_TIMER = Timer(C.HELD, "release")
QUEUE_TIMER = Timer(C.QUEUED, "queue")
STRICT_TIMERS = (WAIT_ANY, RELEASE_TIMER, QUEUE_TIMER)


def _cv(name: str, releases: str, points: tuple[Point, ...], timers: tuple[Timer, ...]) -> ClockVariant:
    return ClockVariant(name, releases, IterVariant(name, releases, points, CStage, C.QUEUED), timers)


CLOCK_VARIANTS: dict[str, ClockVariant] = {v.name: v for v in (
    _cv("clocks-0.5.12", "SGLang 0.5.12 to 0.5.18", (_poll(C.GONE), ABORT_LOCAL, FORWARD),
        (WAIT_RECEIVER, QUEUE_TIMER)),
    _cv("clocks-0.5.19", "SGLang 0.5.19 (deferred release on)",
        (_poll(C.HELD), RELEASE_LOCAL, ABORT_LOCAL, FORWARD), (WAIT_RECEIVER, RELEASE_TIMER, QUEUE_TIMER)),
    _cv("clocks-0.5.21", "SGLang 0.5.20 to 0.5.22 (deferred release on)",
        (_poll(C.HELD), RELEASE_LOCAL, ABORT_BROADCAST, FORWARD), (WAIT_RECEIVER, RELEASE_TIMER, QUEUE_TIMER)),
    _cv("clocks-0.5.23", "SGLang 0.5.23 (deferred release on)",
        (_poll(C.HELD), RELEASE_MIN, ABORT_BROADCAST, FORWARD), (WAIT_RECEIVER, RELEASE_TIMER, QUEUE_TIMER)),
    # strict: every verdict goes through a collective (the poll's MIN, the release's MIN,
    # the abort's MAX), and every stage is timed whatever the receiver says
    _cv("clocks-strict", "this project", (_poll(C.HELD), RELEASE_MIN, ABORT_MAX, FORWARD),
        STRICT_TIMERS),
)}


def get_clock_variant(name: str) -> ClockVariant:
    try:
        return CLOCK_VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown clock variant {name!r} (known: {', '.join(CLOCK_VARIANTS)})") from None


# -- the mechanism, over Ops (ints here, Z3 terms in model/encoding/clocks.py) -----------
def verdict(v: ClockVariant, stage: Any, start: Any, elapsed: Any, dt: Any, poll: Any,
            limits: Limits, ops: Ops = PY) -> Any:
    """1 where this rank's own clock says the request's timer at ``stage`` ran out this
    step (``start``: its stage when the step began; a timer started this step has not)."""
    conds = []
    for t in v.timers:
        c = ops.and_(ops.eq(stage, int(t.stage)), ops.eq(start, int(t.stage)),
                     ops.ge(elapsed + dt, limits[t.limit]))
        if t.polls is not None:
            c = ops.and_(c, any_of(ops, *[ops.eq(poll, x) for x in t.polls]))
        conds.append(c)
    return ops.ite(any_of(ops, *conds), 1, 0)


def point_input(v: ClockVariant, name: str, stage: Any, start: Any, elapsed: Any, dt: Any,
                env: Mapping[str, Any], limits: Limits, ops: Ops = PY) -> Any:
    """One (rank, request)'s value of a point's input: the environment's, or a verdict."""
    if name not in DERIVED:
        return env[name]
    expired = verdict(v, stage, start, elapsed, dt, env["poll"], limits, ops)
    if name == "expired":
        return expired
    return ops.ite(any_of(ops, ops.eq(env["ack"], 1), ops.eq(expired, 1)), 1, 0)   # release


def advance(start: Any, after: Any, elapsed: Any, age: Any, dt: Any, ops: Ops = PY) -> tuple[Any, Any]:
    """The timer after the step: it runs on while the request stays, restarts on a move."""
    stays = ops.and_(ops.eq(after, start), ops.not_(ops.eq(after, int(C.GONE))))
    return ops.ite(stays, elapsed + dt, 0), ops.ite(stays, age + 1, 0)


def timed(stage: Any, limits: Limits, ops: Ops = PY) -> list[tuple[Any, Any]]:
    """(at a stage strict's design times, its limit) pairs: where bounded_wait applies."""
    return [(ops.eq(stage, int(t.stage)), limits[t.limit]) for t in STRICT_TIMERS]


Grid = Sequence[Sequence[Any]]          # [rank][request]


@dataclass(frozen=True)
class ClockState:
    stages: tuple[tuple[int, ...], ...]
    elapsed: tuple[tuple[int, ...], ...]
    age: tuple[tuple[int, ...], ...]


def initial_clock_state(ranks: int, requests: int) -> ClockState:
    zeros = tuple((0,) * requests for _ in range(ranks))
    return ClockState(tuple((int(C.WAITING),) * requests for _ in range(ranks)), zeros, zeros)


def clock_points(v: ClockVariant, stages: Grid, elapsed: Grid, dt: Sequence[Any],
                 env: Mapping[str, Grid], limits: Limits, f: Folds = PYF,
                 seen: list | None = None) -> list[tuple]:
    """One step's points on every rank: (point, before, after, issued, shapes) each, the
    verdicts read from the stage each point sees (spec: PYF; encoding: Z3F); each
    point's inputs are appended to ``seen`` where given."""
    start, out = stages, []
    ranks, reqs = len(stages), len(stages[0]) if stages else 0
    for p in v.iter.points:
        names = [n for n in (p.input, p.gate, p.veto) if n]
        inputs = {n: [[point_input(v, n, stages[k][r], start[k][r], elapsed[k][r], dt[k],
                                   {e: env[e][k][r] for e in CLOCK_INPUTS}, limits, f.ops)
                       for r in range(reqs)] for k in range(ranks)] for n in names}
        after, issued, shapes = apply_point(p, stages, inputs, f)
        out.append((p, stages, after, issued, shapes))
        if seen is not None:
            seen.append(inputs)
        stages = after
    return out


def clock_step(v: ClockVariant, state: ClockState, dt: Sequence[int], env: Mapping[str, Grid],
               limits: Limits) -> tuple[ClockState, IterationResult]:
    steps = clock_points(v, state.stages, state.elapsed, dt, env, limits)
    records: list[list[Record]] = [[] for _ in state.stages]
    results = []
    for p, before, after, issued, shapes in steps:
        for k, did in enumerate(issued):
            if did:
                records[k].append((p.name, p.op.value, shapes[k]))
        results.append(PointResult(p.name, issued, before, after))
    final = steps[-1][2]
    timers = [[advance(state.stages[k][r], final[k][r], state.elapsed[k][r], state.age[k][r], dt[k])
               for r in range(len(final[k]))] for k in range(len(final))]
    nxt = ClockState(tuple(map(tuple, final)), tuple(tuple(e for e, _ in row) for row in timers),
                     tuple(tuple(a for _, a in row) for row in timers))
    return nxt, IterationResult(nxt.stages, tuple(tuple(r) for r in records), tuple(results))


def check_env(v: ClockVariant, dt: object, env: Mapping[str, object], ranks: int, requests: int,
              bound: ClockBound) -> None:
    """Raise ValueError naming the first bad dt or input."""
    if not isinstance(dt, (list, tuple)) or len(dt) != ranks:
        raise ValueError(f"'dt' must list {ranks} ranks")
    bound.check(dt)
    check_grid(env, CLOCK_INPUTS, ranks, requests)


def check_limits(limits: Mapping[str, object]) -> dict[str, int]:
    out = {}
    for name in LIMITS:
        x = limits.get(name) if isinstance(limits, Mapping) else None
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"limit {name!r} must be an integer >= 1 clock unit, got {x!r}")
        out[name] = x
    return out


# -- the invariants ---------------------------------------------------------------------
def bounded_wait(state: ClockState, limits: Limits) -> list[Violation]:
    """Every request leaves each timed stage (WAITING, HELD, QUEUED) within its limit in
    steps (a step lasts at least one clock unit): age < limit wherever it is held."""
    for k, row in enumerate(state.stages):
        for r, s in enumerate(row):
            for at, limit in timed(s, limits):
                if at and state.age[k][r] >= limit:
                    return [Violation("bounded_wait", f"request {r} has been {C(s).name} on rank {k} "
                                      f"for {state.age[k][r]} steps, limit {limit}", (k,), (r,))]
    return []


def clock_violations(v: ClockVariant, state: ClockState, res: IterationResult, limits: Limits) -> list[Violation]:
    """Every invariant this step breaks, in CLOCK_NAMES order."""
    return [*iteration_violations(res, v.iter), *bounded_wait(state, limits)]
