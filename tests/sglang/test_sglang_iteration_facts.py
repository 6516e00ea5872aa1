"""The iteration variants against the releases' own decode.py (impl/sglang/iteration_facts.py):
each pinned release's source shows exactly the mechanisms its iter-* variant models, and
a source changed at one mechanism is reported at that mechanism."""
import pytest

from impl.sglang.iteration_facts import (DECODE, MODELLED_BY, OFFLOAD, PREFILL, PREFILL_MODELLED_BY, SCHEDULER,
                                        mechanisms_of, offload_mechanisms_of, offload_mismatches,
                                        prefill_mechanisms_modelled, prefill_mechanisms_of, prefill_mismatches,
                                        release_mismatches)
from impl.sglang.wheels import PINNED, open_wheel
from model.spec.agreement import Op, Skip
from model.spec.iteration import ITER_VARIANTS


@pytest.mark.parametrize("version", PINNED)
def test_each_release_is_modelled_by_its_variant(version):
    assert version in MODELLED_BY
    assert release_mismatches(version) == []


def test_the_release_differences_are_read_from_the_source():
    got = {v: mechanisms_of(open_wheel(v).source_of(DECODE)[0]) for v in ("0.5.12", "0.5.13", "0.5.21", "0.5.23")}
    assert [got[v].prealloc_skip for v in got] == [Skip.ALL_READY, Skip.ALL_READY_NO_LOCAL_FAIL, Skip.EMPTY, Skip.EMPTY]
    assert [got[v].checksum for v in got] == [None, None, Op.LOCAL, Op.MAX]
    assert [got[v].transfer_veto for v in got] == [False, True, True, True]
    assert [got[v].hold for v in got] == [None, None, Op.LOCAL, Op.MAX]
    assert [got[v].release for v in got] == [None, None, Op.MIN, Op.MIN]
    assert [got[v].release_host_only for v in got] == [False, False, True, False]
    assert [got[v].admission_halts for v in got] == [True] * 4        # the fit test's FIFO break
    v19 = mechanisms_of(open_wheel("0.5.19").source_of(DECODE)[0])
    assert (v19.hold, v19.release) == (Op.LOCAL, Op.LOCAL)     # deferred release came in 0.5.19, with no collective


@pytest.mark.parametrize("version", PINNED)
def test_each_release_offload_is_modelled_by_its_variant(version):
    assert offload_mismatches(version) == []


def _offload(version, edit=None, scheduler_edit=None):
    w = open_wheel(version)
    off, sched = w.source_of(OFFLOAD)[0], w.source_of(SCHEDULER)[0]
    for text, change in ((off, edit), (sched, scheduler_edit)):
        if change:
            assert change[0] in text
    off = off.replace(*edit, 1) if edit else off
    sched = sched.replace(*scheduler_edit, 1) if scheduler_edit else sched
    return offload_mechanisms_of(off, sched)


def test_the_offload_drain_is_read_from_the_source():
    assert _offload("0.5.19").drain == () and _offload("0.5.23").drain == (Op.MIN, Op.MAX)
    assert _offload("0.5.23").progress == (Op.MIN, 2, False) and _offload("0.5.23").drain_on_local_memory
    edited = _offload("0.5.23", ("pending, op=torch.distributed.ReduceOp.MAX", "pending, op=torch.distributed.ReduceOp.MIN"))
    assert edited.drain == (Op.MIN, Op.MIN)
    agreed = _offload("0.5.23", scheduler_edit=("if kv_full_retract_flag or (", "if agreed_retract or ("))
    assert not agreed.drain_on_local_memory


@pytest.mark.parametrize("edit, field, value", [
    (("        if not self.queue:\n            return\n", ""), "prealloc_skip", Skip.NEVER),
    (("dist.ReduceOp.MAX", "dist.ReduceOp.SUM"), "checksum", Op.LOCAL),
    (("flags=[hold for _, _, hold in failed],\n            group=self.gloo_group,\n            op=torch.distributed.ReduceOp.MAX",
      "flags=[hold for _, _, hold in failed],\n            group=self.gloo_group,\n            op=torch.distributed.ReduceOp.SUM"),
     "hold", Op.LOCAL),
    (("flags=ready, group=self.gloo_group, op=torch.distributed.ReduceOp.MIN",
      "flags=ready, group=self.gloo_group, op=torch.distributed.ReduceOp.SUM"), "release", Op.LOCAL),
    (("                        decode_req\n                    ):\n                        continue\n",
      "                        decode_req\n                    ):\n                        pass\n"), "transfer_veto", False),
    # pop_preallocated skipping a request that does not fit instead of stopping the walk
    (("                    self.tree_cache.unlock(decode_req.req.lock)\n                    decode_req.req.lock = None\n"
      "                break\n",
      "                    self.tree_cache.unlock(decode_req.req.lock)\n                    decode_req.req.lock = None\n"
      "                continue\n"), "admission_halts", False),
])
def test_a_source_changed_at_one_mechanism_shows_there(edit, field, value):
    source = open_wheel("0.5.23").source_of(DECODE)[0]
    old, new = edit
    assert old in source
    changed = mechanisms_of(source.replace(old, new, 1))
    assert getattr(changed, field) == value
    assert getattr(mechanisms_of(source), field) != value


@pytest.mark.parametrize("version", PINNED)
def test_each_release_prefill_is_modelled_by_its_prefill_variant(version):
    assert prefill_mismatches(version) == []


def test_a_prefill_source_without_the_buffer_continue_shows_it():
    source = open_wheel("0.5.23").source_of(PREFILL)[0]
    got = prefill_mechanisms_of(source)
    assert got.bootstrap_veto == "continue" and got.bootstrap_skip is Skip.EMPTY
    edited = source.replace("if not self.ensure_metadata_buffer(req):", "if False:")
    assert prefill_mechanisms_of(edited).bootstrap_veto is None


def test_0_5_12_breaks_at_the_missing_buffer_and_0_5_13_continues():
    got = {v: prefill_mechanisms_of(open_wheel(v).source_of(PREFILL)[0]).bootstrap_veto for v in PINNED}
    assert got == {"0.5.12": "break", **{v: "continue" for v in PINNED[1:]}}
    assert PREFILL_MODELLED_BY["0.5.12"] == "prefill-0.5.12" and PREFILL_MODELLED_BY["0.5.13"] == "prefill-0.5.13"
    # 0.5.12 edited to continue: its variant (the break) no longer models it
    source = open_wheel("0.5.12").source_of(PREFILL)[0]
    old = "available_size() == 0:\n                break\n"
    assert source.count(old) == 1
    edited = prefill_mechanisms_of(source.replace(old, "available_size() == 0:\n                continue\n"))
    assert edited.bootstrap_veto == "continue"
    assert prefill_mechanisms_modelled(ITER_VARIANTS["prefill-0.5.12"]) != edited
    assert prefill_mechanisms_modelled(ITER_VARIANTS["prefill-0.5.13"]).bootstrap_veto == "continue"


def test_the_waiting_queue_min_is_read_from_the_source():
    assert prefill_mechanisms_of(open_wheel("0.5.13").source_of(PREFILL)[0]).waiting is None
    source = open_wheel("0.5.23").source_of(PREFILL)[0]
    assert prefill_mechanisms_of(source).waiting is Skip.EMPTY
    edited = source.replace("        if not candidates:\n            return\n", "", 1)
    assert edited != source and prefill_mechanisms_of(edited).waiting is Skip.NEVER
