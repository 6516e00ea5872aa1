"""``pdgate conform --sglang VERSIONS [TRACE ...]``: SGLang's released decode code checked
against the spec, release by release.

For each release and trace, the release's own ``pop_transferred`` runs on T gloo
processes driven by the trace's environment events (impl.sglang.runner); what it did is
written as a pdgate trace and validated against the variant that models the release.
Verdicts: ``matches``, ``reproduces`` (an invariant the variant is known to break, at a
step), ``differs`` (the release did something its variant does not allow: exit 1), or
``not checked`` (the variant that models it is not in this spec yet). Default traces:
every trace ``pdgate prove`` wrote to ``--traces`` plus two simulator runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from impl.replay import Script, load_script
from model.spec.invariants import bounded_wait
from model.spec.trace import TraceInputError, read_trace_file
from model.spec.variants import get_variant

NAME = "pdgate conform"
# simulator runs added to the default traces: failures, late writes, slot reuse
SIM_RUNS = (("gate", 2, 3), ("ungated", 2, 3))
SIM_FLAGS = ("--requests", "16", "--fail-prob", "0.1", "--late-write", "exp:50", "--slots", "2",
             "--request-pool", "1")


class ConformInputError(ValueError):
    """Bad command-line input: one line."""


def release_variant(version: str, deferred: bool, patch: str | None) -> str:
    """The spec variant that models ``version`` as configured."""
    from impl.sglang.wheels import parse_version
    key = parse_version(version)
    if patch:
        return patch
    if key < (0, 5, 13):
        return "ungated"
    # 0.5.19-0.5.20 defer only decode-initiated aborts (none in a trace): gate
    if deferred and key >= (0, 5, 21):
        return "deferred" if key >= (0, 5, 23) else "deferred-local"
    return "gate"


def known_variant(name: str) -> bool:
    try:
        get_variant(name)
    except ValueError:
        return False
    return True


@dataclass
class Source:
    name: str
    script: Script
    claim: str | None           # the invariant the source trace claims broken
    bound: int | None           # its bound, for bounded_wait


MAX_RANKS, MAX_SLOTS = 8, 4096      # one process per rank; SGLang's buffers per slot


def read_source(path: str) -> Source:
    if not Path(path).is_file():
        raise ConformInputError(f"{path}: not a readable trace file")

    def parse(fp: Any) -> Source:
        lines = list(fp)                      # a file, or the reader's bounded lines
        script = load_script(lines)           # malformed input: one line naming the line
        claim = bound = None
        for text in lines:
            if '"violation"' in text:
                rec = json.loads(text)
                if rec.get("kind") == "violation":
                    claim, bound = rec.get("invariant"), rec.get("bound")
        return Source(Path(path).name, script, claim, bound)
    source = read_trace_file(path, parse)
    h = source.script.header
    if h.ranks > MAX_RANKS or h.slots > MAX_SLOTS:
        raise ConformInputError(f"{path}: {h.ranks} ranks and {h.slots} slots; conform runs at "
                                f"most {MAX_RANKS} ranks (one process each) and {MAX_SLOTS} slots")
    return source


def default_sources(traces_dir: str) -> list[Source]:
    d = Path(traces_dir)
    paths = sorted(p for p in d.glob("*.jsonl") if not p.name.endswith(".impl.jsonl")) \
        if d.is_dir() else []
    if not paths:
        raise ConformInputError(f"no traces in {d}: run `pdgate prove --traces {d}` first, "
                                f"or name TRACE files")
    return [read_source(str(p)) for p in paths] + simulator_sources()


def simulator_sources() -> list[Source]:
    from sim import cli as sim_cli
    out = []
    with tempfile.TemporaryDirectory(prefix="pdgate-conform-") as tmp:
        for variant, ranks, seed in SIM_RUNS:
            p = argparse.ArgumentParser()
            sim_cli.add_arguments(p)
            path = str(Path(tmp) / f"sim-{variant}-T{ranks}-seed{seed}.jsonl")
            args = p.parse_args(["--variant", variant, "--ranks", str(ranks), "--seed", str(seed),
                                 *SIM_FLAGS])
            sim_cli.simulate_one(args, variant, seed, path, False)
            out.append(read_source(path))
    return out


def _verdict(result: Any, source: Source) -> dict:
    v = result.validation
    row: dict[str, Any] = {"verdict": "matches", "invariant": None, "step": None}
    if result.refused:
        row.update(verdict="differs", step=v.steps, line=None, detail=result.refused)
        return row
    if not v.ok:
        row.update(verdict="differs", step=v.steps, line=v.line, detail=v.message)
        return row
    hung = v.state is not None and v.state.hung is not None
    if v.first_violation is not None:
        step, viol = v.first_violation
        row.update(verdict="reproduces", invariant=viol.invariant, step=step, detail=viol.detail)
    elif source.claim == "bounded_wait" and source.bound is not None and \
            bounded_wait(v.state, source.bound):
        row.update(verdict="reproduces", invariant="bounded_wait", step=v.steps - 1,
                   detail=bounded_wait(v.state, source.bound)[0].detail)
    if hung:
        row["hang"] = {"step": v.steps, "lengths": list(v.state.hung)}
    return row


def _describe(row: dict) -> str:
    if row["verdict"] == "reproduces":
        text = f"reproduces {row['invariant']} at step {row['step']}"
    elif row["verdict"] == "differs" and row.get("line") is None:
        text = f"differs at step {row['step']}: {row.get('detail')}"
    elif row["verdict"] == "differs":
        text = f"differs at line {row.get('line')}: {row.get('detail')}"
    elif row["verdict"] == "not checked":
        text = f"not checked: {row.get('detail')}"
    else:
        text = "matches"
    if row.get("hang"):
        text += f"; the MIN of step {row['hang']['step']} mismatches (queue lengths " \
                f"{row['hang']['lengths']}: reported by the collective timeout)"
    return text


def check(versions: list[str], sources: list[Source], *, deferred: bool = False,
          mode: str = "own", patch: str | None = None, timeout_s: float = 3.0) -> list[dict]:
    """Run every release on every trace; one row per (release, trace)."""
    from impl.sglang.runner import Job, fit_script, run_jobs
    rows, jobs, job_rows = [], [], []
    for version in versions:
        vname = release_variant(version, deferred, patch)
        for src in sources:
            row = {"release": version, "mode": mode, "trace": src.name, "variant": vname,
                   "deferred": deferred}
            rows.append(row)
            if not known_variant(vname):
                row.update(verdict="not checked", invariant=None, step=None,
                           detail=f"variant {vname} is not in this spec")
                continue
            script, note = fit_script(src.script, get_variant(vname))
            if note:
                row["note"] = note
            jobs.append(Job(version, mode, deferred, script, note))
            job_rows.append((row, src))
    by_ranks: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        by_ranks.setdefault(job.script.header.ranks, []).append(i)
    for ranks, idx in sorted(by_ranks.items()):
        results = run_jobs([jobs[i] for i in idx], timeout_s=timeout_s)
        for i, res in zip(idx, results):
            row, src = job_rows[i]
            row.update(_verdict(res, src), steps=res.steps, errors=res.errors,
                       stub_reads=res.reads)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="*", help="spec traces (default: --traces DIR plus simulator runs)")
    p.add_argument("--sglang", required=True, metavar="VERSIONS",
                   help="comma-separated releases, or 'pinned' (the set install.sh fetches)")
    p.add_argument("--traces", default="out/traces", metavar="DIR",
                   help="where `pdgate prove` wrote its traces (default out/traces)")
    p.add_argument("--deferred", action="store_true",
                   help="run with SGLang's deferred KV release on (0.5.19+)")
    p.add_argument("--swap", action="store_true",
                   help="pdgate's drop-in poll functions inside SGLang's own queue")
    p.add_argument("--patch", choices=["strict"],
                   help="SGLang's queue with pdgate's strict patch (impl.sglang.patch.install)")
    p.add_argument("--local-release", action="store_true",
                   help="with --patch: release held slots per rank, as strict's spec does, "
                        "instead of agreed across ranks at each step (install()'s default)")
    p.add_argument("--json", metavar="PATH", help="write one object per (release, trace)")
    p.add_argument("--collective-timeout", type=float, default=3.0, metavar="S",
                   help="timeout of every collective, seconds (default 3)")
    p.add_argument("--reads", action="store_true",
                   help="also print what each release read from the stub layer")


def _versions(text: str) -> list[str]:
    from impl.sglang.wheels import PINNED, parse_version, wheel_path
    names = list(PINNED) if text == "pinned" else [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise ConformInputError("--sglang: no release given")
    for v in names:
        parse_version(v)
        wheel_path(v)                     # MissingRelease names the install command
    return names


def run(args: argparse.Namespace) -> int:
    from impl.sglang.wheels import MissingRelease
    try:
        if args.swap and args.patch:
            raise ConformInputError("--swap and --patch exclude each other")
        if args.deferred and args.patch:
            raise ConformInputError("--deferred does not combine with --patch (the patch "
                                    "replaces SGLang's deferred release with its own)")
        if args.local_release and not args.patch:
            raise ConformInputError("--local-release needs --patch strict")
        if not 0 < args.collective_timeout <= 600:
            raise ConformInputError("--collective-timeout must be in (0, 600] seconds")
        versions = _versions(args.sglang)
        if args.json:
            Path(args.json).open("a", encoding="utf-8").close()     # writable before any work
        sources = [read_source(t) for t in args.trace] if args.trace else \
            default_sources(args.traces)
    except (ConformInputError, MissingRelease, TraceInputError, ValueError, OSError) as exc:
        msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"{NAME}: {msg}", file=sys.stderr)
        return 2
    mode = "swap" if args.swap else ("patch-local" if args.local_release else "patch") \
        if args.patch else "own"
    try:
        rows = check(versions, sources, deferred=args.deferred, mode=mode, patch=args.patch,
                     timeout_s=args.collective_timeout)
    except Exception as exc:              # a rank died or the deadline passed: one line
        print(f"{NAME}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr)
        return 1
    width = max(len(r["trace"]) for r in rows)
    for r in rows:
        print(f"{r['release']:<8} {mode:<11} {r['trace']:<{width}}  {r['variant']:<14} {_describe(r)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    if args.reads:           # what each release's code read from the stub layer, run included
        for v in versions:
            names = dict.fromkeys(n for r in rows if r["release"] == v
                                  for n in r.get("stub_reads", []))
            print(f"SGLang {v} read from stubs ({len(names)}): {', '.join(names)}")
    differs = sum(r["verdict"] == "differs" for r in rows)
    unchecked = sum(r["verdict"] == "not checked" for r in rows)
    print(f"{len(rows)} checks: {differs} differ, {unchecked} not checked")
    return 1 if differs else 0
