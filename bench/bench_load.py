"""``pdgate e2e`` under CPU load, at its default liveness settings (``--heartbeat-ms 100``):
no request may be aborted for a prefill that was only slow (issue 21: before the
liveness window followed the machine, 2 of 3 such runs aborted about half of 300).

HOGS busy-loop processes (default 4 per core) run beside the runs, which are then
``pdgate e2e`` subprocesses: three runs of 300 requests on 2 ranks and one of 1,000
small requests on 4 ranks. Each run's JSON records the load average and CPU pressure it
saw (``machine_load``); the figures are what every run committed and aborted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TARGETS = {"aborted_total": ("<=", 0), "committed_share": (">=", 1.0)}
HOGS_PER_CORE = 4


def _hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _e2e(tmp: Path, name: str, flags: list[str]) -> dict:
    out = tmp / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "model.cli", "e2e", "--json", str(out),
                           "--work-dir", str(tmp / name), *flags],
                          capture_output=True, text=True, timeout=900)
    if not out.exists():        # e2e always writes its JSON; say what it said instead
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{name}: pdgate e2e wrote no JSON (exit {done.returncode}): {last}")
    return json.loads(out.read_text())


def run(quick: bool) -> dict:
    runs = [("r2-s1", ["--ranks", "2", "--requests", "300", "--seed", "1"]),
            ("r2-s2", ["--ranks", "2", "--requests", "300", "--seed", "2"]),
            ("r2-s3", ["--ranks", "2", "--requests", "300", "--seed", "3"]),
            ("r4-small", ["--ranks", "4", "--requests", "1000", "--page-bytes", "4096",
                          "--min-pages", "1", "--max-pages", "4"])]
    if quick:
        runs = [("r2-s1", ["--ranks", "2", "--requests", "100", "--seed", "1"])]
    hogs = _hogs(HOGS_PER_CORE * (os.cpu_count() or 1))
    figures: dict = {"hogs": len(hogs)}
    committed = requested = aborted = 0
    try:
        with tempfile.TemporaryDirectory(prefix="pdgate-bench-load-") as tmp:
            for name, flags in runs:
                got = _e2e(Path(tmp), name, flags)
                committed += got["committed"] or 0
                aborted += got["aborted"] or 0
                requested += got["requests"]
                figures[name] = {"committed": got["committed"], "aborted": got["aborted"],
                                 "seconds": got["seconds"], "error": got["error"],
                                 "loadavg_1m_after": got["machine_load"]["after"]["loadavg_1m"]}
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=10)
    figures.update(aborted_total=aborted, committed_share=round(committed / requested, 4))
    return figures
