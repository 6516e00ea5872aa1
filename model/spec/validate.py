"""Replay a trace through the spec: the first record the spec does not allow, or OK.

Exit codes used by ``pdgate validate``: 0 the spec allows the whole trace, 1 it does
not (or the trace ended early), 2 malformed input.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass, field
from typing import Iterable

from model.spec.events import Event, Step
from model.spec.invariants import (INVARIANTS, Violation, bounded_wait, check_invariants,
                                   step_violations)
from model.spec.kernel import Decision
from model.spec.machine import EventNotEnabled, StepRecord, apply
from model.spec.state import SystemState, initial_state
from model.spec.trace import (MAX_CLAIMS, TraceFormatError, TraceInputError, _int, event_record,
                              open_records, parse_record, read_trace_file, require_enqueued,
                              require_nothing_after)
from model.spec.iteration import ITER_VARIANTS
from model.spec.pipeline import PP_VARIANTS
from model.spec.itertrace import IterationValidation, is_iteration_header, validate_iterations
from model.spec.clocks import CLOCK_VARIANTS
from model.spec.variants import brief
from model.spec.clocktrace import ClockValidation, is_clock_header, validate_clocks
from model.spec.variants import ABLATIONS, VARIANTS


@dataclass
class ValidationResult:
    ok: bool
    message: str
    steps: int
    state: SystemState | None = None
    line: int | None = None
    first_violation: tuple[int, Violation] | None = None   # (step, violation) seen in replay
    claims: list[Violation] = field(default_factory=list)  # violation records confirmed


def _diff_step(want: StepRecord, got: StepRecord) -> str | None:
    if (want.hang or None) != (got.hang or None):
        return f"hang {list(want.hang or [])} in trace, spec gives {list(got.hang or [])}"
    for w, g in zip(want.ranks, got.ranks):
        for name in ("queue", "local", "gated", "reduced", "popped"):
            wv, gv = getattr(w, name), getattr(g, name)
            if wv != gv:
                if name == "popped":
                    wv = [[q, Decision(d).name.lower(), p] for q, d, p in wv]
                    gv = [[q, Decision(d).name.lower(), p] for q, d, p in gv]
                return f"rank {w.rank} {name} {list(wv)} in trace, spec gives {list(gv)}"
    return None


def validate(lines: Iterable[str], variant: str | None = None) -> ValidationResult:
    """Replay ``lines``; raises TraceFormatError on malformed input."""
    header, last_line, records = open_records(lines)
    v = header.spec_variant(variant)
    state = initial_state(v, header.ranks, header.slots)
    first_violation = None
    claims: list[Violation] = []

    def fail(line: int, msg: str, at: int | None = None) -> ValidationResult:
        at = state.steps if at is None else at
        return ValidationResult(False, f"line {line} (step {at}): {msg}", state.steps,
                                state, line, first_violation, claims)

    for line, obj in records:
        last_line = line
        rec = parse_record(obj, line, header)
        if isinstance(rec, int):
            require_nothing_after(records, line)
            if rec != state.steps:
                return fail(line, f"end record says {rec} steps, spec took {state.steps}")
            return ValidationResult(True, f"OK: {state.steps} steps match variant {v.name}",
                                    state.steps, state, line, first_violation, claims)
        if isinstance(rec, Violation):
            if len(claims) >= MAX_CLAIMS:   # each is checked against the whole state
                raise TraceFormatError(line, f"more than {MAX_CLAIMS} violation records")
            if rec.invariant == "bounded_wait":   # liveness report: needs its bound
                found = bounded_wait(state, _int(obj, "bound", line))
            elif rec.invariant not in INVARIANTS:
                raise TraceFormatError(line, f"violation: unknown invariant {rec.invariant!r}")
            else:
                found = check_invariants(state, [rec.invariant])
            if not found:
                return fail(line, f"trace claims {rec.invariant} is violated, spec state satisfies it")
            claims.append(found[0])
            continue
        try:
            if isinstance(rec, StepRecord):
                if rec.step != state.steps:
                    return fail(line, f"step record numbered {rec.step}, spec is at step {state.steps}")
                got = apply(state, Step())
                diff = _diff_step(rec, got)
                if diff:   # name the step the record is, not the one the spec moved on to
                    return fail(line, f"spec does not allow this step: {diff}", rec.step)
            else:       # an environment event, or a bare {"kind": "step"}
                require_enqueued(rec, state.requests, line)
                got = apply(state, rec)
        except EventNotEnabled as exc:
            return fail(line, f"spec does not allow {_show(rec)}: {exc}")
        if got is not None and first_violation is None:
            # Only what this step changed: every invariant held before it (else
            # first_violation would be set), so a full rescan would be quadratic.
            found = step_violations(state, got)
            if found:
                first_violation = (got.step, found[0])
    return ValidationResult(False, f"line {last_line}: trace ended before its end record "
                            f"(after {state.steps} steps)", state.steps, state, last_line,
                            first_violation, claims)


def _show(rec: Event) -> str:
    return " ".join(f"{k}={val}" for k, val in event_record(rec).items())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="NDJSON trace (docs/trace-format.md): step or iteration trace")
    known = sorted([*VARIANTS, *ABLATIONS, *ITER_VARIANTS, *PP_VARIANTS, *CLOCK_VARIANTS])

    def variant(name: str) -> str:
        if name not in known:        # argparse's own message would list every name
            raise argparse.ArgumentTypeError(f"unknown variant {name!r} (known: {brief(known)})")
        return name
    p.add_argument("--variant", type=variant, metavar="V",
                   help="replay against this variant or ablation instead of the header's "
                        "(iter-*, prefill-* and pp-* for iteration traces, clocks-* for clock traces)")


def violation_line(result: ValidationResult | IterationValidation | ClockValidation) -> str | None:
    """The line naming the first invariant the replay saw break (validate and replay
    print it), or None."""
    if not result.first_violation:
        return None
    step, viol = result.first_violation
    unit = "iteration" if isinstance(result, IterationValidation) else "step"
    return (f"invariant {viol.invariant} breaks at {unit} {step}: {viol.detail} "
            f"(ranks {list(viol.ranks)}, requests {list(viol.reqs)})")


def validate_any(lines: Iterable[str], variant: str | None
                 ) -> ValidationResult | IterationValidation | ClockValidation:
    """An iteration or clock trace (by its header's format) or a step trace."""
    lines = iter(lines)
    head = next(lines, "")
    try:
        header = json.loads(head)
        iterations, clocks = is_iteration_header(header), is_clock_header(header)
    except (ValueError, RecursionError):
        iterations = clocks = False     # the step trace reader names what is wrong with it
    lines = itertools.chain([head], lines)
    if clocks:
        if variant is not None and variant not in CLOCK_VARIANTS:
            raise TraceFormatError(1, f"--variant {variant} is not a clock variant; this is a clock trace")
        return validate_clocks(lines, variant)
    if variant in CLOCK_VARIANTS:
        raise TraceFormatError(1, f"--variant {variant} is a clock variant; this is not a clock trace")
    if iterations:
        return validate_iterations(lines, variant)
    if variant in ITER_VARIANTS or variant in PP_VARIANTS:
        raise TraceFormatError(1, f"--variant {variant} is an iteration variant; this is a step trace")
    return validate(lines, variant)


def run(args: argparse.Namespace) -> int:
    try:
        result = read_trace_file(args.trace, lambda fp: validate_any(fp, args.variant))
    except TraceInputError as exc:
        print(f"pdgate validate: {exc}", file=sys.stderr)
        return 2
    print(result.message)
    line = violation_line(result)
    if line:
        print(line)
    return 0 if result.ok else 1
