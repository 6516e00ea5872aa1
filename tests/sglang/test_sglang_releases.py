"""Every SGLang release 0.5.12 to 0.5.23 (impl/sglang/wheels.py RELEASES), not only the
six pinned ones: each one's source read by every source reader (`pdgate conform --facts
--sglang all`) and compared with the variants that model it. Expected table (release ->
family -> variant, every row ``matches``; "transfer" is the trace mode's variant as
shipped / with deferred KV release on, checked by running it: test_sglang_conform.py):

| release | decode, offload | prefill | pp (decode/prefill) | clocks | transfer |
|---|---|---|---|---|---|
| 0.5.12 | iter-0.5.12 | prefill-0.5.12 | pp-0.5.12/pp-prefill-0.5.12 | clocks-0.5.12 | ungated / ungated |
| 0.5.13 | iter-0.5.13 | prefill-0.5.13 | pp-0.5.13/pp-prefill-0.5.13 | clocks-0.5.12 | gate / gate |
| 0.5.14 to 0.5.16 | iter-0.5.13 | prefill-0.5.18 | pp-0.5.13/pp-prefill-0.5.13 | clocks-0.5.12 | gate / gate |
| 0.5.17, 0.5.18 | iter-0.5.13 | prefill-0.5.18 | pp-0.5.13/pp-prefill-0.5.18 | clocks-0.5.12 | gate / gate |
| 0.5.19 | iter-0.5.19 | prefill-0.5.18 | pp-0.5.13/pp-prefill-0.5.18 | clocks-0.5.19 | gate / gate |
| 0.5.20 | iter-0.5.20 | prefill-0.5.18 | pp-0.5.13/pp-prefill-0.5.18 | clocks-0.5.21 | gate / gate |
| 0.5.21 | iter-0.5.21 | prefill-0.5.18 | pp-0.5.13/pp-prefill-0.5.18 | clocks-0.5.21 | gate / deferred-local |
| 0.5.22 | iter-0.5.21 | prefill-0.5.18 | pp-0.5.13/pp-prefill-0.5.23 | clocks-0.5.21 | gate / deferred-local |
| 0.5.23 | iter-0.5.23 | prefill-0.5.18 | pp-0.5.23/pp-prefill-0.5.23 | clocks-0.5.23 | gate / deferred |

Siblings where the same machinery says ``differs``: each unpinned release read against
the variant a neighbour has (what the docs assumed before these releases were read),
at exactly the facts that changed; and an unpinned release's source edited at one
mechanism (`--source`).
"""
from __future__ import annotations

import json

import pytest

from impl.sglang import clock_facts, conform, iteration_facts, pp_facts
from impl.sglang.facts import FAMILIES
from impl.sglang.wheels import PINNED, RELEASES, open_wheel, wheel_path
from model.cli import main

_PRE = {12: "prefill-0.5.12", 13: "prefill-0.5.13"}
_PP = {12: "pp-0.5.12/pp-prefill-0.5.12", 17: "pp-0.5.13/pp-prefill-0.5.18", 18: "pp-0.5.13/pp-prefill-0.5.18",
       19: "pp-0.5.13/pp-prefill-0.5.18", 20: "pp-0.5.13/pp-prefill-0.5.18", 21: "pp-0.5.13/pp-prefill-0.5.18",
       22: "pp-0.5.13/pp-prefill-0.5.23", 23: "pp-0.5.23/pp-prefill-0.5.23"}
_ITER = {12: "iter-0.5.12", 19: "iter-0.5.19", 20: "iter-0.5.20", 21: "iter-0.5.21", 22: "iter-0.5.21",
         23: "iter-0.5.23"}
_CLOCKS = {19: "clocks-0.5.19", 20: "clocks-0.5.21", 21: "clocks-0.5.21", 22: "clocks-0.5.21",
           23: "clocks-0.5.23"}
TABLE = {f"0.5.{n}": {"decode": _ITER.get(n, "iter-0.5.13"), "offload": _ITER.get(n, "iter-0.5.13"),
                      "prefill": _PRE.get(n, "prefill-0.5.18"), "pp": _PP.get(n, "pp-0.5.13/pp-prefill-0.5.13"),
                      "clocks": _CLOCKS.get(n, "clocks-0.5.12")} for n in range(12, 24)}
TRANSFER = {"0.5.12": ("ungated", "ungated"), **{f"0.5.{n}": ("gate", "gate") for n in range(13, 21)},
            "0.5.21": ("gate", "deferred-local"), "0.5.22": ("gate", "deferred-local"),
            "0.5.23": ("gate", "deferred")}


def test_every_release_0_5_12_to_0_5_23_is_listed_and_cached():
    assert RELEASES == ("0.5.12", "0.5.13", "0.5.14", "0.5.15", "0.5.16", "0.5.17", "0.5.18", "0.5.19",
                        "0.5.20", "0.5.21", "0.5.22", "0.5.23")
    assert set(PINNED) < set(RELEASES)
    assert all(wheel_path(v).is_file() for v in RELEASES)      # install.sh fetched them
    assert {v: conform.MODELLED_BY[v] for v in RELEASES} == TRANSFER


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    """`pdgate conform --facts --sglang all`: its exit code, output and JSON rows."""
    out = tmp_path_factory.mktemp("facts") / "facts.json"
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["conform", "--facts", "--sglang", "all", "--json", str(out)])
    return code, buf.getvalue().splitlines(), json.loads(out.read_text())


def test_conform_facts_on_all_releases_is_the_expected_table(facts):
    code, lines, rows = facts
    n = len(RELEASES) * len(FAMILIES)
    assert code == 0 and lines[-1] == f"{n} checks: {n} match, 0 reproduce, 0 differ"
    got = {}
    for r in rows:
        assert (r["verdict"], r["mismatches"]) == ("matches", []), r
        got.setdefault(r["release"], {})[r["family"]] = r["variant"]
    assert got == TABLE


MAPS = {"decode": iteration_facts.MODELLED_BY, "offload": iteration_facts.MODELLED_BY,
        "prefill": iteration_facts.PREFILL_MODELLED_BY, "pp": pp_facts.MODELLED_BY,
        "clocks": clock_facts.MODELLED_BY}


@pytest.mark.parametrize("release, family, neighbour, facts_changed", [
    # 0.5.20 dropped 0.5.19's all-ready prealloc skip, and has none of 0.5.21's checksum or
    # host-staged release MIN: neither neighbour's variant models it (iter-0.5.20 does)
    ("0.5.20", "decode", "iter-0.5.19", {"prealloc_skip"}),
    ("0.5.20", "decode", "iter-0.5.21", {"checksum", "release", "release_host_only"}),
    ("0.5.20", "offload", "iter-0.5.21", {"drain", "drain_on_local_memory"}),
    # rank 0's broadcast timeout abort came in 0.5.20, not 0.5.21
    ("0.5.20", "clocks", "clocks-0.5.19", {"abort"}),
    ("0.5.22", "clocks", "clocks-0.5.23", {"release"}),
    # the waiting queue's MIN came in 0.5.14
    ("0.5.14", "prefill", "prefill-0.5.13", {"waiting"}),
    # the PP prefill consensus applied from 0.5.17, PP0's polls forwarded from 0.5.22
    ("0.5.16", "pp", ("pp-0.5.13", "pp-prefill-0.5.18"), {"prefill_consensus_applied"}),
    ("0.5.17", "pp", ("pp-0.5.13", "pp-prefill-0.5.13"), {"prefill_consensus_applied"}),
    # the walk's break at a request without a metadata buffer: 0.5.12's, a continue from 0.5.13
    ("0.5.12", "pp", ("pp-0.5.12", "pp-prefill-0.5.13"), {"prefill_buffer_break"}),
    ("0.5.13", "pp", ("pp-0.5.13", "pp-prefill-0.5.12"), {"prefill_buffer_break"}),
    ("0.5.22", "pp", ("pp-0.5.13", "pp-prefill-0.5.18"),
     {"prefill_ring", "prefill_consensus_applied", "prefill_by_position"}),
    ("0.5.22", "pp", ("pp-0.5.23", "pp-prefill-0.5.23"), {"empty_min_skipped", "hold_max"}),
    ("0.5.22", "decode", "iter-0.5.23", {"checksum", "hold", "release_host_only"}),
])
def test_an_unpinned_release_against_a_neighbours_variant_differs_where_it_changed(
        monkeypatch, release, family, neighbour, facts_changed):
    mismatches = FAMILIES[family][1]
    assert mismatches(release) == []
    monkeypatch.setitem(MAPS[family], release, neighbour)
    lines = mismatches(release)
    assert {line.split()[1].rstrip(":") for line in lines} == facts_changed, lines


# 0.5.20's source edited back to 0.5.19's behaviour at one mechanism
EDITS = [
    # the all-ready prealloc skip restored
    ("sglang.srt.disaggregation.decode",
     "        # Receiver polling observes asynchronous failures while KV allocation\n",
     "        if all(dr.waiting_for_input for dr in self.queue) and not any(\n"
     "                dr.kv_receiver.conclude_state == KVPoll.Failed for dr in self.queue):\n"
     "            return\n",
     "decode", "0.5.20 prealloc_skip: source Skip.ALL_READY_NO_LOCAL_FAIL, iter-0.5.20 Skip.EMPTY"),
    # the timeout aborts kept on rank 0 instead of riding the request broadcast
    ("sglang.srt.managers.scheduler", "recv_requests(local_reqs=local_reqs)", "recv_requests(local_reqs=[])",
     "clocks", "0.5.20 abort: source Op.LOCAL, clocks-0.5.21 Op.BROADCAST"),
]


@pytest.mark.parametrize("module, old, new, family, line", EDITS)
def test_an_edited_unpinned_source_differs_at_that_mechanism_only(tmp_path, capsys, module, old, new, family,
                                                                   line):
    text = open_wheel("0.5.20").source_of(module)[0]
    assert text.count(old) == 1, old
    path = tmp_path / (module.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True)
    path.write_text(text.replace(old, new), encoding="utf-8")
    assert main(["conform", "--facts", "--sglang", "0.5.20", "--source", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [x.split()[1] for x in out if " differs: " in x] == [family]
    assert any(x.endswith(f"differs: {line}") for x in out), out


def test_a_release_no_variant_models_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """A cached wheel of a release the table does not list (0.5.24) is refused before any
    run: a variant must model it (``--patch`` checks against the patch's own)."""
    monkeypatch.setenv("PDGATE_SGLANG_CACHE", str(tmp_path))
    (tmp_path / "sglang-0.5.24-cp311-cp311-manylinux_2_34_x86_64.whl").write_bytes(b"")
    assert main(["conform", "--sglang", "0.5.24", "--traces", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no variant models SGLang 0.5.24" in err[0]
    assert conform.release_variant("0.5.24", False, "strict") == "strict"
