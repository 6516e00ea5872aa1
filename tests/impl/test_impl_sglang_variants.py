"""impl.decode for the mechanisms of SGLang 0.5.19-0.5.23: agreed admission as a library
call, deferred release of failed requests' slots, SGLang's free order, and timeouts
configured in seconds (the deployable defaults never abort a merely slow transfer);
plus spec walks of the new variants replayed on 2 and 4 real gloo ranks."""
from __future__ import annotations

from dataclasses import replace

import pytest

from impl.decode import DecodeTransferQueue, Decision, MetadataBuffers, Req, SlotAllocator
from impl.decode.lockstep import LockstepGroup, run_ranks
from impl.decode.timeouts import GATE_TIMEOUT_S, STEP_FLOOR_S, steps_for
from impl.replay import load_script, replay_scripts
from impl.scripted import ScriptedReceiver
from model.spec import KVPoll, get_variant
from model.spec.variants import VARIANTS, FreeOrder
from .impl_walks import walk

FAILED, SUCCESS = int(KVPoll.Failed), int(KVPoll.Success)


def make(variant, ranks=2, slots=2, **kw):
    g = LockstepGroup(ranks, timeout_s=5)
    return [DecodeTransferQueue(None, MetadataBuffers(slots), SlotAllocator(slots), variant,
                                exchange=g.exchange(k), **kw) for k in range(ranks)]


def step(qs):
    out = run_ranks([q.pop_transferred for q in qs])
    assert not any(isinstance(o, Exception) for o in out), out
    return out


def admit(qs, rid, room):
    return run_ranks([lambda q=q: q.admit([(Req(rid, room), ScriptedReceiver())]) for q in qs])


def fail_everywhere(qs, rid):
    """Rank 0's receiver fails the request; the next step aborts it on every rank."""
    next(d for d in qs[0].queue if d.req.rid == rid).kv_receiver.state = FAILED
    popped = step(qs)
    assert [[(p.decode_req.req.rid, p.decision) for p in ps] for ps in popped] == \
        [[(rid, Decision.ABORT_FAILED)]] * len(qs)


def held_receiver(q, rid):
    return next(d for d in q.held if d.req.rid == rid).kv_receiver


def test_timeouts_are_seconds_and_the_defaults_do_not_abort_slow_transfers():
    q = make("strict", ranks=1)[0]
    assert q.variant.timeout_steps == steps_for(GATE_TIMEOUT_S) == round(30 / STEP_FLOOR_S)
    assert make("strict", ranks=1, timeout_s=2.0, step_floor_s=0.01)[0].variant.timeout_steps == 200
    assert make("deferred", ranks=1)[0].variant.release_timeout_steps == 30_000
    assert make("strict", ranks=1, timeout_steps=7)[0].variant.timeout_steps == 7
    for kw, message in [({"timeout_s": 1.0, "timeout_steps": 3}, "not both"),
                        ({"timeout_s": -1.0}, "timeout must be a finite number"),
                        ({"release_timeout_s": 1.0}, "no release timeout")]:
        with pytest.raises(ValueError, match=message):
            make("strict", ranks=1, **kw)
    with pytest.raises(ValueError, match="no timeout to override"):
        make("gate", ranks=1, timeout_s=1.0)
    # a KV transfer slower than thousands of steps: WaitingForInput never ages
    qs = make("strict", ranks=2, timeout_s=0.01, step_floor_s=0.001)     # 10 gate-held steps
    admit(qs, "slow", 77)
    for _ in range(50):
        assert step(qs) == [[], []]
    assert [len(q) for q in qs] == [1, 1] and all(int(q._age[0]) == 0 for q in qs)


def test_agreed_admission_takes_the_min_of_uneven_capacities():
    qs = make("strict", slots=1)
    admit(qs, "a", 11)
    fail_everywhere(qs, "a")          # strict quarantines the slot until its writes are done
    qs[0].quarantined[0].kv_receiver.fenced = True           # rank 0 only got the fence
    assert run_ranks([q.capacity for q in qs]) == [1, 0]
    assert run_ranks([lambda q=q: q.admissible(3) for q in qs]) == [0, 0]
    assert admit(qs, "b", 12) == [[], []]
    qs[1].quarantined[0].kv_receiver.fenced = True
    assert [len(x) for x in admit(qs, "b", 12)] == [1, 1]
    with pytest.raises(ValueError, match="wanted must be an integer >= 0"):
        qs[0].admissible(-1)


def test_local_deferral_holds_per_rank_and_local_admission_diverges():
    qs = make("deferred-local", slots=1)
    admit(qs, "a", 11)
    fail_everywhere(qs, "a")
    assert [len(q.held) for q in qs] == [1, 1] and run_ranks([q.capacity for q in qs]) == [0, 0]
    held_receiver(qs[0], "a").fenced = True     # rank 0's prefill acknowledged the abort
    assert run_ranks([q.capacity for q in qs]) == [1, 0]
    assert [len(x) for x in admit(qs, "b", 12)] == [1, 0]     # no collective: ranks differ
    assert [len(q) for q in qs] == [1, 0]


def test_agreed_deferral_releases_on_every_rank_in_the_same_step():
    qs = make("deferred", slots=1, release_timeout_s=10.0, step_floor_s=1.0)   # 10 steps
    admit(qs, "a", 11)
    fail_everywhere(qs, "a")
    held_receiver(qs[0], "a").fenced = True
    step(qs)
    assert [len(q.held) for q in qs] == [1, 1]            # rank 1 has no acknowledgement yet
    held_receiver(qs[1], "a").fenced = True
    step(qs)
    assert [len(q.held) for q in qs] == [0, 0] and [q.allocator.free_list() for q in qs] == [[0], [0]]


def test_agreed_deferral_releases_before_the_next_admission_once_every_rank_is_fenced():
    """0.5.23 resolves its holds before each admission (machine._fence): the slot of a
    request every rank's prefill acknowledged is free for the next request, no step in
    between; one rank's acknowledgement alone keeps it held."""
    qs = make("deferred", slots=1, release_timeout_s=10.0, step_floor_s=1.0)
    admit(qs, "a", 11)
    fail_everywhere(qs, "a")
    held_receiver(qs[0], "a").fenced = True
    assert admit(qs, "b", 12) == [[], []] and [len(q.held) for q in qs] == [1, 1]
    held_receiver(qs[1], "a").fenced = True
    assert [[d.req.rid for d in got] for got in admit(qs, "b", 12)] == [["b"], ["b"]]
    assert [len(q.held) for q in qs] == [0, 0]


def test_agreed_deferral_releases_after_the_timeout_without_acknowledgement():
    qs = make(get_variant("deferred", release_timeout_steps=2), slots=1)
    admit(qs, "a", 11)
    fail_everywhere(qs, "a")
    step(qs)
    assert [len(q.held) for q in qs] == [1, 1]
    step(qs)
    assert [len(q.held) for q in qs] == [0, 0]


@pytest.mark.parametrize("order, freed", [(FreeOrder.QUEUE, [2, 9]), (FreeOrder.SET, [9, 2])])
def test_free_order_follows_the_variant(order, freed):
    q = make(replace(VARIANTS["gate"], free_order=order), ranks=1, slots=10)[0]
    for i in range(10):
        q.enqueue(Req(str(i), 100 + i), ScriptedReceiver())
    for d in q.queue:
        if d.req.rid in ("2", "9"):
            d.kv_receiver.state = FAILED
    popped = q.pop_transferred()
    assert [p.decode_req.req.rid for p in popped] == ["2", "9"]       # results in queue order
    assert q.allocator.free_list() == freed                           # slots in the variant's


@pytest.mark.parametrize("ranks", [2, 4])
def test_walks_of_the_new_variants_replay_on_real_ranks(ranks):
    texts = [walk(v, ranks, 2, 40, seed, fail_rate=0.4)
             for v in ("deferred-local", "deferred", "strict-local-admission") for seed in range(3)]
    scripts = [load_script(t.splitlines()) for t in texts]
    results = replay_scripts(scripts, ranks, collective_timeout_s=10, deadline_s=150)
    assert len(results) == len(scripts)
    for text, r in zip(texts, results):
        assert r.validation.ok, (r.validation.message, text)
        if r.script.header.variant == "deferred":            # agreed holds: never diverges
            assert r.error is None, r.error
