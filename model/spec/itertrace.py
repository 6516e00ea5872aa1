"""Iteration traces (docs/trace-format.md, "Iteration traces"): write, and replay
through model/spec/iteration.py (or model/spec/pipeline.py: a ``pp-*`` variant, whose
header adds ``stages``). ``pdgate validate`` takes them by their header's format,
``pdgate-iteration``; the limits and exit codes are the step traces'.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterable, Sequence

from model.spec.invariants import Violation
from model.spec.iteration import (ITER_VARIANTS, ITERATION_NAMES,
                                  check_inputs, get_iter_variant, initial_stages, iteration_violations,
                                  run_iteration)
from model.spec.pipeline import (PP_NAMES, PP_VARIANTS, check_pp_inputs, initial_pp_stages,
                                 pipeline_violations, run_pipeline)
from model.spec.trace import MAX_CLAIMS, MAX_RANK_SLOTS, MAX_RANKS, TraceFormatError, _int, read_records

FORMAT, VERSION = "pdgate-iteration", 1
MAX_REQUESTS = 1 << 16


class IterationTraceWriter:
    def __init__(self, fp: IO[str], variant: str, ranks: int, requests: int, source: str, **extra: Any):
        self.fp = fp
        self._write({"kind": "header", "format": FORMAT, "version": VERSION, "variant": variant,
                     "ranks": ranks, "requests": requests, "source": source, **extra})

    def _write(self, obj: dict[str, Any]) -> None:
        self.fp.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def iteration(self, i: int, inputs: dict[str, Sequence[Sequence[int]]], res: Any) -> None:
        self._write({"kind": "iteration", "i": i, "inputs": {n: [list(r) for r in rows] for n, rows in inputs.items()},
                     "records": [[list(x) for x in rec] for rec in res.records],
                     "stages": [list(row) for row in res.stages]})

    def violation(self, v: Violation, i: int) -> None:
        self._write({"kind": "violation", "invariant": v.invariant, "iteration": i,
                     "ranks": list(v.ranks), "reqs": list(v.reqs), "detail": v.detail})

    def end(self, iterations: int) -> None:
        self._write({"kind": "end", "iterations": iterations})


def is_iteration_header(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("kind") == "header" and obj.get("format") == FORMAT


@dataclass
class IterationValidation:
    ok: bool
    message: str
    iterations: int
    first_violation: tuple[int, Violation] | None = None
    claims: list[Violation] = field(default_factory=list)


@dataclass(frozen=True)
class _Replay:
    """What a trace's variant replays through: the decode iteration or the pipeline."""
    name: str
    initial: Any
    run: Callable[[Any, Any], Any]
    violations: Callable[[Any], list[Violation]]
    check: Callable[[dict], None]
    names: tuple[str, ...]


def _header(obj: Any, line: int, variant: str | None) -> tuple[_Replay, int, int]:
    if not is_iteration_header(obj):
        raise TraceFormatError(line, f"first record must be a {FORMAT} header")
    if obj.get("version") != VERSION or isinstance(obj.get("version"), bool):
        raise TraceFormatError(line, f"unsupported iteration trace version {obj.get('version')!r:.40}")
    name = variant or obj.get("variant")
    known = [*ITER_VARIANTS, *PP_VARIANTS]
    if not isinstance(name, str) or name not in known:
        raise TraceFormatError(line, f"unknown iteration variant {name!r:.60} (known: {', '.join(known)})")
    ranks, reqs = _int(obj, "ranks", line, 1, MAX_RANKS), _int(obj, "requests", line, 1, MAX_REQUESTS)
    pp = _int(obj, "stages", line, 1, MAX_RANKS) if name in PP_VARIANTS else 1
    if pp * ranks * reqs > MAX_RANK_SLOTS:
        raise TraceFormatError(line, f"header: stages x ranks x requests = {pp * ranks * reqs} "
                               f"exceeds {MAX_RANK_SLOTS}")
    if name in PP_VARIANTS:
        pv = PP_VARIANTS[name]
        return _Replay(name, initial_pp_stages(pv, pp, ranks, reqs), lambda st, inp: run_pipeline(pv, pp, st, inp),
                       lambda res: pipeline_violations(res, pv),
                       lambda inp: check_pp_inputs(pv, inp, pp, ranks, reqs), PP_NAMES), pp * ranks, reqs
    v = get_iter_variant(name)
    return _Replay(name, initial_stages(ranks, reqs), lambda st, inp: run_iteration(v, st, inp),
                   lambda res: iteration_violations(res, v), lambda inp: check_inputs(v, inp, ranks, reqs),
                   ITERATION_NAMES), ranks, reqs


def _records(obj: Any, line: int, ranks: int) -> list[list[tuple]] | None:
    recs = obj.get("records")
    if recs is None:
        return None
    ok = isinstance(recs, list) and len(recs) == ranks and all(
        isinstance(rs, list) and all(isinstance(x, list) and len(x) == 3 and isinstance(x[0], str)
                                     and isinstance(x[1], str) and isinstance(x[2], int)
                                     and not isinstance(x[2], bool) for x in rs) for rs in recs)
    if not ok:
        raise TraceFormatError(line, f"iteration: 'records' must list {ranks} ranks of [collective, op, shape]")
    return [[tuple(x) for x in rs] for rs in recs]


def validate_iterations(lines: Iterable[str], variant: str | None = None) -> IterationValidation:
    """Replay an iteration trace; raises TraceFormatError on malformed input."""
    records = read_records(lines)
    first = next(records, None)
    if first is None:
        raise TraceFormatError(1, "empty trace (no header)")
    v, ranks, reqs = _header(first[1], first[0], variant)
    stages, done, last = v.initial, 0, first[0]
    res: Any = None
    first_violation: tuple[int, Violation] | None = None
    claims: list[Violation] = []
    for line, obj in records:
        last = line
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if kind == "iteration":
            if _int(obj, "i", line) != done:
                return IterationValidation(False, f"line {line}: iteration numbered {obj['i']}, spec is at {done}", done)
            inputs = obj.get("inputs")
            try:
                if not isinstance(inputs, dict):
                    raise ValueError("'inputs' must be an object")
                v.check(inputs)
            except ValueError as exc:
                raise TraceFormatError(line, f"iteration: {exc}") from None
            res = v.run(stages, inputs)
            want = _records(obj, line, ranks)
            if want is not None and [list(r) for r in res.records] != want:
                k = next(k for k in range(ranks) if list(res.records[k]) != want[k])
                return IterationValidation(False, f"line {line} (iteration {done}): rank {k} issues "
                                           f"{list(map(list, res.records[k]))} in the spec, the trace says "
                                           f"{[list(x) for x in want[k]]}", done)
            got = obj.get("stages")
            if got is not None and got != [list(row) for row in res.stages]:
                return IterationValidation(False, f"line {line} (iteration {done}): stages {got!r:.200} in "
                                           f"the trace, the spec gives {[list(r) for r in res.stages]}", done)
            found = v.violations(res)
            if found and first_violation is None:
                first_violation = (done, found[0])
            stages, done = res.stages, done + 1
        elif kind == "violation":
            name = obj.get("invariant")
            if name not in v.names:
                raise TraceFormatError(line, f"violation: unknown invariant {name!r:.60} (known: {', '.join(v.names)})")
            if len(claims) >= MAX_CLAIMS:
                raise TraceFormatError(line, f"more than {MAX_CLAIMS} violation records")
            hit = [x for x in (v.violations(res) if res else []) if x.invariant == name]
            if not hit:
                return IterationValidation(False, f"line {line}: trace claims {name} is violated, "
                                           "the spec's last iteration satisfies it", done, first_violation, claims)
            claims.append(hit[0])
        elif kind == "end":
            for extra, _ in records:
                raise TraceFormatError(extra, f"record after the end record (line {line})")
            if _int(obj, "iterations", line) != done:
                return IterationValidation(False, f"line {line}: end record says {obj['iterations']} "
                                           f"iterations, spec took {done}", done, first_violation, claims)
            return IterationValidation(True, f"OK: {done} iterations match variant {v.name}", done,
                                       first_violation, claims)
        else:
            raise TraceFormatError(line, f"unknown iteration trace record kind {kind!r:.40}")
    return IterationValidation(False, f"line {last}: trace ended before its end record "
                               f"(after {done} iterations)", done, first_violation, claims)
