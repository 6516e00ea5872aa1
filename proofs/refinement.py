"""The refinement obligation: model/encoding/refine.py run on every state the explicit-state
search reaches at small sizes (proofs/explore.py), per variant and mode.

Each set names the explored sizes and the rooms the requests carry; the universe has
one request more than the search enqueues, so every state also offers a fresh request
(refused where a rank has no free slot). ``PROVE_SETS`` is what ``pdgate prove`` runs
(seconds per variant); ``CI_SETS`` is the larger exhaustive run of the CI test.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from model.encoding.refine import RefinementReport, check_refinement
from model.spec.variants import Variant
from proofs.explore import explore, request_events


@dataclass(frozen=True)
class RefinementSet:
    mode: str                       # "unbounded" or "finite" (model/encoding/refine.py)
    ranks: int
    requests: int                   # enqueued by the search (the universe has one more)
    steps: int
    slots: int
    rooms: str = "distinct"         # "distinct", "zero" (request 0 has room 0) or "equal"

    def __str__(self) -> str:
        return (f"{self.mode} T={self.ranks} N={self.requests}+1 S={self.slots} "
                f"steps={self.steps} rooms={self.rooms}")


ROOMS = ("distinct", "zero", "equal")
PROVE_SETS = (
    RefinementSet("unbounded", 2, 1, 1, 1, "zero"),     # the MIN over ranks, misalignment, room 0
    RefinementSet("unbounded", 1, 2, 1, 1, "equal"),    # slot reuse, late writes, equal rooms
    RefinementSet("finite", 1, 1, 1, 2, "distinct"),    # a free list of two: its order shows
)
CI_SETS = tuple(RefinementSet(mode, *size, rooms) for mode in ("unbounded", "finite")
                for size, rooms in (((2, 1, 2, 1), "distinct"), ((2, 1, 2, 1), "zero"),
                                    ((1, 2, 2, 1), "equal"))) + (
    RefinementSet("finite", 1, 2, 1, 2, "distinct"),     # reuse with two slots: FIFO order
    RefinementSet("finite", 1, 2, 2, 1, "distinct"))     # late writes into a reused slot


def run_set(variant: Variant, rs: RefinementSet, stop_at_first: bool = True) -> RefinementReport:
    if rs.rooms not in ROOMS:
        raise ValueError(f"unknown rooms {rs.rooms!r} (known: {', '.join(ROOMS)})")
    kw = {"room_zero": rs.rooms == "zero", "equal_rooms": rs.rooms == "equal"}
    found = explore(variant, rs.ranks, rs.requests, rs.steps, rs.slots, invariants=[],
                    check_liveness=False, keep_states=True, **kw)
    offers = request_events(rs.requests + 1, **kw)
    return check_refinement(variant, found.reached, offers, rs.mode, stop_at_first)


def refinement(variant: Variant, sets: tuple[RefinementSet, ...] = PROVE_SETS
               ) -> tuple[bool, str]:
    """(every set agrees, detail): the first mismatch, or what was covered."""
    t0 = time.perf_counter()
    states = events = solver = 0
    for rs in sets:
        rep = run_set(variant, rs)
        if rep.mismatches:
            return False, f"{rs}: {rep.mismatches[0]}"
        states, events, solver = states + rep.states, events + rep.events, solver + rep.solver_queries
    return True, (f"{states} states x every event ({events} checks, {solver} solver queries) in "
                  f"{len(sets)} sets, {time.perf_counter() - t0:.1f} s: guards agree, successors "
                  f"exact (finite) / exact up to the named abstractions (unbounded)")
