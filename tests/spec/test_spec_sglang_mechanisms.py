"""The mechanisms of SGLang's later releases as spec fields: admission (agreed or
rank-local), deferred release of failed requests' slots (per rank or agreed), the free
order of popped slots, and strict's timeout counting only gate-held steps."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from model.spec.events import Enqueue, Fail, Fence, KvDone, Land, Step
from model.spec.invariants import check_invariants
from model.spec.kernel import Decision
from model.spec.machine import EventNotEnabled, admitting, apply, enabled
from model.spec.state import initial_state
from model.spec.trace import TraceWriter
from model.spec.validate import validate
from model.spec.variants import (ABLATIONS, VARIANTS, Admission, Deferral, FreeOrder,
                                 get_variant)
from proofs.explore import explore


def _abort_everywhere(s, req):
    """Fail ``req`` on rank 0; the next step aborts it on every rank (MIN Failed)."""
    apply(s, Fail(0, req))
    apply(s, Step())
    assert all(rs.outcomes[req] == ("abort", Decision.ABORT_FAILED) for rs in s.ranks)


@pytest.mark.parametrize("name", ["deferred-local", "deferred"])
def test_a_failed_requests_slot_is_held_until_the_release_timeout(name):
    v = get_variant(name, release_timeout_steps=3)
    s = initial_state(v, 2, 1)
    apply(s, Enqueue(0, 7, 5))
    _abort_everywhere(s, 0)
    for held_steps in (1, 2):
        assert [rs.free for rs in s.ranks] == [[], []]
        assert [rs.held for rs in s.ranks] == [{0: held_steps - 1}] * 2
        apply(s, Step())
    apply(s, Step())                       # held 3 steps: released on every rank
    assert [rs.free for rs in s.ranks] == [[0], [0]] and all(not rs.held for rs in s.ranks)


def test_commits_and_room_aborts_free_at_once_under_deferral():
    s = initial_state(VARIANTS["deferred"], 1, 2)
    apply(s, Enqueue(0, 7, 5))
    apply(s, Enqueue(1, 8, 6))
    for req in (0, 1):
        apply(s, KvDone(0, req))
    apply(s, Land(0, 0, "room"))
    s.ranks[0].room_at[s.ranks[0].slot_of[1]] = 99      # a stale, foreign room
    apply(s, Step())
    assert s.ranks[0].outcomes == {0: ("commit", 0), 1: ("abort", Decision.ABORT_ROOM_MISMATCH)}
    assert sorted(s.ranks[0].free) == [0, 1] and not s.ranks[0].held


def test_local_deferral_releases_on_each_ranks_fence_and_admission_then_diverges():
    s = initial_state(VARIANTS["deferred-local"], 2, 1)
    apply(s, Enqueue(0, 7, 5))
    _abort_everywhere(s, 0)
    apply(s, Fence(0, 0))                # rank 0's prefill acknowledged: rank 0 frees now
    assert [rs.free for rs in s.ranks] == [[0], []]
    assert admitting(s) == [0]
    apply(s, Enqueue(1, 8, 6))
    assert [rs.queue for rs in s.ranks] == [[1], []]
    assert [v.invariant for v in check_invariants(s)] == ["queues_identical"]
    apply(s, Step())
    assert s.hung == (1, 0)              # the next MIN: vectors of different lengths


def test_agreed_deferral_releases_only_once_every_rank_can():
    s = initial_state(get_variant("deferred", release_timeout_steps=5), 2, 1)
    apply(s, Enqueue(0, 7, 5))
    _abort_everywhere(s, 0)
    apply(s, Fence(0, 0))
    apply(s, Step())
    assert [rs.free for rs in s.ranks] == [[], []]      # rank 1 still waits for its ack
    assert not admitting(s)
    apply(s, Fence(1, 0))
    apply(s, Step())
    assert [rs.free for rs in s.ranks] == [[0], [0]] and admitting(s) == [0, 1]


def test_agreed_admission_is_the_min_over_ranks():
    """strict's quarantine is per rank: rank 0's slot is free, rank 1's is not."""
    s = initial_state(VARIANTS["strict"], 2, 1)
    apply(s, Enqueue(0, 7, 5))
    _abort_everywhere(s, 0)
    apply(s, Fence(0, 0))
    assert [rs.free for rs in s.ranks] == [[0], []]
    assert admitting(s) == [] and not any(isinstance(e, Enqueue) for e in enabled(s, [Enqueue(1, 8, 6)]))
    with pytest.raises(EventNotEnabled, match="rank 1 has no free metadata slot"):
        apply(s, Enqueue(1, 8, 6))
    local = initial_state(ABLATIONS["strict-local-admission"], 2, 1)
    for ev in (Enqueue(0, 7, 5), Fail(0, 0), Step(), Fence(0, 0), Enqueue(1, 8, 6)):
        apply(local, ev)
    assert [rs.queue for rs in local.ranks] == [[1], []]


def test_set_free_order_is_cpythons_and_differs_from_queue_order_past_the_table_size():
    # the claim checked: a set of small ints iterates by hash slot, ascending only
    # below the table size (8 slots for a small set)
    assert list({2, 9}) == [9, 2] and list({1, 2, 5}) == [1, 2, 5]
    frees = {}
    for order in FreeOrder:
        v = replace(VARIANTS["gate"], free_order=order)
        s = initial_state(v, 1, 10)
        for r in range(10):
            apply(s, Enqueue(r, 100 + r, r))
        for r in (2, 9):                 # positions 2 and 9 fail, the rest stay queued
            apply(s, Fail(0, r))
        apply(s, Step())
        frees[order] = s.ranks[0].free
    assert frees[FreeOrder.QUEUE] == [2, 9] and frees[FreeOrder.SET] == [9, 2]
    assert VARIANTS["deferred"].free_order is FreeOrder.SET
    assert VARIANTS["deferred-local"].free_order is FreeOrder.SET


def test_invariant_verdicts_do_not_depend_on_the_free_order():
    """Explicit search (small positions: same order) and long random walks with ten
    queued requests (where the orders differ) find the same verdicts for both orders."""
    for name in ("gate", "strict"):
        for size in [(2, 2, 4, 1), (1, 2, 3, 2)]:
            verdicts = {order: set(explore(replace(VARIANTS[name], free_order=order), *size,
                                           check_liveness=False).violations) for order in FreeOrder}
            assert verdicts[FreeOrder.QUEUE] == verdicts[FreeOrder.SET], (name, size)
    rng = random.Random(4)
    v = ABLATIONS["strict-set-order"]
    differed = 0
    for trial in range(30):
        s, n = initial_state(v, 2, 12), 0
        for _ in range(200):
            events = enabled(s, [Enqueue(n, 1000 + n, n)])
            enq = [e for e in events if isinstance(e, Enqueue)]
            # fill the queue first: pops past position 8 need ten queued requests
            ev = enq[0] if enq and rng.random() < 0.5 else rng.choice(events)
            n += isinstance(ev, Enqueue)
            before = [list(rs.queue) for rs in s.ranks]
            rec = apply(s, ev)
            if rec is not None and any(len(p) > 1 and max(before[0].index(r) for r, _, _ in p) >= 8
                                       for p in rec.popped):
                differed += 1
            assert not check_invariants(s), (trial, check_invariants(s))
    assert differed > 0                  # the walks did pop at positions past 8


def test_strict_timeout_counts_only_steps_the_gate_holds_a_latched_success():
    v = get_variant("strict", 2)
    s = initial_state(v, 2, 1)
    apply(s, Enqueue(0, 7, 5))
    for _ in range(10):                  # a slow KV transfer: WaitingForInput never ages
        apply(s, Step())
    assert s.ranks[0].queue == [0] and s.ranks[0].age == {0: 0}
    apply(s, KvDone(0, 0))
    apply(s, Step())                     # rank 1 still waiting: the MIN is WaitingForInput
    assert s.ranks[0].age == {0: 0}
    apply(s, KvDone(1, 0))
    apply(s, Step())
    apply(s, Step())                     # MIN Transferring twice: the gate held it 2 steps
    assert [rs.age for rs in s.ranks] == [{0: 2}, {0: 2}]
    rec = apply(s, Step())
    assert rec.popped == (((0, int(Decision.ABORT_FAILED), 0),),) * 2


def test_a_failure_after_success_aborts_a_gated_request_on_every_rank():
    s = initial_state(VARIANTS["strict"], 2, 1)
    apply(s, Enqueue(0, 7, 5))
    apply(s, KvDone(0, 0))
    apply(s, KvDone(1, 0))
    apply(s, Fail(1, 0))
    apply(s, Step())
    assert all(rs.outcomes[0] == ("abort", Decision.ABORT_FAILED) for rs in s.ranks)


def test_deferred_traces_carry_their_release_timeout_and_validate(tmp_path):
    import io
    v = get_variant("deferred-local", release_timeout_steps=2)
    s = initial_state(v, 2, 1)
    fp = io.StringIO()
    w = TraceWriter(fp, v.name, 2, 1, "test", v.timeout_steps, v.release_timeout_steps)
    for ev in (Enqueue(0, 7, 5), Fail(0, 0), Step(), Step(), Step(), Enqueue(1, 8, 6)):
        rec = apply(s, ev)
        w.step(rec) if rec is not None else w.event(ev)
    w.end(s.steps)
    text = fp.getvalue()
    assert '"release_timeout_steps":2' in text.splitlines()[0]
    result = validate(text.splitlines())
    assert result.ok and result.state.variant.release_timeout_steps == 2
    assert [rs.queue for rs in result.state.ranks] == [[1], [1]]
    # replayed with the default release timeout (1) the slot came back a step earlier;
    # with a longer one it is still held and the recorded enqueue is refused
    longer = text.replace('"release_timeout_steps":2', '"release_timeout_steps":3')
    assert not validate(longer.splitlines()).ok


def test_variant_fields_of_the_new_variants():
    dl, d = VARIANTS["deferred-local"], VARIANTS["deferred"]
    assert (dl.defer_failed, d.defer_failed) == (Deferral.LOCAL, Deferral.AGREED)
    assert dl.admission is d.admission is Admission.LOCAL
    assert all(VARIANTS[n].admission is Admission.AGREED for n in ("ungated", "gate", "strict"))
    assert "defer-failed=local" in dl.describe() and "free-order=set" in d.describe()
    with pytest.raises(ValueError, match="has no release timeout to override"):
        get_variant("strict", release_timeout_steps=3)
    with pytest.raises(ValueError, match="release_timeout_steps must be an integer >= 1"):
        get_variant("deferred", release_timeout_steps=0)
