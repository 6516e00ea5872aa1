"""Clock traces (docs/trace-format.md, "Clock traces"): write, and replay through
model/spec/clocks.py. ``pdgate validate`` takes them by their header's format,
``pdgate-clocks``; the limits and exit codes are the iteration traces'.

Header: variant, ranks, requests, ``limits`` (wait, release, queue: clock units >= 1) and
``clock`` ({lo, hi}: every rank's elapsed time per step). Each ``step`` record gives
``dt`` (per rank) and ``inputs`` (poll, ack, finish: [rank][request]); ``records``,
``stages``, ``elapsed`` and ``age`` are optional and checked against the spec's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import IO, Any, Iterable, Mapping, Sequence

from model.spec.clocks import (CLOCK_NAMES, CLOCK_VARIANTS, ClockBound, ClockState, ClockVariant,
                               check_env, check_limits, clock_step, clock_violations, get_clock_variant,
                               initial_clock_state)
from model.spec.invariants import Violation
from model.spec.iteration import IterationResult
from model.spec.itertrace import MAX_REQUESTS
from model.spec.trace import MAX_CLAIMS, MAX_RANK_SLOTS, MAX_RANKS, TraceFormatError, _int, read_records

FORMAT, VERSION = "pdgate-clocks", 1
MAX_CLOCK = 1 << 40          # a bound on lo/hi, far over any deployed timeout in units


class ClockTraceWriter:
    def __init__(self, fp: IO[str], variant: str, ranks: int, requests: int, limits: Mapping[str, int],
                 bound: ClockBound, source: str, **extra: Any):
        self.fp = fp
        self._write({"kind": "header", "format": FORMAT, "version": VERSION, "variant": variant,
                     "ranks": ranks, "requests": requests, "limits": dict(limits),
                     "clock": {"lo": bound.lo, "hi": bound.hi}, "source": source, **extra})

    def _write(self, obj: dict[str, Any]) -> None:
        self.fp.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def step(self, i: int, dt: Sequence[int], env: Mapping[str, Sequence[Sequence[int]]],
             state: ClockState, res: IterationResult) -> None:
        self._write({"kind": "step", "i": i, "dt": list(dt),
                     "inputs": {n: [list(r) for r in rows] for n, rows in env.items()},
                     "records": [[list(x) for x in rec] for rec in res.records],
                     "stages": [list(r) for r in state.stages], "elapsed": [list(r) for r in state.elapsed],
                     "age": [list(r) for r in state.age]})

    def violation(self, v: Violation, i: int) -> None:
        self._write({"kind": "violation", "invariant": v.invariant, "step": i,
                     "ranks": list(v.ranks), "reqs": list(v.reqs), "detail": v.detail})

    def end(self, steps: int) -> None:
        self._write({"kind": "end", "steps": steps})


def is_clock_header(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("kind") == "header" and obj.get("format") == FORMAT


@dataclass
class ClockValidation:
    ok: bool
    message: str
    iterations: int          # steps (named as the iteration traces' field, for the CLI)
    first_violation: tuple[int, Violation] | None = None
    claims: list[Violation] = field(default_factory=list)


def _header(obj: Any, line: int, variant: str | None) -> tuple[ClockVariant, int, int, dict, ClockBound]:
    if not is_clock_header(obj):
        raise TraceFormatError(line, f"first record must be a {FORMAT} header")
    if obj.get("version") != VERSION or isinstance(obj.get("version"), bool):
        raise TraceFormatError(line, f"unsupported clock trace version {obj.get('version')!r:.40}")
    name = variant or obj.get("variant")
    if not isinstance(name, str) or name not in CLOCK_VARIANTS:
        raise TraceFormatError(line, f"unknown clock variant {name!r:.60} (known: {', '.join(CLOCK_VARIANTS)})")
    ranks, reqs = _int(obj, "ranks", line, 1, MAX_RANKS), _int(obj, "requests", line, 1, MAX_REQUESTS)
    if ranks * reqs > MAX_RANK_SLOTS:
        raise TraceFormatError(line, f"header: ranks x requests = {ranks * reqs} exceeds {MAX_RANK_SLOTS}")
    try:
        limits = check_limits(obj.get("limits"))
    except ValueError as exc:
        raise TraceFormatError(line, f"header: {exc}") from None
    clock = obj.get("clock")
    if not isinstance(clock, dict):
        raise TraceFormatError(line, "header: 'clock' must be an object {lo, hi}")
    lo, hi = _int(clock, "lo", line, 1, MAX_CLOCK), _int(clock, "hi", line, 1, MAX_CLOCK)
    if hi < lo:
        raise TraceFormatError(line, f"header: clock hi {hi} is below lo {lo}")
    return get_clock_variant(name), ranks, reqs, limits, ClockBound(lo, hi)


def _check(obj: dict, key: str, want: Any, line: int, done: int) -> str | None:
    got = obj.get(key)
    if got is not None and got != want:
        return f"line {line} (step {done}): {key} {got!r:.200} in the trace, the spec gives {want}"
    return None


def validate_clocks(lines: Iterable[str], variant: str | None = None) -> ClockValidation:
    """Replay a clock trace; raises TraceFormatError on malformed input."""
    records = read_records(lines)
    first = next(records, None)
    if first is None:
        raise TraceFormatError(1, "empty trace (no header)")
    v, ranks, reqs, limits, bound = _header(first[1], first[0], variant)
    state, done, last = initial_clock_state(ranks, reqs), 0, first[0]
    found: list[Violation] = []
    first_violation: tuple[int, Violation] | None = None
    claims: list[Violation] = []
    for line, obj in records:
        last = line
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if kind == "step":
            if _int(obj, "i", line) != done:
                return ClockValidation(False, f"line {line}: step numbered {obj['i']}, spec is at {done}", done)
            env, dt = obj.get("inputs"), obj.get("dt")
            try:
                if not isinstance(env, dict):
                    raise ValueError("'inputs' must be an object")
                check_env(v, dt, env, ranks, reqs, bound)
            except ValueError as exc:
                raise TraceFormatError(line, f"step: {exc}") from None
            state, res = clock_step(v, state, dt, env, limits)
            for key, want in (("records", [[list(x) for x in rec] for rec in res.records]),
                              ("stages", [list(r) for r in state.stages]),
                              ("elapsed", [list(r) for r in state.elapsed]), ("age", [list(r) for r in state.age])):
                wrong = _check(obj, key, want, line, done)
                if wrong:
                    return ClockValidation(False, wrong, done)
            found = clock_violations(v, state, res, limits)
            if found and first_violation is None:
                first_violation = (done, found[0])
            done += 1
        elif kind == "violation":
            name = obj.get("invariant")
            if name not in CLOCK_NAMES:
                raise TraceFormatError(line, f"violation: unknown invariant {name!r:.60} (known: {', '.join(CLOCK_NAMES)})")
            if len(claims) >= MAX_CLAIMS:
                raise TraceFormatError(line, f"more than {MAX_CLAIMS} violation records")
            hit = [x for x in found if x.invariant == name]
            if not hit:
                return ClockValidation(False, f"line {line}: trace claims {name} is violated, "
                                       "the spec's last step satisfies it", done, first_violation, claims)
            claims.append(hit[0])
        elif kind == "end":
            for extra, _ in records:
                raise TraceFormatError(extra, f"record after the end record (line {line})")
            if _int(obj, "steps", line) != done:
                return ClockValidation(False, f"line {line}: end record says {obj['steps']} steps, "
                                       f"spec took {done}", done, first_violation, claims)
            return ClockValidation(True, f"OK: {done} steps match variant {v.name}", done, first_violation, claims)
        else:
            raise TraceFormatError(line, f"unknown clock trace record kind {kind!r:.40}")
    return ClockValidation(False, f"line {last}: trace ended before its end record (after {done} steps)",
                           done, first_violation, claims)
