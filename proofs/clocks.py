"""Per-rank clocks' obligations (docs/PROOFS.md, "Per-rank clocks"), rows of ``pdgate prove``.

  safety:point:P / induction:point:P   from every agreed state, any per-rank clock
                    history, any dt >= 1 (any skew), any environment and symbolic limits:
                    P issues alike and leaves the stages agreed (unbounded); where a
                    release breaks it, a CTI from the smallest exact universe.
  safety:clocks_agree   every point in turn, each from any agreed start of step: they
                    compose into the whole step (with the agreed initial state: every
                    step of every run, by induction). Its siblings: the releases'
                    induction:point rows, the same queries.
  liveness:bounded_wait   strict: stages and ages agreed, age <= elapsed and age < limit
                    at every timed stage is inductive (symbolic limits, any skew, a backend
                    that never fails, acks that never come) and holds initially: a request
                    leaves every timed stage within its limit in steps (one step lasts at
                    least one clock unit). induction:bounded_wait: its CTI elsewhere.
  cex:point:P       the smallest run whose first break is at P, exported.
  cex:bounded_wait  the smallest run that waits past the limit (Transferring untimed,
                    #31800, with a backend that never reports failure, #36108), exported.
  nonvacuous:clock-skew   strict: a run where the ranks' clocks disagree about the
                    deadline and the request still leaves on every rank at once, exported.
  refines:clocks    on seeded random states, the unbounded encoding allows exactly the
                    spec's successor (stages, issues, timers).
"""
from __future__ import annotations

import random
from dataclasses import replace
from typing import Callable

import z3

from model.encoding.clocks import (ClockUnrolled, bounded_wait_initial, bounded_wait_inductive,
                                   concrete_run, extend_clocks, preserves_clocked, refines_clocked,
                                   start_clocks, wait_exceeded_at)
from model.encoding.iteration import Query
from model.encoding.solver import Solver
from model.spec.clocks import (CLOCK_INPUTS, CLOCK_VARIANTS, ClockBound, ClockState, ClockVariant, CStage,
                               clock_step, clock_violations, initial_clock_state)
from model.spec.clocktrace import ClockTraceWriter
from proofs.agreement import _first_sat
from proofs.obligations import Obligation, Outcome, Settings

# The searches: 2 ranks, up to 2 requests and 4 steps, every limit 2 units, skew 1 per step.
SEARCH_RANKS, SEARCH_REQS, SEARCH_STEPS = 2, 2, 4
SEARCH_LIMITS = {"wait": 2, "release": 2, "queue": 2}
SEARCH_CLOCK = ClockBound(1, 2)
# Which points break agreement in which release (verified, row by row, by the solver).
CLOCK_BREAKS: dict[str, tuple[str, ...]] = {
    "clocks-0.5.12": ("abort_on_timeout",),
    "clocks-0.5.19": ("deferred_release", "abort_on_timeout"),
    "clocks-0.5.21": ("deferred_release",),
    "clocks-0.5.23": (),                 # agreed: rank 0's abort verdict, the release's MIN
    "clocks-strict": (),
}
UNBOUNDED_WAIT = ("clocks-0.5.12", "clocks-0.5.19", "clocks-0.5.21", "clocks-0.5.23")   # Transferring untimed


def _v(ob: Obligation) -> ClockVariant:
    return CLOCK_VARIANTS[ob.variant]


def _verdict(q: Query, where: str, proved: str) -> Outcome:
    if q.result.status == "unsat":
        return Outcome("proved", proved)
    if q.result.status == "sat":
        return Outcome("not inductive", f"CTI at {where}: {q.shown or '(no model)'}")
    return Outcome(q.result.status, q.result.reason)


def _preserves(ob: Obligation, st: Settings) -> Outcome:
    """One point (``arg``), or every point in turn (``*``: they compose into the whole
    step, each from any agreed stages and any agreed start of step)."""
    v = _v(ob)
    names = [p.name for p in v.iter.points] if ob.arg == "*" else [ob.arg]
    for name in names:
        points = [p for p in v.iter.points if p.name == name]
        q, where = _first_sat(lambda u: preserves_clocked(v, points, st.timeout_ms, u, free_start=True),
                              ob.expected == "proved")
        if q.result.status != "unsat":
            out = _verdict(q, where, "")
            return replace(out, detail=f"{name}: {out.detail}")
    what = f"{len(names)} points, composed: every step" if ob.arg == "*" else ob.arg
    return Outcome("proved", f"{what}: from every agreed state, any clocks and skew, any limits, "
                   "unsat for every T and N")


def _bounded_wait(ob: Obligation, st: Settings) -> Outcome:
    """The timers' conjuncts on every step whose stages agree after it (a CTI there is
    one for bounded_wait), then that agreement itself (the composed per-point queries:
    clocks_agree), and the initial state."""
    v = _v(ob)
    init = bounded_wait_initial(st.timeout_ms)
    if init.result.status != "unsat":
        return Outcome("not inductive" if init.result.status == "sat" else init.result.status,
                       "the initial state breaks bounded_wait")
    # the small universes first even where a proof is expected: cheap when unsat, and a
    # broken design's CTI comes from them long before the unbounded query gives up
    q, where = _first_sat(lambda u: bounded_wait_inductive(v, st.timeout_ms, u, agreed_after=True), False)
    if q.result.status != "unsat":
        return _verdict(q, where, "")
    agreed = _preserves(replace(ob, arg="*"), st)
    if agreed.result != "proved":
        return replace(agreed, detail=f"stages after the step: {agreed.detail}")
    return Outcome("proved", "init + step unsat for symbolic limits, any skew, any backend and acks "
                   "(with the step's agreement, composed per point): a request leaves each timed "
                   "stage within its limit in steps")


def _point_goal(u: ClockUnrolled, i: int, name: str) -> z3.BoolRef:
    """The first break at point ``name`` in step i: stages agree at every point boundary
    before it, and after it they differ or its collective was issued differently."""
    agree = lambda g: z3.And([g[0][r] == g[k][r] for k in range(1, u.ranks) for r in range(u.reqs)])
    before = [agree(b) for steps in u.steps[:i + 1] for _, b, *_ in steps]
    idx = [p.name for p in u.variant.points].index(name)
    p, _, after, issued, shapes = u.steps[i][idx]
    prior = before[:len(before) - len(u.steps[i]) + idx + 1]
    differ = [z3.Or(issued[0] != issued[k], z3.And(issued[0], shapes[0] != shapes[k]))
              for k in range(1, u.ranks)] if p.collective else []
    return z3.And(*prior, z3.Or(z3.Not(agree(after)), *differ))


def _skew_goal(u: ClockUnrolled, i: int) -> z3.BoolRef:
    """At step i's poll the ranks' verdicts differ (skewed clocks), no receiver polled
    Failed, and the request leaves to HELD on every rank."""
    idx = [p.name for p in u.variant.points].index("transfer_poll")
    _, before, after, *_ = u.steps[i][idx]
    expired, poll = u.seen[i][idx]["expired"], u.inputs[i]["poll"]
    return z3.And(*[z3.And(before[k][0] == int(CStage.WAITING), after[k][0] == int(CStage.HELD), poll[k][0] != 0)
                    for k in range(u.ranks)], expired[0][0] != expired[1][0])


def _search(ob: Obligation, st: Settings, goal: Callable[[ClockUnrolled, int], z3.BoolRef],
            wanted: tuple[str, ...], what: str) -> Outcome:
    v = _v(ob)
    for reqs in range(1, SEARCH_REQS + 1):
        u = start_clocks(v, SEARCH_RANKS, reqs, SEARCH_LIMITS, SEARCH_CLOCK)
        for i in range(SEARCH_STEPS):
            extend_clocks(u)            # the goal at step i reads steps 0..i only
            s = Solver(st.timeout_ms)
            s.add(*u.domain, goal(u, i))
            res = s.check()
            if res.status == "sat":
                return _export(ob, st, v, reqs, concrete_run(u, res.model, i + 1), wanted, what)
            if res.status != "unsat":
                return Outcome(res.status, res.reason)
    return Outcome("none found", f"within T={SEARCH_RANKS}, N<={SEARCH_REQS}, {SEARCH_STEPS} steps")


def _export(ob: Obligation, st: Settings, v: ClockVariant, reqs: int, run: list, wanted: tuple[str, ...],
            what: str) -> Outcome:
    """Replay the solver's dt and inputs through the spec and write the trace: the
    violation is the spec's, never the solver's."""
    path = st.traces / f"{ob.variant}.{ob.obligation.replace(':', '-')}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    state: ClockState = initial_clock_state(SEARCH_RANKS, reqs)
    with open(path, "w", encoding="utf-8") as fp:
        w = ClockTraceWriter(fp, v.name, SEARCH_RANKS, reqs, SEARCH_LIMITS, SEARCH_CLOCK, "pdgate prove",
                             note=f"{ob.obligation}: minimal within T={SEARCH_RANKS}, N<={SEARCH_REQS}, "
                                  f"{SEARCH_STEPS} steps, limits {SEARCH_LIMITS}")
        for i, (dt, env) in enumerate(run):
            state, res = clock_step(v, state, dt, env, SEARCH_LIMITS)
            w.step(i, dt, env, state, res)
        found = clock_violations(v, state, res, SEARCH_LIMITS)
        claim = [x for x in found if x.invariant in wanted]
        if ob.expected == "counterexample":
            if not claim:
                return Outcome("replay mismatch", f"the spec's last step breaks none of {', '.join(wanted)}")
            w.violation(claim[0], len(run) - 1)
        elif found:
            return Outcome("replay mismatch", f"the witness breaks {found[0].invariant}")
        w.end(len(run))
    detail = claim[0].detail if ob.expected == "counterexample" else what
    return Outcome(ob.expected, f"T={SEARCH_RANKS} N={reqs}, {len(run)} steps, dt {[d for d, _ in run]}: {detail}",
                   str(path))


def _cex_point(ob: Obligation, st: Settings) -> Outcome:
    return _search(ob, st, lambda u, i: _point_goal(u, i, ob.arg), ("collectives_agree", "stages_agree"), "")


def _cex_wait(ob: Obligation, st: Settings) -> Outcome:
    return _search(ob, st, lambda u, i: wait_exceeded_at(u, i, SEARCH_LIMITS), ("bounded_wait",), "")


def _witness(ob: Obligation, st: Settings) -> Outcome:
    return _search(ob, st, _skew_goal, (), "the ranks' clocks disagree on the deadline; the request "
                   "leaves on every rank at once")


REFINE_SAMPLES, REFINE_SIZES = 1, ((2, 2), (3, 1))   # per size; the CI test runs more


def random_case(v: ClockVariant, rng: random.Random, ranks: int, reqs: int) -> tuple:
    """A state (mostly agreed stages, per-rank clocks), dt, environment and limits."""
    row = [rng.choice(list(CStage)) for _ in range(reqs)]
    stages = tuple(tuple(int(rng.choice(list(CStage))) if rng.random() < 0.3 else int(x) for x in row)
                   for _ in range(ranks))
    elapsed = tuple(tuple(rng.randint(0, 4) for _ in range(reqs)) for _ in range(ranks))
    age = tuple(tuple(min(e, rng.randint(0, 3)) for e in row) for row in elapsed)
    env = {n: [[rng.choice(d) for _ in range(reqs)] for _ in range(ranks)] for n, d in CLOCK_INPUTS.items()}
    dt = [rng.randint(1, 3) for _ in range(ranks)]
    limits = {n: rng.randint(1, 5) for n in ("wait", "release", "queue")}
    return ClockState(stages, elapsed, age), dt, env, limits


def _refines(ob: Obligation, st: Settings) -> Outcome:
    v, rng, n = _v(ob), random.Random(ob.variant), 0
    for ranks, reqs in REFINE_SIZES:
        for _ in range(REFINE_SAMPLES):
            state, dt, env, limits = random_case(v, rng, ranks, reqs)
            nxt, res = clock_step(v, state, dt, env, limits)
            q = refines_clocked(v, state, dt, env, limits, [(pr.after, pr.issued) for pr in res.points],
                                (nxt.elapsed, nxt.age), st.timeout_ms)
            n += 1
            if q.result.status != "unsat":
                return Outcome("refinement mismatch" if q.result.status == "sat" else q.result.status,
                               f"T={ranks} N={reqs} state {state} dt {dt} inputs {env} limits {limits}: "
                               "the encoding allows another successor")
    return Outcome("proved", f"{n} random states: the unbounded encoding allows exactly the spec's stages, "
                   "issues and timers after every point")


def clock_obligations() -> list[Obligation]:
    out: list[Obligation] = []
    for name, v in CLOCK_VARIANTS.items():
        for p in v.iter.points:
            broken = p.name in CLOCK_BREAKS[name]
            out.append(Obligation(f"{'induction' if broken else 'safety'}:point:{p.name}", name,
                                  "not inductive" if broken else "proved", True, _preserves, p.name))
            if broken:
                out.append(Obligation(f"cex:point:{p.name}", name, "counterexample", False, _cex_point, p.name))
        if not CLOCK_BREAKS[name]:      # the releases' siblings: their induction:point rows
            out.append(Obligation("safety:clocks_agree", name, "proved", True, _preserves, "*"))
        if name in UNBOUNDED_WAIT:
            out.append(Obligation("induction:bounded_wait", name, "not inductive", True, _bounded_wait))
            out.append(Obligation("cex:bounded_wait", name, "counterexample", False, _cex_wait))
        else:
            out.append(Obligation("liveness:bounded_wait", name, "proved", True, _bounded_wait))
            out.append(Obligation("nonvacuous:clock-skew", name, "proved", False, _witness))
    # the encoding against the spec (the points' mechanism is shared; the verdicts and timers
    # are what is new): on strict, whose rows the encoding's mutants must flip
    out.append(Obligation("refines:clocks", "clocks-strict", "proved", False, _refines))
    return out
