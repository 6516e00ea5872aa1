"""Random walks over the spec, shared by the tests that compare two ways of driving it."""
from __future__ import annotations

import random
from typing import Callable, Iterator, Sequence

from model.spec.events import ROOM, Enqueue, Event, Fail, KvDone
from model.spec.machine import KV_DONE, KV_FAILED, PAYLOAD_LANDS, ROOM_LANDS
from model.spec.machine import EventNotEnabled, apply, enabled
from model.spec.state import SystemState, initial_state
from model.spec.variants import Variant


def random_walk(rng: random.Random, state: SystemState, moves: int) -> Iterator[tuple[Event, int]]:
    """Up to ``moves`` events, each drawn uniformly among those enabled in ``state`` (the
    caller applies it before drawing the next), a fresh Enqueue always offered (rooms 0, 5
    or 6: genuine zeros and duplicates included). Yields (event, requests enqueued so far)."""
    nxt = 0
    for _ in range(moves):
        events = enabled(state, [Enqueue(nxt, rng.choice([0, 5, 6]), rng.randint(1, 3))])
        if not events:
            return
        ev = rng.choice(events)
        nxt += isinstance(ev, Enqueue)
        yield ev, nxt


def refusal(fn: Callable[..., object], *args: object) -> str | None:
    """``fn(*args)``'s EventNotEnabled message, or None where it was allowed."""
    try:
        fn(*args)
    except EventNotEnabled as exc:
        return str(exc)
    return None


def event_code(ev: Event, ranks: int) -> int:
    """A KvDone / Fail / Land as batch.deliver's code ``kind * ranks + rank``."""
    kind = {KvDone: KV_DONE, Fail: KV_FAILED}.get(type(ev))
    if kind is None:
        kind = ROOM_LANDS if ev.field == ROOM else PAYLOAD_LANDS
    return kind * ranks + ev.rank


def compare_with_apply(rng: random.Random, variants: Sequence[Variant], form: Callable[[SystemState, Event], None],
                       handles: tuple[type, ...], odd: Callable[[random.Random, int, int], Event],
                       walks: int = 200, moves: int = 50) -> tuple[int, int]:
    """``form`` (a second way to perform events of the types ``handles``) against
    ``apply`` on random walks: after every move, a random, often refused, event
    ``odd(rng, ranks, requests so far)`` gives both the same message (or none), and the
    states stay equal. Returns (events performed by ``form``, odd events refused)."""
    formed = refused = 0
    for _ in range(walks):
        ref = initial_state(rng.choice(variants), rng.randint(1, 3), rng.randint(1, 3))
        twin = ref.copy()
        for ev, nxt in random_walk(rng, ref, moves):
            apply(ref, ev)
            if isinstance(ev, handles):
                form(twin, ev)
                formed += 1
            else:
                apply(twin, ev)
            bad = odd(rng, ref.n_ranks, nxt)
            msg = refusal(apply, ref, bad)
            assert refusal(form, twin, bad) == msg
            refused += msg is not None
            assert twin.key() == ref.key()
    return formed, refused
