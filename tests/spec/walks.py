"""Random walks over the spec, shared by the tests that compare two ways of driving it."""
from __future__ import annotations

import random
from typing import Iterator

from model.spec.events import Enqueue, Event
from model.spec.machine import enabled
from model.spec.state import SystemState


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
