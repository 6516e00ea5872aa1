"""The gate and pop decisions, exhaustively over small domains, against a deliberately
dumb reference written from protocol.md's prose (by variant name, not from the
Variant fields the kernel reads)."""
from __future__ import annotations

import itertools

import pytest

from model.spec.kernel import Decision, gated_poll, pop_decision
from model.spec.kvpoll import KVPoll
from model.spec.variants import VARIANTS, get_variant

F, B, W, T, S = (int(p) for p in KVPoll)
ROOMS = (0, 7, 8)          # 0 is the cleared-slot sentinel; 7 and 8 are two requests
AGES = range(0, 7)


def reference_gate(name: str, local: int, seen: int, expected: int, age: int,
                   timeout: int | None) -> int:
    value = local
    if name in ("gate", "gate-noclear", "deferred-local", "deferred"):
        # 0.5.13 to 0.5.23: Success -> Transferring while the local room reads 0.
        if local == S and seen == 0:
            value = T
    elif name == "strict":
        # Hold Success until the local room equals the expected room ...
        if local == S and seen != expected:
            value = T
        # ... an expected room of 0 cannot be told from a cleared slot: Failed ...
        if expected == 0:
            value = F
        # ... and whatever has not matched within the bound is reported Failed.
        if value != S and age >= timeout:
            value = F
    return value


def reference_pop(name: str, reduced: int, seen: int, expected: int) -> Decision:
    if reduced == F:
        return Decision.ABORT_FAILED
    if reduced != S:
        return Decision.KEEP
    if seen == 0:
        # <= 0.5.12 "not ready, retry" on that rank only; later versions abort.
        return Decision.KEEP if name == "ungated" else Decision.ABORT_ROOM_ZERO
    if seen != expected:
        return Decision.ABORT_ROOM_MISMATCH
    return Decision.COMMIT


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_gate_matches_reference_exhaustively(name):
    timeouts = [1, 2, 4] if VARIANTS[name].timeout_steps is not None else [None]
    checked = 0
    for timeout in timeouts:
        v = get_variant(name, timeout)
        for local, seen, expected, age in itertools.product(KVPoll, ROOMS, ROOMS, AGES):
            want = reference_gate(name, int(local), seen, expected, age, timeout)
            assert gated_poll(v, int(local), seen, expected, age) == want, (local, seen, expected, age)
            checked += 1
    assert checked >= 5 * 9 * 7


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_pop_matches_reference_exhaustively(name):
    v = VARIANTS[name]
    for reduced, seen, expected in itertools.product(KVPoll, ROOMS, ROOMS):
        got = Decision(pop_decision(v, int(reduced), seen, expected))
        assert got is reference_pop(name, int(reduced), seen, expected), (reduced, seen, expected)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_gate_never_raises_a_poll(name):
    """The gate only lowers a value (or fails it): it can never invent a Success."""
    v = VARIANTS[name]
    for local, seen, expected, age in itertools.product(KVPoll, ROOMS, ROOMS, AGES):
        assert gated_poll(v, int(local), seen, expected, age) <= int(local)


def test_decision_outcomes():
    assert Decision.KEEP.outcome is None and not Decision.KEEP.leaves
    assert Decision.COMMIT.outcome == "commit" and Decision.COMMIT.leaves
    for d in (Decision.ABORT_FAILED, Decision.ABORT_ROOM_ZERO, Decision.ABORT_ROOM_MISMATCH):
        assert d.outcome == "abort" and d.leaves


def test_get_variant_rejects_bad_overrides():
    with pytest.raises(ValueError, match="unknown variant"):
        get_variant("nope")
    with pytest.raises(ValueError, match="no timeout"):
        get_variant("gate", 3)
    with pytest.raises(ValueError, match=">= 1"):
        get_variant("strict", 0)
    assert get_variant("strict", 7).timeout_steps == 7
