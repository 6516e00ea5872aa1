"""The decode iteration's obligations (docs/PROOFS.md, "The decode iteration"), rows of
``pdgate prove`` next to the transfer queue's.

  safety:point:P    P preserves agreement: from every state where the ranks agree on
                    every request's stage, with any inputs, every rank issues P alike
                    (same collective, op and requests) and the stages still agree.
                    Unbounded (any T, any N). induction:point:P where a release's P
                    breaks it: the CTI, from the smallest exact universe.
  safety:collectives_agree   the whole iteration preserves agreement (unbounded), and
                    the initial state agrees: by induction, every iteration of every
                    run issues the same collectives on every rank.
  safety:no_local_decision_after_min   from ANY state: after each collective, ranks
                    holding a request at the same stage move it alike (unbounded;
                    induction: with a concrete CTI where a release breaks it).
  cex:INV           the smallest run from the initial state that breaks INV
                    (T=2, N<=2, iterations<=3), replayed by the spec and exported.
  cex:point:P       the smallest run whose first break is at P (agreement held at
                    every point before it), exported: one trace per broken mechanism.
  induction:collectives_agree   the sibling of the safety row: the same query on a
                    broken variant is sat (a concrete CTI).
  refines:iteration   on seeded random states and inputs, the unbounded encoding
                    allows exactly the spec's successor and issues at every point.
  nonvacuous:iteration   strict: a run in which a request is admitted, transferred
                    and runs, with a gate holding on the way, exists and is exported.
"""
from __future__ import annotations

import random
from typing import Callable

import z3

from model.encoding.iteration import (Query, concrete_inputs, decides_agreed, disagree_at, extend,
                                      preserves, refines, unroll)
from model.encoding.solver import Solver
from model.encoding.vocab import Z3OPS
from model.spec.agreement import Point, is_member
from model.spec.iteration import (INPUTS, ITER_VARIANTS, IterVariant, initial_stages,
                                  iteration_violations, run_iteration)
from model.spec.itertrace import IterationTraceWriter
from proofs.obligations import Obligation, Outcome, Settings

MAX_ITER_RANKS, MAX_ITER_REQS, MAX_ITERATIONS = 2, 2, 3
# The exact universes (ranks, requests) a CTI is searched in before the unbounded query.
CTI_UNIVERSES = ((2, 1), (2, 2))
# Which points break agreement in which release (verified, row by row, by the solver).
BREAKS: dict[str, tuple[str, ...]] = {
    "iter-0.5.12": ("admission",),
    "iter-0.5.13": ("prealloc_poll", "admission", "transfer_poll"),
    "iter-0.5.19": ("deferred_release", "prealloc_poll", "admission", "transfer_poll",
                    "defer_release"),
    "iter-0.5.20": ("deferred_release", "admission", "transfer_poll", "defer_release"),
    "iter-0.5.21": ("deferred_release", "admission", "transfer_poll", "defer_release",
                    "kv_checksum", "offload_drain_progress", "offload_drain"),
    "iter-0.5.23": ("admission", "transfer_poll", "offload_drain_progress",
                    "offload_drain"),
    "iter-strict": (),
    "prefill-0.5.12": ("bootstrap_poll",),
    "prefill-0.5.13": ("bootstrap_poll",),
    "prefill-0.5.18": ("bootstrap_poll",),
    "prefill-strict": (),
}
# the transfer queue's continues; prefill's metadata-buffer check in pop_bootstrapped
# (a continue from 0.5.13, 0.5.12's break: a halt)
LOCAL_AFTER_MIN = ("iter-0.5.13", "iter-0.5.19", "iter-0.5.20", "iter-0.5.21", "iter-0.5.23", "prefill-0.5.12",
                   "prefill-0.5.13", "prefill-0.5.18")


def _point(v: IterVariant, name: str) -> Point:
    return next(p for p in v.points if p.name == name)


def _first_sat(make: Callable[[tuple[int, ...] | None], Query], proof_first: bool,
               universes: tuple[tuple[int, ...], ...] = CTI_UNIVERSES,
               names: tuple[str, ...] = ("T", "N")) -> tuple[Query, str]:
    """The unbounded answer if it is unsat (a proof), else the first sat answer in the
    exact small ``universes`` (a concrete CTI; each size labelled by ``names``), else the
    unbounded answer. ``proof_first`` only orders the queries (the unbounded one first
    where a proof is expected, since a sat answer comes fastest from a small universe);
    the verdict is the same."""
    unbounded = make(None) if proof_first else None
    if unbounded is not None and unbounded.result.status == "unknown":
        # quantified queries: z3's search order follows the term ids the process has made
        # so far, so the same query, rebuilt, can finish where it timed out (seen in the
        # suite, never alone); only an unsat or a model counts, as before
        unbounded = make(None)
    if unbounded is not None and unbounded.result.status == "unsat":
        return unbounded, "unbounded"
    for u in universes:
        q = make(u)
        if q.result.status == "sat":
            return q, " ".join(f"{n}={x}" for n, x in zip(names, u))
    return unbounded or make(None), "unbounded"


def _describe(q: Query) -> str:
    return q.shown or "(no model)"


def _preserves(ob: Obligation, st: Settings) -> Outcome:
    v = ITER_VARIANTS[ob.variant]
    if ob.arg == "*":
        return _composed(ob, st, v)
    q, where = _first_sat(lambda u: preserves(v, [_point(v, ob.arg)], st.timeout_ms, u), ob.expected == "proved")
    status = q.result.status
    if status == "unsat":
        return Outcome("proved", f"{ob.arg}: from every agreed state, any inputs, unsat for every T and N")
    if status == "sat":
        return Outcome("not inductive", f"CTI at {where}: {_describe(q)}")
    return Outcome(status, q.result.reason)


def _composed(ob: Obligation, st: Settings, v: IterVariant) -> Outcome:
    """The whole iteration, point by point: each maps every agreed state (a stage per
    request) to an agreed one, issuing alike, so their sequence does. One query per
    point instead of one for the iteration: the monolithic query of eleven points timed
    out under load, and the composition is exact (the agreed states are the invariant)."""
    for p in v.points:
        q, where = _first_sat(lambda u, p=p: preserves(v, [p], st.timeout_ms, u), ob.expected == "proved")
        if q.result.status == "sat":
            return Outcome("not inductive", f"CTI at {where}, at {p.name}: {_describe(q)}")
        if q.result.status != "unsat":
            return Outcome(q.result.status, f"{p.name}: {q.result.reason}")
    return Outcome("proved", f"every point ({len(v.points)}), composed: from every agreed state, any inputs, "
                   "unsat for every T and N (initial state agreed: by induction, every iteration)")


def _local_decisions(ob: Obligation, st: Settings) -> Outcome:
    v = ITER_VARIANTS[ob.variant]
    collectives = [p for p in v.points if p.collective]
    for p in collectives:
        q, where = _first_sat(lambda u, p=p: decides_agreed(v, p, st.timeout_ms, u),
                              ob.expected == "proved")
        if q.result.status == "sat":
            return Outcome("not inductive", f"CTI at {where}, after {p.name}: {_describe(q)}")
        if q.result.status != "unsat":
            return Outcome(q.result.status, f"{p.name}: {q.result.reason}")
    return Outcome("proved", f"{len(collectives)} collectives: from any state, equal stage and reduced "
                   "value give equal moves, unsat for every T and N")


def _goal(u, i: int, ob: Obligation) -> z3.BoolRef:
    if not ob.arg.startswith("point:"):
        return disagree_at(u, i, ob.arg)
    # the first break at point P: stages agree at every point boundary before it
    name = ob.arg.split(":", 1)[1]
    agree = lambda stages: z3.And([stages[0][r] == stages[k][r] for k in range(1, u.ranks)
                                   for r in range(u.reqs)])
    before = [agree(b) for steps in u.steps[:i + 1] for p, b, *_ in steps]
    idx = [p.name for p in u.variant.points].index(name)
    p, b, after, issued, shapes = u.steps[i][idx]
    prior = before[:len(before) - len(u.steps[i]) + idx + 1]
    breaks = z3.Or(z3.Not(agree(after)), *[z3.Or(issued[0] != issued[k], z3.And(issued[0], shapes[0] != shapes[k]))
                                            for k in range(1, u.ranks)] if p.collective else [])
    return z3.And(*prior, breaks)


def _witness_goal(u, i: int, ob: Obligation) -> z3.BoolRef:
    """strict: request 0 reaches the forward on every rank at iteration i, and on the way a gate held
    it: at a gated point every rank polled a value that moves it, one rank's gate flag
    was set, and it stayed where it was on every rank."""
    runs = z3.And([u.steps[i][-1][1][k][0] == int(u.variant.runs) for k in range(u.ranks)])
    held = []
    for j in range(i + 1):
        for p, before, after, *_ in u.steps[j]:
            if p.gate is None:
                continue
            local, flag = u.inputs[j][p.input], u.inputs[j][p.gate]
            top, target = max(p.moves)
            held.append(z3.And(*[z3.And(is_member(p, before[k][0], Z3OPS), before[k][0] != int(target),
                                        local[k][0] == top, after[k][0] == before[k][0])
                                 for k in range(u.ranks)],
                               z3.Or([flag[k][0] == 1 for k in range(u.ranks)])))
    return z3.And(runs, z3.Or(held))


def _search(ob: Obligation, st: Settings, goal: Callable) -> Outcome:
    v = ITER_VARIANTS[ob.variant]
    for reqs in range(1, MAX_ITER_REQS + 1):
        u = unroll(v, MAX_ITER_RANKS, reqs, 0)
        for i in range(MAX_ITERATIONS):
            extend(u)
            s = Solver(st.timeout_ms)
            s.add(*u.domain, goal(u, i, ob))
            res = s.check()
            if res.status == "sat":
                inputs = concrete_inputs(u, res.model)[:i + 1]
                return _export(ob, st, v, reqs, inputs)
            if res.status != "unsat":
                return Outcome(res.status, res.reason)
    return Outcome("none found", f"within T={MAX_ITER_RANKS}, N<={MAX_ITER_REQS}, {MAX_ITERATIONS} iterations")


def _export(ob: Obligation, st: Settings, v: IterVariant, reqs: int, inputs: list) -> Outcome:
    """Replay the solver's inputs through the spec and write the trace: the records and
    the violation are the spec's, never the solver's."""
    path = st.traces / f"{ob.variant}.{ob.obligation.replace(':', '-')}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    stages = initial_stages(MAX_ITER_RANKS, reqs)
    with open(path, "w", encoding="utf-8") as fp:
        w = IterationTraceWriter(fp, v.name, MAX_ITER_RANKS, reqs, "pdgate prove",
                                 note=f"{ob.obligation}: minimal within T={MAX_ITER_RANKS}, "
                                      f"N<={MAX_ITER_REQS}, {MAX_ITERATIONS} iterations")
        for i, inp in enumerate(inputs):
            res = run_iteration(v, stages, inp)
            w.iteration(i, inp, res)
            stages = res.stages
        found = iteration_violations(res, v)
        # a point breaks agreement in its collective or in the stages it leaves
        wanted = ("collectives_agree", "stages_agree") if ob.arg.startswith("point:") else (ob.arg,)
        claim = [x for x in found if x.invariant in wanted]
        if ob.expected == "counterexample":
            if not claim:
                return Outcome("replay mismatch", f"the spec's last iteration breaks none of {', '.join(wanted)}")
            w.violation(claim[0], len(inputs) - 1)
        elif found:
            return Outcome("replay mismatch", f"the witness breaks {found[0].invariant}")
        w.end(len(inputs))
    result = ob.expected
    detail = claim[0].detail if ob.expected == "counterexample" else "a request runs on every rank; a gate held it once"
    return Outcome(result, f"T={MAX_ITER_RANKS} N={reqs}, {len(inputs)} iterations: {detail}", str(path))


def _counterexample(ob: Obligation, st: Settings) -> Outcome:
    return _search(ob, st, _goal)


def _witness(ob: Obligation, st: Settings) -> Outcome:
    return _search(ob, st, _witness_goal)


REFINE_SAMPLES, REFINE_SIZES = 2, ((2, 2), (3, 1))   # per size; the CI test runs more


def halting_sample(v: IterVariant, p: Point) -> tuple[IterVariant, list[list[int]], dict[str, list[list[int]]]]:
    """Point p alone on 2 ranks holding 2 requests at its first member stage, where
    request 0 halts rank 0's walk (its value is p's halt there, and on every rank where
    a veto decides) and request 1 would move everywhere: the walk's stop is exercised
    (random states rarely reach it)."""
    assert p.halt is not None
    mover = max(value for value, _ in p.moves if value != p.halt)
    stages = [[int(p.members[0])] * 2 for _ in range(2)]
    first = lambda k: p.halt if k == 0 or p.veto is not None else mover
    inputs = {name: [[0, 0] for _ in range(2)] for name in {p.input, p.gate, p.veto} - {None}}
    inputs[p.input] = [[first(k), mover] for k in range(2)]
    if p.veto is not None:
        inputs[p.veto] = [[1, 0], [0, 0]]
    return IterVariant(v.name, v.releases, (p,), v.stages, v.runs), stages, inputs


def _refine_one(v: IterVariant, stages: list, inputs: dict, st: Settings) -> Query:
    res = run_iteration(v, tuple(map(tuple, stages)), inputs)
    return refines(v, stages, inputs, [(pr.after, pr.issued) for pr in res.points], st.timeout_ms)


def _refines(ob: Obligation, st: Settings) -> Outcome:
    """On random states and inputs (seeded), the unbounded encoding read over exactly
    those ranks and requests allows only the spec's successor at every point; and at
    each halting point, on a state where its walk stops."""
    v = ITER_VARIANTS[ob.variant]
    rng = random.Random(ob.variant)
    samples = []
    for ranks, reqs in REFINE_SIZES:
        for _ in range(REFINE_SAMPLES):
            # mostly agreed states (the reachable ones), some split ones
            row = [rng.choice(list(v.stages)) for _ in range(reqs)]
            stages = [[int(rng.choice(list(v.stages))) if rng.random() < 0.3 else int(x) for x in row]
                      for _ in range(ranks)]
            inputs = {name: [[rng.choice(INPUTS[name]) for _ in range(reqs)] for _ in range(ranks)]
                      for name in v.inputs()}
            samples.append((v, stages, inputs))
    halting = [halting_sample(v, p) for p in v.points if p.halt is not None]
    for sv, stages, inputs in samples + halting:
        q = _refine_one(sv, stages, inputs, st)
        if q.result.status != "unsat":
            return Outcome("refinement mismatch" if q.result.status == "sat" else q.result.status,
                           f"T={len(stages)} N={len(stages[0])} stages {stages} inputs {inputs}: the encoding "
                           f"allows another successor ({_describe(q)})")
    more = f", and {len(halting)} where a walk halts" if halting else ""
    return Outcome("proved", f"{len(samples)} random states and inputs{more}: the unbounded encoding allows "
                   "exactly the spec's stages and issues after every point")


def iteration_obligations() -> list[Obligation]:
    out: list[Obligation] = []
    for name, v in ITER_VARIANTS.items():
        for p in v.points:
            broken = p.name in BREAKS[name]
            out.append(Obligation(f"{'induction' if broken else 'safety'}:point:{p.name}", name,
                                  "not inductive" if broken else "proved", True, _preserves, p.name))
            if broken:
                out.append(Obligation(f"cex:point:{p.name}", name, "counterexample", False,
                                      _counterexample, f"point:{p.name}"))
        if BREAKS[name]:
            out.append(Obligation("cex:collectives_agree", name, "counterexample", False, _counterexample,
                                  "collectives_agree"))
            out.append(Obligation("induction:collectives_agree", name, "not inductive", True, _preserves, "*"))
        else:
            out.append(Obligation("safety:collectives_agree", name, "proved", True, _preserves, "*"))
            out.append(Obligation("nonvacuous:iteration", name, "proved", False, _witness, "run"))
        local = name in LOCAL_AFTER_MIN
        out.append(Obligation(f"{'induction' if local else 'safety'}:no_local_decision_after_min", name,
                              "not inductive" if local else "proved", True, _local_decisions))
        if local:
            out.append(Obligation("cex:no_local_decision_after_min", name, "counterexample", False,
                                  _counterexample, "no_local_decision_after_min"))
        out.append(Obligation("refines:iteration", name, "proved", False, _refines))
    return out
