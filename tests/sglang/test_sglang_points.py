"""pdgate conform --points (impl/sglang/points.py): every release's own (0.5.12 to 0.5.23,
RELEASES) ``pop_preallocated`` and ``pop_bootstrapped`` on 2 and 3 thread ranks against
the iter-* / prefill-* variant that models it, cut to the points that code covers.

Expected-verdict table, fixed scenarios (``pdgate conform --points --sglang all``;
m matches, d differs, r:I reproduces invariant I), releases 0.5.12 to 0.5.23 in order:

| scenario | verdicts | why |
|---|---|---|
| decode all-proceed, bootstrapping, handshake-fail-one | m x12 | |
| decode resolve-split | m x12 | the releases keep a pending request in the prealloc queue and poll it (Bootstrapping before ``init``): both ranks issue the MIN. (The variants once left PENDING out of it: this row said d on every release and the spec was corrected, model/spec/iteration.py ``prealloc``) |
| decode fits-split, two-mixed, head-of-line-split | r:stages_agree x12 | admission on each rank's own budget (head-of-line-split: rank 0 stops at request 0, so request 1 waits there too) |
| decode ready-fail-one | m, r x7, m x4 (r: collectives_agree) | 0.5.13-0.5.19 poll only where a receiver failed locally; 0.5.20 on poll whatever the receivers say |
| decode queue-split | r:stages_agree x8, r:collectives_agree x4 | 0.5.20+ poll a queue of READY requests: the empty rank skips (a hang, reported) |
| decode fits-head-of-line | m x12 | admission stops at the first request that does not fit (FIFO ``break``: the admission point's ``halt``). (The variants once admitted each request on its own: this row said d on every release, and the spec was corrected) |
| prefill boot-ready, boot-fail-one | m x12 | |
| prefill no-buffer-split (#37909) | r:no_local_decision_after_min x12 | |
| prefill boot-queue-split | r:collectives_agree x12 | the empty-queue early return |
| prefill no-buffer-then-fail | m x12 | 0.5.12 ``break``s at the missing buffer, so a later Failed request stays queued (prefill-0.5.12 halts there); 0.5.13 on ``continue`` (prefill-0.5.13, prefill-0.5.18). (prefill-0.5.12 once modelled 0.5.12 and 0.5.13 with the ``continue``: this row said d on 0.5.12) |

Seeded random scenarios (seed 0): the expected string per release below; `pdgate prove`'s
iter-0.5.13 / prefill-0.5.12 cex traces as scenarios on 0.5.13.

Siblings where the same comparison says ``differs``: a release's code against another
release's variant and against the strict variants (``--variant``), and a release's
source edited at one mechanism (``source=``).
"""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from impl.sglang import points, threadgroup as tg
from impl.sglang.wheels import RELEASES
from model.cli import main
from model.spec.agreement import Stage as S
from model.spec.iteration import ITER_VARIANTS, IterVariant

M = "m " * 12
EXPECTED = {
    "all-proceed": M, "bootstrapping": M, "handshake-fail-one": M, "resolve-split": M,
    "fits-split": "r:stages_agree " * 12, "two-mixed": "r:stages_agree " * 12,
    "ready-fail-one": "m " + "r:collectives_agree " * 7 + "m " * 4,
    "queue-split": "r:stages_agree " * 8 + "r:collectives_agree " * 4,
    "fits-head-of-line": M, "head-of-line-split": "r:stages_agree " * 12,
    "boot-ready": M, "boot-fail-one": M,
    "no-buffer-split": "r:no_local_decision_after_min " * 12,
    "boot-queue-split": "r:collectives_agree " * 12,
    "no-buffer-then-fail": M,
}
# seeded random scenarios (seed 0, 6 decode and 6 prefill, interleaved): per release
RANDOM = {"0.5.12": "mmrrrmmmmrrm", **{f"0.5.{n}": "mmmrrmmmmrrm" for n in range(13, 20)},
          **{f"0.5.{n}": "mmmrmmmmmrmm" for n in range(20, 24)}}


def _code(row: dict) -> str:
    return f"r:{row['invariant']}" if row["verdict"] == "reproduces" else row["verdict"][0]


@pytest.fixture(scope="module")
def rows():
    return points.check(list(RELEASES), points.fixed_scenarios() + points.random_scenarios(0, 6))


def test_every_release_gives_the_expected_verdicts(rows):
    assert RELEASES == tuple(f"0.5.{n}" for n in range(12, 24))
    fixed = {sc.name for sc in points.fixed_scenarios()}
    got = {}
    for r in rows:
        if r["scenario"] in fixed:
            got.setdefault(r["scenario"], []).append(_code(r))
    assert {k: " ".join(v) for k, v in got.items()} == {k: v.strip() for k, v in EXPECTED.items()}


def test_the_seeded_random_scenarios_give_the_expected_verdicts(rows):
    got = {}
    for r in rows:
        if r["scenario"].startswith("random-"):
            got[r["release"]] = got.get(r["release"], "") + _code(r)[0]
    assert got == RANDOM
    assert not [r for r in rows if r["scenario"].startswith("random-") and r["verdict"] == "differs"]


def test_no_release_run_crashed_and_none_differs(rows):
    assert not [r for r in rows if "raised" in (r.get("detail") or "")]
    assert not [(r["release"], r["scenario"], r["detail"]) for r in rows if r["verdict"] == "differs"]


def test_a_hang_is_reported_with_both_ranks_records(rows):
    row = next(r for r in rows if (r["release"], r["scenario"]) == ("0.5.23", "queue-split"))
    assert row["records"] == [[("min", 1)], []] and row["spec_records"] == [[["prealloc_poll", "min", 1]], []]
    assert "rank 0 waits in MIN shape [1], rank 1 issues nothing" in row["detail"]


@pytest.mark.parametrize("version, scenario, variant, detail", [
    # 0.5.12 skips a queue of READY requests; 0.5.21's variant polls it
    ("0.5.12", "ready-fail-one", "iter-0.5.21", "rank 0 collective 0: spec prealloc_poll MIN shape 1, release nothing"),
    # 0.5.13 polls where its own receiver failed; 0.5.12's variant skips
    ("0.5.13", "ready-fail-one", "iter-0.5.12", "rank 0 collective 0: spec nothing, release MIN shape 1"),
    # 0.5.20 polls a READY queue on every rank; 0.5.19's variant skips where none failed
    ("0.5.20", "ready-fail-one", "iter-0.5.19", "rank 1 collective 0: spec nothing, release MIN shape 1"),
    # and 0.5.19 does skip there, where 0.5.20's variant polls
    ("0.5.19", "ready-fail-one", "iter-0.5.20", "rank 1 collective 0: spec prealloc_poll MIN shape 1, release nothing"),
    # strict agrees admission with a MIN the releases never issue
    ("0.5.23", "fits-split", "iter-strict", "rank 0 collective 1: spec admission MIN shape 1, release nothing"),
    # prefill-strict gates the missing buffer before the MIN; 0.5.23 continues after it
    ("0.5.23", "no-buffer-split", "prefill-strict", "rank 1 request 0: spec BOOTSTRAP, release WAITING"),
    # 0.5.12 breaks at the missing buffer; 0.5.13's variant continues to the Failed request
    ("0.5.12", "no-buffer-then-fail", "prefill-0.5.13", "rank 0 request 1: spec GONE, release BOOTSTRAP"),
    # 0.5.13 continues; 0.5.12's variant stops at the missing buffer
    ("0.5.13", "no-buffer-then-fail", "prefill-0.5.12", "rank 0 request 1: spec BOOTSTRAP, release GONE"),
])
def test_the_comparison_says_differs_against_a_wrong_variant(rows, version, scenario, variant, detail):
    """The release's run of the scenario (the rows'), compared with another variant."""
    row = next(r for r in rows if (r["release"], r["scenario"]) == (version, scenario))
    sc = next(s for s in points.fixed_scenarios() if s.name == scenario)
    assert row["verdict"] != "differs"
    other = points.compare(sc, variant, row["run"])
    assert (other["variant"], other["verdict"], other["detail"]) == (variant, "differs", detail)


def test_the_variant_flag_compares_with_that_variant():
    sc = next(s for s in points.fixed_scenarios() if s.name == "ready-fail-one")
    [row] = points.check(["0.5.13"], [sc], variant="iter-0.5.12")
    assert (row["variant"], row["verdict"]) == ("iter-0.5.12", "differs")


# a release's source edited at one mechanism: the run is its code, so the verdict moves
EDITS = {
    # 0.5.13 without its local-Failed poll: it skips a READY queue as 0.5.12 does
    ("0.5.13", "ready-fail-one"): ("sglang/srt/disaggregation/decode.py",
                                   "decode_req.kv_receiver.conclude_state == KVPoll.Failed", "False",
                                   "rank 0 collective 0: spec prealloc_poll MIN shape 1, release nothing"),
    # 0.5.23's prefill keeping a bootstrapped request it has a buffer for
    ("0.5.23", "boot-ready"): ("sglang/srt/disaggregation/prefill.py",
                               "elif not self.finalize_bootstrap(req):", "elif True:",
                               "rank 0 request 0: spec WAITING, release BOOTSTRAP"),
    # 0.5.23 skipping a request that does not fit instead of stopping its walk
    ("0.5.23", "fits-head-of-line"): ("sglang/srt/disaggregation/decode.py",
                                      "                    decode_req.req.lock = None\n                break\n",
                                      "                    decode_req.req.lock = None\n                continue\n",
                                      "rank 0 request 1: spec READY, release TRANSFER"),
    # 0.5.12's prefill continuing past the missing buffer (as 0.5.13 does)
    ("0.5.12", "no-buffer-then-fail"): ("sglang/srt/disaggregation/prefill.py",
                                        "available_size() == 0:\n                break\n",
                                        "available_size() == 0:\n                continue\n",
                                        "rank 0 request 1: spec BOOTSTRAP, release GONE"),
}


@pytest.mark.parametrize("version, scenario", sorted(EDITS))
def test_an_edited_release_source_differs_from_its_variant(rows, tmp_path, version, scenario):
    from impl.sglang.wheels import open_wheel
    name, old, new, detail = EDITS[(version, scenario)]
    text = open_wheel(version).member(name)
    assert text.count(old) == 1
    (tmp_path / name).parent.mkdir(parents=True)
    (tmp_path / name).write_text(text.replace(old, new))
    sc = next(s for s in points.fixed_scenarios() if s.name == scenario)
    [row] = points.check([version], [sc], source=str(tmp_path))
    assert (row["verdict"], row["detail"]) == ("differs", detail), row
    assert next(r for r in rows if (r["release"], r["scenario"]) == (version, scenario))["verdict"] != "differs"


def test_the_free_buffers_mean_no_buffer_for_the_later_askers():
    stages = [[1, 1, 1], [1, 1, 0]]
    # request 1 polls Bootstrapping on rank 1: only 0 and 2 ask on rank 0, 0 on rank 1
    assert points.no_buffer(stages, [[2, 2, 2], [2, 1, 2]], [1, 0]) == [[0, 0, 1], [1, 0, 0]]


@pytest.fixture(scope="module")
def cex_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cex")
    assert main(["prove", "--variant", "iter-0.5.13", "--variant", "prefill-0.5.12", "--only", "cex:point:prealloc",
                 "--only", "cex:collectives_agree", "--only", "cex:point:admission", "--traces", str(out),
                 "--jobs", "1"]) == 0
    return out


def test_the_spec_counterexamples_run_as_scenarios(cex_dir):
    """pdgate prove's cex traces, one scenario per iteration, on the release its variant
    models: the release's code reproduces the local-Failed skip's hang and the split
    admission, and contradicts none."""
    paths = sorted(cex_dir.glob("*.jsonl"))
    scenarios = [sc for p in paths for sc in points.trace_scenarios(str(p), points.COVERED)]
    got = {r["scenario"]: (_code(r), r["detail"]) for r in points.check(["0.5.13"], scenarios)}
    assert got["iter-0.5.13.cex-point-prealloc_poll#1"][0] == "r:collectives_agree"
    assert got["iter-0.5.13.cex-point-admission#0"][0] == "r:stages_agree"
    # the whole iteration's counterexample is the solver's choice: its first break may lie
    # past the points this code covers (then the covered part matches), never against them
    assert got["iter-0.5.13.cex-collectives_agree#0"][0] != "d"
    assert not [k for k, (code, _) in got.items() if code == "d"], got
    assert got["prefill-0.5.12.cex-collectives_agree#0"][0] == "r:no_local_decision_after_min"


def test_a_trace_that_is_not_an_iteration_trace_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"kind":"header","format":"pdgate-trace"}\n')
    assert main(["conform", "--points", "--sglang", "0.5.23", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "pdgate-iteration header" in err and len(err.strip().splitlines()) == 1, err


# -- the fake gloo group ----------------------------------------------------------------
def _ranks(bodies, timeout_s=0.5):
    hub = tg.Hub(len(bodies), timeout_s)
    groups = [tg.Group(hub, k, len(bodies)) for k in range(len(bodies))]
    values = tg.run_threads(hub, [lambda k=k: bodies[k](groups[k]) for k in range(len(bodies))])
    return hub, values


def _reduce(values, op):
    def body(group):
        t = torch.tensor(values[group.rank], dtype=torch.int32)
        tg.FakeDist().all_reduce(t, op=op, group=group)
        return t.tolist()
    return body


def test_the_group_really_reduces_and_records_op_and_shape():
    ops = torch.distributed.ReduceOp
    for op, name, want in ((ops.MIN, "min", [1, 0]), (ops.MAX, "max", [4, 2])):
        hub, values = _ranks([_reduce({0: [4, 0], 1: [1, 2], 2: [3, 1]}, op)] * 3)
        assert values == [want] * 3 and hub.errors == [None] * 3
        assert hub.records == [[(name, (2,))]] * 3


def test_a_rank_left_waiting_is_reported_not_hung():
    start = time.monotonic()
    hub, _ = _ranks([_reduce({0: [1]}, torch.distributed.ReduceOp.MIN), lambda g: None])
    assert hub.errors[0].startswith("Hang: collective 0: rank 0 waits in MIN shape [1], rank 1 issues nothing")
    # a peer that is still busy: the timeout ends the wait
    hub, _ = _ranks([_reduce({0: [1]}, torch.distributed.ReduceOp.MIN), lambda g: time.sleep(1.0)], 0.3)
    assert hub.errors[0].startswith("Hang:") and "rank 1 issues nothing yet" in hub.errors[0]
    assert hub.errors[1] is None and time.monotonic() - start < 4


def test_collectives_of_different_shapes_mismatch_on_both_ranks():
    hub, _ = _ranks([_reduce({0: [1], 1: [1, 1]}, torch.distributed.ReduceOp.MIN)] * 2)
    assert all(e.startswith("Mismatch: collective 0: rank 0 issues MIN shape [1], rank 1 issues MIN shape [2]")
               for e in hub.errors)


# -- the command line -------------------------------------------------------------------
def test_the_command_prints_the_table_and_exits_1_where_a_release_differs(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["conform", "--points", "--sglang", "0.5.21", "--random", "1", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:3] == ["0.5.21", "decode", "fits-head-of-line"] and "matches" in line for line in lines)
    assert lines[-1] == "17 checks: 11 match, 6 reproduce, 0 differ"
    assert out.read_text().count('"scenario"') == 17
    # the same release against 0.5.12's variant (which skips a queue of READY requests): exit 1
    assert main(["conform", "--points", "--sglang", "0.5.21", "--random", "0", "--variant", "iter-0.5.12"]) == 1
    assert "differs: rank 0 collective 0: spec nothing, release MIN shape 1" in capsys.readouterr().out


def test_seed_without_points_is_refused(capsys):
    assert main(["conform", "--sglang", "0.5.23", "--seed", "3"]) == 2
    assert "--seed and --random need --points" in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--variant", "gate"], "unknown iteration variant 'gate'"),
    (["--swap"], "--points does not combine with --swap"),
    (["--random", "-1"], "--random must be in [0, 1000]"),
    (["--sglang", "0.5.7"], "SGLang 0.5.7 is not in"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    argv = ["conform", "--points", *(["--sglang", "0.5.23"] if "--sglang" not in args else []), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def _pending_outside_the_min(name: str) -> IterVariant:
    """The release's variant as the spec had it before conform --points ran the wheels:
    its prealloc MIN over PREALLOC and READY only (a pending request not polled)."""
    v = ITER_VARIANTS[name]
    return IterVariant(f"{name}-pending-outside", v.releases, tuple(
        replace(p, members=(S.PREALLOC, S.READY), gate=None) if p.name == "prealloc_poll" else p
        for p in v.points))


def test_the_model_before_the_correction_differs_where_the_wheels_poll_a_pending_request(rows):
    """The sibling of resolve-split's ``m``: the same runs against the old modelling of
    the prealloc MIN say differs, on every release (the correction is the wheels')."""
    scenarios = {(s.name, s.side): s for s in points.fixed_scenarios()}
    for r in rows:
        if r["scenario"] != "resolve-split":
            continue
        other = points.compare(scenarios[("resolve-split", "decode")], _pending_outside_the_min(r["variant"]),
                               r["run"])
        assert other["verdict"] == "differs" and "spec nothing, release MIN shape 1" in other["detail"], other


def _admits_each_on_its_own(name: str) -> IterVariant:
    """The release's variant as the spec had it before conform --points ran the wheels'
    admission: each READY request admitted on its own fit (no FIFO break)."""
    v = ITER_VARIANTS[name]
    return IterVariant(f"{name}-no-halt", v.releases, tuple(
        replace(p, halt=None) if p.name == "admission" else p for p in v.points))


def test_the_model_without_the_fifo_break_differs_where_the_wheels_stop(rows):
    """The sibling of fits-head-of-line's ``m``: the same runs against admission without
    the halt say differs, on every release (the correction is the wheels')."""
    sc = next(s for s in points.fixed_scenarios() if s.name == "fits-head-of-line")
    for r in rows:
        if r["scenario"] == sc.name:
            other = points.compare(sc, _admits_each_on_its_own(r["variant"]), r["run"])
            assert (other["verdict"], other["detail"]) == ("differs", "rank 0 request 1: spec TRANSFER, release READY")
