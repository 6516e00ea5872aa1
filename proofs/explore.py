"""Explicit-state bounded model checking of the concrete spec.

An independent cross-check of the Z3 proofs: it runs ``model.spec.machine`` itself,
breadth first from the initial state, with de-duplication on ``SystemState.key()``.
Because the search is breadth first over events, the first state found violating an
invariant gives a shortest event sequence to a violation.

Requests are enqueued in id order (0, 1, ...) with distinct non-zero rooms and distinct
payloads, so a payload or room read from the wrong tenant is always visible. Ids are
labels only, so fixing their order loses no behaviour.

Reductions, each keeping every invariant verdict and every shortest-path length (the
tests compare them with a BFS that has none): ranks are interchangeable; a request
failed on one rank has every rank's receiver value for it keyed as Failed; ages past
every bound that reads them are capped; fences are skipped where the variant neither defers release nor
fence before reuse. Measured sizes and times: see the lead's report / bench.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from model.spec.events import Enqueue, Event, Fence, Land, Step
from model.spec.kvpoll import KVPoll
from model.spec.invariants import INVARIANTS, bounded_wait
from model.spec.machine import apply, enabled
from model.spec.state import SystemState, initial_state
from model.spec.variants import DEFAULT_TIMEOUT_STEPS, Deferral, Variant

ROOM_BASE, PAYLOAD_BASE = 101, 501
_FAILED = int(KVPoll.Failed)


@dataclass
class ExploreResult:
    variant: str
    ranks: int
    requests: int
    steps: int
    slots: int
    states: int                        # distinct states reached, up to the reductions
    complete: bool                     # False if max_states cut the search short (an
    # early stop once every check broke is complete: no verdict can change after it)
    violations: dict[str, list[Event]] = field(default_factory=dict)
    reached: list[SystemState] = field(default_factory=list)   # with keep_states=True
    liveness: list[Event] | None = None  # shortest path to a request older than wait_bound
    wait_bound: int = DEFAULT_TIMEOUT_STEPS
    seconds: float = 0.0

    def holds(self, invariant: str) -> bool:
        return invariant not in self.violations

    def summary(self) -> str:
        broken = ", ".join(f"{k} ({len(v)} events)" for k, v in self.violations.items()) or "none"
        live = "holds" if self.liveness is None else f"violated ({len(self.liveness)} events)"
        cut = "" if self.complete else " (cut short by max_states)"
        return (f"{self.variant}: T={self.ranks} requests={self.requests} steps={self.steps} "
                f"slots={self.slots}: {self.states} states{cut} in {self.seconds:.2f}s; "
                f"violated: {broken}; bounded_wait({self.wait_bound}): {live}")


def request_events(requests: int, room_zero: bool = False,
                   equal_rooms: bool = False) -> list[Enqueue]:
    """The deterministic requests the explorer enqueues; ``room_zero`` gives request 0
    a genuine bootstrap_room of 0 (SGLang's sentinel value), ``equal_rooms`` gives every
    request the same room (a room cannot tell such tenants apart: the gate's MATCH is
    then no protection, which the refinement check must see too)."""
    def room(i: int) -> int:
        if room_zero and i == 0:
            return 0
        return ROOM_BASE if equal_rooms else ROOM_BASE + i
    return [Enqueue(i, room(i), PAYLOAD_BASE + i) for i in range(requests)]


def _one_rank(state: SystemState, ev: Event) -> int | None:
    """The one rank ``ev`` can change, or None: a Step, an Enqueue, and (agreed
    deferral) a Fence, which releases a hold on every rank once all can release it."""
    if isinstance(ev, Fence) and state.variant.defer_failed is Deferral.AGREED:
        return None
    return getattr(ev, "rank", None)


def _successor(state: SystemState, ev: Event) -> SystemState:
    """Copy only what ``ev`` can change (``_one_rank``)."""
    rank = _one_rank(state, ev)
    if rank is None:
        return state.copy()
    ranks = list(state.ranks)
    ranks[rank] = ranks[rank].copy()
    return SystemState(state.variant, state.n_slots, ranks, state.requests, state.steps, state.hung)


def _cap_ages(state: SystemState, cap: int) -> None:
    """Ages above ``cap`` change nothing any more (no timeout or wait bound reads them
    beyond it), so states that differ only there are merged."""
    for rs in state.ranks:
        for r, a in rs.age.items():
            if a > cap:
                rs.age[r] = cap


def _key(rank_keys: tuple, state: SystemState) -> tuple:
    """The state's key up to two equivalences that keep every invariant verdict:
    - ranks are interchangeable (the protocol and the invariants are symmetric in them);
    - once any rank's receiver failed a request, the next Step aborts it everywhere and
      drops every rank's receiver entry for it, so the other ranks' receiver values for
      it (Waiting or Success) no longer matter: they are keyed as Failed."""
    failed = {r for rs in state.ranks for r, p in rs.recv.items() if p == _FAILED}
    if failed:
        rank_keys = tuple(k[:1] + (tuple((r, _FAILED if r in failed else p) for r, p in k[1]),)
                          + k[2:] for k in rank_keys)
    hung = tuple(sorted(state.hung)) if state.hung is not None else None
    return tuple(sorted(rank_keys)), len(state.requests), hung


def explore(variant: Variant, ranks: int, requests: int, steps: int, slots: int,
            invariants: list[str] | None = None, max_states: int | None = None,
            room_zero: bool = False, wait_bound: int | None = None,
            late_writes: bool = True, check_liveness: bool = True,
            equal_rooms: bool = False, keep_states: bool = False) -> ExploreResult:
    """Every state reachable with at most ``requests`` enqueues and ``steps`` protocol
    steps. ``wait_bound`` (default: the variant's timeout, else DEFAULT_TIMEOUT_STEPS)
    is the age past which a queued request counts as a liveness violation.
    ``late_writes=False`` drops metadata landing after its request left that rank, to
    tell failures that need a late write from those that do not.
    ``check_liveness=False`` skips the bounded-wait check (``liveness`` stays None),
    so a search for counterexamples stops as soon as each named invariant broke.
    ``keep_states=True`` searches the whole bound and returns every distinct state (one
    per key) in ``reached``, in breadth-first order: the refinement check's inputs.

    Only Step and Enqueue change what the invariants read (queues, outcomes, ages), so
    the checks run on their successors alone; the search stops early once every named
    invariant and liveness are violated, since nothing is left to learn."""
    names = list(INVARIANTS) if invariants is None else list(invariants)
    for name in names:
        if name not in INVARIANTS:
            raise ValueError(f"unknown invariant {name!r} (known: {', '.join(INVARIANTS)})")
    bound = wait_bound if wait_bound is not None else (variant.timeout_steps or DEFAULT_TIMEOUT_STEPS)
    cap = max(variant.timeout_steps or 0, bound + 1)
    reqs = request_events(requests, room_zero, equal_rooms)
    fences_matter = variant.fence_before_reuse or variant.defer_failed is not Deferral.NONE
    started = time.perf_counter()

    init = initial_state(variant, ranks, slots)
    init_keys = tuple(rs.key() for rs in init.ranks)
    # Node n: parent[n] = (parent node, event). best[key] = fewest protocol steps used to
    # reach that state: reaching it again having used more steps is no news.
    parent: list[tuple[int, Event | None]] = [(-1, None)]
    best: dict[tuple, int] = {_key(init_keys, init): 0}
    frontier: deque[tuple[int, SystemState, tuple]] = deque([(0, init, init_keys)])
    result = ExploreResult(variant.name, ranks, requests, steps, slots, 0, True, wait_bound=bound)
    pending = set(names)
    kept: set[tuple] = set()

    def path(node: int) -> list[Event]:
        out: list[Event] = []
        while node > 0:
            node, ev = parent[node]
            out.append(ev)
        return out[::-1]

    def check(node: int, state: SystemState) -> None:
        for name in list(pending):
            if INVARIANTS[name](state):
                result.violations[name] = path(node)
                pending.discard(name)
        if check_liveness and result.liveness is None and bounded_wait(state, bound):
            result.liveness = path(node)

    check(0, init)
    while frontier and (keep_states or pending or (check_liveness and result.liveness is None)):
        node, state, rank_keys = frontier.popleft()
        if keep_states:
            key = _key(rank_keys, state)
            if key not in kept:
                kept.add(key)
                result.reached.append(state)
        offer = [reqs[len(state.requests)]] if len(state.requests) < requests else []
        for ev in enabled(state, offer):
            rank = getattr(ev, "rank", None)
            if not late_writes and isinstance(ev, Land) and ev.req in state.ranks[rank].outcomes:
                continue
            if isinstance(ev, Fence) and not fences_matter:
                # Without fence-before-reuse or deferred release a fence only rules out
                # later landings: the unfenced state can do everything the fenced one can.
                continue
            if rank is None and isinstance(ev, Step) and state.steps >= steps:
                continue
            nxt = _successor(state, ev)
            apply(nxt, ev, detail=False)     # no StepRecord: nothing here reads it
            if _one_rank(state, ev) is None:
                if rank is None:
                    _cap_ages(nxt, cap)
                keys = tuple(rs.key() for rs in nxt.ranks)
            else:
                keys = rank_keys[:rank] + (nxt.ranks[rank].key(),) + rank_keys[rank + 1:]
            key = _key(keys, nxt)
            seen = best.get(key)
            if seen is not None and seen <= nxt.steps:
                continue
            if max_states is not None and seen is None and len(best) >= max_states:
                result.complete = False
                continue
            best[key] = nxt.steps
            parent.append((node, ev))
            child = len(parent) - 1
            if rank is None:
                check(child, nxt)
            frontier.append((child, nxt, keys))
    result.states = len(best)
    result.violations = {n: result.violations[n] for n in names if n in result.violations}
    result.seconds = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m proofs.explore --variant gate --ranks 2 --requests 2 --steps 4 --slots 1``:
    the summary, then each shortest counterexample as a scenario script."""
    import argparse

    from model.spec.scenario import script_for
    from model.spec.variants import VARIANTS

    p = argparse.ArgumentParser(prog="python -m proofs.explore", description=main.__doc__)
    p.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    for name, default in (("ranks", 2), ("requests", 2), ("steps", 4), ("slots", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--max-states", type=int, default=None)
    p.add_argument("--room-zero", action="store_true", help="request 0 has bootstrap_room 0")
    p.add_argument("--equal-rooms", action="store_true", help="every request has the same room")
    args = p.parse_args(argv)
    for name in ("ranks", "requests", "steps", "slots", "max_states"):
        value = getattr(args, name)
        if value is not None and value < (0 if name in ("requests", "steps") else 1):
            p.error(f"--{name.replace('_', '-')} {value} is out of range")
    v = VARIANTS[args.variant]
    r = explore(v, args.ranks, args.requests, args.steps, args.slots,
                max_states=args.max_states, room_zero=args.room_zero, equal_rooms=args.equal_rooms)
    print(r.summary())
    found = list(r.violations.items()) + ([("bounded_wait", r.liveness)] if r.liveness else [])
    for name, path in found:
        print(f"\n# shortest {name} violation ({len(path)} events)")
        print(script_for(v.name, args.ranks, args.slots, path, v.timeout_steps), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
