"""``pdgate replay TRACE --ranks T``: replay a spec trace on T real gloo processes.

Each process runs one rank of the real impl (impl.scripted.RankHarness: the real
DecodeTransferQueue and MetadataBuffers, scripted receivers and metadata writes) through
the trace's environment events and steps. The ranks' step records are merged into the
impl's own trace (source "impl"), which is then replayed through the spec
(model.spec.validate). Exit codes: 0 the impl matched the spec at every step; 1 the impl
raised a divergence error (the ``ungated`` bug: a one-line explanation, never a hang),
a rank failed, or the spec rejects the impl trace; 2 bad input.
"""
from __future__ import annotations

import argparse
import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from impl.decode.collective import GlooExchange
from impl.decode.errors import CollectiveError, DecodeInputError
from impl.decode.trace import StepTrace
from impl.ranks import RanksFailed, run_ranks
from impl.scripted import RankHarness
from model.spec.events import Enqueue, Event, Step
from model.spec.invariants import Violation
from model.spec.machine import RankStep, StepRecord
from model.cli import number, writable_problem
from model.spec.trace import (MAX_CLAIMS, Header, TraceFormatError, TraceInputError, TraceWriter,
                              open_records, parse_record, read_trace_file, require_enqueued,
                              require_nothing_after)
from model.spec.validate import ValidationResult, validate, violation_line

MAX_RANKS = 32      # one process each


@dataclass(frozen=True)
class Script:
    """A parsed input trace: its header and the events to drive (steps included)."""
    header: Header
    events: tuple[Event, ...]


@dataclass
class ReplayResult:
    script: Script
    trace: str                        # the impl trace (NDJSON)
    validation: ValidationResult
    error: str | None                 # the impl's typed error, if a step or event raised
    error_kind: str | None            # "divergence" (collective) or "rejected" (input)
    steps: int

    @property
    def ok(self) -> bool:
        return self.error is None and self.validation.ok


def load_script(lines: Iterable[str]) -> Script:
    """Parse a whole trace, up to its ``end`` record and nothing after it (raises
    TraceFormatError); violation claims are not driven."""
    header, line, records = open_records(lines)
    events: list[Event] = []
    enqueued: set[int] = set()
    claims = 0
    for line, obj in records:
        rec = parse_record(obj, line, header)
        if isinstance(rec, int):
            require_nothing_after(records, line)
            return Script(header, tuple(events))
        require_enqueued(rec, enqueued, line)
        if isinstance(rec, Enqueue):
            enqueued.add(rec.req)
        if isinstance(rec, StepRecord):
            events.append(Step())
        elif isinstance(rec, Violation):
            claims += 1
            if claims > MAX_CLAIMS:      # the same input validate refuses
                raise TraceFormatError(line, f"more than {MAX_CLAIMS} violation records")
        else:
            events.append(rec)
    raise TraceFormatError(line, "trace ended before its end record (cut short?)")


def _replay_rank(rank: int, world: int, scripts: list[Script], collective_timeout_s: float) -> list[dict]:
    """Child process body: every script in turn on this rank, same group throughout."""
    out = []
    for script in scripts:
        h = script.header
        harness = RankHarness(rank, h.spec_variant(), h.slots,
                              GlooExchange(None, collective_timeout_s),
                              collective_timeout_s=collective_timeout_s)
        error = kind = None
        at = len(script.events)
        for i, ev in enumerate(script.events):
            try:
                harness.apply(ev)
            except CollectiveError as exc:
                error, kind, at = str(exc), "divergence", i
            except DecodeInputError as exc:
                error, kind, at = str(exc), "rejected", i
            if error:
                break
        out.append({"steps": [r.to_json() for r in harness.tracer.records], "error": error,
                    "kind": kind, "at": at})
        if kind == "divergence" and "length mismatch" not in error:
            break           # the group may be unusable after a timeout; stop here
    return out


def _merge(script: Script, per_rank: list[dict]) -> tuple[str, int]:
    """The impl trace from every rank's step records, interleaved with the events."""
    h = script.header
    fp = io.StringIO()
    writer = TraceWriter(fp, h.variant, h.ranks, h.slots, "impl", h.timeout_steps,
                         h.release_timeout_steps)
    records = [[StepTrace.from_json(s) for s in r["steps"]] for r in per_rank]
    stop = min(r["at"] for r in per_rank)
    step = 0
    for i, ev in enumerate(script.events):
        if not isinstance(ev, Step):
            if i >= stop:
                break
            writer.event(ev)
            continue
        if any(step >= len(rs) for rs in records):
            break
        ranks = tuple(_rank_step(k, rs[step]) for k, rs in enumerate(records))
        hang = records[0][step].hang
        writer.step(StepRecord(step, ranks, hang))
        if hang is not None or i >= stop:
            break
        step += 1
    writer.end(step)
    return fp.getvalue(), step


def _rank_step(rank: int, s: StepTrace) -> RankStep:
    return RankStep(rank, tuple(int(q) for q in s.queue), s.local, s.gated, s.reduced,
                    tuple((int(rid), int(d), p) for rid, d, p in s.popped))


def replay_scripts(scripts: Sequence[Script], ranks: int, *, collective_timeout_s: float = 10.0,
                   deadline_s: float = 120.0) -> list[ReplayResult]:
    """Replay several scripts (same rank count) on one set of ``ranks`` processes."""
    for s in scripts:
        if s.header.ranks != ranks:
            raise ValueError(f"trace has {s.header.ranks} ranks, replay asked for {ranks}")
    outcomes = run_ranks(_replay_rank, ranks, (list(scripts), collective_timeout_s),
                         deadline_s=deadline_s, group_timeout_s=collective_timeout_s)
    results = []
    for j, script in enumerate(scripts):
        per_rank = [o.value[j] for o in outcomes if j < len(o.value)]
        if len(per_rank) != ranks:
            break
        text, steps = _merge(script, per_rank)
        errors = [r for r in per_rank if r["error"]]
        first = min(errors, key=lambda r: r["at"]) if errors else None
        results.append(ReplayResult(script, text, validate(text.splitlines()),
                                    first["error"] if first else None,
                                    first["kind"] if first else None, steps))
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="NDJSON spec trace (docs/trace-format.md)")
    p.add_argument("--ranks", type=number(1, MAX_RANKS, integer=True),
                   help=f"number of gloo processes, 1..{MAX_RANKS} (default: the trace's ranks)")
    p.add_argument("--out", help="where to write the impl trace (default: TRACE.impl.jsonl)")
    p.add_argument("--collective-timeout", type=number(0, 3600, above=True), default=10.0,
                   metavar="S", help="timeout of every collective, seconds (default 10)")
    p.add_argument("--deadline", type=number(0, 86400, above=True), default=120.0, metavar="S",
                   help="kill the ranks after this many seconds (default 120)")


def run(args: argparse.Namespace) -> int:
    name = "pdgate replay"
    out = Path(args.out) if args.out else Path(args.trace).with_suffix(".impl.jsonl")
    problem = writable_problem(out, args.trace)
    if problem:
        print(f"{name}: {problem}", file=sys.stderr)
        return 2
    try:
        script = read_trace_file(args.trace, load_script)
    except TraceInputError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    ranks = args.ranks if args.ranks is not None else script.header.ranks
    if ranks > MAX_RANKS:
        print(f"{name}: the trace has {ranks} ranks; replay runs at most {MAX_RANKS} processes",
              file=sys.stderr)
        return 2
    try:
        [result] = replay_scripts([script], ranks, collective_timeout_s=args.collective_timeout,
                                  deadline_s=args.deadline)
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except RanksFailed as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    try:
        out.write_text(result.trace, encoding="utf-8")
    except OSError as exc:
        print(f"{name}: cannot write {out}: {exc.strerror}", file=sys.stderr)
        return 2
    v = result.validation
    print(f"impl trace: {out} ({result.steps} steps on {ranks} gloo ranks); spec: {v.message}")
    broken = violation_line(v)
    if broken:      # the spec allowed every step, and this is what those steps broke
        print(broken)
    if result.error_kind == "divergence":
        print(f"{name}: {script.header.variant} diverged at step {result.steps}: {result.error}")
        return 1
    if result.error_kind == "rejected":
        print(f"{name}: the impl refused the trace's input: {result.error}", file=sys.stderr)
        return 2
    return 0 if v.ok else 1
