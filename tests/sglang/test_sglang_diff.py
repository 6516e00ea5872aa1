"""The strict patch as a unified diff (`pdgate conform --emit-diff`): for every pinned
release, `patch -p1` (Debian's) applies it cleanly to the decode module unpacked from the
release's wheel, and `pdgate conform --source` on the patched source gives the verdicts
the monkey-patch gives. Sibling: the patched source checked as `gate` (what the release
as shipped is) differs, so what ran was the patched code."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from impl.sglang import conform
from impl.sglang.patch import DIFF_MARK, DIFF_TARGET, strict_block, strict_diff
from impl.sglang.wheels import PINNED, open_wheel

TRACES = ("gate.cex-outcomes_agree.jsonl", "gate.cex-no_corruption.jsonl",
          "gate.liveness-bounded_wait_room=0.jsonl", conform.STALE_ROOM)


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def traces_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    proc = _cli("prove", "--variant", "gate", "--only", "cex:", "--only", "liveness",
                "--traces", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    conform.write_stale_room(str(out / conform.STALE_ROOM))
    return out


@pytest.fixture(scope="module")
def sources(traces_dir):
    return [conform.read_source(str(traces_dir / name)) for name in TRACES]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """Each pinned release's decode module from its wheel, the emitted diff applied."""
    root = tmp_path_factory.mktemp("diff")
    proc = _cli("conform", "--sglang", "pinned", "--emit-diff", str(root / "diffs"))
    assert proc.returncode == 0, proc.stderr
    out = {}
    for version in PINNED:
        tree = root / version
        (tree / DIFF_TARGET).parent.mkdir(parents=True)
        (tree / DIFF_TARGET).write_text(open_wheel(version).member(DIFF_TARGET))
        diff = root / "diffs" / f"sglang-{version}-strict.diff"
        applied = subprocess.run(["patch", "-p1", "--fuzz=0", "--batch", "-i", str(diff)],
                                 cwd=tree, capture_output=True, text=True, timeout=60)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        # cleanly: no offset, no fuzz, nothing rejected
        assert applied.stdout.strip() == f"patching file {DIFF_TARGET}", applied.stdout
        out[version] = tree
    return out


def test_the_diff_adds_exactly_the_block_that_calls_the_patch_module(trees):
    for version, tree in trees.items():
        original = open_wheel(version).member(DIFF_TARGET)
        assert (tree / DIFF_TARGET).read_text() == original + strict_block(version)
    with pytest.raises(ValueError, match="already carries"):
        strict_diff("0.5.23", original + strict_block("0.5.23"))


def test_the_patched_source_gives_the_monkey_patch_verdicts(sources, trees):
    key = ("trace", "variant", "verdict", "invariant", "step", "found")
    monkey = conform.check(list(PINNED), sources, mode="patch", patch="strict")
    for version, tree in trees.items():
        rows = conform.check([version], sources, mode="patch", patch="strict",
                             source_dir=str(tree))
        assert [tuple(r.get(k) for k in key) for r in rows] == \
            [tuple(r.get(k) for k in key) for r in monkey if r["release"] == version]
        assert not [r for r in rows if r["verdict"] == "differs"], rows
    late = [r for r in monkey if r["trace"] == "gate.cex-outcomes_agree.jsonl"]
    assert {r["verdict"] for r in late} == {"cut"}   # strict holds the slot: the rest is cut


def test_the_patched_source_is_what_runs(sources, trees):
    """Checked as ``gate`` (`--variant gate`), the patched source differs on the
    late-room and room-0 traces, where the release as shipped reproduces gate's breaks;
    without --patch (the harness installs nothing) too: the source patches itself."""
    picked = [s for s in sources if s.name in ("gate.cex-outcomes_agree.jsonl",
                                               "gate.liveness-bounded_wait_room=0.jsonl")]
    shipped = conform.check(["0.5.23"], picked)
    assert {r["verdict"] for r in shipped} == {"reproduces"}
    tree = str(trees["0.5.23"])
    for patch in ("strict", None):
        rows = conform.check(["0.5.23"], picked, mode="patch" if patch else "own", patch=patch,
                             source_dir=tree, variant="gate")
        assert [(r["variant"], r["verdict"]) for r in rows] == [("gate", "differs")] * 2, rows


def test_cli_runs_the_patched_source_and_refuses_a_mismatched_one(traces_dir, trees, tmp_path):
    trace = tmp_path / "t.jsonl"
    conform.write_stale_room(str(trace))
    out = tmp_path / "rows.json"
    proc = _cli("conform", "--sglang", "0.5.13", "--patch", "strict", "--source",
                str(trees["0.5.13"]), str(trace), "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = json.loads(out.read_text())
    assert (row["variant"], row["verdict"]) == ("strict", "matches")
    unpatched = tmp_path / "plain"
    (unpatched / DIFF_TARGET).parent.mkdir(parents=True)
    (unpatched / DIFF_TARGET).write_text(open_wheel("0.5.13").member(DIFF_TARGET))
    assert DIFF_MARK not in (unpatched / DIFF_TARGET).read_text()
    # the table's sibling: the patched source checked as gate (a genuine room 0: gate
    # holds it forever, the patch fails it)
    proc = _cli("conform", "--sglang", "0.5.13", "--patch", "strict", "--source",
                str(trees["0.5.13"]), "--variant", "gate",
                str(traces_dir / "gate.liveness-bounded_wait_room=0.jsonl"))
    assert proc.returncode == 1 and "differs at" in proc.stdout, proc.stdout + proc.stderr
    for args, needle in (
            (["--patch", "strict", "--source", str(unpatched)], "does not carry the strict patch"),
            (["--variant", "nope"], "unknown variant 'nope'"),
            (["--source", str(trees["0.5.13"])], "carries the strict patch: add --patch"),
            (["--source", str(tmp_path / "none")], "is not a file"),
            (["--emit-diff", str(trace)], "is not a directory")):
        proc = _cli("conform", "--sglang", "0.5.13", *args, str(trace), timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
