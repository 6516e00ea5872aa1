"""pdgate conform --pp: every pinned release's own PP decode transfer consensus (the
scheduler PP mixin's ring + pop_transferred) on 2 stages x 2 thread ranks against its
pp-* variant. Expected verdicts per scenario, one per pinned release in PINNED order
(m: matches, d: differs, r:I: reproduces I):

| scenario | verdicts | why |
|---|---|---|
| all-success, one-transferring | m x6 | every stage's ring and second MIN agree |
| all-failed | m x5, d | 0.5.23's pop_transferred adds a MAX over its failed requests' hold flags (not in pp-0.5.13) |
| stage-split-failure | r:stages_agree x5, d | the ring keeps Failed as finished: stage 0 commits, stage 1 aborts; 0.5.23 adds its MAX first |
| queue-split | d x5, r:collectives_agree | one TP rank of stage 0 without the request: up to 0.5.21 it still MINs an empty poll list (shape 0, a gloo mismatch) where the spec skips; 0.5.23 skips, so its peer hangs |
| gated-second-min | d, r:stages_agree x5 | 0.5.13+: the gated second MIN holds stage 1; 0.5.12 commits on stage 1 rank 0 and keeps it on rank 1 (its commit checks the metadata row, rank-local; pp-0.5.12 does not read it) |

0.5.23 prefill (``pop_bootstrapped`` with pp_size 2: PP0's TP-MIN sent down the stages,
zipped by position), against pp-prefill-0.5.23:

| scenario | verdict |
|---|---|
| boot-pp-ready, boot-pp-later-stage-fails | matches (stage 1 acts on PP0's polls, not its own Failed) |
| boot-pp-stage0-empty (cex:positions_agree) | reproduces positions_agree (stage 1 hangs in its receive) |
| boot-pp-shifted (cex:positions_shifted) | reproduces positions_agree (PP0's Failed for request 1 aborts request 0 on stage 1) |
"""
from __future__ import annotations

import time

import pytest

from impl.sglang import ppprefill, pprun
from impl.sglang.wheels import PINNED
from model.cli import main

EXPECTED = {
    "all-success": "m m m m m m", "one-transferring": "m m m m m m", "all-failed": "m m m m m d",
    "stage-split-failure": "r:stages_agree " * 5 + "d", "gated-second-min": "d" + " r:stages_agree" * 5,
    "queue-split": "d d d d d r:collectives_agree",
}


PREFILL = {"boot-pp-ready": "m", "boot-pp-later-stage-fails": "m",
           "boot-pp-stage0-empty": "r:positions_agree", "boot-pp-shifted": "r:positions_agree"}


def _code(row: dict) -> str:
    return f"r:{row['invariant']}" if row["verdict"] == "reproduces" else row["verdict"][0]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    start = time.monotonic()
    out = pprun.check_pp(PINNED, pprun.fixed_pp_scenarios())
    assert time.monotonic() - start < 40
    return out


def test_expected_verdicts_per_release(rows: list[dict]) -> None:
    got = {name: " ".join(_code(r) for r in rows if r["scenario"] == name) for name in EXPECTED}
    assert got == {k: " ".join(v.split()) for k, v in EXPECTED.items()}


def test_the_release_code_ran_its_ring_and_both_mins(rows: list[dict]) -> None:
    """Every release's own P2P helpers: TP rank 0 sends and receives, then broadcasts
    to its stage; each stage's two TP-MINs."""
    for version in PINNED:
        r = next(x for x in rows if x["release"] == version and x["scenario"] == "all-success")
        assert r["records"] == [[("min", 2), ("min", 2)]] * 4
        assert r["ring"] == [[("send", 1), ("recv", 1), ("bcast", 0), ("send", 1)],   # list on, release back, on
                             [("bcast", 0)],
                             [("recv", 0), ("bcast", 1), ("send", 0), ("recv", 0), ("bcast", 1)],
                             [("bcast", 1), ("bcast", 1)]], version
        assert r["places"] == [[2, 2]] * 4 and not any(r["errors"])


def test_the_known_differences_name_their_cause(rows: list[dict]) -> None:
    d = {(r["release"], r["scenario"]): r["detail"] for r in rows if r["verdict"] == "differs"}
    assert d[("0.5.23", "all-failed")] == "stage 0 rank 0 collective 2: spec nothing, release MAX shape 1"
    assert d[("0.5.12", "gated-second-min")] == "stage 1 rank 1 request 0: spec PREBUILT, release TRANSFER"
    assert d[("0.5.21", "queue-split")] == "stage 0 rank 1 collective 0: spec nothing, release MIN shape 0"


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
    assert main(["conform", "--pp", "--sglang", "0.5.13"]) == 1     # queue-split differs
    out = capsys.readouterr().out
    assert "6 checks: 3 match, 2 reproduce, 1 differ" in out


@pytest.fixture(scope="module")
def prefill_rows() -> list[dict]:
    return ppprefill.check_pp_prefill(ppprefill.prefill_pp_scenarios())


def test_prefill_forwarding_by_position(prefill_rows: list[dict]) -> None:
    assert {r["scenario"]: _code(r) for r in prefill_rows} == PREFILL
    ready = prefill_rows[0]
    assert ready["records"] == [[("min", 2)], [("min", 2)], [("pp_recv", 0)], [("pp_recv", 0)]]
    assert ready["ring"][0] == [("pp_send", 2)]               # each TP rank of PP0 sends its list
    shifted = prefill_rows[3]
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
