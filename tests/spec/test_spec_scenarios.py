"""Golden scenario files (tests/spec/scenarios/*.txt): each block's output must be
what the spec gives today. PDGATE_REWRITE=1 stores the current output instead."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model.spec.scenario import ScenarioError, run_script

SCENARIOS = sorted((Path(__file__).parent / "scenarios").glob("*.txt"))
ROOT = Path(__file__).resolve().parents[2]


def test_there_are_scenarios_for_every_variant():
    text = "\n".join(p.read_text() for p in SCENARIOS)
    for name in ("ungated", "gate-noclear", "gate", "strict"):
        assert f"variant {name}\n" in text
    assert len(SCENARIOS) >= 8


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_matches_golden_output(path: Path):
    text = path.read_text()
    got = run_script(text)
    if os.environ.get("PDGATE_REWRITE") == "1":
        path.write_text(got)
        return
    assert got == text, f"{path.name} differs from the spec's output; rerun with PDGATE_REWRITE=1 and review the diff"


@pytest.mark.parametrize("script, line, words", [
    ("ranks 2\n----\nok\n\nfrobnicate 1\n", 5, "unknown command 'frobnicate'"),
    ("enqueue 1 room=7 payload=5\n", 1, "r<id>"),
    ("enqueue r1 room=x payload=5\n", 1, "room must be an integer"),
    ("enqueue r1 payload=5\n", 1, "usage: enqueue"),
    ("kv-done 2 r1\n", 1, "rank 2 out of range 0..1"),
    ("kv-done -1 r1\n", 1, "rank must be >= 0"),
    ("land 0 r1 bytes\n", 1, "room or payload"),
    ("step now\n", 1, "step takes no arguments"),
    ("variant fast\n", 1, "unknown variant 'fast'"),
    ("ranks 0\n", 1, "ranks must be >= 1"),
    ("step\n\nranks 3\n", 3, "ranks must come before the first event"),
    ("variant gate\n\ntimeout 3\n\nstep\n", 5, "has no timeout to override"),
])
def test_bad_commands_give_one_line_naming_the_line(script: str, line: int, words: str):
    with pytest.raises(ScenarioError) as err:
        run_script(script)
    assert err.value.line == line
    message = str(err.value)
    assert message.startswith(f"line {line}: ") and words in message and "\n" not in message


def test_disabled_events_are_reported_not_raised():
    out = run_script("kv-done 0 r1\n")
    assert out == "kv-done 0 r1\n----\nnot enabled: kv_done: request 1 is not in rank 0's transfer queue\n"


def test_scenario_main_reports_bad_script_without_traceback(tmp_path: Path):
    bad = tmp_path / "bad.txt"
    bad.write_text("ranks 2\n\nfly r1\n")
    proc = subprocess.run([sys.executable, "-m", "model.spec.scenario", str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"scenario: {bad}: line 3: unknown command 'fly'"
    assert "Traceback" not in proc.stderr
