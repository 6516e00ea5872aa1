"""Cross-check the unbounded results against proofs/explore.py: an explicit-state
search of the concrete spec (no Z3) for small sizes. Invariants proved safe must show
no violation within the bound; every invariant with a counterexample must be found."""
from __future__ import annotations

from model.spec.invariants import INVARIANTS
from model.spec.variants import VARIANTS

# Sizes per run (ranks, requests, protocol steps, slots); one slot forces reuse, which
# the late-write counterexamples need. strict (no violation expected) gets more room.
SIZES: dict[str, list[dict[str, int]]] = {
    "strict": [dict(ranks=2, requests=2, steps=3, slots=1), dict(ranks=2, requests=2, steps=2, slots=2)],
}
DEFAULT_SIZES = [dict(ranks=2, requests=2, steps=2, slots=1)]


def crosscheck(variant: str, proved: tuple[str, ...], max_states: int = 300_000):
    from proofs.obligations import Outcome
    try:
        from proofs.explore import explore
    except ImportError as exc:
        return Outcome("unavailable", f"proofs/explore.py: {exc}")
    found: set[str] = set()
    states, complete = 0, True
    for size in SIZES.get(variant, DEFAULT_SIZES):
        res = explore(VARIANTS[variant], invariants=list(INVARIANTS), max_states=max_states, **size)
        found |= set(res.violations)
        states += res.states
        complete &= res.complete
    wrong = [f"{n} violated although proved" for n in proved if n in found]
    missed = [f"{n} not found" for n in INVARIANTS if n not in proved and n not in found]
    if wrong or missed:
        return Outcome("disagrees", "; ".join(wrong + missed))
    scope = "complete" if complete else f"cut at {max_states} states"
    sizes = "; ".join(" ".join(f"{k}={v}" for k, v in s.items()) for s in SIZES.get(variant, DEFAULT_SIZES))
    return Outcome("proved", f"{states} states ({scope}) at {sizes}: "
                   f"violations {sorted(found) or 'none'}, as the proofs say")
