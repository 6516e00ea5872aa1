"""Divergence detection after every protocol step, cheaply.

``step_violations`` checks only what a step can change, with the semantics of the
spec's named invariants (model/spec/invariants.py), assuming they held before the step:
- queues_identical: the queues after the pop are equal on every rank;
- outcomes_agree: every rank popped the same requests with the same outcome kind
  (with identical queues before the step, a request popped on one rank only differs);
- no_corruption: every commit read the payload its prefill sent;
- exactly_once: a popped request is no longer queued.
On any finding it returns the spec's own ``check_invariants`` result, so reports carry
the spec's Violation objects. tests/sim/test_sim_checks.py checks both agree.
"""
from __future__ import annotations

from model.spec.invariants import Violation, check_invariants
from model.spec.kernel import Decision
from model.spec.machine import StepPops, StepRecord
from model.spec.state import SystemState

_COMMIT = int(Decision.COMMIT)


def _suspect(state: SystemState, rec: StepRecord | StepPops) -> bool:
    ranks = state.ranks
    q0 = ranks[0].queue
    for rs in ranks[1:]:
        if rs.queue != q0:
            return True
    first, *others = rec.popped
    requests = state.requests
    for popped in others:
        if popped != first:      # rare: compare the outcome kinds, then the payloads
            if [(r, d == _COMMIT) for r, d, _ in popped] != [(r, d == _COMMIT) for r, d, _ in first]:
                return True
            if any(d == _COMMIT and p != requests[r].payload for r, d, p in popped):
                return True
    if any(d == _COMMIT and p != requests[r].payload for r, d, p in first):
        return True
    return bool(first and q0) and not set(q0).isdisjoint(r for r, _, _ in first)


def step_violations(state: SystemState, rec: StepRecord | StepPops) -> list[Violation]:
    """The invariant violations this step introduced (empty if none), or a hang."""
    if rec.hang is not None:
        detail = "MIN over different queue lengths " + ", ".join(
            f"rank {k}: {n}" for k, n in enumerate(rec.hang))
        return check_invariants(state) or [Violation("queues_identical", detail,
                                                     tuple(range(state.n_ranks)))]
    if not _suspect(state, rec):
        return []
    return check_invariants(state)
