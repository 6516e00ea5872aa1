"""pdgate conform --pp: every release's own (0.5.12 to 0.5.23, RELEASES) PP consensus code
(the scheduler PP mixin's rings + pop_transferred / pop_bootstrapped) on 2 stages x 2
thread ranks against its pp-* variant. Expected verdicts per scenario, one per release in
RELEASES order (m: matches, r:I: reproduces I; no row differs):

| scenario | verdicts | why |
|---|---|---|
| all-success, one-transferring, all-transferring, all-failed | m x12 | every stage's ring and second MIN agree (0.5.23: with its hold-flag MAX after a Failed; all-transferring: an empty list, the second MIN still over the queue) |
| stage-split-failure | r:stages_agree x12 | the ring keeps Failed as finished: stage 0 commits, stage 1 aborts |
| gated-second-min | r:stages_agree x12 | 0.5.13+: the gated second MIN holds stage 1; 0.5.12: its commit keeps the request on the rank whose metadata row has not landed |
| queue-split | r:collectives_agree x12 | one TP rank of stage 0 without the request: up to 0.5.22 it MINs an empty list (shape 0, a gloo mismatch); 0.5.23 skips, so its peer hangs |

Each row that differed before the model was corrected has a sibling that still differs:
the same run against the variant that lacks the mechanism (test_the_old_modelling_differs).

Prefill, 0.5.12 to 0.5.21 (the bootstrap ring: good intersected, bad united; then
``pop_bootstrapped`` with the consensus), against pp-prefill-0.5.12 / pp-prefill-0.5.13 / pp-prefill-0.5.18:

| scenario | 0.5.12 to 0.5.16 | 0.5.17 to 0.5.21 |
|---|---|---|
| ring-ready, ring-stage-bootstrapping | m | m |
| ring-stage-fails (stage 1 Failed) | r:stages_agree (each stage pops on its own second poll) | m (the consensus applied, #31869) |
| ring-no-buffer (stage 1 rank 1 has none) | r:stages_agree | r:stages_agree |
| ring-queue-split | r:collectives_agree (a shape-0 MIN) | r:collectives_agree |
| ring-buffer-break (two requests, the second Failed; stage 1 rank 1 has no buffer) | r:stages_agree (0.5.12's walk breaks: the Failed one stays there; 0.5.13 on continue to it) | r:stages_agree |

0.5.22 and 0.5.23 prefill (``pop_bootstrapped`` with pp_size 2: PP0's TP-MIN sent down the
stages, zipped by position), against pp-prefill-0.5.23:

| scenario | verdict (each) |
|---|---|
| boot-pp-ready, boot-pp-later-stage-fails | matches (stage 1 acts on PP0's polls, not its own Failed) |
| boot-pp-stage0-empty (cex:positions_agree) | reproduces positions_agree (stage 1 hangs in its receive) |
| boot-pp-shifted (cex:positions_shifted) | reproduces positions_agree (PP0's Failed for request 1 aborts request 0 on stage 1) |
"""
from __future__ import annotations

import time

import pytest

from impl.sglang import ppprefill, pprun
from impl.sglang.wheels import RELEASES
from model.cli import main

EXPECTED = {
    "all-success": "m " * 12, "one-transferring": "m " * 12, "all-transferring": "m " * 12,
    "all-failed": "m " * 12, "stage-split-failure": "r:stages_agree " * 12,
    "gated-second-min": "r:stages_agree " * 12, "queue-split": "r:collectives_agree " * 12,
}
# the ring releases, 0.5.12 to 0.5.21, in order
RING = {"ring-ready": "m " * 10, "ring-stage-bootstrapping": "m " * 10,
        "ring-stage-fails": "r:stages_agree " * 5 + "m " * 5, "ring-no-buffer": "r:stages_agree " * 10,
        "ring-queue-split": "r:collectives_agree " * 10, "ring-buffer-break": "r:stages_agree " * 10}
RING_RELEASES = RELEASES[:10]
# 0.5.22 and 0.5.23 forward PP0's polls by position, each with these verdicts
PREFILL = {"boot-pp-ready": "m", "boot-pp-later-stage-fails": "m",
           "boot-pp-stage0-empty": "r:positions_agree", "boot-pp-shifted": "r:positions_agree"}


def _code(row: dict) -> str:
    return f"r:{row['invariant']}" if row["verdict"] == "reproduces" else row["verdict"][0]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    start = time.monotonic()
    out = pprun.check_pp(RELEASES, pprun.fixed_pp_scenarios())
    assert time.monotonic() - start < 80
    return out


def test_expected_verdicts_per_release(rows: list[dict]) -> None:
    got = {name: " ".join(_code(r) for r in rows if r["scenario"] == name) for name in EXPECTED}
    assert got == {k: " ".join(v.split()) for k, v in EXPECTED.items()}
    assert [r for r in rows if r["verdict"] == "differs"] == []


def test_the_release_code_ran_its_ring_and_both_mins(rows: list[dict]) -> None:
    """Every release's own P2P helpers: TP rank 0 sends and receives, then broadcasts
    to its stage; each stage's two TP-MINs."""
    for version in RELEASES:
        r = next(x for x in rows if x["release"] == version and x["scenario"] == "all-success")
        assert r["records"] == [[("min", 2), ("min", 2)]] * 4
        assert r["ring"] == [[("send", 1), ("recv", 1), ("bcast", 0), ("send", 1)],   # list on, release back, on
                             [("bcast", 0)],
                             [("recv", 0), ("bcast", 1), ("send", 0), ("recv", 0), ("bcast", 1)],
                             [("bcast", 1), ("bcast", 1)]], version
        assert r["places"] == [[2, 2]] * 4 and not any(r["errors"])


def test_the_mechanisms_the_model_was_corrected_for(rows: list[dict]) -> None:
    by = {(r["release"], r["scenario"]): r for r in rows}
    # 0.5.23's hold flags MAX after its poll MIN wherever a request failed
    assert by[("0.5.23", "all-failed")]["records"][0] == [("min", 1), ("min", 1), ("max", 1)]
    assert by[("0.5.21", "all-failed")]["records"][0] == [("min", 1), ("min", 1)]
    # up to 0.5.21 an empty queue still MINs (shape 0); 0.5.23's returns first
    assert by[("0.5.21", "queue-split")]["records"][1] == [("min", 0)]
    assert by[("0.5.23", "queue-split")]["records"][1] == []
    # 0.5.12's commit keeps the request on the rank whose metadata row has not landed
    assert by[("0.5.12", "gated-second-min")]["places"][2:] == [[2], [0]]
    # the second MIN polls the whole queue, listed or not
    assert by[("0.5.13", "all-transferring")]["records"] == [[("min", 1), ("min", 1)]] * 4


def test_the_old_modelling_differs(rows: list[dict]) -> None:
    """The rows that differed before the model was corrected, against the variant that
    lacks the mechanism: the comparison still says no."""
    scenarios = {s.name: s for s in pprun.fixed_pp_scenarios()}
    run = lambda version, name: next(x["run"] for x in rows if x["release"] == version and x["scenario"] == name)
    no_max = pprun.compare_pp(scenarios["all-failed"], "pp-0.5.13", run("0.5.23", "all-failed"))
    assert no_max["verdict"] == "differs" and no_max["detail"].endswith("spec nothing, release MAX shape 1")
    split = pprun.compare_pp(scenarios["stage-split-failure"], "pp-0.5.13", run("0.5.23", "stage-split-failure"))
    assert split["verdict"] == "differs" and "release MAX shape 1" in split["detail"]
    for version in ("0.5.21", "0.5.22"):       # the empty-list skip came in 0.5.23, not 0.5.22
        skipped = pprun.compare_pp(scenarios["queue-split"], "pp-0.5.23", run(version, "queue-split"))
        assert skipped["detail"] == "stage 0 rank 1 collective 0: spec nothing, release MIN shape 0"
    gated = pprun.compare_pp(scenarios["gated-second-min"], "pp-0.5.13", run("0.5.12", "gated-second-min"))
    assert gated["verdict"] == "differs" and gated["detail"] == "stage 1 rank 0 request 0: spec TRANSFER, release PREBUILT"


def test_a_wrong_variant_differs(rows: list[dict]) -> None:
    """The same runs against another pp-* variant: the comparison can say no."""
    run = next(x["run"] for x in rows if x["release"] == "0.5.13" and x["scenario"] == "gated-second-min")
    sc = next(s for s in pprun.fixed_pp_scenarios() if s.name == "gated-second-min")
    row = pprun.compare_pp(sc, "pp-0.5.12", run)
    assert row["verdict"] == "differs" and "spec PREBUILT, release TRANSFER" in row["detail"]
    split = next(s for s in pprun.fixed_pp_scenarios() if s.name == "stage-split-failure")
    run = next(x["run"] for x in rows if x["release"] == "0.5.13" and x["scenario"] == split.name)
    assert pprun.compare_pp(split, "pp-strict", run)["verdict"] == "differs"


def test_a_lost_ring_message_is_a_hang_not_a_hang_of_the_test() -> None:
    ring = pprun.Ring(2, 1, timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(pprun.tg.Hang, match="stage 1 rank 0 waits for stage 0"):
        ring.point_to_point([], 1, 0, 1)
    with pytest.raises(pprun.tg.Hang, match="stage 0 rank 1 waits for its stage's broadcast"):
        pprun.Ring(2, 2, timeout_s=0.2).broadcast(None, 0, 1)
    assert time.monotonic() - start < 2


def test_cli_bad_input_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["conform", "--pp", "--sglang", "0.5.13", "--variant", "pp-prefill-0.5.23"]) == 2
    assert main(["conform", "--pp", "--points", "--sglang", "0.5.13"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "unknown PP decode variant" in err[0] and "--points" in err[1]


def test_cli_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["conform", "--pp", "--sglang", "0.5.13"]) == 0     # decode and the prefill ring
    out = capsys.readouterr().out
    assert "13 checks: 6 match, 7 reproduce, 0 differ" in out
    # another release's variant: 0.5.23's hold MAX and empty-queue skip are not 0.5.13's
    assert main(["conform", "--pp", "--sglang", "0.5.13", "--variant", "pp-0.5.23"]) == 1
    assert "7 checks: 3 match, 1 reproduce, 3 differ" in capsys.readouterr().out


@pytest.fixture(scope="module")
def ring_rows() -> list[dict]:
    start = time.monotonic()
    assert [v for v in RELEASES if not ppprefill.by_position(v)] == list(RING_RELEASES)
    out = ppprefill.check_prefill(RING_RELEASES)
    assert time.monotonic() - start < 60
    return out


def test_prefill_bootstrap_ring(ring_rows: list[dict]) -> None:
    got = {name: " ".join(_code(r) for r in ring_rows if r["scenario"] == name) for name in RING}
    assert got == {k: " ".join(v.split()) for k, v in RING.items()}
    by = {(r["release"], r["scenario"]): r for r in ring_rows}
    # 0.5.12 to 0.5.16 poll their whole queue again after the ring; 0.5.17 on the unlisted only
    for version in RING_RELEASES:
        again = version in ("0.5.12", "0.5.13", "0.5.14", "0.5.15", "0.5.16")
        assert by[(version, "ring-ready")]["records"] == [[("min", 1)] * (2 if again else 1)] * 4, version
    assert by[("0.5.18", "ring-stage-bootstrapping")]["records"] == [[("min", 1), ("min", 1)]] * 4
    assert by[("0.5.21", "ring-queue-split")]["records"][1] == [("min", 0)]


def test_prefill_ring_against_the_other_rule_differs(ring_rows: list[dict]) -> None:
    """Own second poll (0.5.12) against the consensus applied (0.5.18), both ways."""
    sc = next(s for s in ppprefill.ring_prefill_scenarios() if s.name == "ring-stage-fails")
    run = lambda version: next(r["run"] for r in ring_rows if r["release"] == version and r["scenario"] == sc.name)
    assert pprun.compare_pp(sc, "pp-prefill-0.5.12", run("0.5.18"))["detail"] == \
        "stage 0 rank 0 collective 1: spec bootstrap_poll MIN shape 1, release nothing"
    assert pprun.compare_pp(sc, "pp-prefill-0.5.18", run("0.5.12"))["verdict"] == "differs"
    # where the rule changed: 0.5.16 is the last to poll again, 0.5.17 the first to apply it
    assert pprun.compare_pp(sc, "pp-prefill-0.5.18", run("0.5.16"))["verdict"] == "differs"
    assert pprun.compare_pp(sc, "pp-prefill-0.5.12", run("0.5.17"))["verdict"] == "differs"


def test_prefill_ring_break_and_continue_at_a_missing_buffer(ring_rows: list[dict]) -> None:
    """0.5.12's walk breaks at a request without a metadata buffer, 0.5.13 to 0.5.16's
    continues: each release matches its own variant only, at the Failed request behind it."""
    sc = next(s for s in ppprefill.ring_prefill_scenarios() if s.name == "ring-buffer-break")
    run = lambda version: next(r["run"] for r in ring_rows if r["release"] == version and r["scenario"] == sc.name)
    assert pprun.compare_pp(sc, "pp-prefill-0.5.13", run("0.5.12"))["detail"] == \
        "stage 1 rank 1 request 1: spec GONE, release BOOTSTRAP"
    for version in ("0.5.13", "0.5.16"):
        assert pprun.compare_pp(sc, "pp-prefill-0.5.12", run(version))["detail"] == \
            "stage 1 rank 1 request 1: spec BOOTSTRAP, release GONE"


@pytest.fixture(scope="module")
def prefill_rows() -> list[dict]:
    return ppprefill.check_prefill(RELEASES[10:])


def test_prefill_forwarding_by_position(prefill_rows: list[dict]) -> None:
    for version in ("0.5.22", "0.5.23"):
        assert {r["scenario"]: _code(r) for r in prefill_rows if r["release"] == version} == PREFILL
    by = {(r["release"], r["scenario"]): r for r in prefill_rows}
    ready = by[("0.5.23", "boot-pp-ready")]
    assert ready["records"] == by[("0.5.22", "boot-pp-ready")]["records"]
    assert ready["records"] == [[("min", 2)], [("min", 2)], [("pp_recv", 0)], [("pp_recv", 0)]]
    assert ready["ring"][0] == [("pp_send", 2)]               # each TP rank of PP0 sends its list
    shifted = by[("0.5.23", "boot-pp-shifted")]
    assert shifted["places"][2] == [4, 1]                     # request 0 GONE, request 1 still queued


def test_prefill_against_strict_differs(prefill_rows: list[dict]) -> None:
    sc = ppprefill.prefill_pp_scenarios()[1]
    row = pprun.compare_pp(sc, "pp-prefill-strict", prefill_rows[1]["run"])
    assert row["verdict"] == "differs" and "release PP_RECV" in row["detail"]


def test_the_wheel_code_decides_an_edited_ring_differs(tmp_path) -> None:
    """0.5.13's mixin with the ring's intersection dropped (a later stage keeps its own
    list): a request stage 0 has not finished is popped on stage 1, and the row that
    matched now differs."""
    from impl.sglang.pp_facts import MIXIN
    from impl.sglang.wheels import open_wheel
    text = open_wheel("0.5.13").source_of(MIXIN)[0]
    cut = "set(prev_transferred_rids) & set(curr_transferred_rids)"
    assert cut in text
    path = tmp_path / "sglang/srt/managers/scheduler_pp_mixin.py"
    path.parent.mkdir(parents=True)
    path.write_text(text.replace(cut, "set(curr_transferred_rids)"), encoding="utf-8")
    sc = [s for s in pprun.fixed_pp_scenarios() if s.name == "one-transferring"]
    row = pprun.check_pp(["0.5.13"], sc, source=str(tmp_path))[0]
    assert row["verdict"] == "differs"
    assert row["detail"] == "stage 1 rank 0 request 1: spec TRANSFER, release PREBUILT"
