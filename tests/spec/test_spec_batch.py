"""``batch.step_pops`` (the simulator's protocol step) is ``apply(state, Step(),
detail=False)``: the same record and the same state after every step of random walks
of every variant, timeouts, divergences and hangs included; ``batch.deliver`` is
``apply`` of KvDone / Fail / Land, refusals included."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from model.spec.batch import Stepper, deliver, step_pops
from model.spec.events import PAYLOAD, ROOM, Enqueue, Fail, KvDone, Land, Step
from model.spec.machine import EventNotEnabled, StepPops, apply
from model.spec.state import initial_state
from model.spec.variants import ABLATIONS, VARIANTS, get_variant

from .walks import compare_with_apply, event_code, random_walk

ALL = [*VARIANTS.values(), *ABLATIONS.values(), get_variant("strict", 1), get_variant("strict", 2)]


def _step(fn, state):
    try:
        return fn(state)
    except EventNotEnabled as exc:
        return str(exc)


def test_step_pops_matches_apply_step_for_step():
    rng = random.Random(11)
    steps = pops = differing = 0
    for _ in range(300):
        ref = initial_state(rng.choice(ALL), rng.randint(1, 4), rng.randint(1, 3))
        fast = ref.copy()
        for ev, _ in random_walk(rng, ref, 60):
            if isinstance(ev, Step):
                steps += 1
                differing += any(rs.queue != fast.ranks[0].queue for rs in fast.ranks)
                want = _step(lambda s: apply(s, ev, detail=False), ref)
                got = _step(step_pops, fast)
                assert got == want
                pops += isinstance(want, StepPops) and any(want.popped)
            else:
                apply(ref, ev)
                apply(fast, ev)
            assert fast.key() == ref.key() and fast.steps == ref.steps
    # the walks reach the popping, the all-kept and the differing-queue cases
    assert steps > 2000 and pops > 300 and differing >= 3


def test_stepper_repeats_quiet_kept_steps_exactly():
    """Stepper.step(quiet=True) right after a step (no event between) equals apply."""
    rng = random.Random(13)
    quiet_steps = 0
    for _ in range(300):
        ref = initial_state(rng.choice(ALL), rng.randint(1, 4), rng.randint(1, 3))
        fast = ref.copy()
        stepper = Stepper(fast)
        previous_was_step = False
        for ev, _ in random_walk(rng, ref, 60):
            if isinstance(ev, Step):
                want = _step(lambda s: apply(s, ev, detail=False), ref)
                got = _step(lambda s: stepper.step(quiet=previous_was_step), fast)
                quiet_steps += previous_was_step
                assert got == want
            else:
                apply(ref, ev)
                apply(fast, ev)
            previous_was_step = isinstance(ev, Step)
            assert fast.key() == ref.key() and fast.steps == ref.steps
    assert quiet_steps > 300


def test_stepper_must_not_be_told_quiet_after_an_event():
    """The machinery can say no: promising quiet after a delivery repeats a stale step."""
    state = initial_state(VARIANTS["gate"], 2, 2)
    apply(state, Enqueue(1, 11, 5))
    stepper = Stepper(state)
    stepper.step(quiet=False)
    for k in (0, 1):
        apply(state, KvDone(k, 1))
        apply(state, Land(k, 1, PAYLOAD))
        apply(state, Land(k, 1, ROOM))
    ref = state.copy()
    assert apply(ref, Step(), detail=False).popped != stepper.step(quiet=True).popped


def test_step_pops_refuses_a_hung_state_like_apply():
    state = initial_state(VARIANTS["ungated"], 2, 1)
    state.hung = (1, 0)
    with pytest.raises(EventNotEnabled, match="hung in a mismatched collective"):
        step_pops(state)


def _odd(rng: random.Random, ranks: int, nxt: int):
    k, r = rng.randrange(ranks), rng.randint(0, nxt + 1)
    return rng.choice([KvDone(k, r), Fail(k, r), Land(k, r, rng.choice([ROOM, PAYLOAD]))])


def test_deliver_matches_apply_including_refused_events():
    delivered, refused = compare_with_apply(
        random.Random(12), ALL, lambda s, ev: deliver(s, ev.req, [event_code(ev, s.n_ranks)]),
        (KvDone, Fail, Land), _odd)
    assert delivered > 1000 and refused > 1000
    for codes in ([8], [-1], [1.5], [0, 99]):      # -1 would wrap round the decode table
        state = initial_state(VARIANTS["gate"], 2, 1)
        apply(state, Enqueue(0, 5, 6))
        before = state.key()
        with pytest.raises(EventNotEnabled, match=f"event code {codes[-1]} is not one of 0..7"):
            deliver(state, 0, codes)
        assert state.key() == before               # refused before any event is performed


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(ALL), st.integers(1, 8), st.integers(1, 4), st.randoms(use_true_random=False))
def test_deliver_of_many_events_is_apply_of_each_until_the_first_refused(variant, ranks, slots, rng):
    """One deliver call of several events of a request (up to 24 on 8 ranks, often
    refused part-way) leaves the state apply leaves after the events before the refused
    one, and raises apply's message for it."""
    ref = initial_state(variant, ranks, slots)
    fast = ref.copy()
    for ev, nxt in random_walk(rng, ref, 60):
        apply(ref, ev)
        apply(fast, ev)
        r = rng.randint(0, nxt)
        batch = [_odd_for(rng, ranks, r) for _ in range(rng.randint(1, 3 * ranks))]
        want = None
        for e in batch:
            try:
                apply(ref, e)
            except EventNotEnabled as exc:
                want = str(exc)
                break
        try:
            deliver(fast, r, [event_code(e, ranks) for e in batch])
            got = None
        except EventNotEnabled as exc:
            got = str(exc)
        assert got == want
        assert fast.key() == ref.key()


def _odd_for(rng: random.Random, ranks: int, r: int):
    k = rng.randrange(ranks)
    return rng.choice([KvDone(k, r), Fail(k, r), Land(k, r, rng.choice([ROOM, PAYLOAD]))])


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(ALL), st.integers(1, 8), st.integers(1, 4), st.randoms(use_true_random=False))
def test_grouped_pop_matches_apply_on_hypothesis_walks(variant, ranks, slots, rng):
    """machine._pop over every rank at once (step_pops, when the queues are equal) and
    each rank alone (apply): the same records and states step for step, up to 8 ranks."""
    ref = initial_state(variant, ranks, slots)
    fast = ref.copy()
    for ev, _ in random_walk(rng, ref, 80):
        if isinstance(ev, Step):
            assert _step(step_pops, fast) == _step(lambda s: apply(s, ev, detail=False), ref)
        else:
            apply(ref, ev)
            apply(fast, ev)
        assert fast.key() == ref.key() and fast.steps == ref.steps
