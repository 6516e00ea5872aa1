"""Wall time of the whole ``pdgate prove`` suite (goal: under 30 s on the 2-core CI
machine), its CPU time (what other load on the machine does not inflate: on an idle
2-core machine the wall time is about half of it plus the longest row), and the
slowest obligation. ``quick`` runs the unbounded proofs only."""
from __future__ import annotations

import json
import os
import resource
import tempfile
import time

from model.cli import main

TARGETS = {"prove_suite_wall_seconds": ("<=", 30.0)}


def _cpu() -> float:
    """User + system CPU seconds of this process and its finished workers."""
    return sum(ru.ru_utime + ru.ru_stime for ru in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))


def run(quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.json")
        argv = ["prove", "--json", path, "--traces", os.path.join(tmp, "traces")]
        if quick:
            argv += ["--only", "safety:", "--only", "lemma:"]
        t0, c0 = time.perf_counter(), _cpu()
        code = main(argv)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        with open(path, encoding="utf-8") as fp:
            rows = json.load(fp)
    slowest = max(rows, key=lambda r: r["seconds"])
    key = "prove_quick_wall_seconds" if quick else "prove_suite_wall_seconds"
    return {key: round(wall, 2), "obligations": len(rows),
            "as_expected": sum(r["result"] == r["expected"] for r in rows), "exit_status": code,
            "unbounded_proofs": sum(r["unbounded"] and r["result"] == "proved" for r in rows),
            "counterexamples": sum(r["result"] == "counterexample" for r in rows),
            "sum_obligation_seconds": round(sum(r["seconds"] for r in rows), 2),
            "sum_obligation_cpu_seconds": round(sum(r["cpu_seconds"] for r in rows), 2),
            # the rows, the facts they share, the runner, the workers' start-up
            "total_cpu_seconds": round(cpu, 2),
            "negative_rows": sum(r["expected"] == "not inductive" for r in rows),
            "slowest_obligation": f"{slowest['obligation']}@{slowest['variant']}",
            "slowest_seconds": slowest["seconds"]}
