"""The strict patch's own mechanisms on two real gloo ranks, each with its sibling
showing the unpatched (or per-rank) code does what the patch prevents:
- a room mismatch seen by one rank at commit time aborts the request on every rank
  (one MAX all-reduce of local flags), where SGLang as shipped commits on one rank and
  aborts on the other;
- held slots are released only when every rank's writes are fenced, so the ranks' free
  slot counts (SGLang's admission) never differ, where per-rank release lets them."""
from __future__ import annotations

import datetime

import torch.distributed as dist

from impl.ranks import run_ranks
from impl.sglang import stubs
from model.spec.events import Enqueue, Fail, Fence, KvDone, Land
from model.spec.kernel import Decision


def _harness(rank: int, world: int, mode: str):
    from impl.sglang.release import SGLangRank, load_release
    from impl.sglang.runner import _load, Job
    release = _load(Job("0.5.23", mode, False, None), 3.0) if mode != "own" else \
        load_release("0.5.23")
    release.collective_timeout_s = 3.0
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    return SGLangRank(release, rank, world, group, 2)


def mismatch_body(rank: int, world: int, mode: str) -> list:
    h = _harness(rank, world, mode)
    for ev in (Enqueue(0, 77, 5), KvDone(rank, 0), Land(rank, 0, "payload"), Land(rank, 0, "room")):
        h.apply(ev)

    def late_foreign_write() -> None:     # after this rank's gate, before its commit
        if rank == 1:
            h.buffers.bootstrap_room[h.slot_of[0], 0] = 999
    if mode == "own":
        reduce = h.observer.all_reduce
        h.observer.all_reduce = lambda t, *a, **k: (late_foreign_write(), reduce(t, *a, **k))[1]
    else:
        note = h.observer.note
        h.observer.note = lambda g: (late_foreign_write(), note(g))[1]
    return h.step().popped


def test_a_mismatch_one_rank_sees_aborts_on_every_rank():
    patched = [o.value for o in run_ranks(mismatch_body, 2, ("patch",), deadline_s=120)]
    assert patched == [[[0, int(Decision.ABORT_FAILED), 0]]] * 2
    shipped = [o.value for o in run_ranks(mismatch_body, 2, ("own",), deadline_s=120)]
    assert shipped == [[[0, int(Decision.COMMIT), 5]], [[0, int(Decision.ABORT_ROOM_MISMATCH), 0]]]


def release_body(rank: int, world: int, mode: str) -> list:
    h = _harness(rank, world, mode)
    free = []
    h.apply(Enqueue(0, 77, 5))
    h.apply(Fail(rank, 0))
    h.step()                                   # aborted on both ranks; its slot is held
    free.append(h.allocator.available_size())
    if rank == 0:                              # only rank 0's writes are done
        h.apply(Land(0, 0, "payload"))
        h.apply(Land(0, 0, "room"))
    h.step()
    free.append(h.allocator.available_size())
    h.apply(Fence(1, 0))                       # rank 1's prefill acknowledges the abort
    h.step()
    free.append(h.allocator.available_size())
    return free


def test_agreed_release_keeps_free_slots_equal_on_every_rank():
    agreed = [o.value for o in run_ranks(release_body, 2, ("patch",), deadline_s=120)]
    assert agreed == [[1, 1, 2], [1, 1, 2]]
    local = [o.value for o in run_ranks(release_body, 2, ("patch-local",), deadline_s=120)]
    assert local[0][1] != local[1][1]          # per rank: rank 0 frees first
    assert local[0][2] == local[1][2] == 2


def test_stubs_list_what_new_code_reads():
    """A release that imports something pdgate has never seen: a list, not a crash."""
    source = ("from sglang.srt.brand_new import Thing, is_fast\n"
              "value = Thing.setting\n"
              "fast = bool(is_fast())\n"
              "class Sub(Thing):\n    pass\n")
    rec = stubs.install(lambda name: (source, False), {})
    try:
        import importlib
        mod = importlib.import_module("sglang.srt.disaggregation.decode")
        assert mod.fast is False and issubclass(mod.Sub, stubs.Stub)
        assert rec.reads == ["sglang.srt.brand_new.Thing", "sglang.srt.brand_new.is_fast",
                             "sglang.srt.brand_new.Thing.setting"]
    finally:
        stubs.purge()


def test_install_patches_the_installed_release_and_refuses_another():
    import sys

    import pytest

    from impl.sglang.patch import install
    from impl.sglang.release import load_release
    rel = load_release("0.5.23")
    try:
        sys.modules["sglang"].__version__ = "0.5.23"
        with pytest.raises(RuntimeError, match="strict patch for SGLang 0.5.21, but 0.5.23"):
            install("0.5.21")
        assert not hasattr(rel.decode.DecodeTransferQueue, "_pdgate_strict")
        assert rel.decode.poll_and_all_reduce.__module__ == "sglang.srt.disaggregation.utils"
        install("0.5.23")
        assert rel.decode.DecodeTransferQueue._pdgate_strict
        assert "_strict_poll" in rel.decode.poll_and_all_reduce.__qualname__
        assert "_strict_poll" in rel.decode.poll_and_all_reduce_with_staging.__qualname__
        assert rel.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue._pdgate_strict
    finally:
        stubs.purge()
