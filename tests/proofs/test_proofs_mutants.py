"""``pdgate prove --mutants``: every built-in mutant is killed, and the JSON says by what."""
from __future__ import annotations

import json

from model.cli import main
from proofs.mutants import MUTANTS, run_all


def test_the_mutants_span_every_area():
    areas = {m.area for m in MUTANTS}
    assert {"kernel", "variant", "machine", "min", "encoding", "lemmas", "timeouts"} <= areas
    assert len(MUTANTS) >= 15 and len({m.name for m in MUTANTS}) == len(MUTANTS)


def test_a_vacuous_encoding_and_a_spec_change_are_killed():
    """The two failure modes the self-test exists for: an axiom that makes every step
    query unsat (caught by the consistency and negative rows, not by any safety row),
    and a spec mechanism the encoding does not share (caught by refinement)."""
    got = {r.name: r for r in run_all(["min-strict-axiom", "machine-lifo-free-list"])}
    assert got["min-strict-axiom"].killed
    assert got["min-strict-axiom"].caught_by[0].startswith(("consistent:", "induction:"))
    assert got["machine-lifo-free-list"].killed
    assert got["machine-lifo-free-list"].caught_by[0].startswith("refines:spec")


def test_the_cli_kills_every_mutant_and_writes_json(tmp_path):
    out = tmp_path / "mutants.json"
    assert main(["prove", "--mutants", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["mutant"] for r in rows] == [m.name for m in MUTANTS]
    for r in rows:
        assert r["killed"] is True and len(r["caught_by"]) == 1, r
        assert r["caught_by"][0].split("@")[0].split(":")[0] in (
            "safety", "lemma", "liveness", "cex", "induction", "consistent", "refines", "nonvacuous",
            "bmc-crosscheck", "deployed"), r


def test_mutants_refuse_obligation_filters(capsys):
    assert main(["prove", "--mutants", "--only", "safety"]) == 2
    assert "select obligations, not mutants" in capsys.readouterr().err
