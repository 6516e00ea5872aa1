"""The workload: when requests arrive and how long their prompts and outputs are.

Synthetic: Poisson, or Gamma inter-arrivals with a burstiness shape (1 = Poisson, as in
SGLang's ``bench_serving --burstiness``). Replay: Mooncake-style JSONL and Azure-style CSV.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from sim.dists import Dist
from sim.errors import SimInputError


@dataclass(frozen=True)
class Workload:
    arrival_ms: np.ndarray     # float64, non-decreasing
    input_len: np.ndarray      # int64 tokens >= 1
    output_len: np.ndarray     # int64 tokens >= 1
    source: str

    def __len__(self) -> int:
        return len(self.arrival_ms)


def synthetic(rng: np.random.Generator, n: int, rate: float, burstiness: float,
              input_len: Dist, output_len: Dist) -> Workload:
    """``n`` arrivals at ``rate`` requests/s; Gamma(shape=burstiness) gaps keep the mean."""
    if n < 1:
        raise SimInputError(f"--requests must be >= 1, got {n}")
    if not rate > 0 or not math.isfinite(rate):
        raise SimInputError(f"--rate must be a positive number of requests/s, got {rate}")
    if not burstiness > 0 or not math.isfinite(burstiness):
        raise SimInputError(f"--burstiness must be > 0, got {burstiness}")
    mean_gap_ms = 1000.0 / rate
    gaps = rng.gamma(burstiness, mean_gap_ms / burstiness, n)
    gaps[0] = 0.0
    return Workload(np.cumsum(gaps), _tokens(input_len.draw(rng, n)),
                    _tokens(output_len.draw(rng, n)),
                    f"synthetic rate={rate:g}/s burstiness={burstiness:g}")


def _tokens(x: np.ndarray) -> np.ndarray:
    return np.maximum(1, np.rint(x)).astype(np.int64)


def _nonneg_int(value: object, where: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SimInputError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    try:
        num = float(value)
    except ValueError:
        raise SimInputError(f"{where}: {name} must be a non-negative integer, got {value!r}") from None
    if not math.isfinite(num) or num < 0 or num != int(num):
        raise SimInputError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return int(num)


def _finish(path: str, rows: list[tuple[float, int, int]], limit: int | None) -> Workload:
    if not rows:
        raise SimInputError(f"--trace-in: {path} holds no requests")
    if limit is not None:
        rows = rows[:limit]
    t = np.array([r[0] for r in rows], dtype=np.float64)
    return Workload(t - t[0], np.maximum(1, np.array([r[1] for r in rows], dtype=np.int64)),
                    np.maximum(1, np.array([r[2] for r in rows], dtype=np.int64)),
                    f"trace {Path(path).name}")


def _check_order(rows: list, t: float, where: str) -> None:
    if rows and t < rows[-1][0]:
        raise SimInputError(f"{where}: timestamp {t:g} ms is earlier than the previous row's")


def load_mooncake(path: str, limit: int | None = None) -> Workload:
    """JSONL rows ``{"timestamp": ms, "input_length": n, "output_length": n, ...}``."""
    rows: list[tuple[float, int, int]] = []
    for n, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        where = f"--trace-in: {path} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SimInputError(f"{where}: malformed JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise SimInputError(f"{where}: expected a JSON object")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise SimInputError(f"{where}: missing {key!r}")
        t = float(_nonneg_int(obj["timestamp"], where, "timestamp"))
        _check_order(rows, t, where)
        rows.append((t, _nonneg_int(obj["input_length"], where, "input_length"),
                     _nonneg_int(obj["output_length"], where, "output_length")))
        if limit is not None and len(rows) >= limit:
            break
    return _finish(path, rows, limit)


def _azure_time_ms(text: str, where: str) -> float:
    text = text.strip()
    try:
        return float(text) * 1000.0          # seconds
    except ValueError:
        pass
    head, dot, frac = text.partition(".")
    try:
        stamp = datetime.fromisoformat(head)
    except ValueError:
        raise SimInputError(f"{where}: TIMESTAMP {text!r} is neither seconds nor a date-time") from None
    if dot and not frac.isdigit():
        raise SimInputError(f"{where}: TIMESTAMP {text!r} has a malformed fraction")
    return stamp.timestamp() * 1000.0 + (float("0." + frac) * 1000.0 if dot else 0.0)


def load_azure(path: str, limit: int | None = None) -> Workload:
    """CSV with header ``TIMESTAMP,ContextTokens,GeneratedTokens`` (date-time or seconds)."""
    lines = _lines(path)
    reader = csv.reader(lines)
    header = [h.strip() for h in next(reader, [])]
    want = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    if any(w not in header for w in want):
        raise SimInputError(f"--trace-in: {path} line 1: header must name {', '.join(want)}")
    idx = [header.index(w) for w in want]
    rows: list[tuple[float, int, int]] = []
    for row in reader:
        n = reader.line_num
        if not row or not any(c.strip() for c in row):
            continue
        where = f"--trace-in: {path} line {n}"
        if len(row) != len(header):
            raise SimInputError(f"{where}: {len(row)} columns, header has {len(header)}")
        t = _azure_time_ms(row[idx[0]], where)
        _check_order(rows, t, where)
        rows.append((t, _nonneg_int(row[idx[1]].strip(), where, "ContextTokens"),
                     _nonneg_int(row[idx[2]].strip(), where, "GeneratedTokens")))
        if limit is not None and len(rows) >= limit:
            break
    return _finish(path, rows, limit)


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SimInputError(f"--trace-in: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SimInputError(f"--trace-in: {path} is not UTF-8 text") from None


def load_trace(path: str, limit: int | None = None) -> Workload:
    """By extension: ``.jsonl``/``.json`` -> Mooncake, ``.csv`` -> Azure."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return load_mooncake(path, limit)
    if suffix == ".csv":
        return load_azure(path, limit)
    raise SimInputError(f"--trace-in: {path}: unknown format (use .jsonl for Mooncake, .csv for Azure)")
