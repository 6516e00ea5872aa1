"""A solver that gives up ("unknown") is never read as an answer by the runner: not as a
counterexample found, not as a counterexample to induction, not as a proof. Each row
kind is fed an unknown from a stub solver layer; the sibling feeds the same row a real
sat / unsat and gets the verdict (so the stubs are wired where the rows look)."""
from __future__ import annotations

from pathlib import Path

import pytest

from model.encoding.checks import BmcResult, QueryLog
from model.encoding.solver import CheckResult
from model.encoding.vocab import Sizes
from proofs import obligations as obl


def _row(key: str) -> obl.Obligation:
    return next(o for o in obl.obligations() if o.key == key)


@pytest.fixture
def no_facts(monkeypatch):
    monkeypatch.setattr(obl, "proved_facts", lambda variant, timeout_ms=20_000: ())


def _log(*statuses: str) -> QueryLog:
    return QueryLog([(f"q{i}", CheckResult(s, 0.0, None, "stub")) for i, s in enumerate(statuses)])


@pytest.mark.parametrize("statuses, result", [
    (("unsat", "unknown"), "unknown"), (("unknown",), "unknown"),
    (("unsat", "sat"), "not inductive"), (("unsat", "unsat"), "inductive")])
def test_a_negative_induction_row_takes_unknown_as_unknown(monkeypatch, no_facts, tmp_path,
                                                            statuses, result):
    monkeypatch.setattr(obl, "check_step", lambda *a, **k: _log(*statuses))
    out = obl._not_inductive(_row("induction:outcomes_agree@gate"), obl.Settings(Path(tmp_path)))
    assert out.result == result, out


@pytest.mark.parametrize("status, result", [("unknown", "unknown"), ("unsat", "none found")])
def test_a_counterexample_search_that_gives_up_finds_nothing(monkeypatch, no_facts, tmp_path,
                                                              status, result):
    monkeypatch.setattr(obl, "bmc", lambda *a, **k: BmcResult(Sizes(1, 1, 1), None, [], 0.0, status))
    out = obl._counterexample(_row("cex:outcomes_agree@gate"), obl.Settings(Path(tmp_path)))
    assert out.result == result and out.trace is None, out


@pytest.mark.parametrize("statuses, result", [
    (("unsat", "unknown"), False), (("unsat", "unsat"), True)])
def test_a_proof_with_an_unknown_query_is_not_proved(monkeypatch, no_facts, tmp_path,
                                                      statuses, result):
    monkeypatch.setattr(obl, "prove_inductive", lambda *a, **k: _log(*statuses))
    monkeypatch.setattr(obl, "check_step", lambda *a, **k: _log("unsat"))
    out = obl._inductive(_row("safety:queues_identical@gate"), obl.Settings(Path(tmp_path)))
    assert (out.result == "proved") is result, out
