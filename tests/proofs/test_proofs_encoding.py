"""The encoding and the spec agree on random reachable states: every ground event is
enabled in the encoding iff the spec allows it, and the encoded next state equals the
spec's next state (mapped through the abstraction), FIFO slot order included."""
import random

import pytest
import z3

from model.encoding.actions import actions, init
from model.encoding.refine import view
from model.encoding.invariants import LEMMAS, SAFETY
from model.encoding.solver import Solver
from model.encoding.vocab import Ctx, Sizes, State
from model.spec.events import PAYLOAD, ROOM, Enqueue, Fail, Fence, KvDone, Land, Step
from model.spec.machine import EventNotEnabled, enabled, step
from model.spec.state import initial_state
from model.spec.variants import ABLATIONS, VARIANTS

RANKS, REQS, SLOTS = 2, 3, 2
ALL = {**VARIANTS, **ABLATIONS}


_view = view     # the spec state as plain values per encoding function (model/encoding/refine.py)


def _assert_view(ctx: Ctx, s: State, view: dict) -> list:
    return [getattr(s, key[0])(*[z3.IntVal(a) for a in key[1:]]) == value for key, value in view.items()]


def _random_states(variant, n_states, seed):
    rng = random.Random(seed)
    for _ in range(n_states):
        state, nxt = initial_state(variant, RANKS, SLOTS), 0
        for _ in range(rng.randrange(0, 14)):
            offer = [Enqueue(nxt, rng.choice((0, 2, 3)), rng.choice((1, 2)))] if nxt < REQS else []
            events = enabled(state, offer)
            if not events:      # hung in a mismatched collective
                break
            ev = rng.choice(events)
            state, _ = step(state, ev)
            nxt += isinstance(ev, Enqueue)
        yield state, nxt


def _ground_events(next_req, rng):
    evs = [Step()]
    if next_req < REQS:
        evs.append(Enqueue(next_req, rng.choice((0, 2, 3)), rng.choice((1, 2))))
    for k in range(RANKS):
        for r in range(REQS):
            evs += [KvDone(k, r), Fail(k, r), Land(k, r, ROOM), Land(k, r, PAYLOAD), Fence(k, r)]
    return evs


def _action_of(ev):
    if isinstance(ev, Land):
        return f"land_{ev.field}"
    return {Enqueue: "enqueue", KvDone: "kv_done", Fail: "fail", Fence: "fence", Step: "step"}[type(ev)]


def _projection_mismatches(post_view, want, model, post):
    bad = []
    for key, value in want.items():
        name, args = key[0], key[1:]
        k_r = args[:2]
        if name in ("recv", "age") and not want[("inq", *k_r)]:
            continue
        if name == "commit" and not want[("dec", *k_r)]:
            continue
        if name == "cpay" and not want[("commit", *k_r)]:
            continue
        if name in ("lr", "lp", "fen"):   # compare what the flags mean: writes still in flight
            continue
        if name == "slot" and not (want[("inq", *k_r)] or want[("quar", *k_r)]
                                   or want[("held", *k_r)]):
            continue
        if name == "hage" and not want[("held", *k_r)]:
            continue
        if name in ("owner", "stamp", "clock"):
            continue
        got = model.eval(getattr(post, name)(*[z3.IntVal(a) for a in args]), model_completion=True)
        got = z3.is_true(got) if z3.is_bool(got) else got.as_long()
        if got != value:
            bad.append((key, got, value))
    return bad


@pytest.mark.parametrize("name", sorted(ALL))
def test_encoded_events_match_the_spec(name):
    variant = ALL[name]
    rng = random.Random(name)
    checked = 0
    for state, next_req in _random_states(variant, 8, sum(map(ord, name))):
        ctx = Ctx(variant, Sizes(RANKS, REQS, SLOTS))
        s = ctx.declare_state("")
        for ev in _ground_events(next_req, rng):
            try:
                after, rec = step(state, ev)
                allowed = True
            except EventNotEnabled:
                allowed = False
            if isinstance(ev, Step) and any(rs.queue != state.ranks[0].queue for rs in state.ranks):
                allowed = False     # the finite unrolling stops at a divergence (actions.py)
            rooms = {r: (q.room, q.payload) for r, q in state.requests.items()}
            if isinstance(ev, Enqueue):
                rooms[ev.req] = (ev.room, ev.payload)
            solver = Solver(10_000)
            solver.add(*ctx.axioms, *_assert_view(ctx, s, _view(state, REQS)))
            solver.add(*[z3.And(ctx.room(z3.IntVal(r)) == rooms.get(r, (0, 0))[0],
                                ctx.payload(z3.IntVal(r)) == rooms.get(r, (0, 0))[1]) for r in range(REQS)])
            a = next(a for a in actions(ctx, s) if a.name == _action_of(ev))
            for key in ("rank", "req"):
                if key in a.params:
                    solver.add(a.params[key] == getattr(ev, key))
            solver.add(a.guard, *a.side)
            res = solver.check()
            assert (res.status == "sat") == allowed, (name, ev, res.status, allowed)
            if not allowed:
                continue
            if isinstance(ev, Step):
                for rk in rec.ranks:
                    for pos, r in enumerate(rk.queue):
                        g = res.model.eval(a.aux["gated"](z3.IntVal(rk.rank), z3.IntVal(r)), model_completion=True)
                        red = res.model.eval(a.aux["reduced"](z3.IntVal(rk.rank), z3.IntVal(r)), model_completion=True)
                        assert (g.as_long(), red.as_long()) == (rk.gated[pos], rk.reduced[pos])
            want = _view(after, REQS)
            assert not _projection_mismatches(None, want, res.model, a.post), (name, ev)
            # in-flight writes mean the same thing on both sides
            for k in range(RANKS):
                for r in range(REQS):
                    rs = after.ranks[k]
                    spec_pending = r in rs.landed and rs.landed[r] != 3 and r not in rs.fenced
                    enc = res.model.eval(a.post.pending(z3.IntVal(k), z3.IntVal(r)), model_completion=True)
                    assert z3.is_true(enc) == spec_pending, (name, ev, k, r)
                # FIFO: the free list order is the stamp order
                free = [x for x in range(SLOTS) if x in rs.free]
                stamps = {x: res.model.eval(a.post.stamp(z3.IntVal(k), z3.IntVal(x)), model_completion=True).as_long()
                          for x in free}
                assert sorted(free, key=stamps.get) == rs.free, (name, ev, k)
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_lemmas_hold_on_reachable_spec_states(name):
    """The strengthening lemmas are true of real reachable states (not just inductive)."""
    variant = VARIANTS[name]
    ctx = Ctx(variant, Sizes(RANKS, REQS, SLOTS))
    s = ctx.declare_state("")
    lemmas = ["fresh_is_blank", "recv_range", "ages_agree", "slot_owner", "slot_held", "quarantine_decided"]
    if name == "strict":
        lemmas += ["writes_to_held_slots", "free_rows_zero", "room_is_own_or_zero", "room_after_payload",
                   "payload_is_own", "bounded_wait", *SAFETY]
    for state, _ in _random_states(variant, 30, 7):
        solver = Solver(10_000)
        solver.add(*ctx.axioms, *_assert_view(ctx, s, _view(state, REQS)))
        solver.add(*[z3.And(ctx.room(z3.IntVal(r)) == q.room, ctx.payload(z3.IntVal(r)) == q.payload)
                     for r, q in state.requests.items()])
        for lemma in lemmas:
            pred = (LEMMAS.get(lemma) or SAFETY.get(lemma) or __import__("model.encoding.invariants", fromlist=["x"]).bounded_wait)
            with solver.frame():
                solver.add(z3.Not(pred(ctx, s)))
                assert solver.check().status == "unsat", (name, lemma)
