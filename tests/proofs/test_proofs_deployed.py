"""The rows of ``pdgate prove`` that reach outside the encoding: the deployed timeouts
(model/spec/timeouts.py) are what the liveness rows assume, and the encoded liveness
bound is tight. Each row passes on the code as it is and flips under its in-memory
mutant (the same machinery saying "no")."""
from __future__ import annotations

from pathlib import Path

import pytest

from proofs import obligations as obl
from proofs.mutants import run_all


@pytest.mark.parametrize("key, expected", [("deployed:timeouts@strict", "proved"),
                                           ("deployed:timeouts@deferred", "proved"),
                                           ("nonvacuous:bound-reached@strict", "proved")])
def test_the_rows_hold_as_expected(tmp_path, key, expected):
    row = next(o for o in obl.obligations() if o.key == key)
    assert row.expected == expected
    out = obl.run_obligation(row, obl.Settings(Path(tmp_path)))
    assert out.result == expected, out.detail


def test_prove_loads_the_timeouts_module_its_rows_depend_on():
    import sys
    assert "model.spec.timeouts" in sys.modules
    assert obl.steps_for.__module__ == "model.spec.timeouts"


def test_their_mutants_are_killed_by_these_rows():
    got = {r.name: r for r in run_all(["timeouts-round-down", "encoding-liveness-bound-plus-one"])}
    assert got["timeouts-round-down"].caught_by == ["deployed:timeouts@strict"]
    assert "steps_for(0.0025, 0.001) = 2" in got["timeouts-round-down"].detail
    assert got["encoding-liveness-bound-plus-one"].caught_by == ["nonvacuous:bound-reached@strict"]
