"""The vocabulary of the Z3 encoding: sorts, the state functions, and the domain.

One ``Ctx`` per query family (no globals). It fixes the variant and how quantifiers
are read:

* unbounded (``sizes=None``): Rank, Req and Slot are uninterpreted sorts of any size,
  ``forall`` builds a real ``z3.ForAll``. Inductive proofs run here, so they cover
  every number of ranks, requests and slots.
* finite (``sizes=Sizes(...)``): each sort is a list of distinct named elements and
  ``forall`` expands to a conjunction, so bounded unrolling is quantifier-free.
* interpreted (``universe=Sizes(...)``, refinement only): the unbounded reading (real
  ``ForAll``, the MIN's axioms, alignment skolems, fresh choices) with each sort an
  enumeration of exactly that many elements (distinct, and nothing else: domain
  closure), so the unbounded code runs on one concrete state (model/encoding/refine.py).

A ``State`` holds one callable per state function; a pre-state wraps declared
``z3.Function`` symbols, a post-state is built by an action as closures over the
pre-state (no fresh symbols, no definitional quantifiers).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Sequence

import z3

from model.spec.kernel import Ops
from model.spec.variants import Variant

Z3OPS = Ops(ite=z3.If, and_=z3.And, not_=z3.Not, eq=lambda a, b: a == b,
            ge=lambda a, b: a >= b, false=z3.BoolVal(False))

# field -> (argument sorts, range sort). Per (rank, request): the receiver and the
# request's metadata writes on that rank; per (rank, slot): the metadata row.
SIGNATURE: dict[str, tuple[tuple[str, ...], str]] = {
    "enq": (("Req",), "Bool"),              # enqueued (on every rank at once)
    "inq": (("Rank", "Req"), "Bool"),       # in this rank's transfer queue
    "recv": (("Rank", "Req"), "Int"),       # receiver poll, KVPoll 0..4
    "age": (("Rank", "Req"), "Int"),        # protocol steps polled so far
    "slot": (("Rank", "Req"), "Slot"),      # metadata slot this rank gave it
    "dec": (("Rank", "Req"), "Bool"),       # left this rank's queue (has an outcome)
    "commit": (("Rank", "Req"), "Bool"),    # the outcome was a commit
    "cpay": (("Rank", "Req"), "Int"),       # payload a commit read
    "lr": (("Rank", "Req"), "Bool"),        # its room write landed here
    "lp": (("Rank", "Req"), "Bool"),        # its payload write landed here
    "fen": (("Rank", "Req"), "Bool"),       # its in-flight writes here are fenced
    "quar": (("Rank", "Req"), "Bool"),      # left; slot held until writes are done
    "held": (("Rank", "Req"), "Bool"),      # aborted as Failed; slot deferred (#35049)
    "hage": (("Rank", "Req"), "Int"),       # steps its deferred slot has been held
    "free": (("Rank", "Slot"), "Bool"),     # slot on the free list
    "rroom": (("Rank", "Slot"), "Int"),     # row: bootstrap_room column 0
    "rpay": (("Rank", "Slot"), "Int"),      # row: first output token
    "owner": (("Rank", "Slot"), "Req"),     # last request the slot was given to
    "stamp": (("Rank", "Slot"), "Int"),     # when it was freed (FIFO order, finite only)
    "clock": ((), "Int"),                   # transitions so far (for stamps)
}



@dataclass(frozen=True)
class State:
    enq: Callable[..., Any]
    inq: Callable[..., Any]
    recv: Callable[..., Any]
    age: Callable[..., Any]
    slot: Callable[..., Any]
    dec: Callable[..., Any]
    commit: Callable[..., Any]
    cpay: Callable[..., Any]
    lr: Callable[..., Any]
    lp: Callable[..., Any]
    fen: Callable[..., Any]
    quar: Callable[..., Any]
    held: Callable[..., Any]
    hage: Callable[..., Any]
    free: Callable[..., Any]
    rroom: Callable[..., Any]
    rpay: Callable[..., Any]
    owner: Callable[..., Any]
    stamp: Callable[..., Any]
    clock: Callable[..., Any]

    def but(self, **changes: Callable[..., Any]) -> "State":
        return replace(self, **changes)

    def pending(self, k: Any, r: Any) -> Any:
        """Some metadata write of r to rank k may still land (not all landed, not fenced)."""
        return z3.And(self.enq(r), z3.Not(z3.And(self.lr(k, r), self.lp(k, r))),
                      z3.Not(self.fen(k, r)))

    def occupies(self, k: Any, r: Any) -> Any:
        """r holds its slot on rank k: queued, quarantined until its writes are done, or
        held by a deferred release."""
        return z3.Or(self.inq(k, r), self.quar(k, r), self.held(k, r))

    def seen(self, k: Any, r: Any) -> Any:
        """The room rank k reads in r's slot."""
        return self.rroom(k, self.slot(k, r))


assert [f.name for f in fields(State)] == list(SIGNATURE)


def memo(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` over Z3 terms, each distinct argument tuple built once. Terms are hash-consed,
    so equal terms share an id; the cache keeps the arguments alive so no id is reused."""
    cache: dict[tuple[int, ...], tuple[Any, tuple]] = {}

    def cached(*args: Any) -> Any:
        key = tuple(a.get_id() for a in args)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = (f(*args), args)
        return hit[0]
    return cached


@dataclass(frozen=True)
class Sizes:
    ranks: int
    reqs: int
    slots: int

    def __str__(self) -> str:
        return f"T={self.ranks} N={self.reqs} S={self.slots}"


_ENUMS: dict[tuple[str, int], tuple[z3.SortRef, list[z3.ExprRef]]] = {}


def _enum_sort(name: str, size: int) -> tuple[z3.SortRef, list[z3.ExprRef]]:
    """The enumeration sort of ``size`` elements standing for ``name`` (one per size:
    Z3 datatypes are declared once per name)."""
    if size < 1:
        raise ValueError(f"a {name} universe needs at least one element, got {size}")
    key = (name, size)
    if key not in _ENUMS:
        sort, consts = z3.EnumSort(f"{name}{size}", [f"{name.lower()}{i}.{size}" for i in range(size)])
        _ENUMS[key] = (sort, list(consts))
    return _ENUMS[key]


class Ctx:
    """Sorts, rigid request data, quantifier reading and fresh names for one query family."""

    def __init__(self, variant: Variant, sizes: Sizes | None = None,
                 universe: Sizes | None = None):
        if sizes is not None and universe is not None:
            raise ValueError("a context is finite (sizes) or interpreted (universe), not both")
        self.variant = variant
        self.sizes = sizes
        self.finite = sizes is not None
        self.elems: dict[str, list[z3.ExprRef]] = {}
        # Unbounded: uninterpreted sorts. Finite: the integers 0..n-1, so that equalities
        # between elements are decided by Z3's simplifier rather than by search.
        # Interpreted: enumeration sorts (their constants are distinct and are all there is).
        if universe is not None:
            self.sorts = {}
            for n, size in (("Rank", universe.ranks), ("Req", universe.reqs), ("Slot", universe.slots)):
                self.sorts[n], self.elems[n] = _enum_sort(n, size)
        elif sizes is None:
            self.sorts = {n: z3.DeclareSort(n) for n in ("Rank", "Req", "Slot")}
        else:
            self.sorts = {n: z3.IntSort() for n in ("Rank", "Req", "Slot")}
        self.sorts["Int"], self.sorts["Bool"] = z3.IntSort(), z3.BoolSort()
        req = self.sorts["Req"]
        # Rigid per request: fixed by the client before enqueue, never changed.
        self.room = z3.Function("room", req, z3.IntSort())
        self.payload = z3.Function("payload", req, z3.IntSort())
        self.idx = z3.Function("enqueue_index", req, z3.IntSort())
        self._count = itertools.count()
        # every fresh symbol, in creation order: a finite unrolling renames those of
        # its one-step template per frame (checks.Unrolling)
        self.created: list[z3.FuncDeclRef] = []
        self.axioms: list[z3.BoolRef] = []
        if isinstance(variant.timeout_steps, z3.ExprRef):    # a symbolic bound: any T >= 1
            self.axioms.append(variant.timeout_steps >= 1)
        # The bound bounded_wait states for a variant without a timeout of its own (its
        # negative row: no bound W >= 1 on the wait is inductive there).
        self.wait_bound = z3.Int("wait_bound")
        self.axioms.append(self.wait_bound >= 1)
        if sizes is not None:
            for name, n in (("Rank", sizes.ranks), ("Req", sizes.reqs), ("Slot", sizes.slots)):
                self.elems[name] = [z3.IntVal(i) for i in range(n)]
            # Rooms and payloads are only compared with each other and with 0, so the
            # values 0..N realise every pattern of equalities: no behaviour is lost.
            n = sizes.reqs
            for i, r in enumerate(self.elems["Req"]):
                self.axioms += [self.idx(r) == i, self.room(r) >= 0, self.room(r) <= n,
                                self.payload(r) >= 0, self.payload(r) <= n]

    # -- names ------------------------------------------------------------------------
    def fresh(self, name: str, sort: str) -> z3.ExprRef:
        c = z3.Const(f"{name}!{next(self._count)}", self.sorts[sort])
        self.created.append(c.decl())
        return c

    def fresh_fn(self, name: str, *sorts: str) -> z3.FuncDeclRef:
        f = z3.Function(f"{name}!{next(self._count)}", *(self.sorts[s] for s in sorts))
        self.created.append(f)
        return f

    # -- quantifiers ----------------------------------------------------------------------
    def forall(self, sorts: Sequence[str], body: Callable[..., Any]) -> z3.BoolRef:
        if self.finite:
            return z3.And([body(*xs) for xs in itertools.product(*(self.elems[s] for s in sorts))])
        xs = [self.fresh(s.lower(), s) for s in sorts]
        return z3.ForAll(xs, body(*xs))

    def at_most(self, sizes: Sizes) -> list[z3.BoolRef]:
        """Unbounded only: every sort has at most ``sizes`` elements (domain closure over
        fresh constants). Added to a query whose answer should be sat, it steers the
        quantifier engine to small models; any model of it is a model of the query
        without it, so a sat answer (and its model) stands for the unbounded query."""
        if self.finite:
            raise ValueError("at_most bounds the unbounded sorts")
        out = []
        for name, n in (("Rank", sizes.ranks), ("Req", sizes.reqs), ("Slot", sizes.slots)):
            elems = [self.fresh(f"{name.lower()}_elem", name) for _ in range(n)]
            out.append(self.forall((name,), lambda x, es=elems: z3.Or([x == e for e in es])))
        return out

    def member(self, term: z3.ExprRef, sort: str) -> z3.BoolRef:
        """Finite: the term denotes one of the sort's elements. Unbounded: trivially true."""
        if not self.finite:
            return z3.BoolVal(True)
        return z3.And(term >= 0, term < len(self.elems[sort]))

    # -- states ---------------------------------------------------------------------------
    def declare_state(self, tag: str) -> State:
        fns = {}
        for name, (args, rng) in SIGNATURE.items():
            if args:
                fns[name] = z3.Function(f"{name}{tag}", *(self.sorts[a] for a in args), self.sorts[rng])
            else:
                const = z3.Const(f"{name}{tag}", self.sorts[rng])
                fns[name] = (lambda c: (lambda: c))(const)
        return State(**fns)

    def well_formed(self, s: State) -> list[z3.BoolRef]:
        """Finite: Slot- and Req-valued functions take element values (domain closure)."""
        if not self.finite:
            return []
        return [self.forall(("Rank", "Req"), lambda k, r: self.member(s.slot(k, r), "Slot")),
                self.forall(("Rank", "Slot"), lambda k, x: self.member(s.owner(k, x), "Req"))]

    def define(self, new: State, value: State) -> z3.BoolRef:
        """Finite only: ``new`` (declared symbols) equals ``value`` (closures) everywhere."""
        eqs = []
        for name, (args, _) in SIGNATURE.items():
            for xs in itertools.product(*(self.elems[a] for a in args)):
                eqs.append(getattr(new, name)(*xs) == getattr(value, name)(*xs))
        return z3.And(eqs)

    # -- the MIN and queue alignment --------------------------------------------------------
    def rank_min(self, g: Callable[[Any, Any], Any]) -> tuple[Callable[[Any], Any], list[z3.BoolRef]]:
        """red(r) = MIN over ranks k of g(k, r). Unbounded: a fresh function with the
        axioms red(r) <= g(k, r) for all k and red(r) = g(w(r), r) (w the skolemised
        witness rank). Finite: the explicit minimum."""
        if self.finite:
            def red(r: Any) -> Any:
                terms = [g(k, r) for k in self.elems["Rank"]]
                m = terms[0]
                for t in terms[1:]:
                    m = z3.If(t < m, t, m)
                return m
            return red, []
        m = self.fresh_fn("red", "Req", "Int")
        w = self.fresh_fn("red_witness", "Req", "Rank")
        side = [self.forall(("Rank", "Req"), lambda k, r: m(r) <= g(k, r)),
                self.forall(("Req",), lambda r: m(r) == g(w(r), r))]
        return m, side

    def aligned(self, s: State) -> tuple[z3.BoolRef, list[z3.BoolRef]]:
        """A Bool that is true exactly when every rank queues the same requests.
        Unbounded: a fresh Bool, its universal half as an implication and its
        existential half skolemised (two ranks and a request that differ)."""
        same = lambda k1, k2, r: s.inq(k1, r) == s.inq(k2, r)
        if self.finite:
            return self.forall(("Rank", "Rank", "Req"), same), []
        al = self.fresh("aligned", "Bool")
        d1, d2, dr = self.fresh("diff_rank", "Rank"), self.fresh("diff_rank", "Rank"), self.fresh("diff_req", "Req")
        return al, [z3.Implies(al, self.forall(("Rank", "Rank", "Req"), same)),
                    z3.Or(al, z3.Not(same(d1, d2, dr)))]

    def first_fresh(self, s: State, r0: z3.ExprRef) -> z3.BoolRef:
        """Finite: requests are enqueued in element order (a symmetry reduction: request
        ids are labels). Unbounded: any fresh request."""
        if not self.finite:
            return z3.Not(s.enq(r0))
        reqs = self.elems["Req"]
        return z3.Or([z3.And(r0 == reqs[j], z3.Not(s.enq(reqs[j])), *[s.enq(q) for q in reqs[:j]])
                      for j in range(len(reqs))])
