"""Pipeline parallel's obligations (docs/PROOFS.md, "Pipeline parallel"), rows of
``pdgate prove`` for the ``pp-*`` variants (model/spec/pipeline.py).

  safety:pp_agree   from every state where every (stage, rank) has every request at
                    the same (boundary) stage, with any inputs, every stage's TP group
                    issues alike and all (stage, rank) still agree: unbounded (any number
                    of stages, ranks per stage and requests), so by induction from the
                    initial state. induction:pp_agree where a release breaks it: the CTI
                    from the smallest exact universe.
  safety:point:P / induction:point:P   the same for one point of a release alone, from
                    an agreed state at any stage: where each release breaks.
  safety:pp_agree_R / induction:pp_agree_R   pp_agree with restricted inputs
                    (RESTRICTIONS: no poll Failed; and every metadata row landed; no
                    metadata buffer short): which fact each release's break needs.
  cex:INV           the smallest run from the initial state breaking INV (2 stages,
                    ranks <= 2, requests <= 2, iterations <= 2), replayed and exported.
  cex:gated_min, cex:commit_veto, cex:own_poll   the smallest such run under a
                    restriction that is not inductive (CEX_UNDER).
  cex:empty_min     0.5.12 to 0.5.22: a rank whose queue emptied MINs a shape-0 list
                    while a peer of its stage MINs its request (a gloo mismatch).
  cex:positions_shifted   0.5.23 prefill: the smallest run in which every stage's send
                    is received, no metadata buffer is short, and yet a later stage moves
                    a request otherwise than stage 0 (it got another request's value).
  nonvacuous:pipeline   strict: a request reaches its stage on every (stage, rank) after
                    the gate held it once; exported.
  refines:pipeline  the initial state with every poll its last value, and seeded random
                    states and inputs: the unbounded encoding, read over
                    exactly those stages, ranks and requests, allows only the spec's
                    successor and issues at every point.
"""
from __future__ import annotations

import random
from typing import Callable

import z3

from model.encoding.iteration import Query, refines
from model.encoding.pipeline import (PipelineUnbounded, broken_at, concrete_pp_inputs, preserves_pp,
                                     unroll_pp)
from model.encoding.solver import Solver
from model.encoding.vocab import Z3OPS
from model.spec.agreement import Across, Point, is_member
from model.spec.iteration import INPUTS
from model.spec.itertrace import IterationTraceWriter
from model.spec.pipeline import PP_VARIANTS, PPVariant, initial_pp_stages, pipeline_violations, run_pipeline
from proofs.obligations import Obligation, Outcome, Settings
from proofs.agreement import _first_sat as first_sat

PP, MAX_PP_RANKS, MAX_PP_REQS, MAX_PP_ITERATIONS = 2, 2, 2, 2
CTI_UNIVERSES = ((2, 1, 1), (2, 2, 1))      # (stages, ranks per stage, requests)
# What each released variant breaks (verified row by row by the solver).
BREAKS: dict[str, tuple[str, ...]] = {
    "pp-0.5.12": ("collectives_agree", "stages_agree"),
    "pp-0.5.13": ("stages_agree",),
    "pp-0.5.23": ("stages_agree",),
    "pp-strict": (),
    "pp-prefill-0.5.12": ("collectives_agree", "stages_agree"),
    "pp-prefill-0.5.13": ("collectives_agree", "stages_agree"),
    "pp-prefill-0.5.18": ("collectives_agree", "stages_agree"),
    "pp-prefill-0.5.23": ("positions_agree", "stages_agree"),
    "pp-prefill-strict": (),
}
# The points that break agreement alone, from any agreed state (the others are proved).
POINT_BREAKS: dict[str, tuple[str, ...]] = {
    "pp-0.5.12": ("transfer_poll",), "pp-0.5.13": ("transfer_poll",), "pp-0.5.23": ("transfer_poll",),
    "pp-prefill-0.5.12": ("bootstrap_poll",), "pp-prefill-0.5.13": ("bootstrap_poll",), "pp-prefill-0.5.18": ("bootstrap_uncovered", "bootstrap_pop"),
}
# pp_agree under a restriction of the inputs: (input, value it never takes), and per
# variant whether it is proved; where not, the named counterexample under it.
RESTRICTIONS: dict[str, tuple[tuple[str, int], ...]] = {
    "no_failure": (("transfer", 0),), "landed": (("transfer", 0), ("unlanded", 1)),
    "buffers": (("no_buffer", 1),)}
RESTRICTED: dict[str, tuple[tuple[str, bool, str], ...]] = {
    "pp-0.5.12": (("no_failure", False, "commit_veto"), ("landed", True, "")),
    "pp-0.5.13": (("no_failure", False, "gated_min"), ("landed", True, "")),
    "pp-0.5.23": (("no_failure", False, "gated_min"), ("landed", True, "")),
    "pp-prefill-0.5.12": (("buffers", False, "own_poll"),),
    "pp-prefill-0.5.13": (("buffers", False, "own_poll"),),
    "pp-prefill-0.5.18": (("buffers", True, ""),),
}
# the releases whose empty queue still MINs (a shape-0 list) and whose TP ranks' queues part
EMPTY_MIN = ("pp-0.5.12", "pp-prefill-0.5.12", "pp-prefill-0.5.13", "pp-prefill-0.5.18")
CEX_UNDER = {cex: name for rows in RESTRICTED.values() for name, _, cex in rows if cex}
REFINE_SAMPLES, REFINE_SIZES = 2, ((1, 2), (2, 1))   # (ranks per stage, requests), 2 stages


def _unbounded(v: PPVariant) -> bool:
    return all(p.across is not Across.PP0 for p in v.points)


def _first_sat(make: Callable[[tuple[int, ...] | None], Query]) -> tuple[Query, str]:
    """proofs/agreement.py's, over the pipeline's universes (stages, ranks, requests),
    the small universes asked first."""
    return first_sat(make, False, CTI_UNIVERSES, ("stages", "T", "N"))


def _preserves(ob: Obligation, st: Settings) -> Outcome:
    v = PP_VARIANTS[ob.variant]
    point = next((p for p in v.points if p.name == ob.arg), None)
    excluded = RESTRICTIONS.get(ob.arg or "", ())
    # the small universes first, whatever is expected: they are unsat in hundredths of a
    # second where a proof follows, and a sat answer from them is a CTI at once, where the
    # unbounded query of a broken design (a mutant's) runs to its timeout
    q, where = _first_sat(lambda u: preserves_pp(v, st.timeout_ms, u, excluded, point))
    if q.result.status == "unsat":
        scope = (f"{point.name} alone, from every agreed state" if point is not None else
                 "from every agreed state, any inputs" + "".join(f", {x} never {n}" for x, n in excluded))
        return Outcome("proved", scope + ": unsat for any number of stages, ranks and requests"
                       + ("" if point is not None else " (initial state agreed: by induction, every iteration)"))
    if q.result.status == "sat":
        return Outcome("not inductive", f"CTI at {where}: {q.shown or '(no model)'}")
    return Outcome(q.result.status, q.result.reason)


def _ring(u) -> Point:
    return next(p for p in u.variant.points if p.across is Across.RING)


def _cex_goal(u, i: int, ob: Obligation) -> z3.BoolRef:
    if ob.arg in CEX_UNDER:            # the restriction holds in every iteration up to i
        calm = [x != value for name, value in RESTRICTIONS[CEX_UNDER[ob.arg]]
                for inp in u.inputs[:i + 1] for row in inp[name] for x in row]
        return z3.And(*calm, broken_at(u, i, "stages_agree"))
    if ob.arg == "empty_min":          # a rank MINs an empty list while a peer of its stage MINs more
        ring = _ring(u)
        _, before, _, issued, shapes = next(x for x in u.steps[i] if x[0] is ring)
        t = u.ranks
        return z3.Or([z3.And(issued[k], issued[j], shapes[k] == 0, shapes[j] > 0)
                      for k in range(u.pp * t) for j in range(u.pp * t) if k != j and k // t == j // t]
                     or [z3.BoolVal(False)])
    if ob.arg == "shifted":            # every send received, no buffer short, yet a request both hold
        met, lands = [], []            # moves on stage 1 otherwise than on stage 0 (another's value)
        for p, before, after, issued, _ in u.steps[i]:
            if p.across is not Across.PP0:
                continue
            t = u.ranks
            for k in range(t, u.pp * t):
                met.append(issued[k] == issued[k - t])
                lands += [z3.And(is_member(p, before[k][r], Z3OPS), before[k][r] == before[k % t][r],
                                 after[k][r] != after[k % t][r]) for r in range(u.reqs)]
        calm = [x == 0 for row in u.inputs[i]["no_buffer"] for x in row]
        return z3.And(*met, *calm, z3.Or(lands) if lands else z3.BoolVal(False))
    return broken_at(u, i, ob.arg)


def _witness_goal(u, i: int, ob: Obligation) -> z3.BoolRef:
    """Request 0 ends iteration i at the variant's ``done`` stage on every (stage, rank),
    and at some iteration the gate held it: every row polled the moving value, a gate
    flag was set, and it stayed."""
    v, rows = u.variant, u.pp * u.ranks
    done = z3.And([u.steps[i][-1][2][k][0] == int(v.done) for k in range(rows)])
    held = []
    for j in range(i + 1):
        for p, before, after, *_ in u.steps[j]:
            if p.gate is None:
                continue
            local, flag = u.inputs[j][p.input], u.inputs[j][p.gate]
            top = max(value for value, _ in p.moves)
            held.append(z3.And(*[z3.And(is_member(p, before[k][0], Z3OPS), local[k][0] == top,
                                        after[k][0] == before[k][0]) for k in range(rows)],
                               z3.Or([flag[k][0] == 1 for k in range(rows)])))
    return z3.And(done, z3.Or(held) if held else z3.BoolVal(False))


def _search(ob: Obligation, st: Settings, goal: Callable) -> Outcome:
    v = PP_VARIANTS[ob.variant]
    # collectives_agree compares the TP ranks of one stage: one rank a stage never breaks it
    least = 2 if ob.arg in ("collectives_agree", "empty_min") else 1
    for ranks, reqs in ((1, 1), (1, 2), (2, 1), (2, 2)):
        if ranks < least:
            continue
        u = unroll_pp(v, PP, ranks, reqs, MAX_PP_ITERATIONS)
        for i in range(MAX_PP_ITERATIONS):
            s = Solver(st.timeout_ms)
            s.add(*u.domain, goal(u, i, ob))
            res = s.check()
            if res.status == "sat":
                return _export(ob, st, v, ranks, reqs, concrete_pp_inputs(u, res.model)[:i + 1])
            if res.status != "unsat":
                return Outcome(res.status, res.reason)
    return Outcome("none found", f"within {PP} stages, T<={MAX_PP_RANKS}, N<={MAX_PP_REQS}, "
                   f"{MAX_PP_ITERATIONS} iterations")


def _export(ob: Obligation, st: Settings, v: PPVariant, ranks: int, reqs: int, inputs: list) -> Outcome:
    """Replay the solver's inputs through the spec and write the trace: its records and
    the violation are the spec's, never the solver's."""
    path = st.traces / f"{ob.variant}.{ob.obligation.replace(':', '-')}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    stages = initial_pp_stages(v, PP, ranks, reqs)
    with open(path, "w", encoding="utf-8") as fp:
        w = IterationTraceWriter(fp, v.name, ranks, reqs, "pdgate prove", stages=PP,
                                 note=f"{ob.obligation}: minimal within {PP} stages, T<={MAX_PP_RANKS}, "
                                      f"N<={MAX_PP_REQS}, {MAX_PP_ITERATIONS} iterations")
        for i, inp in enumerate(inputs):
            res = run_pipeline(v, PP, stages, inp)
            w.iteration(i, inp, res)
            stages = res.stages
        found = pipeline_violations(res, v)
        want = ("stages_agree" if ob.arg in CEX_UNDER else
                {"shifted": "positions_agree", "empty_min": "collectives_agree"}.get(ob.arg, ob.arg))
        claim = [x for x in found if x.invariant == want]
        if ob.expected == "counterexample":
            if not claim:
                return Outcome("replay mismatch", f"the spec's last iteration does not break {want}")
            w.violation(claim[0], len(inputs) - 1)
        elif found:
            return Outcome("replay mismatch", f"the witness breaks {found[0].invariant}")
        w.end(len(inputs))
    detail = (claim[0].detail if ob.expected == "counterexample"
              else "a request gets there on every (stage, rank); the gate held it once")
    return Outcome(ob.expected, f"{PP} stages T={ranks} N={reqs}, {len(inputs)} iterations: {detail}", str(path))


def _counterexample(ob: Obligation, st: Settings) -> Outcome:
    return _search(ob, st, _cex_goal)


def _witness(ob: Obligation, st: Settings) -> Outcome:
    return _search(ob, st, _witness_goal)


def _refines(ob: Obligation, st: Settings) -> Outcome:
    v = PP_VARIANTS[ob.variant]
    rng = random.Random(ob.variant)
    n = 0
    polled = {p.input for p in v.points}
    for ranks, reqs in REFINE_SIZES:
        for i in range(REFINE_SAMPLES + 1):
            if i == 0:      # the path that moves: the initial state, every poll its last value, no flag
                stages = initial_pp_stages(v, PP, ranks, reqs)
                inputs = {name: [[max(INPUTS[name]) if name in polled else 0] * reqs for _ in range(PP * ranks)]
                          for name in v.inputs()}
            else:
                row = [int(rng.choice(list(v.stages))) for _ in range(reqs)]
                stages = tuple(tuple(int(rng.choice(list(v.stages))) if rng.random() < 0.3 else x for x in row)
                               for _ in range(PP * ranks))
                inputs = {name: [[rng.choice(INPUTS[name]) for _ in range(reqs)] for _ in range(PP * ranks)]
                          for name in v.inputs()}
            res = run_pipeline(v, PP, stages, inputs)
            want = [(pr.after, pr.issued) for pr in res.points]
            q = refines(v, stages, inputs, want, st.timeout_ms, PipelineUnbounded((PP, ranks, reqs)))
            n += 1
            if q.result.status != "unsat":
                return Outcome("refinement mismatch" if q.result.status == "sat" else q.result.status,
                               f"{PP} stages T={ranks} N={reqs} stages {stages} inputs {inputs}: the "
                               "encoding allows another successor")
    return Outcome("proved", f"{n} states and inputs (1 per size directed, the rest random): "
                   "the unbounded encoding allows exactly the "
                   "spec's stages and issues after every point")


def pipeline_obligations() -> list[Obligation]:
    out: list[Obligation] = []
    for name, v in PP_VARIANTS.items():
        broken = BREAKS[name]
        if _unbounded(v):
            out.append(Obligation("induction:pp_agree" if broken else "safety:pp_agree", name,
                                  "not inductive" if broken else "proved", True, _preserves))
            out.append(Obligation("refines:pipeline", name, "proved", False, _refines))
            if broken:           # where each release breaks: every point alone
                for p in v.points:
                    bad = p.name in POINT_BREAKS[name]
                    out.append(Obligation(f"{'induction' if bad else 'safety'}:point:{p.name}", name,
                                          "not inductive" if bad else "proved", True, _preserves, p.name))
        for inv in broken:
            out.append(Obligation(f"cex:{inv}", name, "counterexample", False, _counterexample, inv))
        for restriction, proved, cex in RESTRICTED.get(name, ()):
            out.append(Obligation(f"{'safety' if proved else 'induction'}:pp_agree_{restriction}", name,
                                  "proved" if proved else "not inductive", True, _preserves, restriction))
            if cex:
                out.append(Obligation(f"cex:{cex}", name, "counterexample", False, _counterexample, cex))
        if name in EMPTY_MIN:
            out.append(Obligation("cex:empty_min", name, "counterexample", False, _counterexample, "empty_min"))
        if "positions_agree" in broken:
            out.append(Obligation("cex:positions_shifted", name, "counterexample", False, _counterexample,
                                  "shifted"))
        if not broken:
            out.append(Obligation("nonvacuous:pipeline", name, "proved", False, _witness, "run"))
    return out
