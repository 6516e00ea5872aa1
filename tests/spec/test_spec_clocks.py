"""Per-rank clocks (model/spec/clocks.py): the releases' timeouts diverge under skew
where a rank acts on its own clock, strict's verdicts go through a collective, and
clock traces replay through ``pdgate validate``."""
import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from model.spec.clocks import (CLOCK_INPUTS, CLOCK_VARIANTS, ClockBound, CStage, bounded_wait, check_env,
                               check_limits, clock_step, clock_violations, initial_clock_state,
                               limits_from_seconds)
from model.spec.clocktrace import ClockTraceWriter, validate_clocks
from model.spec.trace import TraceFormatError

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"wait": 3, "release": 3, "queue": 3}


def env(poll=(4, 4), ack=(0, 0), finish=(0, 0)):
    return {"poll": [[p] for p in poll], "ack": [[a] for a in ack], "finish": [[f] for f in finish]}


def run(name, steps, limits=LIMITS):
    v, state, found = CLOCK_VARIANTS[name], initial_clock_state(2, 1), []
    for dt, e in steps:
        state, res = clock_step(v, state, dt, e, limits)
        found.append([x.invariant for x in clock_violations(v, state, res, limits)])
    return state, found


# 27221: transferred, then the scheduler's waiting timeout straddles the deadline
STRADDLE = [([1, 1], env()), ([3, 2], env())]


@pytest.mark.parametrize("name", ["clocks-0.5.12", "clocks-0.5.19"])
def test_a_per_rank_abort_on_skewed_clocks_splits_the_ranks(name):
    state, found = run(name, STRADDLE)
    assert state.stages == ((CStage.GONE,), (CStage.QUEUED,))
    assert "stages_agree" in found[1] and "collectives_agree" in found[1]   # the forward on one rank only


def test_strict_aborts_on_the_first_clock_everywhere_later_releases_on_rank_0s():
    state, found = run("clocks-strict", STRADDLE)
    assert state.stages == ((CStage.GONE,), (CStage.GONE,)) and found == [[], []]
    for name in ("clocks-0.5.21", "clocks-0.5.23"):
        state, found = run(name, STRADDLE)                  # rank 0's clock ran out: both abort
        assert state.stages == ((CStage.GONE,), (CStage.GONE,)) and found == [[], []]
        state, found = run(name, [STRADDLE[0], ([2, 3], env())])   # only rank 1's: neither yet
        assert state.stages == ((CStage.QUEUED,), (CStage.QUEUED,)) and found == [[], []]


def test_the_receivers_timeout_before_the_min_is_safe_under_skew():
    # rank 0's receiver times out in WaitingForInput, rank 1's not yet: Failed wins on both
    state, found = run("clocks-0.5.12", [([3, 1], env(poll=(2, 2)))])
    assert state.stages == ((CStage.GONE,), (CStage.GONE,)) and found == [[]]


def test_a_lost_ack_splits_a_local_release_not_an_agreed_one():
    steps = [([1, 1], env(poll=(0, 0))), ([1, 1], env(poll=(0, 0), ack=(1, 0)))]
    for name in ("clocks-0.5.19", "clocks-0.5.21"):
        local, found = run(name, steps)
        assert local.stages == ((CStage.GONE,), (CStage.HELD,)) and "stages_agree" in found[1]
    for name in ("clocks-0.5.23", "clocks-strict"):
        agreed, found = run(name, steps)
        assert agreed.stages == ((CStage.HELD,), (CStage.HELD,)) and found == [[], []]
    # the ack never comes to rank 1: its own clock releases it, on every rank at once
    agreed, found = run("clocks-strict", steps + [([1, 1], env(poll=(0, 0), ack=(1, 0)))] * 2)
    assert agreed.stages == ((CStage.GONE,), (CStage.GONE,)) and found[-1] == []


def test_transferring_never_times_out_in_the_releases_but_does_in_strict():
    never_fails = [([1, 2], env(poll=(3, 3)))] * 5     # #31800 with a backend that never fails (#36108)
    state, found = run("clocks-0.5.23", never_fails)
    assert state.stages == ((CStage.WAITING,), (CStage.WAITING,)) and "bounded_wait" in found[2]
    state, _ = run("clocks-strict", never_fails[:2])        # rank 1's clock runs out first
    assert state.stages == ((CStage.HELD,), (CStage.HELD,))
    state, found = run("clocks-strict", never_fails)         # then the release timer, as one
    assert state.stages == ((CStage.GONE,), (CStage.GONE,)) and all(f == [] for f in found)


# mostly Success, so that requests reach the scheduler's queue; finishes rare
DOMAINS = {**CLOCK_INPUTS, "poll": (0, 2, 3, 4, 4, 4, 4, 4, 4), "finish": (0, 0, 0, 1)}


def test_strict_random_runs_agree_and_wait_boundedly_the_releases_do_not():
    rng = random.Random(7)
    broken = {name: set() for name in CLOCK_VARIANTS}
    for name, v in CLOCK_VARIANTS.items():
        for _ in range(60):
            state = initial_clock_state(3, 2)
            for _ in range(8):
                dt = [rng.randint(1, 3) for _ in range(3)]
                e = {n: [[rng.choice(d) for _ in range(2)] for _ in range(3)] for n, d in DOMAINS.items()}
                state, res = clock_step(v, state, dt, e, LIMITS)
                broken[name] |= {x.invariant for x in clock_violations(v, state, res, LIMITS)}
    assert broken["clocks-strict"] == set()
    for name in ("clocks-0.5.12", "clocks-0.5.19"):
        assert {"stages_agree", "collectives_agree"} <= broken[name], name
    assert "stages_agree" in broken["clocks-0.5.21"]          # the local release
    assert broken["clocks-0.5.23"] <= {"bounded_wait"}        # agreed; only Transferring is untimed


def test_deployed_limits_are_the_step_floor_units_of_the_seconds():
    assert limits_from_seconds() == {"wait": 300_000, "release": 30_000, "queue": 10_000}
    assert limits_from_seconds(1.0, 0.5, 0.0015, step_floor_s=0.001) == {"wait": 1000, "release": 500, "queue": 2}
    with pytest.raises(ValueError, match="timeout"):
        limits_from_seconds(0.0)


def test_bad_dt_inputs_and_limits_are_refused():
    v = CLOCK_VARIANTS["clocks-strict"]
    with pytest.raises(ValueError, match="dt of rank 1"):
        check_env(v, [1, 0], env(), 2, 1, ClockBound(1, 2))
    with pytest.raises(ValueError, match="dt of rank 0"):
        check_env(v, [True, 1], env(), 2, 1, ClockBound(1, 2))
    with pytest.raises(ValueError, match="'poll' rank 0 holds 1"):
        check_env(v, [1, 1], env(poll=(1, 4)), 2, 1, ClockBound(1, 2))
    with pytest.raises(ValueError, match="'dt' must list 2"):
        check_env(v, [1], env(), 2, 1, ClockBound(1, 2))
    with pytest.raises(ValueError, match="'queue'"):
        check_limits({"wait": 1, "release": 1, "queue": 0})


def test_bounded_wait_names_the_rank_and_stage():
    state = initial_clock_state(2, 1)
    assert bounded_wait(state, LIMITS) == []
    from dataclasses import replace
    late = replace(state, age=((3,), (0,)))
    (viol,) = bounded_wait(late, LIMITS)
    assert viol.ranks == (0,) and "WAITING on rank 0 for 3 steps" in viol.detail


def trace(name, steps, limits=LIMITS, claim=None):
    fp = io.StringIO()
    v, state = CLOCK_VARIANTS[name], initial_clock_state(2, 1)
    w = ClockTraceWriter(fp, name, 2, 1, limits, ClockBound(1, 3), "test")
    for i, (dt, e) in enumerate(steps):
        state, res = clock_step(v, state, dt, e, limits)
        w.step(i, dt, e, state, res)
    found = clock_violations(v, state, res, limits)
    for x in found:
        if x.invariant == claim:
            w.violation(x, len(steps) - 1)
    w.end(len(steps))
    return fp.getvalue().splitlines()


def test_a_clock_trace_replays_with_its_claim_and_a_tampered_one_does_not():
    lines = trace("clocks-0.5.12", STRADDLE, claim="stages_agree")
    res = validate_clocks(lines)
    assert res.ok and [c.invariant for c in res.claims] == ["stages_agree"] and res.first_violation[0] == 1
    assert not validate_clocks(lines, "clocks-strict").ok          # strict: no such break
    step = json.loads(lines[2])
    step["elapsed"] = [[9], [9]]
    res = validate_clocks([lines[0], lines[1], json.dumps(step), *lines[3:]])
    assert not res.ok and "elapsed" in res.message


@pytest.mark.parametrize("edit, words", [
    (lambda h: h.update(limits={"wait": 0, "release": 1, "queue": 1}), "limit 'wait'"),
    (lambda h: h.update(clock={"lo": 3, "hi": 2}), "below lo"),
    (lambda h: h.update(variant="clocks-9"), "unknown clock variant"),
    (lambda h: h.pop("clock"), "'clock' must be an object"),
])
def test_bad_clock_headers_are_format_errors(edit, words):
    lines = trace("clocks-strict", STRADDLE)
    head = json.loads(lines[0])
    edit(head)
    with pytest.raises(TraceFormatError, match=words):
        validate_clocks([json.dumps(head), *lines[1:]])


def test_a_dt_outside_the_headers_clock_is_a_format_error():
    lines = trace("clocks-strict", STRADDLE)
    step = json.loads(lines[2])
    step["dt"] = [4, 1]
    with pytest.raises(TraceFormatError, match=r"dt of rank 0 is 4, outside \[1, 3\]"):
        validate_clocks([lines[0], lines[1], json.dumps(step), *lines[3:]])


def test_pdgate_validate_takes_clock_traces(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(trace("clocks-0.5.19", STRADDLE, claim="collectives_agree")) + "\n")
    cli = lambda *a: subprocess.run([sys.executable, "-m", "model.cli", "validate", str(path), *a],
                                    cwd=ROOT, capture_output=True, text=True, timeout=120)
    ok = cli()
    assert ok.returncode == 0 and "OK: 2 steps" in ok.stdout and "collectives_agree breaks at step 1" in ok.stdout
    assert cli("--variant", "clocks-strict").returncode == 1
    wrong = cli("--variant", "iter-strict")
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "not a clock variant" in wrong.stderr
