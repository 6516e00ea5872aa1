"""pdgate conform: every SGLang release's own decode code (0.5.12 to 0.5.23, RELEASES) on
the counterexamples and lassos `pdgate prove` exports for the ungated and gate variants
(1 and 2 ranks) and the stale-room trace, as shipped; the pinned releases also with
pdgate's drop-ins swapped in and with the strict patch (monkey-patched, and as a diff
applied to the release's source); 0.5.20 to 0.5.23 with deferred release on the
deferred variants' counterexamples. The simulator traces
and the other variants' counterexamples run in `pdgate conform`'s default set and in
`pdgate bench conform`, not here (CI time).

Expected-verdict table (protocol.md, issues 10 and 20). Each row is reproduced by its
command (traces from `pdgate prove --traces out/traces`; stale-room.jsonl is in the
default set) and has a sibling where the same machinery says ``differs``:

| rows | command | sibling that differs (same machinery) |
|---|---|---|
| 0.5.12 reproduces #26394 (the queues diverge, the next MIN times out) | `pdgate conform --sglang 0.5.12 out/traces/ungated.cex-queues_identical.jsonl` | `... --variant gate out/traces/gate.liveness-bounded_wait.jsonl` |
| every gated release (0.5.13 to 0.5.23) reproduces the late-room `outcomes_agree`, room-before-payload `no_corruption` and room-0 `bounded_wait` breaks, and matches ungated's queues_identical trace | `pdgate conform --sglang 0.5.13,...,0.5.23 out/traces/gate.cex-*.jsonl out/traces/gate.liveness-bounded_wait_room=0.jsonl out/traces/ungated.cex-queues_identical.jsonl` | `pdgate conform --sglang 0.5.13 --variant ungated out/traces/gate.liveness-bounded_wait.jsonl` |
| every gated release matches the stale-room trace (it zeroes the room on free) | `pdgate conform --sglang all` (row stale-room.jsonl) | `--source T` where T holds 0.5.13's decode.py (or 0.5.23's utils.py) with the `bootstrap_room[idx] = 0` of its free path replaced by `pass` |
| `--swap`: the release's own verdicts, never differs | `pdgate conform --sglang pinned --swap` | as the own rows |
| `--patch strict`: never differs; no `outcomes_agree`, `bounded_wait`, `queues_identical` left; `no_corruption` only where the prefill writes the room first (checked against `strict-no-room-order`: a decode-side patch cannot reorder the prefill's writes); a trace strict refuses an event of is `cut`, never `matches` | `pdgate conform --sglang pinned --patch strict [--local-release]` | `... --patch strict --variant gate` (the patched queue is not gate) |
| `--patch strict --reorder-rooms`: all `strict`, no break left, moved rows `rewritten` | `pdgate conform --sglang 0.5.13,0.5.23 --patch strict --reorder-rooms` | as above |
| the strict diff: `patch -p1` applies to each pinned release, its source gives the monkey-patch's verdicts (test_sglang_diff.py) | `pdgate conform --sglang V --emit-diff D; (cd T; patch -p1 < D/sglang-V-strict.diff); pdgate conform --sglang V --patch strict --source T` | `... --source T --variant gate` |
| 0.5.23 with deferred release matches `deferred` (and reproduces its breaks), 0.5.21 and 0.5.22 `deferred-local`, 0.5.20 `gate` (it holds only decode-initiated aborts) | `pdgate conform --sglang 0.5.20,0.5.21,0.5.22,0.5.23 --deferred out/traces/deferred*.cex-*.jsonl` | `... --sglang 0.5.20 --deferred --variant deferred-local`, `... --sglang 0.5.22 --deferred --variant gate` |
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from impl.sglang import conform
from impl.sglang.runner import Job, fit, fit_script, run_jobs
from impl.sglang.wheels import PINNED, RELEASES
from model.spec.variants import get_variant

GATED = [v for v in RELEASES if v != "0.5.12"]


def _cli(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def traces_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    proc = _cli("prove", "--variant", "ungated", "--variant", "gate", "--variant", "deferred",
                "--variant", "deferred-local",
                "--only", "cex:", "--only", "liveness", "--traces", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def all_sources(traces_dir):
    return {p.name: conform.read_source(str(p)) for p in sorted(traces_dir.glob("*.jsonl"))}


@pytest.fixture(scope="module")
def sources(all_sources, tmp_path_factory):
    """The ungated and gate counterexamples and lassos, and the stale-room trace (the
    expected-verdict table)."""
    stale = tmp_path_factory.mktemp("stale") / conform.STALE_ROOM
    conform.write_stale_room(str(stale))
    return {**{k: v for k, v in all_sources.items() if not k.startswith("deferred")},
            conform.STALE_ROOM: conform.read_source(str(stale))}


def _tree(root, version: str, edits: dict[str, tuple[str, str]]):
    """A source tree of ``version``'s modules in ``edits`` (wheel path -> (old, new)),
    each ``old`` replaced once (it must occur exactly once: the edit cannot miss)."""
    from impl.sglang.wheels import open_wheel
    wheel = open_wheel(version)
    for name, (old, new) in edits.items():
        text = wheel.member(name)
        assert text.count(old) == 1, (version, name, old)
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text.replace(old, new))
    return root


def _rows(rows: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["release"], r["trace"]): r for r in rows}


@pytest.fixture(scope="module")
def own(sources):
    return _rows(conform.check(list(RELEASES), list(sources.values())))


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
    # the room is zeroed on free: a reused slot's gate holds until its own room lands
    assert own[(release, conform.STALE_ROOM)]["verdict"] == "matches"


# zero-on-free as each release writes it: 0.5.13's pop loop, 0.5.23's clear_slot
ZERO_ON_FREE = {
    "0.5.13": {"sglang/srt/disaggregation/decode.py": (
        "            self.metadata_buffers.bootstrap_room[idx] = 0\n", "            pass\n")},
    "0.5.23": {"sglang/srt/disaggregation/utils.py": (
        "        self.bootstrap_room[idx] = 0\n", "        pass\n")},
}


@pytest.mark.parametrize("release", sorted(ZERO_ON_FREE))
def test_a_release_without_zero_on_free_differs_on_the_stale_room(sources, tmp_path, release):
    """The stale-room trace's sibling: the same release with its zero-on-free removed
    lets a reused slot's stale room through the gate on one rank."""
    tree = _tree(tmp_path, release, ZERO_ON_FREE[release])
    [row] = conform.check([release], [sources[conform.STALE_ROOM]], source_dir=str(tree))
    assert (row["variant"], row["verdict"]) == ("gate", "differs"), row
    assert "rank 0 gated [4] in trace, spec gives [3]" in row["detail"]


def test_no_release_differs_from_its_variant(own):
    assert not [r for r in own.values() if r["verdict"] == "differs"]


def test_swapped_in_dropins_match_the_spec_in_every_release(sources, own):
    rows = _rows(conform.check(list(PINNED), list(sources.values()), mode="swap"))
    assert len(rows) == len(PINNED) * len(sources) and set(rows) <= set(own)
    for key, row in rows.items():
        assert row["verdict"] != "differs", row
        # same protocol, so the same findings as the release's own functions
        assert (row["verdict"], row["invariant"]) == (own[key]["verdict"], own[key]["invariant"])


BREAKS = ("outcomes_agree", "bounded_wait", "no_corruption", "queues_identical")


def _early_room(src) -> bool:
    from impl.sglang.runner import rooms_before_payloads
    return bool(rooms_before_payloads(src.script.events))


@pytest.fixture(scope="module")
def patched(sources):
    return {mode: conform.check(list(PINNED), list(sources.values()), mode=mode, patch="strict")
            for mode in ("patch", "patch-local")}


@pytest.mark.parametrize("mode", ["patch", "patch-local"])
def test_strict_patch_runs_the_traces_unmodified_and_removes_the_breaks(sources, patched, mode):
    rows = patched[mode]
    assert not [r for r in rows if r["verdict"] == "differs"], rows
    for row in rows:
        src = sources[row["trace"]]
        # a decode-side patch cannot reorder the prefill's writes: such a trace runs as it
        # is, against strict without the room order, and only there no_corruption stays
        early = _early_room(src)
        assert row["variant"] == ("strict-no-room-order" if early else "strict"), row
        assert row["invariant"] in ((None, "no_corruption") if early else (None,)), row
        assert "moved" not in row.get("note", "")
        # a trace strict refuses an event of is cut, and says so
        assert (row["verdict"] == "cut") == ("cut at event" in row.get("note", "")), row
        assert row["verdict"] in ("matches", "reproduces", "cut")
    early = [r for r in rows if r["trace"] == "gate.cex-no_corruption.jsonl"]
    assert {(r["verdict"], r["invariant"]) for r in early} == {("reproduces", "no_corruption")}
    assert {r["verdict"] for r in rows if r["trace"] == "gate.cex-outcomes_agree.jsonl"} == {"cut"}


def test_strict_patch_with_reordered_rooms_says_rewritten(sources):
    """--reorder-rooms: strict's prefill order imposed on the traces; every break is gone
    and a moved trace reads ``rewritten`` (or ``cut``), never ``matches``."""
    rows = conform.check(["0.5.13", "0.5.23"], list(sources.values()), mode="patch",
                         patch="strict", reorder_rooms=True)
    assert {r["variant"] for r in rows} == {"strict"}
    assert not [r for r in rows if r["verdict"] == "differs" or r["invariant"] in BREAKS], rows
    for row in rows:
        moved = _early_room(sources[row["trace"]])
        if moved:
            assert row["verdict"] in ("rewritten", "cut") and row["changes"], row
            assert any("room of request" in c for c in row["changes"])
        else:
            assert row["verdict"] != "rewritten", row
    assert {r["verdict"] for r in rows if r["trace"] == "gate.cex-no_corruption.jsonl"} == \
        {"rewritten"}


def test_the_patch_runs_with_the_traces_own_timeout(sources):
    """The patch's timeout is a decode-side setting: a trace that names one runs with it
    (strict's default 4 only where it names none), and the run shows it: a request the
    gate holds forever is failed after that many held steps."""
    from dataclasses import replace

    from model.spec.validate import validate
    src = sources["gate.liveness-bounded_wait.jsonl"]
    assert conform.patch_variant("strict", src, False)[0].timeout_steps == 4
    jobs = []
    for steps in (1, 3):
        script = replace(src.script, header=replace(src.script.header, timeout_steps=steps))
        variant, why = conform.patch_variant("strict", conform.Source(src.name, script, None,
                                                                      None), False)
        assert (variant.name, variant.timeout_steps, why) == ("strict", steps, "")
        jobs.append(Job("0.5.23", "patch", False, fit(script, variant).script))
    results = run_jobs(jobs)
    assert [r.validation.ok for r in results] == [True, True], [r.validation.message for r in results]

    def first_pop(text: str) -> int:
        steps = [json.loads(line) for line in text.splitlines() if '"kind":"step"' in line]
        return next(s["step"] for s in steps if s["ranks"][0]["popped"])
    assert first_pop(results[0].trace) < first_pop(results[1].trace)
    # sibling: the run with timeout 3 checked as if the patch had timeout 1 differs
    assert '"timeout_steps":3' in results[1].trace
    relabelled = results[1].trace.replace('"timeout_steps":3', '"timeout_steps":1', 1)
    assert not validate(relabelled.splitlines()).ok


@pytest.mark.parametrize("release, variant", [("0.5.12", "gate"), ("0.5.13", "ungated"),
                                              ("0.5.23", "strict")])
def test_cli_checked_against_the_wrong_variant_differs(traces_dir, release, variant):
    """The table's siblings as commands: --variant V for a release V does not model."""
    trace = traces_dir / "gate.liveness-bounded_wait.jsonl"
    proc = _cli("conform", "--sglang", release, "--variant", variant, str(trace))
    assert proc.returncode == 1 and "differs at" in proc.stdout, proc.stdout + proc.stderr
    assert "1 checks: 1 differ" in proc.stdout


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
    releases) and reproduces its counterexamples; 0.5.21 and 0.5.22 against
    ``deferred-local``; 0.5.20 against ``gate`` (it holds only a decode-initiated
    abort's slot, and a trace has none)."""
    assert conform.release_variant("0.5.23", True, None) == "deferred"
    assert conform.release_variant("0.5.21", True, None) == "deferred-local"
    assert conform.release_variant("0.5.22", True, None) == "deferred-local"
    assert conform.release_variant("0.5.19", True, None) == "gate"   # decode-initiated aborts only
    assert conform.release_variant("0.5.20", True, None) == "gate"
    picked = [all_sources[n] for n in ("deferred.cex-outcomes_agree.jsonl",
                                       "deferred.cex-no_corruption.jsonl",
                                       "deferred.liveness-bounded_wait.jsonl",
                                       "deferred-local.cex-queues_identical.jsonl",
                                       "gate.cex-outcomes_agree.jsonl")]
    rows = _rows(conform.check(["0.5.20", "0.5.21", "0.5.22", "0.5.23"], picked, deferred=True))
    assert not [r for r in rows.values() if r["verdict"] in ("differs", "not checked")], rows
    assert {rows[("0.5.20", n.name)]["variant"] for n in picked} == {"gate"}
    for name in ("deferred-local.cex-queues_identical.jsonl", "gate.cex-outcomes_agree.jsonl"):
        a, b = rows[("0.5.21", name)], rows[("0.5.22", name)]
        assert (b["variant"], b["verdict"], b["invariant"]) == ("deferred-local", a["verdict"], a["invariant"])
    for name in ("deferred.cex-outcomes_agree.jsonl", "deferred.cex-no_corruption.jsonl"):
        row = rows[("0.5.23", name)]
        assert (row["variant"], row["verdict"]) == ("deferred", "reproduces")
        assert row["invariant"] == all_sources[name].claim
    assert rows[("0.5.21", "gate.cex-outcomes_agree.jsonl")]["variant"] == "deferred-local"
    # per-rank holds diverge admission in 0.5.21 (the next MIN times out); 0.5.23 agrees them
    local = rows[("0.5.21", "deferred-local.cex-queues_identical.jsonl")]
    assert (local["verdict"], local["invariant"]) == ("reproduces", "queues_identical")
    assert local["hang"] and any("imed out" in e or "Timeout" in e for e in local["errors"])
    # 0.5.23's agreed hold keeps the slot on every rank: the enqueue that diverged 0.5.21
    # has no slot under deferred, so the trace is cut there (and says so)
    agreed = rows[("0.5.23", "deferred-local.cex-queues_identical.jsonl")]
    assert (agreed["verdict"], agreed["found"]) == ("cut", "matches"), agreed
    assert "no free metadata slot" in agreed["changes"][0]


def test_the_unpinned_deferred_releases_against_the_other_variant_differ(all_sources):
    """The siblings: 0.5.20 checked as if it held every failed slot per rank, 0.5.22 as
    if it freed at once, on the trace where per-rank holds diverge admission."""
    trace = [all_sources["deferred-local.cex-queues_identical.jsonl"]]
    for version, variant, detail in (("0.5.20", "deferred-local", "spec does not allow this step"),
                                     ("0.5.22", "gate", "no free metadata slot")):
        [row] = conform.check([version], trace, deferred=True, variant=variant)
        assert (row["variant"], row["verdict"]) == (variant, "differs") and detail in row["detail"], row


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
    (["--sglang", "0.5.13", "--reorder-rooms"], "needs --patch"),
    (["--sglang", "0.5.13,0.5.23", "--source", "/tmp"], "give one --sglang release"),
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


def test_the_default_traces_are_the_step_traces_prove_wrote(tmp_path):
    """pdgate prove writes iteration, pipeline and clock traces to the same folder: the
    transfer-queue run takes only step traces (a malformed file is kept, and then
    refused with one line by read_source)."""
    heads = {"step.jsonl": '{"kind":"header","format":"pdgate-trace","version":1}',
             "iter.jsonl": '{"kind":"header","format":"pdgate-iteration","version":1}',
             "clocks.jsonl": '{"kind":"header","format":"pdgate-clocks","version":1}',
             "bad.jsonl": "not json"}
    for name, head in heads.items():
        (tmp_path / name).write_text(head + "\n")
    assert {n for n in heads if conform._step_trace(tmp_path / n)} == {"step.jsonl", "bad.jsonl"}
    from model.spec.trace import TraceInputError
    with pytest.raises(TraceInputError, match="malformed JSON"):
        conform.read_source(str(tmp_path / "bad.jsonl"))
