"""Cross-check the unbounded results against proofs/explore.py: an explicit-state
search of the concrete spec (no Z3) for small sizes. Invariants proved safe must show
no violation within the bound; every invariant with a counterexample must be found."""
from __future__ import annotations

from model.spec.variants import VARIANTS

SIZES = dict(ranks=2, requests=2, steps=8, slots=1)
SAFETY_NAMES = ("queues_identical", "outcomes_agree", "no_corruption", "exactly_once")


def crosscheck(variant: str, proved: tuple[str, ...], max_states: int = 200_000):
    from proofs.obligations import Outcome
    try:
        from proofs.explore import explore
    except ImportError as exc:
        return Outcome("unavailable", f"proofs/explore.py: {exc}")
    res = explore(VARIANTS[variant], invariants=list(SAFETY_NAMES), max_states=max_states, **SIZES)
    found = set(res.violations)
    wrong = [f"{n} violated although proved" for n in proved if n in found]
    missed = [f"{n} not found" for n in SAFETY_NAMES if n not in proved and n not in found]
    if wrong or missed:
        return Outcome("disagrees", "; ".join(wrong + missed))
    scope = "complete" if res.complete else f"cut at {max_states} states"
    return Outcome("proved", f"{res.states} states ({scope}) at {SIZES}: "
                   f"violations {sorted(found) or 'none'}, as the proofs say")
