"""pdgate conform: every pinned SGLang release's own decode code on the counterexamples
and lassos `pdgate prove` exports for the ungated and gate variants (1 and 2 ranks), as
shipped, with pdgate's drop-ins swapped in, and with the strict patch; 0.5.21 and 0.5.23
with deferred release on the deferred variant's counterexamples. The simulator traces
and the other variants' counterexamples run in `pdgate conform`'s default set and in
`pdgate bench conform`, not here (CI time).

Expected-verdict table (protocol.md, issue 10):
- 0.5.12 reproduces #26394: the queues diverge, and the next MIN mismatches (a rank
  times out in a collective its peer never joins, reported as the spec's hang);
- every gated release reproduces the stale/late-room ``outcomes_agree`` break and the
  room-before-payload ``no_corruption`` break, and holds a genuine room 0 forever;
- 0.5.23 with deferred release matches ``deferred`` (and reproduces its breaks);
- ``--swap`` and ``--patch strict`` never differ from the spec, and under the patch
  those breaks are gone.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from impl.sglang import conform
from impl.sglang.runner import Job, fit_script, run_jobs
from impl.sglang.wheels import PINNED
from model.spec.variants import get_variant

GATED = [v for v in PINNED if v != "0.5.12"]


def _cli(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def all_sources(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    proc = _cli("prove", "--variant", "ungated", "--variant", "gate", "--variant", "deferred",
                "--variant", "deferred-local",
                "--only", "cex:", "--only", "liveness", "--traces", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {p.name: conform.read_source(str(p)) for p in sorted(out.glob("*.jsonl"))}


@pytest.fixture(scope="module")
def sources(all_sources):
    """The ungated and gate counterexamples and lassos (the expected-verdict table)."""
    return {k: v for k, v in all_sources.items() if not k.startswith("deferred")}


def _rows(rows: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["release"], r["trace"]): r for r in rows}


@pytest.fixture(scope="module")
def own(sources):
    return _rows(conform.check(list(PINNED), list(sources.values())))


def test_0_5_12_reproduces_26394_and_the_next_min_mismatches(own):
    for trace in ("ungated.cex-queues_identical.jsonl", "ungated.cex-outcomes_agree.jsonl"):
        row = own[("0.5.12", trace)]
        assert row["verdict"] == "reproduces" and row["invariant"] == "queues_identical", row
        assert row["variant"] == "ungated"
        # the next MIN: one rank sat in a collective its peer never entered, and timed out
        assert row["hang"]["step"] == row["step"] + 1 and sorted(row["hang"]["lengths"]) == [0, 1]
        assert any("Timeout" in e or "timed out" in e.lower() for e in row["errors"]), row


@pytest.mark.parametrize("release", GATED)
def test_every_gated_release_reproduces_the_gate_breaks(own, release):
    late = own[(release, "gate.cex-outcomes_agree.jsonl")]
    assert (late["verdict"], late["invariant"], late["variant"]) == \
        ("reproduces", "outcomes_agree", "gate")
    early = own[(release, "gate.cex-no_corruption.jsonl")]
    assert (early["verdict"], early["invariant"]) == ("reproduces", "no_corruption")
    zero = own[(release, "gate.liveness-bounded_wait_room=0.jsonl")]
    assert (zero["verdict"], zero["invariant"]) == ("reproduces", "bounded_wait")
    # the gate keeps the queues identical where 0.5.12 diverged
    assert own[(release, "ungated.cex-queues_identical.jsonl")]["verdict"] == "matches"


def test_no_release_differs_from_its_variant(own):
    assert not [r for r in own.values() if r["verdict"] == "differs"]


def test_swapped_in_dropins_match_the_spec_in_every_release(sources, own):
    rows = _rows(conform.check(list(PINNED), list(sources.values()), mode="swap"))
    assert len(rows) == len(own)
    for key, row in rows.items():
        assert row["verdict"] != "differs", row
        # same protocol, so the same findings as the release's own functions
        assert (row["verdict"], row["invariant"]) == (own[key]["verdict"], own[key]["invariant"])


@pytest.mark.parametrize("mode", ["patch", "patch-local"])
def test_strict_patch_validates_against_strict_and_removes_the_breaks(sources, mode):
    rows = conform.check(list(PINNED), list(sources.values()), mode=mode, patch="strict")
    assert {r["variant"] for r in rows} == {"strict"}
    assert not [r for r in rows if r["verdict"] == "differs"], rows
    assert not [r for r in rows if r["invariant"] in ("outcomes_agree", "bounded_wait",
                                                      "no_corruption", "queues_identical")]


def test_the_same_machinery_says_differs_for_the_wrong_variant(sources):
    """0.5.13 checked as if it were ungated, 0.5.12 as if it were gated: both differ."""
    jobs = []
    for version, variant, trace in (("0.5.13", "ungated", "gate.liveness-bounded_wait.jsonl"),
                                    ("0.5.12", "gate", "gate.liveness-bounded_wait.jsonl")):
        script, _ = fit_script(sources[trace].script, get_variant(variant))
        jobs.append(Job(version, "own", False, script))
    results = run_jobs(jobs)
    assert [r.validation.ok for r in results] == [False, False]
    assert all("spec does not allow this step" in r.validation.message for r in results)


def test_deferred_release_matches_its_variants(all_sources):
    """0.5.23 with deferred release validates against ``deferred`` (agreed holds and
    releases) and reproduces its counterexamples; 0.5.21 against ``deferred-local``."""
    assert conform.release_variant("0.5.23", True, None) == "deferred"
    assert conform.release_variant("0.5.21", True, None) == "deferred-local"
    assert conform.release_variant("0.5.19", True, None) == "gate"   # decode-initiated aborts only
    picked = [all_sources[n] for n in ("deferred.cex-outcomes_agree.jsonl",
                                       "deferred.cex-no_corruption.jsonl",
                                       "deferred.liveness-bounded_wait.jsonl",
                                       "deferred-local.cex-queues_identical.jsonl",
                                       "gate.cex-outcomes_agree.jsonl")]
    rows = _rows(conform.check(["0.5.21", "0.5.23"], picked, deferred=True))
    assert not [r for r in rows.values() if r["verdict"] in ("differs", "not checked")], rows
    for name in ("deferred.cex-outcomes_agree.jsonl", "deferred.cex-no_corruption.jsonl"):
        row = rows[("0.5.23", name)]
        assert (row["variant"], row["verdict"]) == ("deferred", "reproduces")
        assert row["invariant"] == all_sources[name].claim
    assert rows[("0.5.21", "gate.cex-outcomes_agree.jsonl")]["variant"] == "deferred-local"
    # per-rank holds diverge admission in 0.5.21 (the next MIN times out); 0.5.23 agrees them
    local = rows[("0.5.21", "deferred-local.cex-queues_identical.jsonl")]
    assert (local["verdict"], local["invariant"]) == ("reproduces", "queues_identical")
    assert local["hang"] and any("imed out" in e or "Timeout" in e for e in local["errors"])
    assert rows[("0.5.23", "deferred-local.cex-queues_identical.jsonl")]["verdict"] == "matches"


def test_cli_table_json_and_exit_code(tmp_path):
    proc = _cli("prove", "--variant", "gate", "--only", "cex:outcomes_agree", "--traces",
                str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    trace = tmp_path / "gate.cex-outcomes_agree.jsonl"
    out = tmp_path / "c.json"
    proc = _cli("conform", "--sglang", "0.5.13", str(trace), "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reproduces outcomes_agree at step" in proc.stdout
    [row] = json.loads(out.read_text())
    assert {"release", "trace", "variant", "verdict", "invariant", "step"} <= set(row)
    assert (row["release"], row["variant"], row["verdict"]) == ("0.5.13", "gate", "reproduces")


@pytest.mark.parametrize("args, needle", [
    (["--sglang", "0.5.x"], "not an SGLang release number"),
    (["--sglang", "0.5.13", "/nonexistent.jsonl"], "not a readable trace file"),
    (["--sglang", "0.5.13", "--swap", "--patch", "strict"], "exclude each other"),
    (["--sglang", "0.5.13", "--collective-timeout", "nan"], "--collective-timeout"),
    (["--sglang", "0.5.13", "/dev/zero"], "not a readable trace file"),
    (["--sglang", "0.5.13", "--local-release"], "needs --patch"),
    (["--sglang", "0.5.23", "--deferred", "--patch", "strict"], "does not combine"),
    (["--sglang", "0.5.13", "--traces", "/nonexistent"], "run `pdgate prove"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    proc = _cli("conform", *args, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr


def test_too_many_ranks_is_refused_before_starting_processes(tmp_path):
    trace = tmp_path / "big.jsonl"
    trace.write_text('{"kind":"header","format":"pdgate-trace","version":1,"variant":"gate",'
                     '"ranks":1000,"slots":2,"timeout_steps":null,"source":"hand"}\n'
                     '{"kind":"end","steps":0}\n')
    proc = _cli("conform", "--sglang", "0.5.13", str(trace), timeout=60)
    assert proc.returncode == 2 and "at most 8 ranks" in proc.stderr, proc.stderr


def test_a_missing_release_names_the_install_command(tmp_path):
    import os
    env = {**os.environ, "PDGATE_SGLANG_CACHE": str(tmp_path)}
    proc = _cli("conform", "--sglang", "0.5.13", env=env, timeout=60)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "0.5.13 is not in" in line and "scripts/install.sh" in line
