"""``pdgate mutate``: the test suite's self-test, over every package.

Each mutant (proofs/catalogue.py) is one small, realistic bug written as a source edit:
a file, a snippet that must occur in it exactly once, its replacement, and the test
node ids that must notice it. The runner copies the source tree to a temporary folder
(never editing the working tree, so an interrupted run corrupts nothing), checks once
that the named tests pass on the unmutated copy, then for each mutant writes the edit
into the copy, runs its tests there in a fresh pytest process with a timeout, and puts
the file back. The tests failing kills the mutant; a mutant they all pass survives (a
finding). A snippet that no longer occurs exactly once is "stale": the catalogue must
follow the code, so that is an error too. The copies run the simulator's compiled
modules from source (PDGATE_PURE=1), with no bytecode cache (a mutated file of the same
size and second would otherwise reuse the original's).

Exit status: 0 every selected mutant killed, 1 some survived or were stale or errored,
2 bad usage.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("model", "sim", "impl", "proofs", "bench", "tests", "pyproject.toml")
SKIPPED = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "_native.json", ".hypothesis",
                                 ".pytest_cache", "*.egg-info")
TEST_TIMEOUT_S = 240.0          # one mutant's tests: a hang the mutant causes is a kill


@dataclass(frozen=True)
class SourceMutant:
    name: str
    package: str                    # impl/decode, impl/mooncake, impl/sglang, sim, model/spec, ...
    path: str                       # relative to the repository root
    original: str                   # must occur exactly once in the file
    replacement: str
    tests: tuple[str, ...]          # pytest node ids that must fail with the edit
    bug: str                        # the realistic bug, in words


@dataclass
class MutantOutcome:
    mutant: SourceMutant
    result: str                     # killed, survived, stale, error
    detail: str = ""
    seconds: float = 0.0

    def row(self) -> dict:
        m = self.mutant
        return {"mutant": m.name, "package": m.package, "path": m.path, "bug": m.bug,
                "tests": list(m.tests), "result": self.result, "killed": self.result == "killed",
                "detail": self.detail, "seconds": round(self.seconds, 2)}


def staleness(m: SourceMutant, root: Path = ROOT) -> str | None:
    """Why ``m`` cannot be applied to the tree at ``root`` (its snippet is not there
    exactly once, or the edit changes nothing), or None."""
    try:
        text = (root / m.path).read_text(encoding="utf-8")
    except OSError as exc:
        return f"{m.path}: {exc.strerror or exc}"
    count = text.count(m.original)
    if count != 1:
        return f"{m.path}: snippet occurs {count} times, not once: {m.original[:60]!r}"
    if m.original == m.replacement:
        return "the replacement equals the original"
    return None


def copy_tree(dest: Path, root: Path = ROOT) -> Path:
    for name in COPIED:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=SKIPPED)
        elif src.exists():
            shutil.copy2(src, dest / name)
    return dest


def pytest_run(tree: Path, tests: Sequence[str], timeout_s: float = TEST_TIMEOUT_S
               ) -> tuple[int | None, str]:
    """(exit status, or None on a timeout; the output's tail) of pytest on ``tests``
    in ``tree``, importing ``tree``'s modules."""
    env = {**os.environ, "PDGATE_PURE": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": str(tree), "MC_LOG_LEVEL": "ERROR"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:g} s"
    tail = (done.stdout + done.stderr).strip().splitlines()[-6:]
    return done.returncode, " | ".join(tail)[-600:]


def run_mutant(m: SourceMutant, tree: Path, timeout_s: float = TEST_TIMEOUT_S) -> MutantOutcome:
    """Apply ``m`` to ``tree`` (a copy), run its tests, restore the file."""
    t0 = time.perf_counter()
    problem = staleness(m, tree)
    if problem:
        return MutantOutcome(m, "stale", problem)
    target = tree / m.path
    original = target.read_text(encoding="utf-8")
    target.write_text(original.replace(m.original, m.replacement, 1), encoding="utf-8")
    try:
        code, tail = pytest_run(tree, m.tests, timeout_s)
    finally:
        target.write_text(original, encoding="utf-8")
    # pytest: 1 some test failed; a timeout is a hang the mutant caused; anything else
    # (usage error, no tests collected, internal error) says the catalogue is wrong
    result = "killed" if code in (1, None) else "survived" if code == 0 else "error"
    return MutantOutcome(m, result, tail if result != "survived" else "every named test passed",
                         time.perf_counter() - t0)


def run_catalogue(mutants: Sequence[SourceMutant], jobs: int = 1, root: Path = ROOT,
                  timeout_s: float = TEST_TIMEOUT_S) -> list[MutantOutcome]:
    """Every mutant on its own copy of the tree (``jobs`` copies, one mutant at a time
    each), after a check that their tests pass unmutated."""
    stale = {m.name: staleness(m, root) for m in mutants}
    live = [m for m in mutants if stale[m.name] is None]
    out = {m.name: MutantOutcome(m, "stale", stale[m.name]) for m in mutants if stale[m.name]}
    with tempfile.TemporaryDirectory(prefix="pdgate-mutate-") as tmp:
        trees = [copy_tree(Path(tmp) / f"tree{j}", root) for j in range(max(1, min(jobs, len(live))))]
        tests = sorted({t for m in live for t in m.tests})
        if tests:
            code, tail = pytest_run(trees[0], tests, timeout_s * 2)
            if code != 0:
                for m in live:
                    out[m.name] = MutantOutcome(m, "error", f"the named tests fail unmutated: {tail}")
                live = []
        shares = [live[j::len(trees)] for j in range(len(trees))]
        with ThreadPoolExecutor(len(trees)) as pool:
            for results in pool.map(lambda j: [run_mutant(m, trees[j], timeout_s) for m in shares[j]],
                                    range(len(trees))):
                out.update((r.mutant.name, r) for r in results)
    return [out[m.name] for m in mutants]


def kill_rates(outcomes: Sequence[MutantOutcome]) -> dict[str, dict]:
    """Per package: mutants, killed, and the kill rate."""
    rates: dict[str, dict] = {}
    for o in outcomes:
        r = rates.setdefault(o.mutant.package, {"mutants": 0, "killed": 0})
        r["mutants"] += 1
        r["killed"] += o.result == "killed"
    for r in rates.values():
        r["kill_rate"] = round(r["killed"] / r["mutants"], 3)
    return rates


# -- the subcommand -------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    from model.cli import number
    p.add_argument("--package", action="append", metavar="P",
                   help="only mutants of this package (repeatable; e.g. impl/decode, sim)")
    p.add_argument("--only", action="append", metavar="TEXT",
                   help="only mutants whose name contains TEXT (repeatable)")
    p.add_argument("--list", action="store_true", help="list the mutants (and any stale) and exit")
    p.add_argument("--json", metavar="PATH", help="write one row per mutant as a JSON list")
    p.add_argument("--jobs", type=number(1, 16, integer=True), default=1, metavar="N",
                   help="copies of the tree run in parallel (default 1)")
    p.add_argument("--timeout", type=number(1, 3600, above=True), default=TEST_TIMEOUT_S,
                   metavar="SECONDS", help=f"per mutant's tests (default {TEST_TIMEOUT_S:g})")


def select(packages: Sequence[str] | None, only: Sequence[str] | None) -> list[SourceMutant]:
    from proofs.catalogue import MUTANTS
    chosen = [m for m in MUTANTS if not packages or m.package in packages]
    return [m for m in chosen if not only or any(t in m.name for t in only)]


def run(args: argparse.Namespace) -> int:
    from proofs.catalogue import MUTANTS
    known = sorted({m.package for m in MUTANTS})
    bad = [p for p in args.package or [] if p not in known]
    if bad:
        print(f"pdgate mutate: unknown package {bad[0]!r} (known: {', '.join(known)})", file=sys.stderr)
        return 2
    mutants = select(args.package, args.only)
    if not mutants:
        print("pdgate mutate: no mutant matches the selection", file=sys.stderr)
        return 2
    if args.list:
        for m in mutants:
            problem = staleness(m)
            print(f"{m.name:40s} {m.package:14s} {m.bug}{'   STALE: ' + problem if problem else ''}")
        return 0
    t0 = time.perf_counter()
    outcomes = run_catalogue(mutants, args.jobs, timeout_s=args.timeout)
    for o in outcomes:
        line = f"{o.result.upper():9s} {o.mutant.name:40s} {o.seconds:6.1f}s  {o.mutant.bug}"
        print(line + (f"\n          {o.detail}" if o.result in ("stale", "error") else ""))
    for package, r in sorted(kill_rates(outcomes).items()):
        print(f"{package:14s} {r['killed']}/{r['mutants']} killed")
    print(f"{sum(o.result == 'killed' for o in outcomes)}/{len(outcomes)} mutants killed "
          f"in {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fp:
            json.dump([o.row() for o in outcomes], fp, indent=2)
    return 0 if all(o.result == "killed" for o in outcomes) else 1
