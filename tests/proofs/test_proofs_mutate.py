"""``pdgate mutate``: the catalogue is current (every snippet occurs once, every named test
exists, at least 10 mutants in each of impl/decode, impl/mooncake, impl/sglang and sim),
the CI subset (fast tests, every package) is killed, and the runner's other verdicts
are real: a harmless edit survives, a vanished snippet is stale, a missing test is an
error; the working tree is never edited. The whole catalogue is ``pdgate bench mutate``."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from model.cli import main
from proofs.catalogue import CI_SUBSET, MUTANTS
from proofs.mutate import ROOT, SourceMutant, copy_tree, run_catalogue, run_mutant, staleness

TAGS = "tests/mooncake/test_mooncake_tags.py"


def test_the_catalogue_is_current_and_covers_every_package():
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    assert [(m.name, staleness(m)) for m in MUTANTS if staleness(m)] == []
    per = Counter(m.package for m in MUTANTS)
    assert all(per[p] >= 10 for p in ("impl/decode", "impl/mooncake", "impl/sglang", "sim")), per
    assert per["model/spec"] >= 2 and per["model/encoding"] >= 2, per
    assert set(CI_SUBSET) <= {m.name for m in MUTANTS}
    assert {m.package for m in MUTANTS if m.name in CI_SUBSET} == set(per)


def test_every_mutant_names_test_functions_not_files():
    """A mutant is killed by named tests: a file (or a class) alone would let any of
    its tests, even one unrelated to the bug, take the kill."""
    loose = [(m.name, t) for m in MUTANTS for t in m.tests
             if not re.fullmatch(r"tests/[\w/]+\.py::test_\w+(\[[^\]]+\])?", t)]
    assert loose == []


def test_every_named_test_exists():
    tests = sorted({t for m in MUTANTS for t in m.tests})
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *tests], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _digest_tree() -> str:
    h = hashlib.sha256()
    for m in sorted({m.path for m in MUTANTS}):
        h.update((ROOT / m).read_bytes())
    return h.hexdigest()


def test_the_ci_subset_is_killed_by_its_named_tests():
    before = _digest_tree()
    chosen = [m for m in MUTANTS if m.name in CI_SUBSET]
    outcomes = run_catalogue(chosen, jobs=2)
    assert [(o.mutant.name, o.result, o.detail) for o in outcomes if o.result != "killed"] == []
    assert _digest_tree() == before


def test_survived_stale_and_error_are_reported(tmp_path):
    tree = copy_tree(tmp_path / "tree")
    harmless = SourceMutant("harmless", "impl/mooncake", "impl/mooncake/auth.py",
                            "TAG_BYTES = 32\n", "TAG_BYTES = 32  # the same\n",
                            (f"{TAGS}::test_the_genuine_tag_verifies_and_unseal_returns_the_body",),
                            "a comment")
    assert run_mutant(harmless, tree).result == "survived"
    assert (tree / harmless.path).read_text() == (ROOT / harmless.path).read_text()   # restored
    gone = SourceMutant("gone", "impl/mooncake", "impl/mooncake/auth.py", "no such text",
                        "x", harmless.tests, "a snippet no longer there")
    assert run_mutant(gone, tree).result == "stale"
    missing = SourceMutant("missing", "impl/mooncake", "impl/mooncake/auth.py",
                           "TAG_BYTES = 32\n", "TAG_BYTES = 31\n", (f"{TAGS}::no_such_test",),
                           "a test that does not exist")
    assert run_mutant(missing, tree).result == "error"


def test_cli_list_json_and_bad_input(tmp_path, capsys):
    assert main(["mutate", "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(MUTANTS)
    assert main(["mutate", "--package", "nope"]) == 2
    assert "unknown package 'nope'" in capsys.readouterr().err
    assert main(["mutate", "--only", "no-such-mutant"]) == 2
    out = tmp_path / "m.json"
    assert main(["mutate", "--only", "auth-tag-only-frame", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["mutant"], r["result"], r["killed"]) for r in rows] == [("auth-tag-only-frame", "killed", True)]
    with pytest.raises(SystemExit):
        main(["mutate", "--jobs", "0"])
