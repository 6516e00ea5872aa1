"""``pdgate validate`` on simulator traces of 4k, 16k and 120k requests (issue 12: it was
quadratic, rescanning every outcome each step).

Figures: wall seconds and microseconds per trace record at each size, and
``linearity``: the cost per record of the largest trace over that of the smallest (1.0
is exactly linear; the quadratic validator gave ~3 from 4k to 16k requests). The traces
are written first by ``pdgate simulate --trace`` (8 ranks, strict), not timed.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from model.spec.trace import read_trace_file
from model.spec.validate import validate

SIZES, QUICK_SIZES = (4_000, 16_000, 120_000), (1_000, 4_000)
TARGETS = {"linearity": ("<=", 1.5)}
ROOT = Path(__file__).resolve().parents[1]


def _trace(path: Path, requests: int) -> None:
    subprocess.run([sys.executable, "-m", "model.cli", "simulate", "--variant", "strict",
                    "--ranks", "8", "--requests", str(requests), "--seed", "1",
                    "--trace", str(path), "--no-wall-clock"],
                   cwd=ROOT, check=True, capture_output=True, timeout=1800)


def run(quick: bool) -> dict:
    out: dict = {}
    per_record = []
    with tempfile.TemporaryDirectory(prefix="pdgate-bench-validate-") as tmp:
        for n in QUICK_SIZES if quick else SIZES:
            path = Path(tmp) / f"trace{n}.ndjson"
            _trace(path, n)
            with open(path, encoding="utf-8") as fp:
                records = sum(1 for _ in fp)
            t0 = time.perf_counter()
            result = read_trace_file(str(path), validate)
            seconds = time.perf_counter() - t0
            if not result.ok:
                raise RuntimeError(f"validate rejected the simulator's trace: {result.message}")
            per_record.append(seconds / records)
            out[f"validate_{n}_requests_s"] = round(seconds, 2)
            out[f"validate_{n}_us_per_record"] = round(seconds / records * 1e6, 2)
            out[f"trace_{n}_records"] = records
    out["linearity"] = round(per_record[-1] / per_record[0], 3)
    return out
