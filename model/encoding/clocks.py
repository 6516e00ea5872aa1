"""The Z3 encoding of per-rank clocks (model/spec/clocks.py), built from the spec's own
functions (``verdict``/``point_input``, ``advance``, the points' ``apply_point``):

* unbounded: model/encoding/iteration.py's ``Unbounded`` (Rank and Req uninterpreted,
  the MIN/MAX by their axioms), the clocks as functions: ``elapsed(k, r)`` any integer
  history (any skew so far), ``dt(k) >= 1`` with no upper bound (any skew this step), the
  limits symbolic constants >= 1 (every configured timeout);
* finite: ``clock_points`` itself on Z3 constants with Z3's folds, unrolled from the
  initial state, each dt within a ``ClockBound``, for the minimal counterexamples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import z3

from model.encoding.iteration import (Query, Unbounded, Unrolled, Z3F, _show, record_differs)
from model.encoding.solver import Solver
from model.encoding.vocab import Z3OPS, memo
from model.spec.agreement import Point
from model.spec.clocks import (CLOCK_INPUTS, LIMITS, CStage, ClockBound, ClockVariant, advance,
                               clock_points, initial_clock_state, point_input, timed)

O = Z3OPS


def symbolic_limits(tag: str = "") -> tuple[dict[str, z3.ArithRef], list[z3.BoolRef]]:
    limits = {n: z3.Int(f"limit_{n}{tag}") for n in LIMITS}
    return limits, [x >= 1 for x in limits.values()]


class ClockUnbounded(Unbounded):
    """Unbounded, plus the environment's functions and one clocked step."""

    def env(self, tag: str) -> dict[str, Callable]:
        out = {}
        for name, domain in CLOCK_INPUTS.items():
            f = z3.Function(f"{name}{tag}", self.rank, self.req, z3.IntSort())
            self.axioms.append(self.forall(lambda k, r, f=f, d=domain: z3.Or([f(k, r) == x for x in d])))
            out[name] = f
        return out

    def clocked(self, v: ClockVariant, st: Callable, elapsed: Callable, dt: Callable, env: dict,
                limits: dict, points: Sequence[Point] | None = None,
                start: Callable | None = None) -> list[tuple[Point, Callable, Callable, Callable]]:
        """(point, before, after, issued) for each point from stages ``st``, each point's
        verdicts read from the stage it sees and the step's start (``start``, default ``st``)."""
        out, cur, st = [], st, start or st
        for p in points if points is not None else v.iter.points:
            names = [n for n in (p.input, p.gate, p.veto) if n]
            inp = {n: memo(lambda k, r, n=n, cur=cur: point_input(
                v, n, cur(k, r), st(k, r), elapsed(k, r), dt(k), {e: env[e](k, r) for e in env}, limits, O))
                for n in names}
            after, issued = self.point(p, cur, inp)
            out.append((p, cur, after, issued))
            cur = after
        return out


def _clock_fns(u: ClockUnbounded, tag: str = "0") -> tuple[Callable, Callable]:
    elapsed = z3.Function(f"elapsed{tag}", u.rank, u.req, z3.IntSort())
    dt = z3.Function(f"dt{tag}", u.rank, z3.IntSort())
    k = z3.Const(f"kdt{tag}", u.rank)
    u.axioms += [z3.ForAll([k], dt(k) >= 1), u.forall(lambda k, r: elapsed(k, r) >= 0)]
    return elapsed, dt


def preserves_clocked(v: ClockVariant, points: Sequence[Point] | None = None, timeout_ms: int = 20_000,
                      universe: tuple[int, int] | None = None, free_start: bool = False) -> Query:
    """From every state where the ranks agree on every request's stage, whatever each
    rank's clock says (any elapsed time, any dt >= 1: any skew) and any environment and
    limits: do the points issue alike and leave the stages agreeing? unsat = yes, for
    every T, N, skew and timeout. ``free_start``: the step's start stages are agreed but
    any (the points' verdicts then hold wherever in a step they run: one query per point
    composes into the whole step)."""
    u = ClockUnbounded(universe)
    agreed = z3.Function("stage0", u.req, z3.IntSort())
    st = lambda k, r: agreed(r)
    start0 = z3.Function("start0", u.req, z3.IntSort())
    start = (lambda k, r: start0(r)) if free_start else None
    elapsed, dt = _clock_fns(u)
    env = u.env("0")
    limits, lim_ax = symbolic_limits()
    k1, k2, r = z3.Const("k1", u.rank), z3.Const("k2", u.rank), z3.Const("r", u.req)
    steps = u.clocked(v, st, elapsed, dt, env, limits, points, start)
    last = steps[-1][2]
    bad = z3.Or([record_differs(p, b, i, k1, k2, r) for p, b, _, i in steps] + [last(k1, r) != last(k2, r)])
    s = Solver(timeout_ms)
    s.add(*u.axioms, *lim_ax, bad)
    res = s.check()
    return Query(f"preserves[{'+'.join(p.name for p, *_ in steps)}]", res, _shown(u, res.model, st, env, elapsed, dt))


def _shown(u: ClockUnbounded, model: Any, st: Callable, env: dict, elapsed: Callable, dt: Callable,
           **more: Callable) -> str:
    """A CTI's state, clocks and environment as [rank][request] lists (exact universes)."""
    return _show(u, model, st, {**env, "elapsed": elapsed, "dt": lambda k, r: dt(k), **more})


def _wait_inv(stage: Any, age: Any, elapsed: Any, limits: dict) -> z3.BoolRef:
    """bounded_wait with its clock lemma: 0 <= age <= elapsed (every step lasts a unit),
    and age < limit at every timed stage."""
    return z3.And(0 <= age, age <= elapsed,
                  *[z3.Implies(at, age < limit) for at, limit in timed(stage, limits, O)])


def bounded_wait_inductive(v: ClockVariant, timeout_ms: int = 20_000,
                           universe: tuple[int, int] | None = None, agreed_after: bool = False) -> Query:
    """With the stages and ages agreed, age <= elapsed and age < limit at every timed
    stage on every rank: does one step keep all of it, for any skew, any environment (a
    backend that never fails, acks that never come) and symbolic limits? unsat: a
    request leaves every timed stage within its limit in steps, for every T, N. Asked
    one conjunct at a time, each in its own frame (smaller queries: the quantified search
    is steadier); the first that is not unsat is the answer. ``agreed_after``: the stages
    after the step agree, assumed (the caller proved it: the composed per-point queries,
    far steadier than the whole step at once) and not asked."""
    u = ClockUnbounded(universe)
    stage0, age0 = z3.Function("stage0", u.req, z3.IntSort()), z3.Function("age0", u.req, z3.IntSort())
    st = lambda k, r: stage0(r)
    elapsed, dt = _clock_fns(u)
    env = u.env("0")
    limits, lim_ax = symbolic_limits()
    u.axioms.append(u.forall(lambda k, r: _wait_inv(stage0(r), age0(r), elapsed(k, r), limits)))
    last = u.clocked(v, st, elapsed, dt, env, limits)[-1][2]
    nxt = memo(lambda k, r: advance(stage0(r), last(k, r), elapsed(k, r), age0(r), dt(k), O))
    k1, k2, r = z3.Const("k1", u.rank), z3.Const("k2", u.rank), z3.Const("r", u.req)
    e1, a1 = nxt(k1, r)
    parts = [a1 != nxt(k2, r)[1], z3.Not(z3.And(0 <= a1, a1 <= e1)),
             *[z3.And(at, a1 >= limit) for at, limit in timed(last(k1, r), limits, O)]]
    if agreed_after:
        post0 = z3.Function("post0", u.req, z3.IntSort())
        u.axioms.append(u.forall(lambda k, r: last(k, r) == post0(r)))
    else:
        parts.insert(0, last(k1, r) != last(k2, r))
    # the invariant and dt >= 1 at the ranks the argument needs (k1, k2, each MIN/MAX's
    # witness): ground instances of axioms above, so the search need not find them
    ranks = [k1, k2, *[w(r) for w in u.witnesses]]
    hints = [z3.And(_wait_inv(stage0(r), age0(r), elapsed(k, r), limits), dt(k) >= 1,
                    *[z3.Implies(trig(k, r), some(k)) for some, trig in u.triggers]) for k in ranks]
    s = Solver(timeout_ms)
    s.add(*u.axioms, *lim_ax, *hints)
    for bad in parts:
        for stage in CStage:             # one case per stage of the request at the start
            with s.frame():
                s.add(stage0(r) == int(stage), bad)
                res = s.check()
            if res.status != "unsat":
                return Query("bounded_wait", res, _shown(u, res.model, st, env, elapsed, dt,
                                                         age=lambda k, r: age0(r)))
    return Query("bounded_wait", res)


def bounded_wait_initial(timeout_ms: int = 20_000) -> Query:
    """The initial state (model/spec/clocks.py's) satisfies bounded_wait for every limit >= 1."""
    limits, lim_ax = symbolic_limits()
    init = initial_clock_state(1, 1)
    s = Solver(timeout_ms)
    s.add(*lim_ax, z3.Not(_wait_inv(z3.IntVal(init.stages[0][0]), z3.IntVal(init.age[0][0]),
                                    z3.IntVal(init.elapsed[0][0]), limits)))
    return Query("bounded_wait[init]", s.check())


def refines_clocked(v: ClockVariant, state: Any, dt: Sequence[int], env: dict, limits: dict,
                    want: Sequence[tuple[Any, Sequence[bool]]], want_timers: Any, timeout_ms: int = 20_000) -> Query:
    """The unbounded encoding over exactly these ranks and requests, this state, dt,
    environment and limits allows nothing but ``want`` (per point the spec's stages and
    issues) and the spec's timers? unsat = it agrees with the spec here."""
    ranks, reqs = len(state.stages), len(state.stages[0])
    u = ClockUnbounded((ranks, reqs))
    st = u.stage_fn("0")
    elapsed, dtf = _clock_fns(u)
    envf = u.env("0")
    ks, rs = u.ranks, u.reqs
    fixed = [st(ks[k], rs[r]) == state.stages[k][r] for k in range(ranks) for r in range(reqs)]
    fixed += [elapsed(ks[k], rs[r]) == state.elapsed[k][r] for k in range(ranks) for r in range(reqs)]
    fixed += [dtf(ks[k]) == dt[k] for k in range(ranks)]
    fixed += [f(ks[k], rs[r]) == env[n][k][r] for n, f in envf.items() for k in range(ranks) for r in range(reqs)]
    lim = {n: z3.IntVal(x) for n, x in limits.items()}
    differs = []
    steps = u.clocked(v, st, elapsed, dtf, envf, lim)
    for (p, _, after, issued), (stages_after, issued_want) in zip(steps, want):
        differs += [after(ks[k], rs[r]) != stages_after[k][r] for k in range(ranks) for r in range(reqs)]
        differs += [issued(ks[k]) != z3.BoolVal(bool(issued_want[k])) for k in range(ranks)]
    last = steps[-1][2]
    for k in range(ranks):
        for r in range(reqs):
            e, a = advance(st(ks[k], rs[r]), last(ks[k], rs[r]), elapsed(ks[k], rs[r]),
                           z3.IntVal(state.age[k][r]), dtf(ks[k]), O)
            differs += [e != want_timers[0][k][r], a != want_timers[1][k][r]]
    s = Solver(timeout_ms)
    s.add(*u.axioms, *fixed, z3.Or(differs))
    return Query("refines", s.check())


# -- bounded: the spec's clock_points on Z3 constants ----------------------------------
@dataclass
class ClockUnrolled(Unrolled):
    dts: list[list[z3.ArithRef]] = None                  # per step, per rank
    states: list[tuple[Any, Any, Any]] = None            # after each step: stages, elapsed, age
    seen: list[list[dict]] = None                        # per step, per point: its inputs


def start_clocks(v: ClockVariant, ranks: int, reqs: int, limits: dict, bound: ClockBound) -> ClockUnrolled:
    """An unrolling of no steps from the initial state; ``extend_clocks`` adds one."""
    init = initial_clock_state(ranks, reqs)
    as_terms = lambda g: [[z3.IntVal(x) for x in row] for row in g]
    u = ClockUnrolled(v.iter, ranks, reqs, [], [], [], [], [], [])
    u.clock, u.limits, u.bound = v, limits, bound
    u.initial = (as_terms(init.stages), as_terms(init.elapsed), as_terms(init.age))
    return u


def extend_clocks(u: ClockUnrolled) -> ClockUnrolled:
    i, ranks, reqs = len(u.steps), u.ranks, u.reqs
    stages, elapsed, age = u.states[-1] if u.states else u.initial
    env = {n: [[z3.Int(f"{n}@{i}.{k}.{r}") for r in range(reqs)] for k in range(ranks)] for n in CLOCK_INPUTS}
    dt = [z3.Int(f"dt@{i}.{k}") for k in range(ranks)]
    u.domain += [z3.Or([x == d for d in CLOCK_INPUTS[n]]) for n, rows in env.items() for row in rows for x in row]
    u.domain += [z3.And(d >= u.bound.lo, d <= u.bound.hi) for d in dt]
    u.seen.append([])
    pts = clock_points(u.clock, stages, elapsed, dt, env, u.limits, Z3F, u.seen[-1])
    final = pts[-1][2]
    timers = [[advance(stages[k][r], final[k][r], elapsed[k][r], age[k][r], dt[k], O)
               for r in range(reqs)] for k in range(ranks)]
    u.inputs.append(env), u.steps.append(pts), u.dts.append(dt)
    u.states.append(([list(row) for row in final], [[e for e, _ in row] for row in timers],
                     [[a for _, a in row] for row in timers]))
    return u


def unroll_clocks(v: ClockVariant, ranks: int, reqs: int, depth: int, limits: dict,
                  bound: ClockBound) -> ClockUnrolled:
    u = start_clocks(v, ranks, reqs, limits, bound)
    for _ in range(depth):
        extend_clocks(u)
    return u


def wait_exceeded_at(u: ClockUnrolled, i: int, limits: dict) -> z3.BoolRef:
    stages, _, age = u.states[i]
    return z3.Or([z3.And(at, age[k][r] >= limit) for k in range(u.ranks) for r in range(u.reqs)
                  for at, limit in timed(stages[k][r], limits, O)])


def concrete_run(u: ClockUnrolled, model: z3.ModelRef, steps: int) -> list[tuple[list[int], dict]]:
    val = lambda x: model.eval(x, model_completion=True).as_long()
    return [([val(d) for d in u.dts[i]], {n: [[val(x) for x in row] for row in rows] for n, rows in u.inputs[i].items()})
            for i in range(steps)]


