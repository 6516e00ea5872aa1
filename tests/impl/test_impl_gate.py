"""The vectorized gate and pop decisions against the scalar spec kernel."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from impl.decode import (FAKE_BOOTSTRAP_HOST, BadPollValue, MetadataBuffers, RoomOutOfRange,
                         SlotOutOfRange, apply_metadata_gate, decide_tensor, gate_tensor)
from impl.decode.buffers import room_to_int64
from model.spec import get_variant, gated_poll, pop_decision

VARIANTS = ["ungated", "gate", "strict", "gate-noclear"]
rooms = st.one_of(st.sampled_from([0, 1, 7, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
polls = st.integers(0, 4)
rows = st.lists(st.tuples(polls, rooms, rooms, st.integers(0, 9), st.booleans()), max_size=40)


def _tensors(rs):
    local = torch.tensor([r[0] for r in rs], dtype=torch.uint8)
    seen = torch.tensor([room_to_int64(r[1]) for r in rs], dtype=torch.int64)
    exp = torch.tensor([room_to_int64(r[2]) for r in rs], dtype=torch.int64)
    age = torch.tensor([r[3] for r in rs], dtype=torch.int64)
    real = torch.tensor([not r[4] for r in rs], dtype=torch.bool)
    return local, seen, exp, age, real


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VARIANTS), rows, st.integers(1, 6), st.sampled_from(["numpy", "torch"]))
def test_gate_matches_spec_kernel(name, rs, timeout, backend):
    v = get_variant(name, timeout if name == "strict" else None)
    local, seen, exp, age, real = _tensors(rs)
    got = gate_tensor(v, local, seen, exp, age, real, backend).tolist()
    want = [p if fake else gated_poll(v, p, s, e, a) for p, s, e, a, fake in rs]
    assert got == want


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VARIANTS), rows, st.sampled_from(["numpy", "torch"]))
def test_pop_decisions_match_spec_kernel(name, rs, backend):
    v = get_variant(name)
    reduced, seen, exp, _, real = _tensors(rs)
    got = decide_tensor(v, reduced, seen, exp, real, backend).tolist()
    want = [pop_decision(v, p, 1, 1) if fake else pop_decision(v, p, s, e)
            for p, s, e, _, fake in rs]
    assert got == want


def _decode_reqs(rs, buffers):
    out = []
    for i, (_, seen, exp, _, fake) in enumerate(rs):
        buffers.write_room(i, seen)
        host = FAKE_BOOTSTRAP_HOST if fake else "10.0.0.1"
        out.append(SimpleNamespace(req=SimpleNamespace(rid=str(i), bootstrap_room=exp,
                                                       bootstrap_host=host),
                                   metadata_buffer_index=i))
    return out


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["gate", "strict"]), rows.filter(bool))
def test_sglang_shaped_gate_matches_spec(name, rs):
    v = get_variant(name)
    buffers = MetadataBuffers(len(rs))
    reqs = _decode_reqs(rs, buffers)
    polls_in = [r[0] for r in rs]
    ages = [r[3] for r in rs]
    out = apply_metadata_gate(polls_in, reqs, buffers, name, ages)
    assert out is polls_in          # SGLang mutates in place; we also return it
    assert out == [p if fake else gated_poll(v, p, s, e, a) for p, s, e, a, fake in rs]


@pytest.mark.parametrize("bad", [5, -1, 255, 256, 4.0, None, "4"])
def test_bad_poll_values_are_refused_with_polls_untouched(bad):
    buffers = MetadataBuffers(4)
    reqs = _decode_reqs([(4, 9, 9, 0, False), (4, 9, 9, 0, False)], buffers)
    polls = [4, bad]
    with pytest.raises(BadPollValue, match="outside KVPoll 0..4"):
        apply_metadata_gate(polls, reqs, buffers, "gate")
    assert polls == [4, bad]


def test_slot_out_of_range_and_bad_room_are_refused():
    buffers = MetadataBuffers(2)
    reqs = _decode_reqs([(4, 9, 9, 0, False)], buffers)
    reqs[0].metadata_buffer_index = 2
    polls = [4]
    with pytest.raises(SlotOutOfRange, match="slot 2 out of range 0..1"):
        apply_metadata_gate(polls, reqs, buffers, "strict")
    reqs[0].metadata_buffer_index = 0
    reqs[0].req.bootstrap_room = 2**64
    with pytest.raises(RoomOutOfRange):
        apply_metadata_gate(polls, reqs, buffers, "strict")
    assert polls == [4]


def test_unsupported_variant_is_refused():
    # every named spec variant is supported (conformance replays run them all), so only
    # a Variant the spec does not define is refused
    custom = dataclasses.replace(get_variant("gate"), name="custom")
    with pytest.raises(ValueError, match="supports the variants"):
        apply_metadata_gate([], [], MetadataBuffers(1), custom)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(VARIANTS), polls, rooms, rooms)
def test_may_pop_table_covers_every_pop_the_kernel_makes(name, reduced, seen, exp):
    from impl.decode.gate import may_pop
    v = get_variant(name)
    if pop_decision(v, reduced, seen, exp) != 0:
        assert may_pop(v)[reduced]
