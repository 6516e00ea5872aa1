"""The rows of ``pdgate prove`` that reach outside the encoding: the deployed timeouts
(model/spec/timeouts.py) are what the liveness rows assume, and the encoded liveness
bound is tight. Each row passes on the code as it is and flips under its in-memory
mutant (the same machinery saying "no"). And ``pdgate prove`` itself, in a fresh
interpreter, runs the modules each row family depends on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proofs import obligations as obl
from proofs.mutants import run_all

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("key, expected", [("deployed:timeouts@strict", "proved"),
                                           ("deployed:timeouts@deferred", "proved"),
                                           ("nonvacuous:bound-reached@strict", "proved")])
def test_the_rows_hold_as_expected(tmp_path, key, expected):
    row = next(o for o in obl.obligations() if o.key == key)
    assert row.expected == expected
    out = obl.run_obligation(row, obl.Settings(Path(tmp_path)))
    assert out.result == expected, out.detail


# One row of each family and the modules its verdict comes from: ``pdgate prove``, run
# on that row alone, must call into each of them (an import alone does not count).
ROW_DEPENDS = {
    "deployed:timeouts@strict": {"model.spec.timeouts"},
    "nonvacuous:bound-reached@strict": {"model.encoding.invariants", "model.spec.kernel"},
    "safety:queues_identical@strict": {"model.spec.kernel", "model.encoding.actions",
                                       "model.encoding.invariants"},
    "refines:spec@strict": {"model.spec.machine", "model.spec.kernel", "model.encoding.refine"},
    "safety:collectives_agree@iter-strict": {"model.spec.agreement", "model.spec.iteration",
                                             "model.encoding.iteration"},
    "safety:pp_agree@pp-strict": {"model.spec.agreement", "model.spec.pipeline", "model.encoding.pipeline"},
    "safety:clocks_agree@clocks-strict": {"model.spec.clocks", "model.encoding.clocks"},
}

_REACHED = """
import contextlib, io, json, sys
from model.cli import main
before = "model.spec.timeouts" in sys.modules
listing = io.StringIO()
with contextlib.redirect_stdout(listing):        # the default set; imports every row's module
    assert main(["prove", "--list"]) == 0
reached, out = set(), {}

def profile(frame, event, arg):                  # a function ran (a module body is an import)
    if event == "call" and frame.f_code.co_name != "<module>":
        reached.add(frame.f_globals.get("__name__"))
for key in sys.argv[2:]:
    only, variant = key.split("@")
    reached.clear()
    printed = io.StringIO()
    sys.setprofile(profile)
    with contextlib.redirect_stdout(printed):
        rc = main(["prove", "--only", only, "--variant", variant, "--jobs", "1", "--traces", sys.argv[1]])
    sys.setprofile(None)
    out[key] = {"rc": rc, "printed": printed.getvalue()[-300:],
                "modules": sorted(m for m in reached if m and m.startswith("model."))}
print("RESULT " + json.dumps({"imported_before": before, "listing": listing.getvalue(), "rows": out}))
"""


def test_prove_itself_runs_the_modules_each_row_family_depends_on(tmp_path):
    """In a fresh interpreter (so no test imported anything first), each family's row
    is in the default set, and ``pdgate prove`` on it alone calls functions of every
    module its verdict depends on (model/spec/timeouts.py for the deployed rows). The
    sibling: the same trace says "no" for a row that never uses the timeouts, though
    proofs/obligations.py imports that module for every row."""
    proc = subprocess.run([sys.executable, "-c", _REACHED, str(tmp_path), *ROW_DEPENDS],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-2000:]
    got = json.loads(line[len("RESULT "):])
    assert got["imported_before"] is False
    listed = {"@".join(row.split()[:2]) for row in got["listing"].splitlines()}
    for key, modules in ROW_DEPENDS.items():
        row = got["rows"][key]
        assert key in listed, f"{key} is not in the default set"
        assert row["rc"] == 0 and "1/1 as expected" in row["printed"], (key, row["printed"])
        assert modules <= set(row["modules"]), (key, sorted(modules - set(row["modules"])))
    for key in ("safety:pp_agree@pp-strict", "safety:queues_identical@strict"):
        assert "model.spec.timeouts" not in got["rows"][key]["modules"], key


def test_their_mutants_are_killed_by_these_rows():
    got = {r.name: r for r in run_all(["timeouts-round-down", "encoding-liveness-bound-plus-one"])}
    assert got["timeouts-round-down"].caught_by == ["deployed:timeouts@strict"]
    assert "steps_for(0.0025, 0.001) = 2" in got["timeouts-round-down"].detail
    assert got["encoding-liveness-bound-plus-one"].caught_by == ["nonvacuous:bound-reached@strict"]
