"""``pdgate validate`` on good, tampered and malformed traces, run as a subprocess:
exit 0 / 1 / 2, one stderr line naming the trace line, never a traceback."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model.spec.events import PAYLOAD, ROOM, Enqueue, KvDone, Land, Step
from model.spec.invariants import check_invariants
from model.spec.machine import apply
from model.spec.state import initial_state
from model.spec.trace import TraceWriter
from model.spec.variants import VARIANTS

ROOT = Path(__file__).resolve().parents[2]
EVENTS = [Enqueue(0, 77, 5), KvDone(0, 0), KvDone(1, 0), Land(0, 0, PAYLOAD), Land(0, 0, ROOM),
          Step()]


def good_trace(variant: str = "ungated") -> list[str]:
    """The trace-format.md example, written through the spec by TraceWriter."""
    fp = io.StringIO()
    writer = TraceWriter(fp, variant, 2, 2, "test")
    s = initial_state(VARIANTS[variant], 2, 2)
    for ev in EVENTS:
        rec = apply(s, ev)
        if rec is None:
            writer.event(ev)
        else:
            writer.step(rec)
            for v in check_invariants(s, ["queues_identical"])[:1]:
                writer.violation(v, rec.step)
    writer.end(s.steps)
    return fp.getvalue().splitlines()


def validate(tmp_path: Path, lines: list[str], *flags: str) -> subprocess.CompletedProcess:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return subprocess.run([sys.executable, "-m", "model.cli", "validate", str(path), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def edit(lines: list[str], index: int, **changes) -> list[str]:
    obj = json.loads(lines[index])
    obj.update(changes)
    return lines[:index] + [json.dumps(obj)] + lines[index + 1:]


def test_good_trace_exits_0(tmp_path):
    proc = validate(tmp_path, good_trace())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK: 1 steps match variant ungated")
    assert "invariant queues_identical breaks at step 0" in proc.stdout
    assert proc.stderr == ""


def test_trace_replayed_against_another_variant_exits_1_naming_the_line(tmp_path):
    lines = good_trace("ungated")
    proc = validate(tmp_path, lines, "--variant", "gate")
    assert proc.returncode == 1
    step_line = next(n for n, text in enumerate(lines, 1) if '"kind":"step"' in text)
    assert proc.stdout.startswith(f"line {step_line} (step 0): spec does not allow this step")


def test_tampered_step_record_exits_1_naming_the_line(tmp_path):
    lines = good_trace("gate")
    index = next(i for i, text in enumerate(lines) if '"kind":"step"' in text)
    obj = json.loads(lines[index])
    obj["ranks"][1]["gated"] = [4]              # claim rank 1 passed the gate with room 0
    lines[index] = json.dumps(obj)
    proc = validate(tmp_path, lines)
    assert proc.returncode == 1
    assert proc.stdout.strip() == (f"line {index + 1} (step 0): spec does not allow this step: "
                                   "rank 1 gated [4] in trace, spec gives [3]")


def test_trace_without_end_record_exits_1(tmp_path):
    proc = validate(tmp_path, good_trace()[:-1])
    assert proc.returncode == 1 and "ended before its end record" in proc.stdout


def _bad_cases() -> list[tuple[str, list[str], int, str]]:
    good = good_trace()
    step = next(i for i, text in enumerate(good) if '"kind":"step"' in text)
    bad_poll = json.loads(good[step])
    bad_poll["ranks"][0]["local"] = [7]
    return [
        ("malformed JSON", good[:2] + ['{"kind": "kv_done", "rank": 0,'] + good[2:], 3, "malformed JSON"),
        ("unknown kind", good[:2] + ['{"kind": "teleport", "rank": 0, "req": 0}'] + good[2:], 3,
         "unknown record kind 'teleport'"),
        ("poll outside 0..4", good[:step] + [json.dumps(bad_poll)] + good[step + 1:], step + 1,
         "poll value 7 outside 0..4"),
        ("rank out of range", edit(good, 2, rank=2), 3, "kv_done: rank 2 out of range 0..1"),
        ("negative rank", edit(good, 2, rank=-1), 3, "rank -1 out of range 0..1"),
        ("request never enqueued", edit(good, 2, req=9), 3, "kv_done: request 9 was never enqueued"),
        ("land on a never-enqueued request", edit(good, 4, req=3), 5, "land: request 3 was never enqueued"),
        ("negative request id", edit(good, 1, req=-4), 2, "enqueue: req -4 out of range >= 0"),
        ("request id not an integer", edit(good, 2, req="r0"), 3, "field 'req' must be an integer"),
        ("bad land field", edit(good, 4, field="logprobs"), 5, "land: field must be one of"),
        ("not an object", good[:2] + ["[1, 2, 3]"] + good[2:], 3, "record must be a JSON object"),
        ("no header", good[1:], 1, "first record must be a pdgate-trace header"),
        ("unknown variant", edit(good, 0, variant="fast"), 1, "unknown variant 'fast'"),
        ("zero ranks", edit(good, 0, ranks=0), 1, "ranks 0 out of range"),
    ]


@pytest.mark.parametrize("name, lines, line, words", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_malformed_input_exits_2_with_one_line(tmp_path, name, lines, line, words):
    proc = validate(tmp_path, lines)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "\n" not in err and "Traceback" not in proc.stderr, proc.stderr
    assert err.startswith(f"pdgate validate: {tmp_path / 'trace.jsonl'}: line {line}: "), err
    assert words in err, err
    assert proc.stdout == ""


def test_missing_and_empty_files_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "model.cli", "validate", str(tmp_path / "none.jsonl")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr
    proc = validate(tmp_path, [""])
    assert proc.returncode == 2 and "empty trace" in proc.stderr


@pytest.mark.parametrize("variant", ["deferred-local", "deferred", "strict-local-admission",
                                     "strict-set-order", "strict-no-fence"])
def test_every_variant_and_ablation_is_accepted_by_name(tmp_path, variant):
    """The gate holds on rank 1 in every gated variant: the same step record."""
    proc = validate(tmp_path, good_trace("gate"), "--variant", variant)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"OK: 1 steps match variant {variant}")
