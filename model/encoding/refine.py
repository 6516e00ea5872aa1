"""Refinement: the symbolic actions against the spec, state by state and event by event.

The encoding keeps its own form of each action (actions.py) next to the spec's
(model/spec/machine.py); this module is what ties the two together. For one concrete
state of the spec it builds an encoding context whose sorts ARE that state's ranks,
requests and slots, pins the pre-state functions and the rigid request data to the
state's values, and checks, for every event (enabled or not):

* the guard: the action's guard and side axioms are satisfiable exactly when the spec
  allows the event (``machine.apply`` does not raise ``EventNotEnabled``);
* the successor: every post-state the action allows equals the spec's successor on
  every function the encoding has (``exact``), or, where the encoding abstracts, the
  spec's successor is at least one of the allowed post-states (``at least``).

Two readings of the same action code are checked:

* ``unbounded``: what the inductive proofs use (real ``ForAll``, the MIN's axioms, the
  alignment skolems, fresh slot choices), with each sort an enumeration of the state's
  elements. Abstractions, argued in docs/PROOFS.md: enqueue may take ANY free slot (the
  FIFO one is among them), and a step on misaligned queues lets every rank see any
  reduced value (the spec's positional MIN is among them).
* ``finite``: what the bounded unrolling uses; FIFO is exact, so everything is exact,
  except that the step on misaligned queues is disabled (an under-approximation: the
  counterexample search stops at the first divergence anyway).

Each action is built once per event over a pre-state of constants (one per function
and element tuple, the rigid request data included); a state is pinned by substituting
its values for them, so Z3's simplifier decides most guards and successors, and the
solver is asked only where a quantifier or a fresh symbol remains (enqueue's choice, the
step's MIN and alignment), once per distinct pinned formula.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import z3
from z3.z3 import _to_expr_ref
from z3.z3core import Z3_substitute

from model.encoding.actions import event_action
from model.encoding.solver import Solver
from model.encoding.vocab import SIGNATURE, Ctx, Sizes, State, memo
from model.spec.events import PAYLOAD, ROOM, Enqueue, Event, Fail, Fence, KvDone, Land, Step
from model.spec.machine import EventNotEnabled, apply
from model.spec.state import ALL_FIELDS, PAYLOAD_BIT, ROOM_BIT, SystemState

MODES = ("unbounded", "finite")
# Per action, in unbounded mode, the functions the encoding leaves to a free choice
# (any free slot instead of the FIFO head): compared "at least", not "exact".
CHOSEN_IN_UNBOUNDED = {"enqueue": ("slot", "free", "owner")}


@dataclass
class RefinementReport:
    states: int = 0
    events: int = 0
    enabled: int = 0
    exact: int = 0                  # successors matched for every allowed choice
    at_least: int = 0               # successors matched by some allowed choice (abstraction)
    solver_queries: int = 0
    mismatches: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.states} states x {self.events // max(self.states, 1)} events "
                f"({self.enabled} enabled): guards agree, {self.exact} successors exact, "
                f"{self.at_least} at least (named abstractions), {self.solver_queries} solver queries")


def _symbolic_fn(ctx: Ctx, arg_sorts: Sequence[str], consts: dict[tuple[int, ...], z3.ExprRef]
                 ) -> Callable[..., Any]:
    """A pre-state function as one constant per element tuple: the constant for element
    arguments, an If-chain over the constants for any other term (a quantified
    variable, a fresh choice). Pinning a state substitutes values for the constants."""
    ids = [{e.get_id(): i for i, e in enumerate(ctx.elems[s])} for s in arg_sorts]

    @memo
    def chain(*args: Any) -> Any:
        out = None
        for k, c in consts.items():
            out = c if out is None else z3.If(
                z3.And([a == ctx.elems[s][i] for a, s, i in zip(args, arg_sorts, k)]), c, out)
        return out

    def f(*args: Any) -> Any:
        key = tuple(m.get(a.get_id()) for a, m in zip(args, ids))
        return consts[key] if None not in key else chain(*args)
    return f


def describe_state(state: SystemState) -> str:
    """A spec state in one line: what each rank holds (for mismatch reports)."""
    def rank(k: int) -> str:
        rs = state.ranks[k]
        parts = [f"queue {rs.queue}", f"recv {rs.recv}", f"landed {rs.landed}"]
        parts += [f"outcomes {rs.outcomes}"] if rs.outcomes else []
        parts += [f"quarantined {sorted(rs.quarantined)}"] if rs.quarantined else []
        parts += [f"fenced {sorted(rs.fenced)}"] if rs.fenced else []
        parts += [f"free {rs.free}", f"rooms {rs.room_at}", f"payloads {rs.payload_at}"]
        return f"rank{k}(" + ", ".join(parts) + ")"
    reqs = ", ".join(f"{r}: room {q.room}" for r, q in sorted(state.requests.items()))
    return f"requests {{{reqs}}} " + " ".join(rank(k) for k in range(len(state.ranks)))


def view(state: SystemState, n_reqs: int) -> dict[tuple, Any]:
    """The spec state as one value per encoding function and element tuple. Entries
    the spec has dropped (a forgotten request, a free slot's last owner) get the
    encoding's monotone reading: a forgotten request's writes count as landed."""
    out: dict[tuple, Any] = {}
    for k, rs in enumerate(state.ranks):
        for r in range(n_reqs):
            forgotten = r in rs.outcomes and r not in rs.landed
            # a rank that never took the request (local admission): nothing in flight
            forgotten |= r in state.requests and r not in rs.landed
            bits = ALL_FIELDS if forgotten else rs.landed.get(r, 0)
            kind, value = rs.outcomes.get(r, ("", 0))
            out.update({("inq", k, r): r in rs.queue, ("recv", k, r): rs.recv.get(r, 0),
                        ("age", k, r): rs.age.get(r, 0), ("slot", k, r): rs.slot_of.get(r, 0),
                        ("dec", k, r): r in rs.outcomes, ("commit", k, r): kind == "commit",
                        ("cpay", k, r): value if kind == "commit" else 0,
                        ("lr", k, r): bool(bits & ROOM_BIT), ("lp", k, r): bool(bits & PAYLOAD_BIT),
                        ("fen", k, r): r in rs.fenced, ("quar", k, r): r in rs.quarantined,
                        ("held", k, r): r in rs.held, ("hage", k, r): rs.held.get(r, 0)})
        holders = {rs.slot_of[r]: r for r in (*rs.queue, *rs.quarantined, *rs.held)}
        for x in range(state.n_slots):
            pos = rs.free.index(x) if x in rs.free else None
            # FIFO as stamps: the head of the free list has the smallest (all below 0,
            # so every slot freed from here on, stamped clock * base + index, is later).
            out.update({("free", k, x): pos is not None, ("rroom", k, x): rs.room_at[x],
                        ("rpay", k, x): rs.payload_at[x], ("owner", k, x): holders.get(x, 0),
                        ("stamp", k, x): pos - len(rs.free) - 1 if pos is not None else -n_reqs - 2})
    for r in range(n_reqs):
        out[("enq", r)] = r in state.requests
    out[("clock",)] = 1
    return out


def want(state: SystemState, n_reqs: int) -> list[tuple[tuple, Any]]:
    """What a successor must agree on: (function, arguments) -> value, wherever the
    value matters to the spec (a receiver while queued, a slot while written, ...)."""
    v = view(state, n_reqs)
    out: list[tuple[tuple, Any]] = [(("enq", r), v[("enq", r)]) for r in range(n_reqs)]
    for k, rs in enumerate(state.ranks):
        for r in range(n_reqs):
            kr = (k, r)
            keys = ["inq", "dec", "quar", "held"]
            keys += ["recv", "age"] if r in rs.queue else []
            keys += ["hage"] if r in rs.held else []
            keys += ["commit"] if r in rs.outcomes else []
            keys += ["cpay"] if rs.outcomes.get(r, ("",))[0] == "commit" else []
            keys += ["lr", "lp", "fen"] if r in rs.landed else []
            keys += ["slot"] if r in rs.slot_of else []
            out += [((name, *kr), v[(name, *kr)]) for name in keys]
            if r not in rs.landed:          # forgotten or never enqueued: nothing in flight
                out.append((("pending", *kr), False))
        for x in range(state.n_slots):
            keys = ["free", "rroom", "rpay"] + ([] if x in rs.free else ["owner"])
            out += [((name, k, x), v[(name, k, x)]) for name in keys]
        for a, b in zip(rs.free, rs.free[1:]):
            out.append((("stamp<", k, a, b), True))
    return out


@dataclass
class _Eval:
    """One event's action over the symbolic pre-state, reduced by the simplifier."""
    name: str
    guard: z3.BoolRef                  # guard and side axioms
    post: dict[tuple, z3.ExprRef]      # (function, indices) -> term, where the action changes it
    kept: frozenset[str]               # functions the action leaves as they were
    # (key, value) -> "the successor has value at key": the same few per event, asked
    # for in most states (building a Z3 term costs more than looking it up)
    agrees: dict[tuple, z3.BoolRef] = field(default_factory=dict)


class Checker:
    """One variant, one mode, one universe: each event's action is built once over a
    pre-state of constants (one per function and element tuple, the rigid request
    data included); a concrete state is pinned by substituting its values for them,
    so Z3's simplifier decides most guards and successors without a solver."""

    def __init__(self, variant: Any, universe: Sizes, mode: str, timeout_ms: int = 10_000):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
        self.variant, self.universe, self.mode = variant, universe, mode
        self.solver = Solver(timeout_ms)
        self.report = RefinementReport()
        ctx = Ctx(variant, universe) if mode == "finite" else Ctx(variant, universe=universe)
        self.ctx, el = ctx, ctx.elems
        self.consts: dict[tuple, z3.ExprRef] = {}

        def declare(name: str, args: Sequence[str], rng: str) -> Callable[..., Any]:
            table = {}
            for xs in itertools.product(*(range(len(el[a])) for a in args)):
                c = z3.Const(f"pre.{name}{list(xs)}", ctx.sorts[rng])
                table[xs] = self.consts[(name, *xs)] = c
            return _symbolic_fn(ctx, args, table) if args else (lambda c=table[()]: c)
        for rigid in ("room", "payload", "idx"):
            setattr(ctx, rigid, declare(rigid, ("Req",), "Int"))
        self.pre = State(**{name: declare(name, args, rng) for name, (args, rng) in SIGNATURE.items()})
        self._evals: dict[Event, _Eval] = {}
        self._vals: dict[Any, z3.ExprRef] = {}
        self._from: Any = None
        self._answers: dict[tuple[int, ...], tuple[str, tuple]] = {}
        self._ands: dict[tuple[int, ...], tuple[z3.BoolRef, list]] = {}
        self._const_key = {c.get_id(): key for key, c in self.consts.items()}
        self._read_cache: dict[int, tuple[tuple, z3.ExprRef]] = {}
        self._pins: dict[tuple, z3.ExprRef] = {}
        self._bools = [z3.BoolVal(True), z3.BoolVal(False)]      # alive: their ids stay theirs
        self._bool_ids = {self._bools[0].get_id(): True, self._bools[1].get_id(): False}

    def _eval(self, ev: Event) -> _Eval:
        e = self._evals.get(ev)
        if e is None:
            ctx, pre, el = self.ctx, self.pre, self.ctx.elems
            a = event_action(ctx, pre, ev)
            kept = frozenset(n for n in SIGNATURE if getattr(a.post, n) is getattr(pre, n))
            post = {}
            for name, (sorts, _) in SIGNATURE.items():
                if name not in kept:
                    for xs in itertools.product(*(range(len(el[s])) for s in sorts)):
                        post[(name, *xs)] = getattr(a.post, name)(*(el[s][i] for s, i in zip(sorts, xs)))
            if not {"enq", "lr", "lp", "fen"} <= kept:
                for k, r in itertools.product(range(len(el["Rank"])), range(len(el["Req"]))):
                    post[("pending", k, r)] = a.post.pending(el["Rank"][k], el["Req"][r])
            e = self._evals[ev] = _Eval(a.name, z3.And(a.guard, *a.side), post, kept)
        return e

    def _z3(self, key: tuple, value: Any) -> z3.ExprRef:
        """A view value as a Z3 value of the function's range (elements by index)."""
        rng = SIGNATURE[key[0]][1] if key[0] in SIGNATURE else ("Bool" if key[0] == "pending" else "Int")
        cache_key = (rng, value)
        out = self._vals.get(cache_key)
        if out is None:
            if rng in self.ctx.elems:
                out = self.ctx.elems[rng][value]
            else:
                out = z3.BoolVal(value) if rng == "Bool" else z3.IntVal(value)
            self._vals[cache_key] = out
        return out

    def _reads(self, t: z3.ExprRef) -> tuple[tuple, ...]:
        """The pre-state constants ``t`` mentions (their keys), found once per term."""
        hit = self._read_cache.get(t.get_id())
        if hit is None:
            seen: set[int] = set()
            stack, found = [t], set()
            while stack:
                x = stack.pop()
                i = x.get_id()
                if i in seen:
                    continue
                seen.add(i)
                if z3.is_quantifier(x):
                    stack.append(x.body())
                elif z3.is_app(x):          # (a bound variable is neither)
                    if x.num_args() == 0:
                        if i in self._const_key:
                            found.add(self._const_key[i])
                    else:
                        stack.extend(x.children())
            hit = self._read_cache[t.get_id()] = (tuple(sorted(found)), t)   # t kept alive
        return hit[0]

    def _known(self, t: z3.ExprRef) -> bool | None:
        """True or False where the simplifier decided ``t``, else None (z3.is_true and
        is_false cost several API calls each; an id lookup, one)."""
        return self._bool_ids.get(t.get_id())

    def _and(self, terms: list[z3.BoolRef]) -> z3.BoolRef:
        """z3.And of the terms, built once per distinct list (states repeat them)."""
        key = tuple(t.get_id() for t in terms)
        hit = self._ands.get(key)
        if hit is None:
            hit = self._ands[key] = (z3.And(terms), terms)   # keeps the terms (and ids) alive
        return hit[0]

    def _sat(self, *formulas: z3.BoolRef) -> str:
        """Satisfiability of pinned formulas. States that differ only where the action
        does not look pin to the same (hash-consed) formula: asked once."""
        key = tuple(f.get_id() for f in formulas)
        hit = self._answers.get(key)
        if hit is not None:
            return hit[0]
        self.report.solver_queries += 1
        with self.solver.frame():
            self.solver.add(*formulas)
            status = self.solver.check().status
        self._answers[key] = (status, formulas)      # keeps the formulas (and ids) alive
        return status

    def check_state(self, state: SystemState, events: Iterable[Event],
                    offers: Sequence[Enqueue]) -> None:
        """``offers``: request r's room and payload where the state has not enqueued it."""
        before = view(state, self.universe.reqs)
        for r in range(self.universe.reqs):
            q = state.requests.get(r) or offers[r]
            before.update({("room", r): q.room, ("payload", r): q.payload, ("idx", r): r})
        # z3.substitute re-checks every pair's sorts on each call: build the arrays once.
        n = len(self.consts)
        if self._from is None:
            self._from = (z3.Ast * n)(*(c.as_ast() for c in self.consts.values()))
        to: list = []                   # this state's values, built on the first miss
        zctx = self.ctx.sorts["Int"].ctx

        def pinned(t: z3.ExprRef, reused: bool = False) -> z3.ExprRef:
            """``t`` with this state's values put in, simplified. ``reused`` (a guard):
            the result depends only on the values of the constants ``t`` reads, and
            most states repeat those of an earlier one (a land reads its own rank's and
            request's entries), so it is computed once per distinct reading. (Not for
            the successor terms: many distinct ones, each read once or twice, and
            finding what a term reads costs more than pinning it.)"""
            key = (t.get_id(), tuple(before[k] for k in self._reads(t))) if reused else None
            hit = self._pins.get(key) if reused else None
            if hit is None:
                if not to:
                    to.append((z3.Ast * n)(*(self._z3(k, before[k]).as_ast() for k in self.consts)))
                sub = Z3_substitute(zctx.ref(), t.as_ast(), n, self._from, to[0])
                hit = z3.simplify(_to_expr_ref(sub, zctx))
                if reused:
                    self._pins[key] = hit
            return hit
        self.report.states += 1
        for ev in events:
            self.report.events += 1
            problem = self._check_event(self._eval(ev), before, pinned, state, ev)
            if problem:
                self.report.mismatches.append(f"{self.mode}: in {describe_state(state)}: {ev}: {problem}")

    def _agrees(self, e: _Eval, before: dict[tuple, Any], key: tuple, value: Any) -> Any:
        """True/False where known without Z3, else the formula (over the pre-state
        constants) that the successor has ``value`` at ``key``."""
        name = key[0]
        if name == "stamp<":
            k, a, b = key[1:]
            sa, sb = (e.post.get(("stamp", k, x)) for x in (a, b))
            if sa is None and sb is None:
                return before[("stamp", k, a)] < before[("stamp", k, b)]
            sa = z3.IntVal(before[("stamp", k, a)]) if sa is None else sa
            sb = z3.IntVal(before[("stamp", k, b)]) if sb is None else sb
            return sa < sb
        if key in e.post:
            out = e.agrees.get((key, value))
            if out is None:
                got = e.post[key]
                out = (got if value else z3.Not(got)) if z3.is_bool(got) else got == self._z3(key, value)
                e.agrees[(key, value)] = out
            return out
        if name == "pending":
            k, r = key[1:]
            return (before[("enq", r)] and not (before[("lr", k, r)] and before[("lp", k, r)])
                    and not before[("fen", k, r)]) == value
        return before[key] == value

    def _check_event(self, e: _Eval, before: dict[tuple, Any],
                     pinned: Callable[..., z3.ExprRef], state: SystemState, ev: Event) -> str:
        nxt = state.copy()
        try:
            apply(nxt, ev, detail=False)
            allowed = True
        except EventNotEnabled:
            allowed = False
        misaligned = isinstance(ev, Step) and len({tuple(sorted(rs.queue)) for rs in state.ranks}) > 1
        allowed_enc = allowed and not (self.mode == "finite" and misaligned)
        guard = pinned(e.guard, reused=True)
        encoded = self._known(guard)
        if encoded is None:
            status = self._sat(guard)
            if status == "unknown":
                return "solver unknown on the guard"
            encoded = status == "sat"
        if encoded != allowed_enc:
            return (f"spec {'allows' if allowed else 'refuses'} it, the encoding "
                    f"{'allows' if encoded else 'refuses'} it")
        if not encoded:
            return ""
        self.report.enabled += 1
        if nxt.hung is not None:
            return ""                        # a hang has no successor to compare (docs/PROOFS.md)
        chosen = () if self.mode == "finite" else CHOSEN_IN_UNBOUNDED.get(e.name, ())
        abstract = misaligned and self.mode == "unbounded"
        exact: list[tuple[tuple, Any, Any]] = []
        loose: list[tuple[tuple, Any, Any]] = []
        for key, value in want(nxt, self.universe.reqs):
            if key[0] == "stamp<" and self.mode != "finite":
                continue                     # stamps order the free list in finite mode only
            (loose if abstract or key[0] in chosen else exact).append(
                (key, value, self._agrees(e, before, key, value)))

        def label(key: tuple, value: Any) -> str:
            return f"{key[0]}{list(key[1:])}={value}"
        wrong = [label(k, v) for k, v, t in exact if t is False]
        terms = [(k, v, t) for k, v, t in exact if isinstance(t, z3.ExprRef)]
        if terms and not wrong:
            conj = pinned(self._and([t for _, _, t in terms]))
            known = self._known(conj)
            if known is False:
                wrong = [label(k, v) for k, v, t in terms if self._known(pinned(t)) is False]
            elif known is None and self._sat(guard, z3.Not(conj)) != "unsat":
                return "successor not determined: an allowed post-state differs from the spec's"
        if wrong:
            return f"successor differs: the encoding never has {', '.join(wrong[:4])}"
        if loose:
            if any(t is False for _, _, t in loose):
                return "the spec's successor is not among the allowed post-states"
            rest = [t for _, _, t in exact + loose if isinstance(t, z3.ExprRef)]
            if self._sat(guard, pinned(self._and(rest))) != "sat":
                return "the spec's successor is not among the allowed post-states"
            self.report.at_least += 1
        else:
            self.report.exact += 1
        return ""


def candidate_events(state: SystemState, n_reqs: int, offers: Sequence[Enqueue]) -> list[Event]:
    """Every event over the universe: the next offered enqueue and a repeated one, and
    every rank x request instance of the per-rank events (most of them disabled)."""
    evs: list[Event] = [Step()]
    nxt = len(state.requests)
    if nxt < len(offers):
        evs.append(offers[nxt])
        # the same request on slots a trace names: each rank's last free one (not the FIFO
        # front), and rank 0's lowest slot that is not free there (refused)
        last = tuple(rs.free[-1] if rs.free else 0 for rs in state.ranks)
        evs.append(replace(offers[nxt], slots=last))
        taken = next((x for x in range(state.n_slots) if x not in state.ranks[0].free), None)
        if taken is not None:
            evs.append(replace(offers[nxt], slots=(taken,) + last[1:]))
    if state.requests:                      # a request id already used: must be refused
        evs.append(offers[0])
    for k in range(len(state.ranks)):
        for r in range(n_reqs):
            evs += [KvDone(k, r), Fail(k, r), Land(k, r, ROOM), Land(k, r, PAYLOAD), Fence(k, r)]
    return evs


def check_refinement(variant: Any, states: Iterable[SystemState], offers: Sequence[Enqueue],
                     mode: str, stop_at_first: bool = True) -> RefinementReport:
    """Check every live state (a hung one has no events at all) against the actions.
    The universe's requests are the offers: one more than the states ever enqueued
    gives every state a fresh request to enqueue (so a rank without a free slot is
    seen refusing it)."""
    states = [s for s in states if s.hung is None]
    if not states:
        raise ValueError("no state to check")
    ch = Checker(variant, Sizes(states[0].n_ranks, len(offers), states[0].n_slots), mode)
    for st in states:
        ch.check_state(st, candidate_events(st, len(offers), offers), offers)
        if stop_at_first and ch.report.mismatches:
            break
    return ch.report
