"""The pipeline variants against the releases' own code (impl/sglang/pp_facts.py): each
pinned release's scheduler_pp_mixin, decode, prefill and utils modules show exactly the
mechanisms its pp-* variants model, and a source changed at one mechanism shows there."""
import pytest

from impl.sglang.iteration_facts import DECODE, PREFILL
from impl.sglang.pp_facts import MIXIN, MODELLED_BY, UTILS, mechanisms_of, release_mismatches
from impl.sglang.wheels import PINNED, open_wheel


@pytest.mark.parametrize("version", PINNED)
def test_each_release_is_modelled_by_its_pp_variants(version):
    assert version in MODELLED_BY
    assert release_mismatches(version) == []


def _sources(version):
    w = open_wheel(version)
    return {m: w.source_of(m)[0] for m in (MIXIN, DECODE, PREFILL, UTILS)}


def test_the_release_differences_are_read_from_the_source():
    got = {v: mechanisms_of(*_sources(v).values()) for v in ("0.5.12", "0.5.13", "0.5.21", "0.5.23")}
    assert [got[v].second_min_gated for v in got] == [False, True, True, True]
    assert [got[v].commit_keeps_unlanded for v in got] == [True, False, False, False]
    assert [got[v].empty_min_skipped for v in got] == [False, False, False, True]
    assert [got[v].hold_max for v in got] == [False, False, False, True]
    assert [got[v].prefill_ring for v in got] == [True, True, True, False]
    assert [got[v].prefill_consensus_applied for v in got] == [False, False, True, False]
    assert [got[v].prefill_by_position for v in got] == [False, False, False, True]
    assert all(m.finished_as_one and m.ring_intersects and m.second_poll and not m.first_min_gated
               for m in got.values())


@pytest.mark.parametrize("version, module, old, new, field", [
    ("0.5.23", DECODE, "polls = self._poll_with_metadata_gate()",
     "polls = poll_and_all_reduce([dr.kv_receiver for dr in self.queue], self.gloo_group)", "second_min_gated"),
    ("0.5.23", MIXIN, "[KVPoll.Success, KVPoll.Failed],", "[KVPoll.Success],", "finished_as_one"),
    ("0.5.23", PREFILL, "polls = poll_and_all_reduce_prefill_pp(", "polls = poll_and_all_reduce_attn_cp_tp_group(",
     "prefill_by_position"),
    ("0.5.23", UTILS, "polls = poll_and_all_reduce(pollers, attn_tp_cpu_group)",
     "polls = poll_and_all_reduce(pollers, attn_tp_cpu_group, metadata_buffers=None)", "first_min_gated"),
    ("0.5.23", UTILS, "if not flags or dist.get_world_size(group) == 1:", "if dist.get_world_size(group) == 1:",
     "empty_min_skipped"),
    ("0.5.23", DECODE, "op=torch.distributed.ReduceOp.MAX,", "op=torch.distributed.ReduceOp.MIN,", "hold_max"),
    ("0.5.12", DECODE, "should_remove = self._commit_transfer_to_req(decode_req)",
     "self._commit_transfer_to_req(decode_req); should_remove = True", "commit_keeps_unlanded"),
    ("0.5.21", MIXIN, "set(prev_bad_bootstrapped_rids) | set(curr_bad_bootstrapped_rids)",
     "set(prev_bad_bootstrapped_rids) & set(curr_bad_bootstrapped_rids)", "prefill_ring"),
    ("0.5.21", PREFILL, "polls = poll_and_all_reduce_pp(", "polls = poll_and_all_reduce_pp_unused(",
     "prefill_consensus_applied"),
])
def test_a_source_changed_at_one_mechanism_shows_there(version, module, old, new, field):
    src = _sources(version)
    before = mechanisms_of(*src.values())
    assert old in src[module]
    src[module] = src[module].replace(old, new)
    after = mechanisms_of(*src.values())
    assert getattr(after, field) != getattr(before, field)
    assert {f for f in before.__dataclass_fields__ if getattr(after, f) != getattr(before, f)} == {field}
