"""The iteration variants against the releases' own decode.py (impl/sglang/iteration_facts.py):
each pinned release's source shows exactly the mechanisms its iter-* variant models, and
a source changed at one mechanism is reported at that mechanism."""
import pytest

from impl.sglang.iteration_facts import (DECODE, MODELLED_BY, PREFILL, mechanisms_of, prefill_mechanisms_of,
                                        prefill_mismatches, release_mismatches)
from impl.sglang.wheels import PINNED, open_wheel
from model.spec.agreement import Op, Skip


@pytest.mark.parametrize("version", PINNED)
def test_each_release_is_modelled_by_its_variant(version):
    assert version in MODELLED_BY
    assert release_mismatches(version) == []


def test_the_release_differences_are_read_from_the_source():
    got = {v: mechanisms_of(open_wheel(v).source_of(DECODE)[0]) for v in ("0.5.12", "0.5.13", "0.5.21", "0.5.23")}
    assert [got[v].prealloc_skip for v in got] == [Skip.ALL_READY, Skip.ALL_READY_NO_LOCAL_FAIL, Skip.EMPTY, Skip.EMPTY]
    assert [got[v].checksum for v in got] == [None, None, Op.LOCAL, Op.MAX]
    assert [got[v].transfer_veto for v in got] == [False, True, True, True]


@pytest.mark.parametrize("edit, field, value", [
    (("        if not self.queue:\n            return\n", ""), "prealloc_skip", Skip.NEVER),
    (("dist.ReduceOp.MAX", "dist.ReduceOp.SUM"), "checksum", Op.LOCAL),
    (("                        decode_req\n                    ):\n                        continue\n",
      "                        decode_req\n                    ):\n                        pass\n"), "transfer_veto", False),
])
def test_a_source_changed_at_one_mechanism_shows_there(edit, field, value):
    source = open_wheel("0.5.23").source_of(DECODE)[0]
    old, new = edit
    assert old in source
    changed = mechanisms_of(source.replace(old, new, 1))
    assert getattr(changed, field) == value
    assert getattr(mechanisms_of(source), field) != value


@pytest.mark.parametrize("version", PINNED)
def test_each_release_prefill_is_modelled_by_prefill_0_5_12(version):
    assert prefill_mismatches(version) == []


def test_a_prefill_source_without_the_buffer_continue_shows_it():
    source = open_wheel("0.5.23").source_of(PREFILL)[0]
    got = prefill_mechanisms_of(source)
    assert got.bootstrap_veto and got.bootstrap_skip is Skip.EMPTY
    edited = source.replace("if not self.ensure_metadata_buffer(req):", "if False:")
    assert not prefill_mechanisms_of(edited).bootstrap_veto
