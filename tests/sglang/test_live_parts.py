"""``pdgate live``'s parts that need no deployment: the requirement list read from
0.5.23's wheel, the rank logs turned into a spec trace (and a log that contradicts
itself refused), bad flags refused with one line."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from impl.mooncake.report import ReportError
from impl.sglang.live_deps import GPU_ONLY, requirements
from impl.sglang.live_trace import (claim_bounded_wait, first_unlatched, release_steps,
                                    trace_from_logs)
from model.spec.kernel import Decision
from model.spec.validate import validate

META = """Metadata-Version: 2.1
Requires-Dist: aiohttp
Requires-Dist: flashinfer_python[cu13]==0.7.2
Requires-Dist: sgl-flash-mla==1.0.0
Requires-Dist: torch==2.14.1
Requires-Dist: transformers==5.19.0
Requires-Dist: av==16.1.0; sys_platform == "linux" and platform_machine == "aarch64"
Requires-Dist: diffusers==0.37.0; extra == "diffusion"
"""


def test_requirements_drop_gpu_only_torch_and_markers():
    assert requirements(META) == ["aiohttp", "transformers==5.19.0"]
    assert {"flashinfer-python", "torch", "sglang-kernel"} <= GPU_ONLY


def _step(k, queue, local, gated, reduced, popped):
    return {"k": "step", "t": 1.0 + k, "rec": {"step": k, "queue": queue, "local": local,
                                               "gated": gated, "reduced": reduced,
                                               "popped": popped, "hang": None, "error": None}}


def _env(kind, rank, req, **kw):
    return {"k": "env", "t": 0.5, "ev": {"kind": kind, "rank": rank, "req": req, **kw}}


def _logs(late_rank_reduced=3):
    """Two ranks, one request; rank 1's room lands a step late (the gate holds)."""
    logs = []
    for r in (0, 1):
        log = [{"k": "pool", "t": 0.0, "slots": 4},
               {"k": "enq", "t": 0.1, "req": 0, "room": 77, "payload": None, "slot": 2},
               # SGLang's Bootstrapping (1) and Transferring (3): the spec's WaitingForInput
               _step(0, [0], [1], [1], [1], []),
               _env("kv_done", r, 0)]
        if r == 0:
            log += [_env("land", 0, 0, field="payload"), _env("land", 0, 0, field="room")]
        log.append(_step(1, [0], [4], [4 if r == 0 else 3], [late_rank_reduced], []))
        if r == 1:
            log += [_env("land", 1, 0, field="payload"), _env("land", 1, 0, field="room")]
        log.append(_step(2, [0], [4], [4], [4], [[0, int(Decision.COMMIT), 9]]))
        logs.append(log)
    return logs


def test_logs_become_a_trace_the_spec_allows():
    buf = io.StringIO()
    assert trace_from_logs(_logs(), buf, "deferred", None) == 3
    lines = buf.getvalue().splitlines()
    enq = next(json.loads(x) for x in lines if '"enqueue"' in x)
    assert enq["payload"] == 9                           # the commit's token
    assert enq["slots"] == [2, 2] and json.loads(lines[0])["slots"] == 4
    result = validate(lines)
    assert result.ok, result.message


def test_a_min_sglang_did_not_compute_is_refused():
    with pytest.raises(ReportError, match="does not match"):
        trace_from_logs(_logs(late_rank_reduced=4), io.StringIO(), "deferred", None)


def test_a_commit_the_spec_forbids_fails_validation():
    logs = _logs()
    for log in logs:                                     # commit while rank 1's gate held
        next(rec for rec in log if rec["k"] == "step" and rec["rec"]["step"] == 1)[
            "rec"]["popped"] = [[0, int(Decision.COMMIT), 9]]
    buf = io.StringIO()
    trace_from_logs(logs, buf, "deferred", None)
    assert not validate(buf.getvalue().splitlines()).ok


@pytest.mark.parametrize("flags, words", [
    (["--late-room", "2:10"], "RANK 0 or 1"),
    (["--late-room", "1:nan"], "milliseconds"),
    (["--late-room", "1"], "RANK:MS"),
    (["--requests", "0"], "--requests"),
    (["--timeout-steps", "inf"], "--timeout-steps"),
    (["--fail-send", "2"], "--fail-send"),
    (["--fail-send", "x"], "--fail-send"),
    (["--kill-prefill-s", "-1"], "--kill-prefill-s"),
    (["--kill-prefill-s", "nan"], "--kill-prefill-s"),
    (["--late-write", "1:never"], "milliseconds"),
    (["--late-write", "3:10"], "RANK 0 or 1"),
    (["--second-wave-s", "-1"], "--second-wave-s"),
    (["--release-timeout-s", "0"], "--release-timeout-s"),
    (["--max-running", "0"], "--max-running"),
])
def test_bad_flags_one_line_exit_2(flags, words):
    run = subprocess.run([sys.executable, "-m", "model.cli", "live", *flags],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert words in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_missing_venv_is_one_line_exit_2(tmp_path):
    run = subprocess.run([sys.executable, "-m", "model.cli", "live"], capture_output=True,
                         text=True, timeout=60,
                         env={**os.environ, "PDGATE_LIVE_VENV": str(tmp_path)})
    assert run.returncode == 2
    assert "install_live.sh" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def _held_logs(steps):
    """Rank 1's room never lands: the gate holds the request at every step."""
    logs = []
    for r in (0, 1):
        log = [{"k": "pool", "t": 0.0, "slots": 4},
               {"k": "enq", "t": 0.1, "req": 0, "room": 77, "payload": None, "slot": 0},
               _env("kv_done", r, 0)]
        if r == 0:
            log += [_env("land", 0, 0, field="payload"), _env("land", 0, 0, field="room")]
        log += [_step(k, [0], [4], [4 if r == 0 else 3], [3], []) for k in range(steps)]
        logs.append(log)
    return logs


def test_a_request_held_past_the_bound_is_claimed_and_confirmed(tmp_path):
    path = tmp_path / "t.ndjson"
    with open(path, "w", encoding="utf-8") as fp:
        trace_from_logs(_held_logs(6), fp, "deferred", None)
    assert claim_bounded_wait(path, 10) is None              # not past this bound: no claim
    detail = claim_bounded_wait(path, 3)
    assert detail and "request 0" in detail
    result = validate(path.read_text().splitlines())
    assert result.ok and [c.invariant for c in result.claims] == ["bounded_wait"]


def test_a_client_abort_cuts_the_trace_before_it():
    logs = _held_logs(6)
    for log in logs:                 # step 4: the router's AbortReq fails the receiver
        for rec in log:
            if rec["k"] == "step" and rec["rec"]["step"] >= 4:
                rec["rec"]["local"] = [0]
    assert first_unlatched(logs) == 4
    buf = io.StringIO()
    assert trace_from_logs(logs, buf, "deferred", None) == 4
    assert validate(buf.getvalue().splitlines()).ok
    assert first_unlatched(_held_logs(6)) is None


def _released_then_reused(release_logged: bool):
    """0.5.23 as shipped: request 0 fails on both ranks and its slot is held; three
    iterations with nothing queued (logged as empty steps while the slot is held); the
    release timeout frees it; request 1 takes the same slot and commits."""
    logs = []
    for r in (0, 1):
        log = [{"k": "pool", "t": 0.0, "slots": 2},
               {"k": "enq", "t": 0.1, "req": 0, "room": 77, "payload": None, "slot": 0},
               _env("fail", r, 0),
               _step(0, [0], [0], [0], [0], [[0, int(Decision.ABORT_FAILED), 0]])]
        log += [_step(k, [], [], [], [], []) for k in (1, 2, 3)]
        if release_logged:
            log.append({"k": "release", "t": 4.5, "req": 0, "why": "timeout"})
        log += [{"k": "enq", "t": 4.6, "req": 1, "room": 88, "payload": None, "slot": 0},
                _env("kv_done", r, 1), {**_env("land", r, 1, field="payload"), "value": 9},
                {**_env("land", r, 1, field="room"), "value": 9},
                _step(4, [1], [4], [4], [4], [[1, int(Decision.COMMIT), 9]])]
        logs.append(log)
    return logs


def test_a_timeout_release_becomes_the_traces_release_timeout_in_steps():
    logs = _released_then_reused(release_logged=True)
    assert release_steps(logs[0], 5) == 3        # counted at steps 1-3, free before step 4
    buf = io.StringIO()
    trace_from_logs(logs, buf, "deferred", None)
    lines = buf.getvalue().splitlines()
    assert json.loads(lines[0])["release_timeout_steps"] == 3
    result = validate(lines)
    assert result.ok, result.message


def test_a_reuse_before_any_release_is_refused():
    buf = io.StringIO()
    trace_from_logs(_released_then_reused(release_logged=False), buf, "deferred", None)
    result = validate(buf.getvalue().splitlines())
    assert not result.ok and "still held by request 0 (deferred release)" in result.message


def test_an_acked_hold_whose_row_landed_is_a_fence_for_deferred_only():
    """0.5.23 holds a failed request's slot on every rank, also where its row landed
    whole; the prefill's ack releases it there too. ``deferred`` holds it and needs
    the fence; ``strict`` forgot the request at its pop, and its trace leaves it out."""
    logs = []
    for r in (0, 1):
        log = [{"k": "pool", "t": 0.0, "slots": 1},
               {"k": "enq", "t": 0.1, "req": 0, "room": 77, "payload": None, "slot": 0},
               {**_env("land", r, 0, field="payload"), "value": 5},
               {**_env("land", r, 0, field="room"), "value": 5},
               _env("fail", r, 0),
               _step(0, [0], [0], [0], [0], [[0, int(Decision.ABORT_FAILED), 0]]),
               {"k": "release", "t": 1.5, "req": 0, "why": "ack"},
               {**_env("fence", r, 0), "why": "ack", "landed": True},
               {"k": "enq", "t": 1.6, "req": 1, "room": 88, "payload": None, "slot": 0},
               _env("fail", r, 1),
               _step(1, [1], [0], [0], [0], [[1, int(Decision.ABORT_FAILED), 0]])]
        logs.append(log)
    for variant, fences in (("deferred", 2), ("strict", 0)):
        buf = io.StringIO()
        trace_from_logs(logs, buf, variant, 4 if variant == "strict" else None)
        lines = buf.getvalue().splitlines()
        assert sum('"fence"' in x for x in lines) == fences
        result = validate(lines)
        assert result.ok, (variant, result.message)
    dropped = [[rec for rec in log if rec.get("landed") is None] for log in logs]
    buf = io.StringIO()
    trace_from_logs(dropped, buf, "deferred", None)       # no ack: the reuse is refused
    assert "still held by request 0 (deferred release)" in validate(buf.getvalue().splitlines()).message
