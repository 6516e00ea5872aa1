"""Cross-check the unbounded results against proofs/explore.py: an explicit-state
search of the concrete spec (no Z3) for small sizes. Invariants proved safe must show
no violation within the bound, every invariant with a counterexample must be found,
and bounded_wait (strict's bound) must hold exactly where the variant has a timeout."""
from __future__ import annotations

from model.spec.invariants import INVARIANTS
from model.spec.variants import VARIANTS

# Sizes per run, each complete in about 2 s on the 2-core CI machine (the state counts
# are in docs/PROOFS.md); one slot forces reuse, which the late-write counterexamples
# need. strict (no violation expected) has a small state space and gets the most room.
SIZES: dict[str, list[dict[str, int]]] = {
    "strict": [dict(ranks=3, requests=3, steps=8, slots=1), dict(ranks=2, requests=2, steps=2, slots=2)],
    # fences matter here (they release held slots), so the state space is larger; 3
    # steps hold every counterexample (the longest, a late write after a deferred slot
    # was released, takes 3)
    "deferred-local": [dict(ranks=2, requests=2, steps=3, slots=1), dict(ranks=3, requests=1, steps=3, slots=1)],
    "deferred": [dict(ranks=2, requests=2, steps=3, slots=1), dict(ranks=3, requests=1, steps=3, slots=1)],
    # the largest state space of the rest (32k states at 8 steps); 4 steps (18k) still
    # find all three of its counterexamples, as at 8
    "ungated": [dict(ranks=2, requests=2, steps=4, slots=1), dict(ranks=3, requests=1, steps=4, slots=1)],
}
DEFAULT_SIZES = [dict(ranks=2, requests=2, steps=8, slots=1), dict(ranks=3, requests=1, steps=8, slots=1)]
LIVENESS_SIZE = dict(ranks=2, requests=1, steps=6, slots=1)   # enough steps to exceed the bound
# Rooms the sizes above never use (they give every request its own non-zero room): a
# genuine room 0, and two requests sharing one. Proved invariants must hold here too
# (what breaks here is not compared: the counterexample rows' sizes are the ones above).
ROOM_SIZES = [dict(ranks=2, requests=1, steps=6, slots=1, room_zero=True),
              dict(ranks=1, requests=2, steps=6, slots=1, equal_rooms=True)]


def _describe(size: dict) -> str:
    rooms = " room 0" if size.get("room_zero") else " equal rooms" if size.get("equal_rooms") else ""
    return "T={ranks} N={requests} steps={steps} S={slots}".format(**size) + rooms


def crosscheck(variant: str, proved: tuple[str, ...], max_states: int = 300_000):
    from proofs.obligations import Outcome
    try:
        from proofs.explore import explore
    except ImportError as exc:
        return Outcome("unavailable", f"proofs/explore.py: {exc}")
    v = VARIANTS[variant]
    found: set[str] = set()
    states, complete = 0, True
    sizes = SIZES.get(variant, DEFAULT_SIZES)
    for size in sizes:
        res = explore(v, invariants=list(INVARIANTS), max_states=max_states, check_liveness=False,
                      **size)
        found |= set(res.violations)
        states, complete = states + res.states, complete and res.complete
    for size in ROOM_SIZES:
        res = explore(v, invariants=list(proved), max_states=max_states, check_liveness=False, **size)
        states, complete = states + res.states, complete and res.complete
        found |= set(res.violations)
    sizes = sizes + ROOM_SIZES
    live = explore(v, invariants=[], max_states=max_states, **LIVENESS_SIZE)
    states, complete = states + live.states, complete and live.complete
    wrong = [f"{n} violated although proved" for n in proved if n in found]
    missed = [f"{n} not found" for n in INVARIANTS if n not in proved and n not in found]
    if (live.liveness is None) != (v.timeout_steps is not None):
        wrong.append(f"bounded_wait {'holds' if live.liveness is None else 'violated'} at "
                     f"{_describe(LIVENESS_SIZE)}")
    if wrong or missed:
        return Outcome("disagrees", "; ".join(wrong + missed))
    scope = "complete" if complete else f"cut at {max_states} states"
    return Outcome("proved", f"{states} states ({scope}) at {'; '.join(map(_describe, sizes))}: "
                   f"violations {sorted(found) or 'none'}; bounded_wait "
                   f"{'holds' if live.liveness is None else 'violated'} at {_describe(LIVENESS_SIZE)}")
