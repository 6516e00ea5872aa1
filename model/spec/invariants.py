"""The safety invariants, by name. The same names appear in the Z3 encoding, the proof
table, the simulator's divergence reports, the tests and every trace violation record.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from model.spec.kernel import Decision
from model.spec.state import SystemState

if TYPE_CHECKING:
    from model.spec.machine import StepPops, StepRecord


@dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str
    ranks: tuple[int, ...] = field(default=())
    reqs: tuple[int, ...] = field(default=())


def queues_identical(s: SystemState) -> list[Violation]:
    """Every rank holds the same requests in the same order (else the MIN mixes them)."""
    first = s.ranks[0].queue
    bad = [k for k, rs in enumerate(s.ranks) if rs.queue != first]
    if not bad:
        return []
    differing = sorted(set().union(*(set(first) ^ set(s.ranks[k].queue) for k in bad)))
    return [Violation("queues_identical",
                      "; ".join(f"rank {k} queue {s.ranks[k].queue}" for k in [0, *bad]),
                      (0, *bad), tuple(differing))]


def outcomes_agree(s: SystemState) -> list[Violation]:
    """A request left on one rank -> it left on every rank, with the same outcome."""
    out = []
    decided = set().union(*(rs.outcomes for rs in s.ranks))
    for r in sorted(decided):
        kinds = [rs.outcomes[r][0] if r in rs.outcomes else None for rs in s.ranks]
        if len(set(kinds)) > 1:
            out.append(Violation("outcomes_agree",
                                 f"request {r}: " + ", ".join(f"rank {k} {kind or 'still queued'}"
                                                              for k, kind in enumerate(kinds)),
                                 tuple(range(s.n_ranks)), (r,)))
    return out


def no_corruption(s: SystemState) -> list[Violation]:
    """A committed request carries exactly the payload its prefill sent."""
    out = []
    for k, rs in enumerate(s.ranks):
        for r, (kind, value) in sorted(rs.outcomes.items()):
            want = s.requests[r].payload
            if kind == "commit" and value != want:
                out.append(Violation("no_corruption",
                                     f"rank {k} committed request {r} with payload {value}, "
                                     f"prefill sent {want}", (k,), (r,)))
    return out


def exactly_once(s: SystemState) -> list[Violation]:
    """A request is queued at most once per rank and never both queued and decided."""
    out = []
    for k, rs in enumerate(s.ranks):
        dup = sorted({r for r in rs.queue if rs.queue.count(r) > 1})
        again = sorted(set(rs.queue) & set(rs.outcomes))
        for r in dup:
            out.append(Violation("exactly_once", f"rank {k} queues request {r} twice", (k,), (r,)))
        for r in again:
            out.append(Violation("exactly_once", f"rank {k} decided request {r} but still queues it",
                                 (k,), (r,)))
    return out


INVARIANTS: dict[str, Callable[[SystemState], list[Violation]]] = {
    "queues_identical": queues_identical,
    "outcomes_agree": outcomes_agree,
    "no_corruption": no_corruption,
    "exactly_once": exactly_once,
}


def bounded_wait(s: SystemState, bound: int) -> list[Violation]:
    """Liveness, made a safety check: no request has been polled more than ``bound``
    times without leaving. (strict's bound is its timeout; ``gate`` has none.)"""
    return [Violation("bounded_wait", f"rank {k} still queues request {r} after {a} steps",
                      (k,), (r,))
            for k, rs in enumerate(s.ranks) for r, a in sorted(rs.age.items()) if a > bound]


def check_invariants(s: SystemState, names: list[str] | None = None) -> list[Violation]:
    """All violations of the named invariants (default: all) in a stable order."""
    out: list[Violation] = []
    for name in names or INVARIANTS:
        out.extend(INVARIANTS[name](s))
    return out


_COMMIT = int(Decision.COMMIT)


def misread(popped: Sequence[tuple[int, int, int]], sent: Callable[[int], int]) -> bool:
    """Some commit of ``popped`` (request, Decision, payload read) read another payload
    than ``sent(request)``, the one its prefill wrote (no_corruption's step check)."""
    return any(d == _COMMIT and p != sent(r) for r, d, p in popped)


def _suspect(state: SystemState, rec: "StepRecord | StepPops") -> bool:
    ranks = state.ranks
    q0 = ranks[0].queue
    for rs in ranks[1:]:
        if rs.queue != q0:
            return True
    every = rec.popped
    first, requests = every[0], state.requests
    others = () if every.count(first) == len(every) else every[1:]   # one C call, mostly
    for popped in others:
        if popped != first:      # rare: compare the outcome kinds, then the payloads
            if [(r, d == _COMMIT) for r, d, _ in popped] != [(r, d == _COMMIT) for r, d, _ in first]:
                return True
            if misread(popped, lambda r: requests[r].payload):
                return True
    if misread(first, lambda r: requests[r].payload):
        return True
    return bool(first and q0) and not set(q0).isdisjoint(r for r, _, _ in first)


def step_violations(state: SystemState, rec: "StepRecord | StepPops") -> list[Violation]:
    """The invariant violations this step introduced (empty if none), or a hang.

    Checks only what a step can change, assuming every invariant held before it:
    queues_identical (the queues after the pop are equal), outcomes_agree (every rank
    popped the same requests with the same outcome kind), no_corruption (every commit
    read the payload its prefill sent), exactly_once (a popped request is no longer
    queued). Cost: the queues and the pops of this step, not the whole history, which
    is what keeps the simulator and ``pdgate validate`` linear in a trace's length. On
    any finding it returns ``check_invariants``'s full result, so callers see the same
    Violation objects as a full check (tests/sim/test_sim_traces.py compares both)."""
    if rec.hang is not None:
        detail = "MIN over different queue lengths " + ", ".join(
            f"rank {k}: {n}" for k, n in enumerate(rec.hang))
        return check_invariants(state) or [Violation("queues_identical", detail,
                                                     tuple(range(state.n_ranks)))]
    if not _suspect(state, rec):
        return []
    return check_invariants(state)
