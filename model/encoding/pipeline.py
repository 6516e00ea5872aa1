"""The Z3 encoding of the pipeline (model/spec/pipeline.py), in model/encoding/iteration.py's
two readings:

* unbounded: a Rank is a (stage, rank) pair of an uninterpreted sort, ``pp_stage`` maps
  it to an uninterpreted PP stage sort (any number of stages, each any number of
  ranks). The spec's per-(rank, request) functions run on terms as in the iteration;
  only the reductions differ: over a whole stage (GROUP: a bound on every rank of the
  stage, equal to a witness rank of it), over everything (ALL: the iteration's), or a
  stage's followed by the ring (RING: a fresh predicate true iff every stage's value
  moves the request: every stage's value moves it, or a witness stage's does not; and
  per ``union`` value one true iff some stage's value is it, with its witness stage).
  PP0's positional forwarding needs queue positions, which an uninterpreted request
  sort has not: its variants are searched finitely only.
* finite: model.spec.pipeline.apply_pp_point itself on Z3 constants (``Z3F``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import z3

from model.encoding.iteration import (Query, StageFn, Unbounded, Z3F, _enum, _show, record_differs)
from model.encoding.solver import CheckResult, Solver
from model.encoding.vocab import Z3OPS
from model.spec.agreement import Across, Op, Point, any_of, is_member
from model.spec.iteration import INPUTS
from model.spec.pipeline import STAY, PPVariant, apply_pp_point, initial_pp_stages


class PipelineUnbounded(Unbounded):
    """Unbounded's queries over (stage, rank) pairs; ``universe`` = (stages, ranks per
    stage, requests) for an exact one (stage-major, as the spec's rows)."""

    def __init__(self, universe: tuple[int, int, int] | None = None) -> None:
        super().__init__(None if universe is None else (universe[0] * universe[1], universe[2]))
        if universe is None:
            self.pp = z3.DeclareSort("PPStage")
        else:
            self.pp, self.pps = _enum("PPStage", universe[0])
        self.stage_of = z3.Function("pp_stage", self.rank, self.pp)
        self.group_reductions: list[tuple[Any, Any, StageFn, Callable[[Any, Any], Any]]] = []
        if universe is not None:
            t = universe[1]
            self.axioms += [self.stage_of(k) == self.pps[i // t] for i, k in enumerate(self.ranks)]

    def forall(self, body: Callable[[Any, Any], Any]) -> z3.BoolRef:
        if not hasattr(self, "pps"):
            return super().forall(body)
        # an exact universe: the same axiom, instantiated (z3 is far quicker on it)
        return z3.And([body(k, r) for k in self.ranks for r in self.reqs])

    def _forall_gr(self, body: Callable[[Any, Any], Any]) -> z3.BoolRef:
        if hasattr(self, "pps"):
            return z3.And([body(g, r) for g in self.pps for r in self.reqs])
        g, r = z3.Const(self._name("g"), self.pp), z3.Const(self._name("r"), self.req)
        return z3.ForAll([g, r], body(g, r))

    def group_reduction(self, name: str, op: Op, contrib: StageFn) -> StageFn:
        """red(g, r) = MIN (MAX) over stage g's ranks: a bound on each, equal to a witness
        rank of g's (a skolem function)."""
        red = z3.Function(self._name(f"{op.value}_{name}"), self.pp, self.req, z3.IntSort())
        wit = z3.Function(self._name(f"witness_{name}"), self.pp, self.req, self.rank)
        bound = (lambda a, b: a <= b) if op is Op.MIN else (lambda a, b: a >= b)
        self.axioms.append(self.forall(lambda k, r: bound(red(self.stage_of(k), r), contrib(k, r))))
        # instances of each earlier stage reduction's bound at this one's witness rank and
        # back (the bounds above, instantiated: they spare z3 the search that relates two
        # reductions of the same polls, which timed out on some term orders)
        at = lambda f, red, contrib, k, r: f(red(self.stage_of(k), r), contrib(k, r))
        for red0, wit0, contrib0, bound0 in self.group_reductions:
            self.axioms.append(self._forall_gr(lambda g, r: z3.And(
                at(bound0, red0, contrib0, wit(g, r), r), at(bound, red, contrib, wit0(g, r), r))))
        self.axioms.append(self._forall_gr(lambda g, r: z3.And(self.stage_of(wit(g, r)) == g,
                                                               red(g, r) == contrib(wit(g, r), r))))
        self.group_reductions.append((red, wit, contrib, bound))
        return red

    def ring(self, p: Point, red: StageFn) -> Callable[[Any], Any]:
        """agreed(r): every stage's value moves r (all of them, or a witness stage's not)."""
        moved = lambda x: any_of(Z3OPS, *[x == key for key, _ in p.moves])
        agreed = z3.Function(self._name(f"ring_{p.name}"), self.req, z3.BoolSort())
        wit = z3.Function(self._name(f"ring_witness_{p.name}"), self.req, self.rank)
        self.axioms += [self.forall(lambda k, r: z3.Implies(agreed(r), moved(red(self.stage_of(k), r)))),
                        self.forall(lambda k, r: z3.Implies(z3.Not(agreed(r)),
                                                            z3.Not(moved(red(self.stage_of(wit(r)), r)))))]
        return agreed

    def some_stage(self, p: Point, red: StageFn, value: int) -> Callable[[Any], Any]:
        """carried(r): some stage's value is ``value`` (a union value: every stage that has
        it implies it, and it implies a witness stage's)."""
        carried = z3.Function(self._name(f"union_{p.name}_{value}"), self.req, z3.BoolSort())
        wit = z3.Function(self._name(f"union_witness_{p.name}_{value}"), self.req, self.rank)
        self.axioms += [self.forall(lambda k, r: z3.Implies(red(self.stage_of(k), r) == value, carried(r))),
                        self.forall(lambda k, r: z3.Implies(carried(r), red(self.stage_of(wit(r)), r) == value))]
        return carried

    def reduced(self, p: Point, contrib: StageFn) -> StageFn:
        if p.across is Across.ALL or not p.collective:
            return super().reduced(p, contrib)
        if p.op not in (Op.MIN, Op.MAX) or p.across is Across.PP0:
            raise NotImplementedError(f"{p.name}: {p.op.value} across {p.across.value} is not encoded unbounded")
        red = self.group_reduction(p.name, p.op, contrib)
        if p.across is Across.GROUP:
            return lambda k, r: red(self.stage_of(k), r)
        agreed = self.ring(p, red)
        value: StageFn = lambda k, r: z3.If(agreed(r), red(self.stage_of(k), r), STAY)
        for u in reversed(p.union):     # spec's ring_value: the first union value any stage carries
            value = (lambda carried, inner, u: lambda k, r: z3.If(carried(r), u, inner(k, r)))(
                self.some_stage(p, red, u), value, u)
        return value


def preserves_pp(v: PPVariant, timeout_ms: int = 20_000, universe: tuple[int, int, int] | None = None,
                 excluded: Sequence[tuple[str, int]] = (), point: Point | None = None) -> Query:
    """From any state where every (stage, rank) has every request at the same stage,
    with any inputs (none of input x equal to value v for each (x, v) ``excluded``):
    does every stage's TP group issue the iteration's collectives alike, do all stages
    still agree, and has no request stopped in a transient stage? ``point``: that point
    alone, from an agreed state at any of the variant's stages.
    unsat = yes, for any number of stages, ranks and requests."""
    u = PipelineUnbounded(universe)
    agreed = z3.Function("stage0", u.req, z3.IntSort())
    st, inp = (lambda k, r: agreed(r)), u.inputs(v, "0")
    # an iteration boundary: a stage of the variant's, none a request leaves within one
    boundary = lambda x: z3.Or([x == int(s) for s in v.stages if point is not None or int(s) not in v.transient])
    u.axioms.append(u.forall(lambda k, r: boundary(agreed(r))))
    for name, value in excluded:
        u.axioms.append(u.forall(lambda k, r, f=inp[name], value=value: f(k, r) != value))
    k1, k2, r = z3.Const("k1", u.rank), z3.Const("k2", u.rank), z3.Const("r", u.req)
    same_stage = u.stage_of(k1) == u.stage_of(k2)

    def first_bad(*bad: z3.BoolRef) -> CheckResult:
        """One query per way to go wrong (unsat for all is unsat for their disjunction;
        each alone is far easier for z3): the first that is not unsat, else unsat."""
        spent = 0.0
        for x in bad:
            s = Solver(timeout_ms)
            s.add(*u.axioms, x)
            part = s.check()
            if part.status != "unsat":
                return part
            spent += part.seconds
        return CheckResult("unsat", spent)

    points = v.points if point is None else (point,)
    before: StageFn = st
    for i, p in enumerate(points):
        ((_, _, after, issued),) = u.iteration(v, before, inp, [p])
        res = first_bad(z3.And(same_stage, record_differs(p, before, issued, k1, k2, r)))
        if res.status != "unsat":
            break
        if i == len(points) - 1:
            res = first_bad(after(k1, r) != after(k2, r), z3.Not(boundary(after(k1, r))))
            break
        res = first_bad(after(k1, r) != after(k2, r))
        if res.status == "unknown":
            break
        if res.status == "unsat":
            # shown agreed here: name it (a sound lemma) and go on from it, so the next
            # points start from an agreed state as the first did
            nxt = z3.Function(f"stage{i + 1}", u.req, z3.IntSort())
            u.axioms.append(u.forall(lambda k, r, after=after, nxt=nxt: after(k, r) == nxt(r)))
            before = (lambda nxt: lambda k, r: nxt(r))(nxt)
        else:                 # parted here: a later point may still join them (no lemma)
            before = after
    names = "+".join(p.name for p in points)
    return Query(f"preserves_pp[{names}]", res, _show(u, res.model, st, inp))


# -- bounded: the spec's apply_pp_point on Z3 constants ---------------------------------
@dataclass
class UnrolledPP:
    variant: PPVariant
    pp: int
    ranks: int            # per stage
    reqs: int
    inputs: list[dict[str, list[list[z3.ArithRef]]]]
    steps: list[list[tuple[Point, Any, Any, Any, Any]]]   # (p, before, after, issued, shapes)
    domain: list[z3.BoolRef]


def unroll_pp(v: PPVariant, pp: int, ranks: int, reqs: int, depth: int, tag: str = "") -> UnrolledPP:
    stages: Any = [[z3.IntVal(x) for x in row] for row in initial_pp_stages(v, pp, ranks, reqs)]
    all_inputs, all_steps, domain = [], [], []
    for i in range(depth):
        inp = {name: [[z3.Int(f"{name}{tag}@{i}.{k}.{r}") for r in range(reqs)] for k in range(pp * ranks)]
               for name in v.inputs()}
        domain += [z3.Or([x == d for d in INPUTS[name]]) for name, rows in inp.items() for row in rows for x in row]
        steps = []
        for p in v.points:
            after, issued, shapes, _ = apply_pp_point(p, pp, stages, inp, Z3F)
            steps.append((p, stages, after, issued, shapes))
            stages = after
        all_inputs.append(inp)
        all_steps.append(steps)
    return UnrolledPP(v, pp, ranks, reqs, all_inputs, all_steps, domain)


def broken_at(u: UnrolledPP, i: int, invariant: str) -> z3.BoolRef:
    """Iteration i breaks the invariant (model/spec/pipeline.py's definitions, on terms)."""
    t, rows, out = u.ranks, u.pp * u.ranks, []
    steps = u.steps[i]
    if invariant == "stages_agree":
        last = steps[-1][2]
        out = [last[0][r] != last[k][r] for k in range(1, rows) for r in range(u.reqs)]
    for p, before, after, issued, shapes in steps:
        if invariant == "collectives_agree":
            for k in range(rows):
                k0 = (k // t) * t
                out.append(z3.Or(issued[k] != issued[k0], z3.And(issued[k0], shapes[k] != shapes[k0])))
        if invariant == "positions_agree" and p.across is Across.PP0:
            for k in range(t, rows):
                out.append(issued[k] != issued[k - t])
                out += [is_member(p, before[k][r], Z3OPS) != is_member(p, before[k % t][r], Z3OPS)
                        for r in range(u.reqs)]
    return z3.Or(out) if out else z3.BoolVal(False)


def concrete_pp_inputs(u: UnrolledPP, model: z3.ModelRef) -> list[dict[str, list[list[int]]]]:
    return [{name: [[model.eval(x, model_completion=True).as_long() for x in row] for row in rows]
             for name, rows in inp.items()} for inp in u.inputs]

