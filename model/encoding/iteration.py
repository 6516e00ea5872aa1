"""The Z3 encoding of the decode iteration (model/spec/iteration.py), in two readings,
both built from the spec's own functions:

* unbounded: Rank and Req are uninterpreted sorts (any number of ranks and requests);
  each point is model/spec/agreement.py's per-(rank, request) functions on Z3 terms,
  the MIN and MAX are a fresh function with their axioms (at most every contribution,
  equal to a witness rank's), and "some member triggers" a fresh predicate with its
  two halves (every trigger implies it; it implies a witness request's trigger).
  ``preserves`` and ``decides_agreed`` ask whether a point (or the whole iteration)
  can break agreement; unsat is a proof for every T and N, and, the stages being the
  whole state, induction over iterations.
* finite: model.spec.iteration.apply_point itself, run on Z3 constants with Z3's folds
  (``Z3F``), unrolled from the initial stages for the minimal counterexamples.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import z3

from model.encoding.solver import CheckResult, Solver
from model.encoding.vocab import Z3OPS, memo
from model.spec.agreement import (Op, Point, Skip, contribution, halts, is_member, issues, next_stage,
                                  triggers)
from model.spec.iteration import (INPUTS, Folds, IterVariant, apply_point, initial_stages)


def _fold(pick: Callable[[Any, Any], Any]) -> Callable[[list[Any]], Any]:
    def fold(xs: list[Any]) -> Any:
        m = xs[0]
        for x in xs[1:]:
            m = z3.If(pick(x, m), x, m)
        return m
    return fold


Z3F = Folds(Z3OPS, _fold(lambda a, b: a < b), _fold(lambda a, b: a > b),
            lambda xs: z3.Or(xs) if xs else z3.BoolVal(False),
            lambda xs: z3.Sum([z3.If(x, 1, 0) for x in xs]) if xs else z3.IntVal(0))

StageFn = Callable[[Any, Any], Any]
_ENUMS: dict[tuple[str, int], tuple[z3.SortRef, list[z3.ExprRef]]] = {}


def _enum(name: str, size: int) -> tuple[z3.SortRef, list[z3.ExprRef]]:
    """An enumeration sort of ``size`` elements and its constants (declared once per size)."""
    if (name, size) not in _ENUMS:
        sort, consts = z3.EnumSort(f"{name}{size}", [f"{name.lower()}{i}.{size}" for i in range(size)])
        _ENUMS[name, size] = (sort, list(consts))
    return _ENUMS[name, size]


class Unbounded:
    """One query family over uninterpreted Rank and Req."""

    def __init__(self, universe: tuple[int, int] | None = None) -> None:
        if universe is None:
            self.rank, self.req = z3.DeclareSort("IRank"), z3.DeclareSort("IReq")
        else:       # exactly this many ranks and requests (enumeration sorts)
            self.rank, self.ranks = _enum("IRank", universe[0])
            self.req, self.reqs = _enum("IReq", universe[1])
        self.root = z3.Const("rank0", self.rank)       # the broadcast's source
        # a request's place in the queues (a halting point walks them in this order); ties
        # and any order only add behaviour, so nothing more is assumed of it unbounded
        self.pos = z3.Function("queue_pos", self.req, z3.IntSort())
        self.axioms: list[z3.BoolRef] = []
        if universe is not None:                       # rank 0 is the first rank, request order
            self.axioms.append(self.root == self.ranks[0])
            self.axioms += [self.pos(r) == i for i, r in enumerate(self.reqs)]
        self._n = 0
        self.witnesses: list[z3.FuncDeclRef] = []      # each reduction's witness rank (per request)
        self.triggers: list[tuple[z3.FuncDeclRef, StageFn]] = []   # each "some member triggers"

    def _name(self, base: str) -> str:
        self._n += 1
        return f"{base}!{self._n}"

    def forall(self, body: Callable[[Any, Any], Any]) -> z3.BoolRef:
        k, r = z3.Const(self._name("k"), self.rank), z3.Const(self._name("r"), self.req)
        return z3.ForAll([k, r], body(k, r))

    def stage_fn(self, tag: str) -> StageFn:
        return z3.Function(f"stage{tag}", self.rank, self.req, z3.IntSort())

    def inputs(self, v: IterVariant, tag: str) -> dict[str, StageFn]:
        """One function per input, each value in its domain."""
        out = {}
        for name in v.inputs():
            f = z3.Function(f"{name}{tag}", self.rank, self.req, z3.IntSort())
            self.axioms.append(self.forall(lambda k, r, f=f, name=name: z3.Or([f(k, r) == x for x in INPUTS[name]])))
            out[name] = f
        return out

    def some_member(self, name: str, trig: StageFn) -> Callable[[Any], Any]:
        """some(k) == exists r. trig(k, r): every trigger implies it, and it implies a
        witness request's trigger (a skolem function)."""
        some = z3.Function(self._name(f"issues_{name}"), self.rank, z3.BoolSort())
        wit = z3.Function(self._name(f"trigger_{name}"), self.rank, self.req)
        self.triggers.append((some, trig))
        self.axioms += [self.forall(lambda k, r: z3.Implies(trig(k, r), some(k))),
                        self.forall(lambda k, r: z3.Implies(some(k), trig(k, wit(k))))]
        return some

    def reduction(self, name: str, op: Op, contrib: StageFn) -> Callable[[Any], Any]:
        """red(r) = MIN (MAX) over ranks of contrib(k, r): a bound on every rank's, equal
        to a witness rank's (a skolem function)."""
        red = z3.Function(self._name(f"{op.value}_{name}"), self.req, z3.IntSort())
        wit = z3.Function(self._name(f"witness_{name}"), self.req, self.rank)
        bound = (lambda a, b: a <= b) if op is Op.MIN else (lambda a, b: a >= b)
        self.witnesses.append(wit)
        self.axioms += [self.forall(lambda k, r: bound(red(r), contrib(k, r))),
                        self.forall(lambda k, r: red(r) == contrib(wit(r), r))]
        return red

    def ahead(self, r2: Any, r: Any) -> z3.BoolRef:
        return self.pos(r2) < self.pos(r)

    def halted(self, name: str, stops: StageFn) -> StageFn:
        """halted(k, r) == some request ahead of r stops k's walk: every such stop implies
        it, and it implies a witness request's (a skolem function)."""
        fn = z3.Function(self._name(f"halted_{name}"), self.rank, self.req, z3.BoolSort())
        wit = z3.Function(self._name(f"halt_at_{name}"), self.rank, self.req, self.req)
        k, r, r2 = (z3.Const(self._name(x), s) for x, s in (("k", self.rank), ("r", self.req), ("r", self.req)))
        self.axioms += [z3.ForAll([k, r, r2], z3.Implies(z3.And(self.ahead(r2, r), stops(k, r2)), fn(k, r))),
                        self.forall(lambda k, r: z3.Implies(fn(k, r), z3.And(self.ahead(wit(k, r), r),
                                                                              stops(k, wit(k, r)))))]
        return fn

    def point(self, p: Point, st: StageFn, inp: dict[str, StageFn]) -> tuple[StageFn, Callable[[Any], Any]]:
        """The stages after p, and who issued its collective, as closures over ``st``."""
        val = lambda name, k, r: 0 if name is None else inp[name](k, r)
        if p.collective and p.skip is not Skip.NEVER:
            some = self.some_member(p.name, lambda k, r: triggers(p, st(k, r), val(p.input, k, r), Z3OPS))
            issued = lambda k: issues(p, some(k), Z3OPS)
        else:
            issued = lambda k: issues(p, z3.BoolVal(False), Z3OPS)
        contrib = memo(lambda k, r: contribution(p, issued(k), st(k, r), val(p.input, k, r),
                                                 val(p.gate, k, r), Z3OPS))
        reduced = self.reduced(p, contrib)
        halted = None if p.halt is None else self.halted(p.name, lambda k, r: halts(
            p, issued(k), st(k, r), reduced(k, r), val(p.veto, k, r), Z3OPS))
        after = memo(lambda k, r: next_stage(p, issued(k), st(k, r), reduced(k, r), val(p.veto, k, r),
                                             Z3OPS, None if halted is None else halted(k, r)))
        return after, issued

    def reduced(self, p: Point, contrib: StageFn) -> StageFn:
        """The value each rank acts on per request, from every rank's contribution."""
        if p.op in (Op.MIN, Op.MAX) and not p.moves and p.veto is None:
            return lambda k, r: p.neutral               # nothing reads the value (a drain)
        if p.op in (Op.MIN, Op.MAX):
            red = self.reduction(p.name, p.op, contrib)
            return lambda k, r: red(r)
        if p.op is Op.LOCAL:
            return contrib
        return lambda k, r: contrib(self.root, r)      # rank 0's

    def iteration(self, v: IterVariant, st: StageFn, inp: dict[str, StageFn],
                  points: Sequence[Point] | None = None) -> list[tuple[Point, StageFn, StageFn, Callable]]:
        """(point, before, after, issued) for each point in order."""
        out = []
        for p in points if points is not None else v.points:
            after, issued = self.point(p, st, inp)
            out.append((p, st, after, issued))
            st = after
        return out


def record_differs(p: Point, before: StageFn, issued: Callable, k1: Any, k2: Any, r: Any) -> z3.BoolRef:
    """Ranks k1 and k2 issue p differently: one does and the other not, or both with
    vectors over different requests (r is where they differ: a stronger statement than
    different lengths, so its negation gives equal shapes)."""
    if not p.collective:
        return z3.BoolVal(False)
    differ = issued(k1) != issued(k2)
    if p.shape is None:
        differ = z3.Or(differ, z3.And(issued(k1), is_member(p, before(k1, r), Z3OPS)
                                      != is_member(p, before(k2, r), Z3OPS)))
    return differ


def moves_differ(p: Point, before: StageFn, after: StageFn, issued: Callable, k1: Any, k2: Any, r: Any) -> z3.BoolRef:
    """After p's collective, two ranks that issued it and hold r at the same stage move
    it to different stages (so something rank-local decided)."""
    if not p.collective:
        return z3.BoolVal(False)
    return z3.And(issued(k1), issued(k2), is_member(p, before(k1, r), Z3OPS),
                  before(k1, r) == before(k2, r), after(k1, r) != after(k2, r))


@dataclass
class Query:
    label: str
    result: CheckResult
    shown: str = ""             # a sat answer in an exact universe: its state and inputs


def _show(u: Unbounded, model: z3.ModelRef | None, st: StageFn, inp: dict[str, StageFn]) -> str:
    """The CTI's pre-state and inputs as lists ([rank][request]), where the sorts are exact."""
    if model is None or not hasattr(u, "ranks"):
        return ""
    table = lambda f: [[model.eval(f(k, r), model_completion=True).as_long() for r in u.reqs] for k in u.ranks]
    return "; ".join([f"stages {table(st)}", *(f"{name} {table(f)}" for name, f in inp.items())])


def preserves(v: IterVariant, points: Sequence[Point] | None = None, timeout_ms: int = 20_000,
              universe: tuple[int, int] | None = None) -> Query:
    """From any state where every rank has every request at the same stage, with any
    inputs: do the points (default: the whole iteration) issue the same collectives on
    every rank and leave the stages agreeing? unsat = yes, for every T and N."""
    u = Unbounded(universe)
    agreed = z3.Function("stage0", u.req, z3.IntSort())   # an agreed state: a stage per request
    st, inp = (lambda k, r: agreed(r)), u.inputs(v, "0")
    k1, k2, r = z3.Const("k1", u.rank), z3.Const("k2", u.rank), z3.Const("r", u.req)
    steps = u.iteration(v, st, inp, points)
    last = steps[-1][2]
    bad = z3.Or([record_differs(p, b, i, k1, k2, r) for p, b, _, i in steps] + [last(k1, r) != last(k2, r)])
    s = Solver(timeout_ms)
    s.add(*u.axioms, bad)
    names = "+".join(p.name for p, *_ in steps)
    res = s.check()
    return Query(f"preserves[{names}]", res, _show(u, res.model, st, inp))


def decides_agreed(v: IterVariant, p: Point, timeout_ms: int = 20_000,
                   universe: tuple[int, int] | None = None) -> Query:
    """From ANY state: can two ranks that issued p's collective and hold a request move
    it differently? unsat = no_local_decision_after_min holds at p (every T, N). At a
    halting point the move depends on the requests ahead in the rank's own queue, so
    there: any state in which the two ranks hold those alike."""
    u = Unbounded(universe)
    st, inp = u.stage_fn("0"), u.inputs(v, "0")
    k1, k2, r = z3.Const("k1", u.rank), z3.Const("k2", u.rank), z3.Const("r", u.req)
    ((_, before, after, issued),) = u.iteration(v, st, inp, [p])
    s = Solver(timeout_ms)
    s.add(*u.axioms, moves_differ(p, before, after, issued, k1, k2, r))
    if p.halt is not None:
        r2 = z3.Const("r_ahead", u.req)
        s.add(z3.ForAll([r2], z3.Implies(u.ahead(r2, r), st(k1, r2) == st(k2, r2))))
    res = s.check()
    return Query(f"decides_agreed[{p.name}]", res, _show(u, res.model, st, inp))


def refines(v: IterVariant, stages: Sequence[Sequence[int]], inputs: dict[str, Sequence[Sequence[int]]],
            want: Sequence[tuple[Sequence[Sequence[int]], Sequence[bool]]], timeout_ms: int = 20_000,
            u: Unbounded | None = None) -> Query:
    """The unbounded encoding, read over exactly these ranks and requests with these
    inputs, allows nothing but ``want`` (per point: the spec's stages after it and who
    issued it)? unsat = it agrees with the spec here. ``u``: an exact universe of that
    size (default: a plain one). One query per point, from the spec's stages before it,
    with the universe's own axioms and that point's only: each query stays small however
    long the iteration, and together they are the whole iteration's (each starts where
    the previous one was shown to end)."""
    ranks, reqs = len(stages), len(stages[0])
    u = u or Unbounded((ranks, reqs))
    base, ks, rs = len(u.axioms), u.ranks, u.reqs
    before: Sequence[Sequence[int]] = stages
    res = None
    for i, (p, (stages_after, issued_want)) in enumerate(zip(v.points, want)):
        start = len(u.axioms)
        st, inp = u.stage_fn(f"0.{i}"), u.inputs(v, f"0.{i}")
        fixed = [st(ks[k], rs[r]) == before[k][r] for k in range(ranks) for r in range(reqs)]
        fixed += [f(ks[k], rs[r]) == inputs[name][k][r] for name, f in inp.items()
                  for k in range(ranks) for r in range(reqs)]
        ((_, _, after, issued),) = u.iteration(v, st, inp, [p])
        differs = [after(ks[k], rs[r]) != stages_after[k][r] for k in range(ranks) for r in range(reqs)]
        differs += [issued(ks[k]) != z3.BoolVal(bool(issued_want[k])) for k in range(ranks)]
        s = Solver(timeout_ms)
        s.add(*u.axioms[:base], *u.axioms[start:], *fixed, z3.Or(differs))
        res = s.check()
        if res.status != "unsat":
            return Query(f"refines[{p.name}]", res)
        before = stages_after
    assert res is not None, "a variant has points"
    return Query("refines", res)


# -- bounded: the spec's apply_point on Z3 constants ------------------------------------
@dataclass
class Unrolled:
    variant: IterVariant
    ranks: int
    reqs: int
    inputs: list[dict[str, list[list[z3.ArithRef]]]]   # per iteration
    steps: list[list[tuple[Point, Any, Any, Any, Any]]]  # per iteration: (p, before, after, issued, shapes)
    domain: list[z3.BoolRef]


def unroll(v: IterVariant, ranks: int, reqs: int, depth: int, tag: str = "") -> Unrolled:
    u = Unrolled(v, ranks, reqs, [], [], [])
    for _ in range(depth):
        extend(u, tag)
    return u


def extend(u: Unrolled, tag: str = "") -> None:
    """One more iteration, from where the last one ended (the searches deepen on demand:
    building the terms costs more than solving the shallow queries)."""
    v, i = u.variant, len(u.steps)
    stages: Any = u.steps[-1][-1][2] if u.steps else [[z3.IntVal(x) for x in row]
                                                     for row in initial_stages(u.ranks, u.reqs)]
    inp = {name: [[z3.Int(f"{name}{tag}@{i}.{k}.{r}") for r in range(u.reqs)] for k in range(u.ranks)]
           for name in v.inputs()}
    for name, rows in inp.items():
        u.domain += [z3.Or([x == d for d in INPUTS[name]]) for row in rows for x in row]
    steps = []
    for p in v.points:
        after, issued, shapes = apply_point(p, stages, inp, Z3F)
        steps.append((p, stages, after, issued, shapes))
        stages = after
    u.inputs.append(inp)
    u.steps.append(steps)


def disagree_at(u: Unrolled, i: int, invariant: str) -> z3.BoolRef:
    """Iteration i breaks the invariant (the spec's definition, on the unrolled terms)."""
    out = []
    for p, before, after, issued, shapes in u.steps[i]:
        if not p.collective:
            continue
        if invariant == "collectives_agree":      # as the spec: every rank against rank 0
            out += [z3.Or(issued[0] != issued[k], z3.And(issued[0], shapes[0] != shapes[k]))
                    for k in range(1, u.ranks)]
            continue
        for k1, k2 in itertools.combinations(range(u.ranks), 2):
            out += [z3.And(issued[k1], issued[k2], is_member(p, before[k1][r], Z3OPS),
                           before[k1][r] == before[k2][r], after[k1][r] != after[k2][r])
                    for r in range(u.reqs)]
    return z3.Or(out) if out else z3.BoolVal(False)


def concrete_inputs(u: Unrolled, model: z3.ModelRef) -> list[dict[str, list[list[int]]]]:
    return [{name: [[model.eval(x, model_completion=True).as_long() for x in row] for row in rows]
             for name, rows in inp.items()} for inp in u.inputs]

