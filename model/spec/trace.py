"""The NDJSON trace format shared by the solver's counterexamples, the simulator and
the impl (docs/trace-format.md). Writing and parsing only; replay is in validate.py.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Iterator, TypeVar

from model.spec.events import FIELDS, Enqueue, Event, Fail, Fence, KvDone, Land, Step
from model.spec.invariants import Violation
from model.spec.kernel import Decision
from model.spec.kvpoll import POLL_VALUES
from model.spec.machine import RankStep, StepRecord
from model.spec.variants import ABLATIONS, VARIANTS, Variant, get_variant

FORMAT, VERSION = "pdgate-trace", 1
# Caps on what a trace may ask for, so hostile input fails in one line, not in memory.
MAX_RANKS = 4096                 # the control plane's prefill_rank/rank range (frames.py)
MAX_SLOTS = 1 << 20
MAX_RANK_SLOTS = 1 << 22         # ranks x slots: the spec keeps two rows per slot per rank
MAX_TIMEOUT_STEPS = 1 << 31
MAX_CLAIMS = 1000                # violation records: writers make one; each costs a full check
MAX_LINE_CHARS = 16 << 20        # one record; a 4096-rank step record of 128 queued is ~6 MiB
ENV_KINDS = {"enqueue": Enqueue, "kv_done": KvDone, "land": Land, "fail": Fail, "fence": Fence}
KINDS = {"header", "step", "violation", "end", *ENV_KINDS}
_DECISION_BY_NAME = {d.name.lower(): d for d in Decision}


class TraceFormatError(ValueError):
    """Malformed input; ``str()`` is one line naming the trace line."""

    def __init__(self, line: int, message: str):
        self.line = line
        super().__init__(f"line {line}: {message}")


def event_record(ev: Event) -> dict[str, Any]:
    if isinstance(ev, Enqueue):
        rec = {"kind": "enqueue", "req": ev.req, "room": ev.room, "payload": ev.payload}
        if ev.slots is not None:
            rec["slots"] = list(ev.slots)
        return rec
    if isinstance(ev, Land):
        return {"kind": "land", "rank": ev.rank, "req": ev.req, "field": ev.field}
    if isinstance(ev, Step):
        return {"kind": "step"}
    kind = {KvDone: "kv_done", Fail: "fail", Fence: "fence"}[type(ev)]
    return {"kind": kind, "rank": ev.rank, "req": ev.req}


def step_record(rec: StepRecord) -> dict[str, Any]:
    return {"kind": "step", "step": rec.step, "hang": list(rec.hang) if rec.hang else None,
            "ranks": [{"rank": r.rank, "queue": list(r.queue), "local": list(r.local),
                       "gated": list(r.gated), "reduced": list(r.reduced),
                       "popped": [[q, Decision(d).name.lower(), p] for q, d, p in r.popped]}
                      for r in rec.ranks]}


def violation_record(v: Violation, step: int, bound: int | None = None) -> dict[str, Any]:
    """A ``violation`` claim (docs/trace-format.md); ``bound`` for ``bounded_wait``."""
    rec: dict[str, Any] = {"kind": "violation", "invariant": v.invariant, "step": step,
                           "ranks": list(v.ranks), "reqs": list(v.reqs), "detail": v.detail}
    if bound is not None:      # bounded_wait: the number of steps exceeded
        rec["bound"] = bound
    return rec


class TraceWriter:
    """Writes one trace. ``t`` (milliseconds, simulated or wall) is optional on any record."""

    def __init__(self, fp: IO[str], variant: str, ranks: int, slots: int, source: str,
                 timeout_steps: int | None = None, release_timeout_steps: int | None = None,
                 **extra: Any):
        self.fp = fp
        header = {"kind": "header", "format": FORMAT, "version": VERSION, "variant": variant,
                  "ranks": ranks, "slots": slots, "timeout_steps": timeout_steps, "source": source}
        if release_timeout_steps is not None:     # only the deferred variants have one
            header["release_timeout_steps"] = release_timeout_steps
        header.update(extra)
        self._write(header)

    def _write(self, obj: dict[str, Any], t: float | None = None) -> None:
        if t is not None:
            obj["t"] = round(t, 6)
        self.fp.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def event(self, ev: Event, t: float | None = None) -> None:
        self._write(event_record(ev), t)

    def step(self, rec: StepRecord, t: float | None = None) -> None:
        self._write(step_record(rec), t)

    def violation(self, v: Violation, step: int, bound: int | None = None) -> None:
        self._write(violation_record(v, step, bound))

    def end(self, steps: int) -> None:
        self._write({"kind": "end", "steps": steps})


@dataclass(frozen=True)
class Header:
    variant: str
    ranks: int
    slots: int
    timeout_steps: int | None
    source: str
    release_timeout_steps: int | None = None     # the deferred variants' (absent: default)

    def spec_variant(self, name: str | None = None) -> Variant:
        """The named variant (default: the header's), with the header's timeouts where
        that variant has them."""
        base = get_variant(name or self.variant)
        return get_variant(base.name, self.timeout_steps if base.timeout_steps else None,
                           self.release_timeout_steps if base.release_timeout_steps else None)


def _int(obj: dict, key: str, line: int, lo: int = 0, hi: int | None = None) -> int:
    val = obj.get(key)
    if isinstance(val, bool) or not isinstance(val, int):
        raise TraceFormatError(line, f"{obj.get('kind')}: field {key!r} must be an integer, got {val!r}")
    if val < lo or (hi is not None and val > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise TraceFormatError(line, f"{obj.get('kind')}: {key} {val} out of range {rng}")
    return val


def _int_list(obj: dict, key: str, line: int, what: str, allowed: frozenset | None = None) -> tuple:
    vals = obj.get(key)
    if not isinstance(vals, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in vals):
        raise TraceFormatError(line, f"step: {what} {key!r} must be a list of integers")
    if allowed is not None:
        for x in vals:
            if x not in allowed:
                raise TraceFormatError(line, f"step: {what} {key} holds poll value {x} outside 0..4")
    return tuple(vals)


def parse_header(obj: Any, line: int) -> Header:
    if not isinstance(obj, dict) or obj.get("kind") != "header" or obj.get("format") != FORMAT:
        raise TraceFormatError(line, f"first record must be a {FORMAT} header")
    version, variant = obj.get("version"), obj.get("variant")
    if isinstance(version, bool) or version != VERSION:
        raise TraceFormatError(line, f"unsupported trace version {version!r:.40}")
    if not isinstance(variant, str) or variant not in VARIANTS and variant not in ABLATIONS:
        raise TraceFormatError(line, f"unknown variant {variant!r:.60}")
    timeouts = {}
    for key in ("timeout_steps", "release_timeout_steps"):
        timeouts[key] = None if obj.get(key) is None else _int(obj, key, line, 1, MAX_TIMEOUT_STEPS)
    ranks = _int(obj, "ranks", line, 1, MAX_RANKS)
    slots = _int(obj, "slots", line, 1, MAX_SLOTS)
    if ranks * slots > MAX_RANK_SLOTS:
        raise TraceFormatError(line, f"header: ranks x slots = {ranks * slots} exceeds "
                                     f"{MAX_RANK_SLOTS}")
    return Header(variant, ranks, slots, timeouts["timeout_steps"], str(obj.get("source", "")),
                  timeouts["release_timeout_steps"])


def _parse_rank_step(obj: Any, line: int, ranks: int) -> RankStep:
    if not isinstance(obj, dict):
        raise TraceFormatError(line, "step: each entry of 'ranks' must be an object")
    rank = _int(obj, "rank", line, 0, ranks - 1)
    what = f"rank {rank}"
    popped = obj.get("popped")
    if not isinstance(popped, list):
        raise TraceFormatError(line, f"step: {what} 'popped' must be a list")
    out = []
    for p in popped:
        if (not isinstance(p, list) or len(p) != 3 or not isinstance(p[0], int)
                or not isinstance(p[1], str) or p[1] not in _DECISION_BY_NAME
                or not isinstance(p[2], int)):
            raise TraceFormatError(line, f"step: {what} popped entry {p!r} is not [req, decision, payload]")
        out.append((p[0], int(_DECISION_BY_NAME[p[1]]), p[2]))
    return RankStep(rank, _int_list(obj, "queue", line, what),
                    _int_list(obj, "local", line, what, POLL_VALUES),
                    _int_list(obj, "gated", line, what, POLL_VALUES),
                    _int_list(obj, "reduced", line, what, POLL_VALUES), tuple(out))


def parse_record(obj: Any, line: int, header: Header) -> Event | StepRecord | Violation | int:
    """One record after the header: an Event, a StepRecord (a step with per-rank data),
    a Violation claim, or the int step count of the end record."""
    if not isinstance(obj, dict):
        raise TraceFormatError(line, "record must be a JSON object")
    kind = obj.get("kind")
    if not isinstance(kind, str) or kind not in KINDS or kind == "header":
        raise TraceFormatError(line, f"unknown record kind {kind!r:.60}")
    if kind == "enqueue":
        slots = obj.get("slots")
        if slots is not None:
            if not isinstance(slots, list) or len(slots) != header.ranks or any(
                    isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < header.slots
                    for x in slots):
                raise TraceFormatError(line, f"enqueue: 'slots' must name one slot in "
                                             f"0..{header.slots - 1} per rank ({header.ranks})")
            slots = tuple(slots)
        return Enqueue(_int(obj, "req", line), _int(obj, "room", line, 0, 2**64 - 1),
                       _int(obj, "payload", line, -2**31, 2**31 - 1), slots)
    if kind in ENV_KINDS:
        rank, req = _int(obj, "rank", line, 0, header.ranks - 1), _int(obj, "req", line)
        if kind == "land":
            if not isinstance(obj.get("field"), str) or obj["field"] not in FIELDS:
                raise TraceFormatError(line, f"land: field must be one of {FIELDS}, got {obj.get('field')!r:.60}")
            return Land(rank, req, obj["field"])
        return ENV_KINDS[kind](rank, req)
    if kind == "step":
        if "ranks" not in obj:
            return Step()
        entries = obj["ranks"]
        if not isinstance(entries, list) or len(entries) != header.ranks:
            raise TraceFormatError(line, f"step: 'ranks' must list all {header.ranks} ranks")
        hang = obj.get("hang")
        if hang is not None:
            hang = _int_list(obj, "hang", line, "step")
        rs = tuple(_parse_rank_step(e, line, header.ranks) for e in entries)
        if [r.rank for r in rs] != list(range(header.ranks)):
            raise TraceFormatError(line, "step: 'ranks' entries must be in rank order 0..T-1")
        return StepRecord(_int(obj, "step", line), rs, hang)
    if kind == "violation":
        name = obj.get("invariant")
        if not isinstance(name, str):
            raise TraceFormatError(line, "violation: 'invariant' must be a string")
        return Violation(name, str(obj.get("detail", "")),
                         _int_list(obj, "ranks", line, "violation"),
                         _int_list(obj, "reqs", line, "violation"))
    return _int(obj, "steps", line)


def require_enqueued(rec: Any, known: Any, line: int) -> None:
    """An environment event must name a request an earlier ``enqueue`` introduced: an
    input error (no state could allow it), not a protocol verdict."""
    if isinstance(rec, (KvDone, Fail, Land, Fence)) and rec.req not in known:
        raise TraceFormatError(line, f"{event_record(rec)['kind']}: request {rec.req} was "
                                     "never enqueued")


def require_nothing_after(records: Iterator[tuple[int, Any]], end_line: int) -> None:
    """The ``end`` record is the last: any record after it is malformed input."""
    for line, _ in records:
        raise TraceFormatError(line, f"record after the end record (line {end_line})")


def open_records(lines: Iterable[str]) -> tuple[Header, int, Iterator[tuple[int, Any]]]:
    """The header, its line number, and the (line, JSON) records after it."""
    records = read_records(lines)
    first = next(records, None)
    if first is None:
        raise TraceFormatError(1, "empty trace (no header)")
    return parse_header(first[1], first[0]), first[0], records


T = TypeVar("T")


def read_trace_file(path: str, parse: Callable[[Iterable[str]], T]) -> T:
    """``parse`` the lines of the trace file at ``path`` (each read with a length bound). Unreadable, non-UTF-8 or malformed input
    raises ``TraceInputError`` whose ``str()`` is one line."""
    try:
        with open_input(path) as fp:
            return parse(bounded_lines(fp))
    except OSError as exc:
        raise TraceInputError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TraceInputError(f"{path} is not UTF-8 text") from None
    except TraceFormatError as exc:
        raise TraceInputError(f"{path}: {exc}") from None


def open_input(path: str, encoding: str = "utf-8") -> IO[str]:
    """``path`` opened as UTF-8 text for reading, without waiting for a writer: a FIFO
    nobody writes to reads as empty instead of hanging (a pipe that is written,
    ``<(cmd)`` or /dev/stdin, still streams)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.set_blocking(fd, True)
        return open(fd, encoding=encoding)
    except BaseException:
        os.close(fd)
        raise


class TraceInputError(ValueError):
    """A trace file that cannot be used (unreadable, not text, malformed): one line."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a trace may hold")


def read_records(lines: Iterable[str]) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON) for every non-blank line. Lines longer than
    MAX_LINE_CHARS, NaN/Infinity, numbers over Python's digit limit and nesting deeper
    than the recursion limit are TraceFormatError (one line), never a traceback."""
    for n, text in enumerate(lines, 1):
        if len(text) > MAX_LINE_CHARS:
            raise TraceFormatError(n, f"line longer than {MAX_LINE_CHARS} characters")
        if not text.strip():
            continue
        try:
            obj = json.loads(text, parse_constant=_refuse_constant)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(n, f"malformed JSON: {exc.msg} at column {exc.colno}") from None
        except RecursionError:
            raise TraceFormatError(n, "JSON nested too deeply") from None
        except ValueError as exc:   # NaN/Infinity, or an integer over the digit limit
            why = ("an integer of more than sys.get_int_max_str_digits() digits"
                   if "digits" in str(exc) else str(exc).splitlines()[0][:120])
            raise TraceFormatError(n, f"unusable JSON: {why}") from None
        t = obj.get("t") if isinstance(obj, dict) else None
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not math.isfinite(t)):
            raise TraceFormatError(n, f"'t' must be a finite number of milliseconds, got {t!r:.40}")
        yield n, obj


def bounded_lines(fp: IO[str], limit: int = MAX_LINE_CHARS) -> Iterator[str]:
    """The lines of ``fp``, each read with a bound: a line over ``limit`` characters
    (``/dev/zero``, a file without newlines) is returned cut at limit + 1 characters,
    which read_records refuses, instead of being read into memory whole."""
    while True:
        text = fp.readline(limit + 1)
        if not text:
            return
        yield text
        if len(text) > limit:
            return
