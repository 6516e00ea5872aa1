"""Spec traces replayed on 2 and 3 real gloo processes (few runs: each spawns ranks)."""
from __future__ import annotations

import argparse

import pytest

from impl.ranks import run_ranks, timeout_probe
from impl.replay import load_script, replay_scripts, run
from .impl_walks import divergence, walk

SEEDS = range(5)


@pytest.mark.parametrize("ranks", [2, 3])
def test_spec_walks_replay_step_by_step_and_ungated_fails_fast(ranks):
    texts = [walk(v, ranks, 3, 45, seed, 4 if v == "strict" else None)
             for v in ("gate", "strict") for seed in SEEDS]
    texts += [walk("ungated", ranks, 2, 45, seed) for seed in SEEDS]
    texts.append(divergence(ranks))
    scripts = [load_script(t.splitlines()) for t in texts]
    results = replay_scripts(scripts, ranks, collective_timeout_s=10, deadline_s=150)
    assert len(results) == len(scripts)
    for text, r in zip(texts, results):
        spec = load_script(text.splitlines())
        assert r.validation.ok, (r.validation.message, text)
        assert r.trace.splitlines()[0].endswith('"source":"impl"}')
        if spec.header.variant != "ungated":
            assert r.error is None, r.error
            assert r.steps == sum(type(e).__name__ == "Step" for e in spec.events)
    hand = results[-1]
    assert hand.error_kind == "divergence" and hand.steps == 1
    assert "length mismatch" in hand.error and "rank 0: 0, rank 1: 1" in hand.error
    diverged = [r for r in results if r.script.header.variant == "ungated" and r.error]
    assert all(r.validation.state.hung or r.validation.first_violation for r in diverged)


def test_cli_reports_the_ungated_divergence_in_one_line(tmp_path, capsys):
    trace = tmp_path / "div.jsonl"
    trace.write_text(divergence(2))
    out = tmp_path / "impl.jsonl"
    args = argparse.Namespace(trace=str(trace), ranks=2, out=str(out), collective_timeout=10.0,
                              deadline=60.0)
    assert run(args) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("impl trace:") and "OK: 1 steps match variant ungated" in lines[0]
    assert lines[1].startswith("invariant queues_identical breaks at step 0")   # as validate says
    assert lines[2] == ("pdgate replay: ungated diverged at step 1: collective length mismatch: "
                        "ranks hold transfer queues of different lengths (rank 0: 0, rank 1: 1)")
    assert '"hang":[0,1]' in out.read_text()


@pytest.mark.parametrize("content, ranks, message", [
    ("not json\n", None, "malformed JSON"),
    ("", None, "empty trace"),
    (divergence(2), 3, "trace has 2 ranks, replay asked for 3"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, content, ranks, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text(content)
    args = argparse.Namespace(trace=str(trace), ranks=ranks, out=None, collective_timeout=10.0,
                              deadline=60.0)
    assert run(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cli_missing_file_exits_2(tmp_path, capsys):
    args = argparse.Namespace(trace=str(tmp_path / "nope"), ranks=None, out=None,
                              collective_timeout=10.0, deadline=60.0)
    assert run(args) == 2
    assert "cannot read" in capsys.readouterr().err


def test_collective_timeout_fires_within_its_bound():
    [first, _] = run_ranks(timeout_probe, 2, (1.5,), deadline_s=60, group_timeout_s=1.5)
    assert first.value["error"] and "did not complete within 1.5 s" in first.value["error"]
    assert 1.4 <= first.value["elapsed_s"] < 4.0
