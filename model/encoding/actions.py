"""The transition relation: the initial states and one action per spec event.

Every action returns its guard and its post-state as closures over the pre-state.
The per-request protocol decisions are the spec's own ``gated_poll`` and
``pop_decision`` evaluated over Z3 terms (``Z3OPS``); everything else reads the
``Variant`` fields. Abstraction arguments (see docs/PROOFS.md):

* Queue order. Enqueue appends a fresh request on every rank at once and a pop only
  removes, so every rank's queue is the global enqueue order restricted to its
  members: two queues are equal iff they have the same members, and no queue holds a
  request twice. Queues are therefore encoded as membership ``inq(k, r)`` only.
* The MIN. While the queues are identical, position i is the same request on every
  rank, so the positional MIN is the per-request MIN over ranks (``Ctx.rank_min``).
  When they are not (``aligned`` false), the concrete system either hangs (lengths
  differ) or mixes requests; the unbounded encoding lets every rank see ANY reduced
  value (a havoc, which over-approximates both), the finite unrolling disables the
  step (an under-approximation, fine for finding counterexamples: it stops at the
  first divergence anyway).
* Slots. Unbounded proofs let enqueue take ANY free slot per rank: the FIFO free list
  is one of those choices, so this over-approximates and is sound for safety. The
  finite unrolling encodes FIFO exactly (``stamp``: the time a slot was freed), so
  its counterexamples replay on the concrete spec slot for slot.
* Bookkeeping the spec drops once a request can receive no more writes
  (``_forget_if_done``) is kept here as monotone flags: they only disable land and
  fence events, exactly as the dropped entries do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import z3

from model.spec.events import Enqueue, Event, Fail, Fence, KvDone, Land, Step
from model.spec.kernel import Decision, gated_poll, pop_decision
from model.spec.kvpoll import KVPoll
from model.spec.variants import Admission, Deferral
from model.encoding.vocab import Ctx, State, Z3OPS, memo

WAITING, SUCCESS, FAILED = int(KVPoll.WaitingForInput), int(KVPoll.Success), int(KVPoll.Failed)
TRANSFERRING = int(KVPoll.Transferring)
KEEP, COMMIT, ABORT_FAILED = int(Decision.KEEP), int(Decision.COMMIT), int(Decision.ABORT_FAILED)
ACTION_NAMES = ("enqueue", "kv_done", "fail", "land_room", "land_payload", "fence", "step")


@dataclass
class Action:
    name: str
    params: dict[str, Any]              # the event's arguments (Z3 terms)
    guard: z3.BoolRef                   # when the event is enabled
    post: State                         # the next state
    side: list[z3.BoolRef] = field(default_factory=list)   # definitions (MIN, alignment)
    aux: dict[str, Callable[..., Any]] = field(default_factory=dict)


def init(ctx: Ctx, s: State) -> z3.BoolRef:
    """Nothing enqueued, every row zeroed, every slot free (FIFO in index order)."""
    parts = [ctx.forall(("Req",), lambda r: z3.Not(s.enq(r))),
             ctx.forall(("Rank", "Req"), lambda k, r: z3.And(
                 z3.Not(s.inq(k, r)), z3.Not(s.dec(k, r)), z3.Not(s.lr(k, r)), z3.Not(s.lp(k, r)),
                 z3.Not(s.fen(k, r)), z3.Not(s.quar(k, r)), z3.Not(s.held(k, r)))),
             ctx.forall(("Rank", "Slot"), lambda k, x: z3.And(s.free(k, x), s.rroom(k, x) == 0,
                                                              s.rpay(k, x) == 0)),
             s.clock() == 0]
    if ctx.finite:
        slots = ctx.elems["Slot"]
        parts += [s.stamp(k, x) == j - len(slots) for k in ctx.elems["Rank"] for j, x in enumerate(slots)]
    return z3.And(parts)


def _stamp_base(ctx: Ctx) -> int:
    return 2 * ctx.sizes.reqs + 1 if ctx.finite else 1


def _free_slots(ctx: Ctx, s: State, freed: Callable[[Any, Any], Any],
                first: Callable[[Any, Any], Any] | None = None) -> State:
    """Slots where ``freed`` holds go back to the free list (zeroed where the variant does).
    Within one transition they go back in their owners' enqueue order, those where
    ``first`` holds (deferred slots released before the step's pops) before the rest.
    (Queue order; SGLang's set order of queue positions is the same order while the
    positions are below 8, which every finite unrolling stays within.)"""
    base = _stamp_base(ctx)
    late = ctx.sizes.reqs if ctx.finite else 0
    rroom = s.rroom
    if ctx.variant.clear_on_free:
        rroom = lambda k, x: z3.If(freed(k, x), 0, s.rroom(k, x))
    rank = (lambda k, x: late) if first is None else (lambda k, x: z3.If(first(k, x), 0, late))
    return s.but(free=lambda k, x: z3.Or(s.free(k, x), freed(k, x)), rroom=rroom,
                 stamp=lambda k, x: z3.If(freed(k, x),
                                          s.clock() * base + rank(k, x) + ctx.idx(s.owner(k, x)),
                                          s.stamp(k, x)))


def _tick(s: State) -> State:
    return s.but(clock=lambda: s.clock() + 1)


def _writes_done(ctx: Ctx, s: State, k0: Any, r0: Any) -> State:
    """After a land or fence: a quarantined slot whose writes are all done is freed."""
    done = z3.And(s.quar(k0, r0), z3.Or(z3.And(s.lr(k0, r0), s.lp(k0, r0)), s.fen(k0, r0)))
    x0 = s.slot(k0, r0)
    out = s.but(quar=lambda k, r: z3.And(s.quar(k, r), z3.Not(z3.And(done, k == k0, r == r0))))
    return _tick(_free_slots(ctx, out, lambda k, x: z3.And(done, k == k0, x == x0)))


def _set_at(f: Callable[..., Any], k0: Any, a0: Any, value: Any) -> Callable[..., Any]:
    return lambda k, a: z3.If(z3.And(k == k0, a == a0), value, f(k, a))


def _params(ctx: Ctx, name: str, k0: Any, r0: Any) -> tuple[Any, Any]:
    """The event's rank and request: given (a ground instance) or fresh constants."""
    return (ctx.fresh(f"{name}_rank", "Rank") if k0 is None else k0,
            ctx.fresh(f"{name}_req", "Req") if r0 is None else r0)


def enqueue(ctx: Ctx, s: State, r0: Any = None, slots: tuple[int, ...] | None = None) -> Action:
    """``slots``: the slot each rank's allocator gave the request (a real run's trace,
    ground elements only): each must be free there, and every rank takes its own,
    whatever the admission (the spec's ``Enqueue.slots``)."""
    r0 = ctx.fresh("enq_req", "Req") if r0 is None else r0
    pick = ctx.fresh_fn("pick", "Rank", "Slot")

    def slot_ok(k: Any) -> Any:
        ok = [ctx.member(pick(k), "Slot"), s.free(k, pick(k))]
        if slots is not None:
            ok.append(_named_slot(ctx, k, pick(k), slots))
        elif ctx.finite:    # FIFO: the free slot freed longest ago
            ok.append(ctx.forall(("Slot",), lambda x: z3.Implies(s.free(k, x),
                                                                 s.stamp(k, pick(k)) <= s.stamp(k, x))))
        return z3.And(ok)

    if ctx.variant.admission is Admission.AGREED or slots is not None:
        # the MIN over ranks of their free slots is at least 1 (or a trace names each
        # rank's slot, free there): every rank takes it
        admit = lambda k: z3.BoolVal(True)
        takes = [ctx.forall(("Rank",), slot_ok)]
    else:
        admit, takes = _local_admission(ctx, s, slot_ok)
    guard = z3.And(ctx.member(r0, "Req"), ctx.first_fresh(s, r0), *takes)
    new = lambda r: r == r0
    here = lambda k, r: z3.And(new(r), admit(k))
    post = s.but(
        enq=lambda r: z3.Or(s.enq(r), new(r)),
        inq=lambda k, r: z3.Or(s.inq(k, r), here(k, r)),
        recv=lambda k, r: z3.If(here(k, r), WAITING, s.recv(k, r)),
        age=lambda k, r: z3.If(here(k, r), 0, s.age(k, r)),
        slot=lambda k, r: z3.If(here(k, r), pick(k), s.slot(k, r)),
        **{f: (lambda g: lambda k, r: z3.And(g(k, r), z3.Not(new(r))))(getattr(s, f))
           for f in ("dec", "fen", "quar", "held")},
        # no write targets a rank that did not take the request: nothing is in flight there
        **{f: (lambda g: lambda k, r: z3.If(new(r), z3.Not(admit(k)), g(k, r)))(getattr(s, f))
           for f in ("lr", "lp")},
        free=lambda k, x: z3.And(s.free(k, x), z3.Not(z3.And(admit(k), x == pick(k)))),
        owner=lambda k, x: z3.If(z3.And(admit(k), x == pick(k)), r0, s.owner(k, x)))
    return Action("enqueue", {"req": r0, "pick": pick}, guard, _tick(post))


def _named_slot(ctx: Ctx, k: Any, slot: Any, slots: tuple[int, ...]) -> z3.BoolRef:
    """``slot`` is the one ``slots`` names for rank ``k`` (false for a rank count or a slot
    outside the universe: the spec refuses those too)."""
    ranks, universe = ctx.elems["Rank"], ctx.elems["Slot"]
    if len(slots) != len(ranks):
        return z3.BoolVal(False)
    return z3.Or([z3.And(k == rank, slot == universe[x]) for rank, x in zip(ranks, slots)
                  if 0 <= x < len(universe)])


def _local_admission(ctx: Ctx, s: State, slot_ok: Callable[[Any], Any]
                     ) -> tuple[Callable[[Any], Any], list[z3.BoolRef]]:
    """Each rank takes the request iff it has a free slot of its own; at least one does.
    Unbounded, "has a free slot" is a fresh predicate constrained both ways, plus the
    capacity argument (docs/PROOFS.md): every rank has the same number of slots, and
    the slots off a free list are exactly those its occupying requests hold
    (slot_owner, slot_held), so ranks with the same occupying requests have the same
    number of free slots and decide alike."""
    if ctx.finite:
        admit = lambda k: z3.Or([s.free(k, x) for x in ctx.elems["Slot"]])
        return admit, [ctx.forall(("Rank",), lambda k: z3.Implies(admit(k), slot_ok(k))),
                       z3.Or([admit(k) for k in ctx.elems["Rank"]])]
    adm = ctx.fresh_fn("admits", "Rank", "Bool")
    w = ctx.fresh("admitting_rank", "Rank")
    same_occupants = ctx.forall(("Rank", "Rank", "Req"),
                                lambda k1, k2, r: s.occupies(k1, r) == s.occupies(k2, r))
    return adm, [ctx.forall(("Rank",), lambda k: z3.Implies(adm(k), slot_ok(k))),
                 ctx.forall(("Rank", "Slot"), lambda k, x: z3.Implies(z3.Not(adm(k)),
                                                                    z3.Not(s.free(k, x)))),
                 adm(w),
                 z3.Implies(same_occupants, ctx.forall(("Rank",), lambda k: adm(k) == adm(w)))]


def receiver(ctx: Ctx, s: State, name: str, value: int, k0: Any = None, r0: Any = None) -> Action:
    """kv_done (Success) latches a queued, unlatched receiver; fail (Failed) also
    overrides a latched Success while the request is queued (as the spec's _arrive)."""
    k0, r0 = _params(ctx, name, k0, r0)
    rv = s.recv(k0, r0)
    unlatched = [rv != FAILED] if value == FAILED else [rv != SUCCESS, rv != FAILED]
    guard = z3.And(ctx.member(k0, "Rank"), ctx.member(r0, "Req"), s.inq(k0, r0), *unlatched)
    return Action(name, {"rank": k0, "req": r0}, guard, _tick(s.but(recv=_set_at(s.recv, k0, r0, value))))


def land(ctx: Ctx, s: State, field_name: str, k0: Any = None, r0: Any = None) -> Action:
    """One field of r0's row becomes visible on rank k0, in the slot k0 gave r0 (which
    may have been freed and reused since: a late write)."""
    k0, r0 = _params(ctx, "land", k0, r0)
    room = field_name == "room"
    bit = s.lr if room else s.lp
    guard = [ctx.member(k0, "Rank"), ctx.member(r0, "Req"), s.enq(r0), z3.Not(bit(k0, r0)),
             z3.Not(s.fen(k0, r0))]
    if room and ctx.variant.room_after_payload:
        guard.append(s.lp(k0, r0))
    x0 = s.slot(k0, r0)
    if room:
        mid = s.but(rroom=_set_at(s.rroom, k0, x0, ctx.room(r0)), lr=_set_at(s.lr, k0, r0, True))
    else:
        mid = s.but(rpay=_set_at(s.rpay, k0, x0, ctx.payload(r0)), lp=_set_at(s.lp, k0, r0, True))
    return Action(f"land_{field_name}", {"rank": k0, "req": r0}, z3.And(guard),
                  _writes_done(ctx, mid, k0, r0))


def fence(ctx: Ctx, s: State, k0: Any = None, r0: Any = None) -> Action:
    """Prefill acknowledged r0's abort on rank k0: nothing of r0 is in flight any more."""
    k0, r0 = _params(ctx, "fence", k0, r0)
    guard = z3.And(ctx.member(k0, "Rank"), ctx.member(r0, "Req"), s.enq(r0), s.dec(k0, r0),
                   z3.Not(s.fen(k0, r0)),
                   z3.Or(z3.Not(z3.And(s.lr(k0, r0), s.lp(k0, r0))), s.held(k0, r0)))
    mid = s.but(fen=_set_at(s.fen, k0, r0, True))
    side: list[z3.BoolRef] = []
    if ctx.variant.defer_failed is Deferral.LOCAL:     # the rank releases its held slot now
        was = s.held(k0, r0)
        x0 = s.slot(k0, r0)
        mid = _free_slots(ctx, mid.but(held=_set_at(s.held, k0, r0, False)),
                          lambda k, x: z3.And(was, k == k0, x == x0))
    elif ctx.variant.defer_failed is Deferral.AGREED:
        # every rank holding r0 can release it, this fence counted: all release it now
        # (machine._fence: 0.5.23 resolves its holds before each admission)
        release, side = _deferred_release(ctx, s, mid.fen, ahead=0)
        go = release(k0, r0)
        mid = _free_slots(ctx, mid.but(held=lambda k, r: z3.And(s.held(k, r),
                                                                z3.Not(z3.And(go, r == r0)))),
                          lambda k, x: z3.And(go, s.held(k, r0), s.slot(k, r0) == x))
    return Action("fence", {"rank": k0, "req": r0}, guard, _writes_done(ctx, mid, k0, r0), side)


def protocol_step(ctx: Ctx, s: State) -> Action:
    """poll -> gate -> MIN -> pop -> release, on every rank and request at once."""
    v = ctx.variant
    # memo: the post-state reads each decision many times; build its term once.
    g = memo(lambda k, r: gated_poll(v, s.recv(k, r), s.seen(k, r), ctx.room(r), s.age(k, r), Z3OPS))
    aligned, side = ctx.aligned(s)
    m, min_side = ctx.rank_min(g)
    m = memo(m)
    havoc = ctx.fresh_fn("havoc_reduced", "Rank", "Req", "Int")
    red = lambda k, r: z3.If(aligned, m(r), havoc(k, r))
    d = memo(lambda k, r: pop_decision(v, red(k, r), s.seen(k, r), ctx.room(r), Z3OPS))
    leaves = memo(lambda k, r: z3.And(s.inq(k, r), d(k, r) != KEEP))
    commits = lambda k, r: z3.And(leaves(k, r), d(k, r) == COMMIT)
    if v.defer_failed is Deferral.NONE:
        defer = lambda k, r: z3.BoolVal(False)
    else:
        defer = lambda k, r: z3.And(leaves(k, r), d(k, r) == ABORT_FAILED)
    if v.fence_before_reuse:
        hold = lambda k, r: z3.And(leaves(k, r), s.pending(k, r), z3.Not(defer(k, r)))
    else:
        hold = lambda k, r: z3.BoolVal(False)
    release, release_side = _deferred_release(ctx, s)

    @memo
    def freed(k: Any, x: Any) -> Any:
        o = s.owner(k, x)
        return z3.And(s.slot(k, o) == x, z3.Or(
            z3.And(leaves(k, o), z3.Not(hold(k, o)), z3.Not(defer(k, o))), release(k, o)))

    def released(k: Any, x: Any) -> Any:
        return release(k, s.owner(k, x))

    post = s.but(
        inq=lambda k, r: z3.And(s.inq(k, r), z3.Not(leaves(k, r))),
        # ages count only steps kept after a MIN of Transferring or Success (machine._pop)
        age=lambda k, r: z3.If(z3.And(s.inq(k, r), z3.Not(leaves(k, r)), red(k, r) >= TRANSFERRING),
                               s.age(k, r) + 1, s.age(k, r)),
        dec=lambda k, r: z3.Or(s.dec(k, r), leaves(k, r)),
        commit=lambda k, r: z3.If(leaves(k, r), d(k, r) == COMMIT, s.commit(k, r)),
        cpay=lambda k, r: z3.If(commits(k, r), s.rpay(k, s.slot(k, r)), s.cpay(k, r)),
        quar=lambda k, r: z3.Or(s.quar(k, r), hold(k, r)))
    if v.defer_failed is not Deferral.NONE:
        still = lambda k, r: z3.And(s.held(k, r), z3.Not(release(k, r)))
        post = post.but(held=lambda k, r: z3.Or(still(k, r), defer(k, r)),
                        hage=lambda k, r: z3.If(defer(k, r), 0,
                                                z3.If(s.held(k, r), s.hage(k, r) + 1, s.hage(k, r))))
    post = _tick(_free_slots(ctx, post, freed, released))
    guard = aligned if ctx.finite else z3.BoolVal(True)
    return Action("step", {}, guard, post, side + min_side + release_side,
                  {"gated": g, "reduced": red, "decision": d})


def _deferred_release(ctx: Ctx, s: State, fen: Callable[[Any, Any], Any] | None = None, ahead: int = 1
                      ) -> tuple[Callable[[Any, Any], Any], list[z3.BoolRef]]:
    """Which deferred slots are released (machine._releasable): fenced (by ``fen``, the
    state's or a fence action's), or held release_timeout_steps steps, counting ``ahead``
    more (a step counts itself; a fence between steps does not); judged per rank (local)
    or once every rank holding the request can release it (agreed: the MIN over ranks
    of "not held or can release")."""
    v = ctx.variant
    if v.defer_failed is Deferral.NONE:
        return (lambda k, r: z3.BoolVal(False)), []
    limit = v.release_timeout_steps
    fen = s.fen if fen is None else fen
    can = lambda k, r: z3.Or(fen(k, r), (s.hage(k, r) + ahead >= limit) if limit is not None
                             else z3.BoolVal(False))
    if v.defer_failed is Deferral.LOCAL:
        return (lambda k, r: z3.And(s.held(k, r), can(k, r))), []
    ok, side = ctx.rank_min(lambda k, r: z3.If(z3.Or(z3.Not(s.held(k, r)), can(k, r)), 1, 0))
    return (lambda k, r: z3.And(s.held(k, r), ok(r) == 1)), side


def actions(ctx: Ctx, s: State) -> list[Action]:
    """Every action from pre-state ``s``, in ACTION_NAMES order (fresh parameters each call)."""
    return [enqueue(ctx, s), receiver(ctx, s, "kv_done", SUCCESS), receiver(ctx, s, "fail", FAILED),
            land(ctx, s, "room"), land(ctx, s, "payload"), fence(ctx, s), protocol_step(ctx, s)]


def event_action(ctx: Ctx, s: State, ev: Event) -> Action:
    """The action of one spec event, its parameters the context's elements (the one
    place that maps spec events to actions: the refinement check goes through it)."""
    rank = lambda: ctx.elems["Rank"][ev.rank]
    req = lambda: ctx.elems["Req"][ev.req]
    if isinstance(ev, Enqueue):
        return enqueue(ctx, s, req(), ev.slots)
    if isinstance(ev, KvDone):
        return receiver(ctx, s, "kv_done", SUCCESS, rank(), req())
    if isinstance(ev, Fail):
        return receiver(ctx, s, "fail", FAILED, rank(), req())
    if isinstance(ev, Land):
        return land(ctx, s, ev.field, rank(), req())
    if isinstance(ev, Fence):
        return fence(ctx, s, rank(), req())
    if isinstance(ev, Step):
        return protocol_step(ctx, s)
    raise ValueError(f"no action for event {ev!r}")


def ground_actions(ctx: Ctx, s: State) -> list[Action]:
    """Finite only: one action per event instance (parameters are elements), so Z3's
    simplifier folds every comparison of a parameter with an element."""
    ranks, reqs = ctx.elems["Rank"], ctx.elems["Req"]
    out = [enqueue(ctx, s, r) for r in reqs]
    for k in ranks:
        for r in reqs:
            out += [receiver(ctx, s, "kv_done", SUCCESS, k, r), receiver(ctx, s, "fail", FAILED, k, r),
                    land(ctx, s, "room", k, r), land(ctx, s, "payload", k, r), fence(ctx, s, k, r)]
    return out + [protocol_step(ctx, s)]
