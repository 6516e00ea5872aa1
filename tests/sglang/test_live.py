"""``pdgate live`` end to end: a real SGLang 0.5.23 prefill, TP=2 decode and
sglang_router on CPU (the venv of scripts/install_live.sh), each run checked against a
non-disaggregated server's outputs and its decode ranks' trace replayed by the spec.

- success: every request's text equals the baseline's, the trace validates (deferred),
  naming the real metadata slots of a 4-slot pool, one of them reused (the warm-up's and
  four requests' five enqueues), which the replay checks;
- one fault, a metadata room that never lands on decode rank 1, under the strict
  patch (both sides: the prefill writes each room last, and says how often): every
  request is aborted on both ranks by strict's timeout instead of held forever, the trace validates against ``strict``, and the same trace is refused by
  ``deferred`` (0.5.23 as shipped holds such a request forever: the spec's liveness
  counterexample), so the replay can say no.

Slow (each deployment starts in minutes on 2 cores): two tests, one module-wide
deployment each; pytest-timeout is raised for them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model.spec.validate import validate

LIVE_TIMEOUT_S = 2400


def _live(tmp: Path, *flags: str) -> dict:
    out = tmp / "live.json"
    run = subprocess.run([sys.executable, "-m", "model.cli", "live", "--requests", "4",
                          "--work-dir", str(tmp), "--json", str(out), *flags],
                         capture_output=True, text=True, timeout=LIVE_TIMEOUT_S - 60,
                         env={**os.environ})
    assert out.exists(), run.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(LIVE_TIMEOUT_S)
def test_live_pd_matches_the_plain_server(tmp_path):
    got = _live(tmp_path)
    assert got["failed_requests"] == 0, got["errors"]
    assert got["matches_baseline"] == got["requests"] == 4
    assert got["trace_valid"], got["trace_message"]
    assert got["steps"] > 0
    with open(got["trace"], encoding="utf-8") as fp:
        records = [json.loads(line) for line in fp]
    assert records[0]["slots"] == got["slots"] == 4
    named = [tuple(r["slots"]) for r in records if r["kind"] == "enqueue"]
    assert len(named) == 5 and len(set(named)) < len(named)      # a slot was reused


@pytest.mark.timeout(LIVE_TIMEOUT_S)
def test_live_room_never_lands_strict_aborts_everywhere(tmp_path):
    got = _live(tmp_path, "--late-room", "1:never", "--patch", "strict",
                "--timeout-steps", "50", "--request-timeout-s", "60")
    assert got["failed_requests"] == 4          # aborted, not hanging: the client got errors
    assert got["errors"] and all("transfer failed" in e for e in got["errors"]), got["errors"]
    assert got["trace_valid"], got["trace_message"]
    # strict's prefill side ran: each request's metadata row sent, its room written last
    assert got["prefill_patch"]["room_last"] >= got["prefill_patch"]["rows"] >= 4, got["prefill_patch"]
    with open(got["trace"], encoding="utf-8") as fp:
        assert validate(fp).ok
    with open(got["trace"], encoding="utf-8") as fp:
        shipped = validate(fp, variant="deferred")
    assert not shipped.ok, shipped.message
