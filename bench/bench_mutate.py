"""``pdgate mutate``'s whole catalogue (proofs/catalogue.py): every source mutant applied
to a copy of the tree and its named tests run there. Figures: the kill rate per package
and overall (goal: every mutant killed), and the run's wall seconds. ``quick`` runs the
CI subset (tests/proofs/test_proofs_mutate.py) instead."""
from __future__ import annotations

from proofs.catalogue import CI_SUBSET, MUTANTS
from proofs.mutate import kill_rates, run_catalogue

TARGETS = {"kill_rate": (">=", 1.0)}
JOBS = 2


def run(quick: bool) -> dict:
    chosen = [m for m in MUTANTS if m.name in CI_SUBSET] if quick else list(MUTANTS)
    outcomes = run_catalogue(chosen, JOBS)
    out: dict = {"mutants": len(outcomes), "killed": sum(o.result == "killed" for o in outcomes)}
    out["kill_rate"] = round(out["killed"] / len(outcomes), 3)
    for package, r in sorted(kill_rates(outcomes).items()):
        out[f"kill_rate[{package}]"] = f"{r['killed']}/{r['mutants']} = {r['kill_rate']}"
    out["not_killed"] = ", ".join(f"{o.mutant.name} ({o.result})" for o in outcomes
                                  if o.result != "killed") or "none"
    out["slowest_mutant_seconds"] = round(max(o.seconds for o in outcomes), 1)
    return out
