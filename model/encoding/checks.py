"""The checking API: ``check_init``, ``check_step`` (consecution), ``premises`` (non-
vacuity) and ``bmc`` (bounded unrolling on a finite instance)."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import z3

from model.spec.variants import Deferral, Variant
from model.encoding.actions import ACTION_NAMES, Action, actions, ground_actions, init, protocol_step
from model.encoding.invariants import PREDICATES
from model.encoding.solver import CheckResult, Solver
from model.encoding.vocab import SIGNATURE, Ctx, Sizes, State

Goal = Callable[[Ctx, State], z3.BoolRef]


def conj(ctx: Ctx, s: State, names: Sequence[str]) -> z3.BoolRef:
    return z3.And([PREDICATES[n](ctx, s) for n in names])


@dataclass
class QueryLog:
    """Per-query results of one obligation: (label, CheckResult)."""
    queries: list[tuple[str, CheckResult]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for _, r in self.queries)

    def failures(self, want: str) -> list[str]:
        return [f"{label}: {r.status}{' (' + r.reason + ')' if r.reason else ''}"
                for label, r in self.queries if r.status != want]


def check_init(variant: Variant, names: Sequence[str], timeout_ms: int = 20_000) -> CheckResult:
    """Unbounded: every initial state satisfies the conjunction (expect unsat)."""
    ctx = Ctx(variant)
    s = ctx.declare_state("")
    solver = Solver(timeout_ms)
    solver.add(*ctx.axioms, init(ctx, s), z3.Not(conj(ctx, s, names)))
    return solver.check()


def check_step(variant: Variant, names: Sequence[str], timeout_ms: int = 20_000,
               only: Sequence[str] = ACTION_NAMES, at_most: Sizes | None = None,
               describe: bool = False, universe: Sizes | None = None) -> QueryLog:
    """Unbounded consecution, one query per action: the conjunction before the action
    and its negation after it is unsat for every action. ``at_most`` bounds the sorts
    (Ctx.at_most) for a search that expects sat: a counterexample to induction then
    comes back fast, and ``describe`` puts it (pre-state, event, post-state) in the
    result's ``reason``. ``universe`` instead fixes each sort to exactly that many
    elements (the interpreted reading of vocab.Ctx: the same unbounded code and
    quantifiers over an enumeration), for a sat search: a model there is a model of
    the unbounded query with that many elements."""
    ctx = Ctx(variant, universe=universe)
    s = ctx.declare_state("")
    solver = Solver(timeout_ms)
    solver.add(*ctx.axioms, conj(ctx, s, names))
    if at_most is not None:
        solver.add(*ctx.at_most(at_most))
    log = QueryLog()
    for a in actions(ctx, s):
        if a.name not in only:
            continue
        with solver.frame():
            solver.add(a.guard, *a.side, z3.Not(conj(ctx, a.post, names)))
            res = solver.check()
            if describe and res.model is not None:
                res.reason = describe_cti(ctx, s, a, res.model, names)
            log.queries.append((a.name, res))
    return log


def consistent(variant: Variant, names: Sequence[str], at_most: Sizes = Sizes(2, 2, 2),
               timeout_ms: int = 20_000) -> QueryLog:
    """Unbounded: for every action, some state satisfying the conjunction enables it,
    its side axioms (the MIN, alignment) included (expect sat). A contradictory guard or
    axiom would make every consecution query of that action unsat: this says it is not."""
    ctx = Ctx(variant)
    s = ctx.declare_state("")
    solver = Solver(timeout_ms)
    solver.add(*ctx.axioms, conj(ctx, s, names), *ctx.at_most(at_most))
    log = QueryLog()
    for a in actions(ctx, s):
        with solver.frame():
            solver.add(a.guard, *a.side)
            log.queries.append((a.name, solver.check()))
    return log


def _snapshot(model: z3.ModelRef, ctx: Ctx, s: State, ranks: list, reqs: list,
              names: dict) -> str:
    """One line per rank: each request it has seen, with what the invariants read."""
    ev = lambda t: model.eval(t, model_completion=True)
    lines = []
    for k in ranks:
        items = []
        for r in reqs:
            seen_here = [s.enq(r), s.inq(k, r), s.dec(k, r), s.quar(k, r)]
            if not any(z3.is_true(ev(b)) for b in seen_here):
                continue
            flags = [] if z3.is_true(ev(s.enq(r))) else ["never enqueued"]
            if z3.is_true(ev(s.inq(k, r))):
                flags.append(f"queued recv={ev(s.recv(k, r))} age={ev(s.age(k, r))}")
            if z3.is_true(ev(s.dec(k, r))):
                flags.append("commit payload=" + str(ev(s.cpay(k, r))) if z3.is_true(ev(s.commit(k, r)))
                             else "abort")
            if z3.is_true(ev(s.quar(k, r))):
                flags.append("quarantined")
            flags.append(f"seen room {ev(s.seen(k, r))}"
                         + "".join(f" {f}" for f, b in (("room-landed", s.lr), ("payload-landed", s.lp))
                                   if z3.is_true(ev(b(k, r)))))
            items.append(f"{names[r.get_id()]}: {', '.join(flags)}")
        lines.append(f"{names[k.get_id()]}[{'; '.join(items) or 'nothing'}]")
    return " ".join(lines)


class _OverUniverse:
    """``ctx`` with its quantifiers expanded over a model's finite universe, so that a
    predicate evaluates to true or false in that model (Z3 does not evaluate ForAll)."""

    def __init__(self, ctx: Ctx, universe: dict[str, list]):
        self._ctx, self._universe = ctx, universe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def forall(self, sorts: Sequence[str], body: Callable[..., Any]) -> z3.BoolRef:
        return z3.And([body(*xs) for xs in itertools.product(*(self._universe[s] for s in sorts))])


def describe_cti(ctx: Ctx, s: State, a: Action, model: z3.ModelRef, names: Sequence[str]) -> str:
    """A counterexample to induction from a model: its ranks and requests (the model's
    universe), the pre-state, the event with its arguments, the post-state, and which
    conjunct breaks."""
    # an interpreted context's sorts are enumerations (no universe in the model)
    universe = lambda sort: ctx.elems.get(sort) or list(model.get_universe(ctx.sorts[sort]) or [])
    ranks, reqs = universe("Rank"), universe("Req")
    label = {e.get_id(): f"rank{i}" for i, e in enumerate(ranks)}
    label.update({e.get_id(): f"req{i}" for i, e in enumerate(reqs)})
    for r in reqs:
        room = model.eval(ctx.room(r), model_completion=True)
        pay = model.eval(ctx.payload(r), model_completion=True)
        label[r.get_id()] += f"(room {room}, payload {pay})"
    args = []
    for key in ("rank", "req"):
        if key in a.params:
            v = model.eval(a.params[key], model_completion=True)
            args.append(label.get(v.get_id(), str(v)).split("(")[0])
    expand = _OverUniverse(ctx, {"Rank": ranks, "Req": reqs,
                                 "Slot": universe("Slot")})
    broken = [n for n in names
              if z3.is_false(model.eval(PREDICATES[n](expand, a.post), model_completion=True))]
    if "bounded_wait" in names:
        bound = ctx.variant.timeout_steps if ctx.variant.timeout_steps is not None else ctx.wait_bound
        if isinstance(bound, z3.ExprRef):
            bound = model.eval(bound, model_completion=True)
        broken = [f"{n} (bound {bound})" if n == "bounded_wait" else n for n in broken]
    return (f"CTI with {len(ranks)} ranks, {len(reqs)} requests: pre {_snapshot(model, ctx, s, ranks, reqs, label)}"
            f" | event {a.name}({', '.join(args)}) | post {_snapshot(model, ctx, a.post, ranks, reqs, label)}"
            f" | breaks {', '.join(broken)}")


def prove_inductive(variant: Variant, names: Sequence[str], timeout_ms: int = 20_000) -> QueryLog:
    log = check_step(variant, names, timeout_ms)
    log.queries.insert(0, ("init", check_init(variant, names, timeout_ms)))
    return log


def premises(variant: Variant, names: Sequence[str], sizes: Sizes = Sizes(2, 2, 2),
             timeout_ms: int = 20_000) -> QueryLog:
    """Non-vacuity: for every action, the conjunction and the action's guard hold
    together in some state (a finite structure with exactly ``sizes`` elements, which
    is a model of the unbounded premises). Expect sat."""
    ctx = Ctx(variant, sizes)
    s = ctx.declare_state("")
    solver = Solver(timeout_ms)
    solver.add(*ctx.axioms, *ctx.well_formed(s), conj(ctx, s, names))
    log = QueryLog()
    for a in actions(ctx, s):
        with solver.frame():
            solver.add(a.guard, *a.side)
            log.queries.append((a.name, solver.check()))
    return log


# -- bounded model checking -----------------------------------------------------------------
@dataclass
class Move:
    """One unrolled transition of a bmc model: the action and its decoded arguments."""
    action: str
    args: dict[str, int]


@dataclass
class BmcResult:
    sizes: Sizes
    depth: int | None               # transitions to the goal, None if not within the bound
    steps: list[Move]
    seconds: float
    status: str                     # "sat", "unsat" (no goal within the bound) or "unknown"


def _ground_name(a: Action) -> str:
    return "".join(f"_{v}" for k, v in sorted(a.params.items()) if k in ("rank", "req"))


def _decls(s: State) -> list[z3.FuncDeclRef]:
    """The declared symbols of a state, in SIGNATURE order (a 0-ary one as its constant's)."""
    return [getattr(s, n) if args else getattr(s, n)().decl() for n, (args, _) in SIGNATURE.items()]


def _renamed(f: z3.FuncDeclRef, name: str) -> z3.ExprRef:
    """``name`` with ``f``'s signature, applied to the variables substitute_funs binds."""
    g = z3.Function(name, *(f.domain(j) for j in range(f.arity())), f.range())
    return g(*(z3.Var(j, f.domain(j)) for j in range(f.arity())))


@dataclass
class _Step:
    """One transition built once over template frames ``@a`` -> ``@b`` (selectors of the
    previous transition ``@p``); frame i gets it by renaming symbols, so the Python
    construction of the actions (most of an unrolling's time) is paid once, not per
    frame. Every frame's step is the same formula up to names: nothing in it depends on i."""
    pre: State
    post: State
    acts: list[Action]
    sels: list[z3.BoolRef]
    prev: list[z3.BoolRef]
    step: z3.BoolRef                # selection, guards, next frame, assumed invariants
    order: z3.BoolRef               # the canonical order against the previous transition
    fresh: list[z3.FuncDeclRef]     # per-frame fresh symbols (enqueue's pick, the havoc)

    def sel(self, a: Action, tag: str) -> z3.BoolRef:
        return z3.Bool(f"sel_{a.name}{_ground_name(a)}@{tag}")

    def at(self, i: int) -> tuple[list[tuple[z3.BoolRef, Action]], list[z3.BoolRef]]:
        """Frame i -> i+1: the choices (selector, action) and the formulas to assert."""
        pairs = [(f, _renamed(f, f.name().replace("@a", f"@{i}")))
                 for f in _decls(self.pre)]
        pairs += [(f, _renamed(f, f.name().replace("@b", f"@{i + 1}"))) for f in _decls(self.post)]
        sels = [self.sel(a, str(i)) for a in self.acts]
        pairs += [(b.decl(), c) for b, c in zip(self.sels, sels)]
        pairs += [(f, _renamed(f, f"{f.name()}@{i}")) for f in self.fresh]
        out = [z3.substitute_funs(self.step, *pairs)]
        if i > 0:
            pairs += [(b.decl(), self.sel(a, str(i - 1))) for b, a in zip(self.prev, self.acts)]
            out.append(z3.substitute_funs(self.order, *pairs))
        return list(zip(sels, self.acts)), out


class Unrolling:
    """An incremental unrolling of the finite transition relation from the initial states."""

    def __init__(self, variant: Variant, sizes: Sizes, timeout_ms: int = 20_000,
                 assume: Sequence[str] = ()):
        self.assume = list(assume)      # proved invariants: prune every frame with them
        self.ctx = Ctx(variant, sizes)
        self.solver = Solver(timeout_ms)
        s0 = self.ctx.declare_state("@0")
        self.frames = [s0]
        self.choices: list[list[tuple[z3.BoolRef, Action]]] = []
        self.solver.add(*self.ctx.axioms, *self.ctx.well_formed(s0), init(self.ctx, s0))
        self._step: _Step | None = None

    def extend(self) -> None:
        if self._step is None:
            self._step = self._build_step()
        i = len(self.frames) - 1
        choices, formulas = self._step.at(i)
        self.solver.add(*formulas)
        self.frames.append(self.ctx.declare_state(f"@{i + 1}"))
        self.choices.append(choices)

    def _build_step(self) -> _Step:
        ctx = self.ctx
        s, nxt = ctx.declare_state("@a"), ctx.declare_state("@b")
        first_fresh = len(ctx.created)
        acts = ground_actions(ctx, s)
        fresh = ctx.created[first_fresh:]
        sels = [z3.Bool(f"sel_{a.name}{_ground_name(a)}@a") for a in acts]
        prev = [z3.Bool(f"sel_{a.name}{_ground_name(a)}@p") for a in acts]
        parts = [z3.PbEq([(b, 1) for b in sels], 1)]
        for b, a in zip(sels, acts):
            if a.name == "fence" and not fences_matter(ctx.variant):
                # Without fence_before_reuse or deferral a fence only disables later lands:
                # dropping it (and those lands) gives a shorter run agreeing on every invariant.
                parts.append(z3.Not(b))
            else:
                parts.append(z3.Implies(b, z3.simplify(z3.And(a.guard, *a.side))))
        # The next frame: one If-chain per function value over the actions that change it.
        for name, (args, _) in SIGNATURE.items():
            before = getattr(s, name)
            changed = [(b, getattr(a.post, name)) for b, a in zip(sels, acts)
                       if getattr(a.post, name) is not before]
            for xs in itertools.product(*(ctx.elems[x] for x in args)):
                old = z3.simplify(before(*xs))
                value = old
                for b, f in changed:
                    term = z3.simplify(f(*xs))
                    if not term.eq(old):
                        value = z3.If(b, term, value)
                parts.append(getattr(nxt, name)(*xs) == value)
        if self.assume:
            parts.append(conj(ctx, nxt, self.assume))
        order = self._canonical_order(list(zip(prev, acts)), list(zip(sels, acts)))
        return _Step(s, nxt, acts, sels, prev, z3.And(parts), order, fresh)

    @staticmethod
    def _canonical_order(prev: list[tuple[z3.BoolRef, Action]],
                         cur: list[tuple[z3.BoolRef, Action]]) -> z3.BoolRef:
        """Partial-order reduction (finite elements are integers, so they are ordered).
        Between two global events (enqueue, step), receiver events (kv_done, fail)
        commute with every per-rank event and per-rank events of different ranks
        commute with each other (stamps keep their per-rank order), so every run has a
        permutation of the same length reaching the same state in which receiver
        events come first, sorted by (rank, request), then the rest sorted by rank."""
        def pick(choice: list[tuple[z3.BoolRef, Action]], names: tuple[str, ...], key: str) -> Any:
            term = z3.IntVal(-1)
            for b, a in choice:
                if a.name in names:
                    term = z3.If(b, a.params[key], term)
            return term

        def any_of(choice: list[tuple[z3.BoolRef, Action]], names: tuple[str, ...]) -> z3.BoolRef:
            return z3.Or([b for b, a in choice if a.name in names])
        rx, rest = ("kv_done", "fail"), ("land_room", "land_payload", "fence")
        pr, pq, cr, cq = pick(prev, rx, "rank"), pick(prev, rx, "req"), pick(cur, rx, "rank"), pick(cur, rx, "req")
        return z3.And(
            z3.Not(z3.And(any_of(prev, rest), any_of(cur, rx))),
            z3.Implies(z3.And(any_of(prev, rx), any_of(cur, rx)),
                       z3.Or(pr < cr, z3.And(pr == cr, pq < cq))),
            z3.Implies(z3.And(any_of(prev, rest), any_of(cur, rest)),
                       pick(prev, rest, "rank") <= pick(cur, rest, "rank")))

    def check(self, goal: Goal) -> tuple[str, list[Move]]:
        reach = goal(self.ctx, self.frames[-1])
        with self.solver.frame():
            self.solver.add(reach)
            res = self.solver.check()
        if res.status == "unsat":
            # a fact now (no run of this length reaches the goal): said outright, it
            # prunes the longer runs' search through this frame
            self.solver.add(z3.Not(reach))
        return res.status, (self._decode(res.model) if res.model is not None else [])

    def _decode(self, model: z3.ModelRef) -> list[Move]:
        ctx = self.ctx

        def element(term: z3.ExprRef, sort: str) -> int:
            return next(i for i, e in enumerate(ctx.elems[sort])
                        if z3.is_true(model.eval(term == e, model_completion=True)))
        out = []
        for choice in self.choices:
            b, a = next((b, a) for b, a in choice if z3.is_true(model.eval(b, model_completion=True)))
            args: dict[str, int] = {}
            for key in ("rank", "req"):
                if key in a.params:
                    args[key] = element(a.params[key], "Rank" if key == "rank" else "Req")
            if a.name == "enqueue":
                r = a.params["req"]
                args["room"] = model.eval(ctx.room(r), model_completion=True).as_long()
                args["payload"] = model.eval(ctx.payload(r), model_completion=True).as_long()
            out.append(Move(a.name, args))
        return out


def fences_matter(v: Variant) -> bool:
    """A fence frees a slot (strict's quarantine, a deferred release), not only stops lands."""
    return v.fence_before_reuse or v.defer_failed is not Deferral.NONE


def bmc(variant: Variant, sizes: Sizes, goal: Goal, max_depth: int,
        timeout_ms: int = 20_000, assume: Sequence[str] = ()) -> BmcResult:
    """The shortest unrolling (at most ``max_depth`` transitions) that reaches ``goal``."""
    t0 = time.perf_counter()
    u = Unrolling(variant, sizes, timeout_ms, assume)
    for depth in range(1, max_depth + 1):
        u.extend()
        status, steps = u.check(goal)
        if status != "unsat":
            return BmcResult(sizes, depth if status == "sat" else None, steps,
                             time.perf_counter() - t0, status)
    return BmcResult(sizes, None, [], time.perf_counter() - t0, "unsat")


def violates(name: str) -> Goal:
    return lambda ctx, s: z3.Not(PREDICATES[name](ctx, s))


def stutter_goal(extra: Callable[[Ctx, State, Any], z3.BoolRef] | None = None) -> Goal:
    """A lasso for liveness: some request is queued on every rank with every receiver
    Success, and the protocol step from here changes nothing but ages (and the clock),
    so with no timeout (ages enter no decision) stepping forever never removes it."""
    def goal(ctx: Ctx, s: State) -> z3.BoolRef:
        a = protocol_step(ctx, s)
        same = []
        for name, (args, _) in SIGNATURE.items():
            if name in ("age", "clock", "stamp"):
                continue
            for xs in itertools.product(*(ctx.elems[x] for x in args)):
                same.append(getattr(a.post, name)(*xs) == getattr(s, name)(*xs))
        stuck = z3.Or([z3.And([z3.And(s.inq(k, r), s.recv(k, r) == 4) for k in ctx.elems["Rank"]]
                              + ([extra(ctx, s, r)] if extra else []))
                       for r in ctx.elems["Req"]])
        return z3.And(a.guard, *a.side, stuck, *same)
    return goal
