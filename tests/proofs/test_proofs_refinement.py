"""The refinement check (model/encoding/refine.py): exhaustive on larger small sizes than
``pdgate prove`` runs, and able to say no (a changed spec mechanism is reported)."""
from __future__ import annotations

import pytest

from model.spec import machine
from proofs.obligations import ALL_VARIANTS
from proofs.refinement import CI_SETS, PROVE_SETS, RefinementSet, run_set


@pytest.mark.parametrize("name", sorted(ALL_VARIANTS))
def test_every_reachable_state_and_event_refines(name):
    """Both readings, every state of CI_SETS, every event: no mismatch, and the sets
    really exercise what they are for (disabled events, abstractions, solver queries)."""
    for rs in CI_SETS:
        rep = run_set(ALL_VARIANTS[name], rs)
        assert rep.mismatches == [], (str(rs), rep.mismatches[:1])
        assert rep.states > 10 and rep.enabled < rep.events, str(rs)
        if rs.mode == "unbounded" and rs.requests + 1 >= 2:
            assert rep.at_least > 0, str(rs)        # enqueue's free choice was compared


def test_sets_cover_room_zero_and_equal_rooms_in_prove():
    rooms = {rs.rooms for rs in PROVE_SETS}
    assert {"zero", "equal", "distinct"} <= rooms
    assert {rs.mode for rs in PROVE_SETS} == {"unbounded", "finite"}


def _lifo(monkeypatch):
    orig = machine._ENV_HANDLERS[machine.Enqueue]

    def lifo(state, ev):
        if ev.req not in state.requests and all(rs.free for rs in state.ranks):
            for rs in state.ranks:
                rs.free.insert(0, rs.free.pop())
        orig(state, ev)
    monkeypatch.setitem(machine._ENV_HANDLERS, machine.Enqueue, lifo)


def test_a_lifo_free_list_breaks_the_finite_reading_only(monkeypatch):
    """Any free slot is the unbounded reading's named abstraction; FIFO is exact in the
    finite one. So a LIFO spec is still refined by the first and refused by the second."""
    _lifo(monkeypatch)
    variant = ALL_VARIANTS["strict"]
    finite = run_set(variant, RefinementSet("finite", 1, 1, 1, 2))
    assert finite.mismatches and "successor" in finite.mismatches[0]
    unbounded = run_set(variant, RefinementSet("unbounded", 1, 1, 1, 2))
    assert unbounded.mismatches == [] and unbounded.at_least > 0


def test_a_spec_guard_change_is_reported_in_both_readings(monkeypatch):
    orig = machine._land

    def land_any_order(state, rank, req, field):     # ignores room_after_payload
        v = state.variant
        state.variant = type(v)(**{**v.__dict__, "room_after_payload": False})
        try:
            orig(state, rank, req, field)
        finally:
            state.variant = v
    monkeypatch.setitem(machine._ENV_HANDLERS, machine.Land,
                        lambda state, ev: land_any_order(state, ev.rank, ev.req, ev.field))
    for mode in ("unbounded", "finite"):
        rep = run_set(ALL_VARIANTS["strict"], RefinementSet(mode, 1, 1, 1, 1))
        assert rep.mismatches and "spec allows it, the encoding refuses it" in rep.mismatches[0], mode


def test_explore_keeps_every_distinct_state_and_the_room_modes():
    from proofs.explore import explore, request_events
    v = ALL_VARIANTS["gate"]
    res = explore(v, 1, 2, 1, 1, invariants=[], check_liveness=False, keep_states=True, equal_rooms=True)
    assert len(res.reached) == res.states and res.complete
    assert len({s.key() for s in res.reached}) == len(res.reached)
    assert {e.room for e in request_events(3, equal_rooms=True)} == {request_events(1)[0].room}
    assert [e.room for e in request_events(2, room_zero=True)][0] == 0
