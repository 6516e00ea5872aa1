"""Published LLM-serving traces, read as published and as a stream.

Formats (sim/data/README.md has the sources):
- Mooncake FAST'25 JSON lines: ``{"timestamp": ms from the trace start, "input_length",
  "output_length", "hash_ids": [512-token prefix block ids]}``;
- Azure LLM inference CSV, 2023 and 2024: ``TIMESTAMP,ContextTokens,GeneratedTokens``,
  TIMESTAMP a date-time (``2023-11-16 18:17:03.9799600``, ``2024-05-10
  00:00:00.009930+00:00``, the fraction left out when zero); 2025 multimodal:
  ``TIMESTAMP,NumImages,ContextTokens,GeneratedTokens`` (``2024-10-15T12:00:00.269Z``);
  a date-time without an offset is UTC, never the machine's time zone;
- BurstGPT CSV: ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
  (Timestamp in seconds from the trace start; extra columns such as ``Session ID`` and
  ``Elapsed time`` are allowed), ``Response tokens`` 0 marks a failed request.

Rows are read one line at a time (memory does not grow with the file; only the rows
kept are stored, in compact arrays), must be in time order, and a bad row is a one-line
SimInputError naming the file and line. A row with 0 output tokens (BurstGPT's failed
requests, or any format's) is kept as a *failed* request: its transfer fails.
"""
from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
import re
import zlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from sim.errors import SimInputError

MAX_LINE = 1 << 20            # bytes per line; a longer one (or /dev/zero) is refused
MAX_TOKENS = 10**7            # per request: beyond any model's context, and bounds the run
BLOCK_TOKENS = 512            # Mooncake's hash_ids block size
DEFAULT_CACHE_BLOCKS = 65536  # prefill-side prefix cache: 32 M tokens
_DAYS_BEFORE_MONTH = (0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334)
_DATETIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?"
                       r"(Z|[+-]\d\d:?\d\d)?")

# header name -> field, per CSV format (the first format whose names all appear wins)
CSV_FORMATS = {
    "azure-2025": {"TIMESTAMP": "t", "NumImages": None, "ContextTokens": "in", "GeneratedTokens": "out"},
    "azure": {"TIMESTAMP": "t", "ContextTokens": "in", "GeneratedTokens": "out"},
    "burstgpt": {"Timestamp": "s", "Request tokens": "in", "Response tokens": "out"},
}


@dataclass
class TraceRows:
    """The kept rows (arrival ms from the first kept row) and what reading found."""
    arrival_ms: array
    input_len: array
    output_len: array
    failed: array
    cached_tokens: array
    fmt: str
    rows_read: int = 0
    truncated: bool = False
    cache_lookups: int = 0       # prompt tokens of the kept requests
    cache_hits: int = 0          # of which found in the prefix cache

    def __len__(self) -> int:
        return len(self.arrival_ms)


def _days_from_civil(y: int, m: int, d: int) -> int:
    """Days from 1970-01-01 (proleptic Gregorian), exact for any year 1..9999."""
    y1 = y - 1
    days = y1 * 365 + y1 // 4 - y1 // 100 + y1 // 400 + _DAYS_BEFORE_MONTH[m - 1] + d - 1
    if m > 2 and (y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)):
        days += 1
    return days - 719162


def datetime_ns(text: str, where: str) -> int:
    """Integer ns since the Unix epoch of a trace date-time (UTC unless an offset says)."""
    m = _DATETIME.fullmatch(text.strip())
    if not m:
        raise SimInputError(f"{where}: TIMESTAMP {text[:40]!r} is not a date-time like "
                            f"2023-11-16 18:17:03.9799600 or 2024-10-15T12:00:00.269Z")
    y, mo, d, hh, mm, ss = (int(g) for g in m.groups()[:6])
    frac, zone = m.group(7) or "", m.group(8)
    leap = y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)
    month_days = (31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)[mo - 1] \
        if 1 <= mo <= 12 else 0
    if not (1 <= y and 1 <= mo <= 12 and 1 <= d <= month_days and hh < 24 and mm < 60 and ss < 60):
        raise SimInputError(f"{where}: TIMESTAMP {text[:40]!r} is not a valid date-time")
    secs = _days_from_civil(y, mo, d) * 86400 + hh * 3600 + mm * 60 + ss
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        secs -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return secs * 10**9 + int((frac + "000000000")[:9])


def _seconds_ns(text: str, where: str, name: str) -> int:
    try:
        val = float(text)
    except ValueError:
        raise SimInputError(f"{where}: {name} {text[:40]!r} is not a number of seconds") from None
    if not math.isfinite(val) or val < 0 or val > 1e12:
        raise SimInputError(f"{where}: {name} {text[:40]!r} must be a finite number of seconds in 0..1e12")
    return round(val * 1e9)


def _count(value: object, where: str, name: str, hi: int = MAX_TOKENS) -> int:
    """A non-negative integer count (ints, or integral floats/strings) up to ``hi``."""
    if type(value) is int and 0 <= value <= hi:       # the common cases, fast
        return value
    if type(value) is str and value.isascii() and value.isdigit() and len(value) < 10 \
            and int(value) <= hi:
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 30:
            raise SimInputError(f"{where}: {name} {text[:20]!r}... is not a count up to {hi}")
        try:
            value = int(text) if text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise SimInputError(f"{where}: {name} {text[:40]!r} is not a non-negative integer") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SimInputError(f"{where}: {name} must be a non-negative integer, got {type(value).__name__}")
    if isinstance(value, float) and not (math.isfinite(value) and value == int(value)):
        raise SimInputError(f"{where}: {name} {value!r} is not a non-negative integer")
    if not 0 <= value <= hi:
        shown = value if isinstance(value, float) or abs(value) < 10**30 else f"a {len(str(value))}-digit number"
        raise SimInputError(f"{where}: {name} {shown} is out of range 0..{hi}")
    return int(value)


def _lines(fp: IO[str], path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) with a cap on line length, so memory stays bounded."""
    n = 0
    while True:
        try:
            line = fp.readline(MAX_LINE + 1)
        except UnicodeDecodeError:
            raise SimInputError(f"--trace-in: {path} line {n + 1}: not UTF-8 text") from None
        except (OSError, EOFError, zlib.error) as exc:     # a truncated or corrupt .gz
            raise SimInputError(f"--trace-in: {path} line {n + 1}: cannot read: "
                                f"{getattr(exc, 'strerror', None) or exc}") from None
        if not line:
            return
        n += 1
        if len(line) > MAX_LINE:
            raise SimInputError(f"--trace-in: {path} line {n}: longer than {MAX_LINE} characters")
        yield n, line


class PrefixCache:
    """An LRU cache of prefix blocks (the prefill side's): a request's leading blocks
    found in it are not recomputed; every block of the request is then cached."""

    def __init__(self, blocks: int):
        self.capacity = blocks
        self.lru: OrderedDict[int, None] = OrderedDict()

    def lookup(self, hash_ids: list[int]) -> int:
        """Leading blocks already cached; then caches (or refreshes) them all."""
        if self.capacity <= 0:
            return 0
        lru, hits = self.lru, 0
        for h in hash_ids:
            if h not in lru:
                break
            hits += 1
        touch = lru.move_to_end
        for h in hash_ids:
            if h in lru:
                touch(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:       # least recently used first
            lru.popitem(last=False)
        return hits


def _mooncake_rows(fp: IO[str], path: str) -> Iterator[tuple[int, int, int, list[int] | None, int]]:
    for n, line in _lines(fp, path):
        if not line.strip():
            continue
        where = f"--trace-in: {path} line {n}"
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as exc:   # ValueError: bad JSON, ints over 4300 digits
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply or number too long"
            raise SimInputError(f"{where}: malformed JSON ({msg})") from None
        if not isinstance(obj, dict):
            raise SimInputError(f"{where}: expected a JSON object")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise SimInputError(f"{where}: missing {key!r}")
        t_ms = _count(obj["timestamp"], where, "timestamp", 10**15)
        hashes = obj.get("hash_ids")
        if hashes is not None and (not isinstance(hashes, list) or (hashes and (
                not set(map(type, hashes)) <= {int} or min(hashes) < 0 or max(hashes) >= 2**63))):
            raise SimInputError(f"{where}: hash_ids must be a list of non-negative integers")
        yield (t_ms * 10**6, _count(obj["input_length"], where, "input_length"),
               _count(obj["output_length"], where, "output_length"), hashes, n)


def _csv_rows(fp: IO[str], path: str) -> tuple[str, Iterator[tuple[int, int, int, None, int]]]:
    lines = _lines(fp, path)
    first = next(lines, None)
    if first is None:
        raise SimInputError(f"--trace-in: {path} holds no requests")
    header = [h.strip() for h in next(csv.reader([first[1]]), [])]
    for fmt, names in CSV_FORMATS.items():
        if all(name in header for name in names):
            break
    else:
        known = "; ".join(",".join(names) for names in CSV_FORMATS.values())
        raise SimInputError(f"--trace-in: {path} line 1: header must name the columns of a known "
                            f"format ({known})")
    cols = {field: header.index(name) for name, field in names.items() if field}

    def rows() -> Iterator[tuple[int, int, int, None, int]]:
        for n, line in lines:
            if not line.strip():
                continue
            where = f"--trace-in: {path} line {n}"
            try:
                row = next(csv.reader([line]))
            except csv.Error as exc:
                raise SimInputError(f"{where}: malformed CSV ({exc})") from None
            if len(row) != len(header):
                raise SimInputError(f"{where}: {len(row)} columns, header has {len(header)}")
            if "t" in cols:     # a date-time (also accepted: plain seconds)
                text = row[cols["t"]].strip()
                t = (_seconds_ns(text, where, "TIMESTAMP") if text[:1].isdigit() and "-" not in text
                     else datetime_ns(text, where))
            else:
                t = _seconds_ns(row[cols["s"]], where, "Timestamp")
            yield (t, _count(row[cols["in"]], where, "input tokens"),
                   _count(row[cols["out"]], where, "output tokens"), None, n)
    return fmt, rows()


# leading bytes -> what the file is, for files we refuse with a hint
_REFUSED = {b"PK\x03\x04": ("a zip archive", "unzip it first"),
            b"BZh": ("bzip2 data", "bunzip2 it first"), b"\xfd7zXZ": ("xz data", "unxz it first"),
            b"\x28\xb5\x2f\xfd": ("zstd data", "unzstd it first"),
            b"\xff\xfe": ("UTF-16 text", "convert it first: iconv -f UTF-16 -t UTF-8"),
            b"\xfe\xff": ("UTF-16 text", "convert it first: iconv -f UTF-16 -t UTF-8")}
_GZIP = b"\x1f\x8b"
_BOM = b"\xef\xbb\xbf"


def open_trace(path: str) -> tuple[IO[str], bytes]:
    """``path`` as UTF-8 text (a leading BOM, as Excel writes, dropped; gzip, as Azure
    2025 is published, decompressed as it is read), and its first bytes of content.
    Other archives and UTF-16 are refused with the command that converts them. A FIFO
    nobody writes to reads as empty instead of hanging."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(fd, True)
        raw: IO[bytes] = io.BufferedReader(io.FileIO(fd, "rb"))
        magic = raw.peek(8)[:8]
        if magic[:2] == _GZIP:
            raw = gzip.GzipFile(fileobj=raw, mode="rb")
            magic = raw.peek(8)[:8]
        head = magic[len(_BOM):] if magic.startswith(_BOM) else magic
    except (OSError, EOFError, zlib.error) as exc:
        raise SimInputError(f"--trace-in: cannot read {path}: "
                            f"{getattr(exc, 'strerror', None) or exc}") from None
    for lead, (what, fix) in _REFUSED.items():
        if magic.startswith(lead):
            raw.close()
            raise SimInputError(f"--trace-in: {path} is {what}; {fix} (CSV or JSON lines, "
                                f"plain or .gz, are read)")
    return io.TextIOWrapper(raw, encoding="utf-8-sig", newline=""), head


def read_trace(path: str, limit: int | None = None, window_s: tuple[float, float] | None = None,
               cache_blocks: int = DEFAULT_CACHE_BLOCKS) -> TraceRows:
    """Stream ``path`` (format by content: JSON lines, else a CSV header), keeping the
    rows inside ``window_s`` (seconds from the first row, [start, end)) up to ``limit``
    of them; the prefix cache sees every row read (it warms up before the window)."""
    fp, head = open_trace(path)
    with fp:
        suffixes = [x.lower() for x in Path(path).suffixes if x.lower() != ".gz"]
        if suffixes[-1:] in ([".jsonl"], [".json"]) or head[:1] in (b"{", b"["):
            fmt, rows = "mooncake", _mooncake_rows(fp, path)
        else:
            fmt, rows = _csv_rows(fp, path)
        out = TraceRows(array("d"), array("q"), array("q"), array("b"), array("q"), fmt)
        cache = PrefixCache(cache_blocks)
        t0 = prev = None
        lo_ns, hi_ns = ((round(window_s[0] * 1e9), round(window_s[1] * 1e9)) if window_s
                        else (0, None))
        first_kept = None
        for t, n_in, n_out, hashes, line in rows:
            out.rows_read += 1
            if prev is not None and t < prev:
                raise SimInputError(f"--trace-in: {path} line {line}: timestamp earlier than the "
                                    f"previous row's (rows must be in time order)")
            prev = t
            if t0 is None:
                t0 = t
            rel = t - t0
            if hi_ns is not None and rel >= hi_ns:
                break
            hit_blocks = cache.lookup(hashes) if hashes else 0
            if rel < lo_ns:
                continue
            if limit is not None and len(out) >= limit:
                out.truncated = True
                break
            if first_kept is None:
                first_kept = t
            cached = min(n_in, hit_blocks * BLOCK_TOKENS)
            out.arrival_ms.append((t - first_kept) / 1e6)
            out.input_len.append(n_in)
            out.output_len.append(n_out)
            out.failed.append(n_out == 0)
            out.cached_tokens.append(cached)
            out.cache_lookups += n_in
            out.cache_hits += cached
    if not len(out):
        where = " inside --trace-window" if window_s else ""
        raise SimInputError(f"--trace-in: {path} holds no requests{where}")
    return out
