"""``pdgate conform --sglang VERSIONS [TRACE ...]``: SGLang's released decode code checked
against the spec, release by release.

For each release and trace, the release's own ``pop_transferred`` runs on T gloo
processes driven by the trace's environment events (impl.sglang.runner); what it did is
written as a pdgate trace and validated against the variant that models the release.
Verdicts: ``matches``, ``reproduces`` (an invariant the variant is known to break, at a
step), ``differs`` (the release did something its variant does not allow: exit 1),
``not checked`` (the variant that models it is not in this spec yet), ``cut`` and
``rewritten`` (the trace had to be fitted to the variant: never ``matches``). Default
traces: every trace ``pdgate prove`` wrote to ``--traces``, two simulator runs and the
stale-room trace.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from impl.replay import Script, load_script
from model.spec.invariants import bounded_wait
from model.spec.trace import TraceInputError, read_trace_file
from model.spec.variants import get_variant

if TYPE_CHECKING:
    from impl.sglang.runner import Fitted

NAME = "pdgate conform"
# simulator runs added to the default traces: failures, late writes, slot reuse
SIM_RUNS = (("gate", 2, 3), ("ungated", 2, 3))
SIM_FLAGS = ("--requests", "16", "--fail-prob", "0.1", "--late-write", "exp:50", "--slots", "2",
             "--request-pool", "1")


class ConformInputError(ValueError):
    """Bad command-line input: one line."""


# The transfer-queue variant that models each release: (as shipped, with SGLang's deferred
# KV release on), read from each wheel's pop_transferred. 0.5.13 on gate the MIN on the
# metadata row and zero the room on free; 0.5.19 and 0.5.20 hold only a decode-initiated
# abort's slot (none in a trace: gate); 0.5.21 and 0.5.22 hold every failed transfer's
# slot per rank; 0.5.23 agrees the holds (a MAX) and the releases (a MIN).
MODELLED_BY = {"0.5.12": ("ungated", "ungated"), **{f"0.5.{n}": ("gate", "gate") for n in range(13, 21)},
               "0.5.21": ("gate", "deferred-local"), "0.5.22": ("gate", "deferred-local"),
               "0.5.23": ("gate", "deferred")}


def release_variant(version: str, deferred: bool, patch: str | None) -> str:
    """The spec variant that models ``version`` as configured (ConformInputError for a
    release no variant models)."""
    if patch:
        return patch
    if version not in MODELLED_BY:
        raise ConformInputError(f"no variant models SGLang {version} (modelled: {', '.join(MODELLED_BY)})")
    return MODELLED_BY[version][int(deferred)]


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


def _step_trace(path: Path) -> bool:
    """Not another kind of trace: ``pdgate prove`` also writes the iteration, pipeline
    and clock traces (``pdgate-iteration``, ``pdgate-clocks``) there, for ``--points``
    and ``pdgate validate``; an unreadable one is kept, for read_source's one line."""
    try:
        with path.open(encoding="utf-8") as fp:
            head = json.loads(fp.readline(1 << 16) or "null")
    except (OSError, ValueError):
        return True
    return not isinstance(head, dict) or head.get("format") in (None, "pdgate-trace")


def default_sources(traces_dir: str) -> list[Source]:
    d = Path(traces_dir)
    paths = sorted(p for p in d.glob("*.jsonl") if not p.name.endswith(".impl.jsonl") and _step_trace(p)) \
        if d.is_dir() else []
    if not paths:
        raise ConformInputError(f"no traces in {d}: run `pdgate prove --traces {d}` first, "
                                f"or name TRACE files")
    return [read_source(str(p)) for p in paths] + builtin_sources()


STALE_ROOM = "stale-room.jsonl"


def stale_room_events() -> list[Any]:
    """A slot reused after a commit, on 2 ranks: request 1's writes reach rank 1 first.
    A release that zeroes the room on free holds it on rank 0 (its room reads 0) until
    its writes land there too; one that does not reads request 0's room on rank 0, the
    gate passes, and the ranks disagree (rank 0 aborts the mismatch, rank 1 commits:
    #27374, ``gate-noclear``). The default traces need it whatever ``pdgate prove``
    exported: a release that stops zeroing its slots must differ from ``gate``."""
    from model.spec.events import PAYLOAD, ROOM, Enqueue, KvDone, Land, Step
    both = (0, 1)
    return [Enqueue(0, 1, 7), *(Land(k, 0, f) for k in both for f in (PAYLOAD, ROOM)),
            *(KvDone(k, 0) for k in both), Step(),
            Enqueue(1, 2, 8), *(KvDone(k, 1) for k in both), Land(1, 1, PAYLOAD),
            Land(1, 1, ROOM), Step(), Land(0, 1, PAYLOAD), Land(0, 1, ROOM), Step()]


def write_stale_room(path: str) -> None:
    """The stale-room trace as ``gate-noclear`` takes it (the spec decides every step),
    with its ``outcomes_agree`` claim."""
    from model.spec.invariants import step_violations
    from model.spec.machine import apply
    from model.spec.state import initial_state
    from model.spec.trace import TraceWriter
    variant = get_variant("gate-noclear")
    state = initial_state(variant, 2, 1)
    with open(path, "w", encoding="utf-8") as fp:
        writer = TraceWriter(fp, variant.name, 2, 1, NAME, note="stale room after a reuse")
        for ev in stale_room_events():
            rec = apply(state, ev)
            if rec is None:
                writer.event(ev)
                continue
            writer.step(rec)
            for viol in step_violations(state, rec):
                writer.violation(viol, state.steps - 1)
        writer.end(state.steps)


def builtin_sources() -> list[Source]:
    """The simulator runs and the stale-room trace."""
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
        path = str(Path(tmp) / STALE_ROOM)
        write_stale_room(path)
        out.append(read_source(path))
    return out


def _verdict(result: Any, source: Source, fitted: "Fitted | None" = None) -> dict:
    """The row's verdict. A run of a cut or rewritten trace never reads ``matches``: its
    verdict is ``cut`` or ``rewritten`` (what changed in ``changes``), what the run found
    in ``found`` (``differs`` stays ``differs``)."""
    row = _found(result, source)
    changes = [] if fitted is None else [*fitted.rewritten, *([fitted.cut] if fitted.cut else [])]
    if changes and row["verdict"] != "differs":
        row.update(found=row["verdict"], changes=changes,
                   verdict="cut" if fitted.cut else "rewritten")
    return row


def _found(result: Any, source: Source) -> dict:
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
    elif row["verdict"] in ("cut", "rewritten"):
        found = _describe({**row, "verdict": row["found"], "hang": None})
        head = "" if row["verdict"] == "cut" else "rewritten: "
        text = f"{head}{'; '.join(row['changes'])} -> {found}"
    else:
        text = "matches"
    if row.get("hang"):
        text += f"; the MIN of step {row['hang']['step']} mismatches (queue lengths " \
                f"{row['hang']['lengths']}: reported by the collective timeout)"
    return text


def patch_variant(patch: str, source: Source, reorder_rooms: bool) -> tuple[Any, str]:
    """The variant a patched release is checked against on ``source``, unmodified: the
    patch's timeout is the trace's own where it has one (a decode-side setting), and a
    trace whose prefill writes a room before its payload is checked against ``patch``
    without the room order (the decode-side patch cannot reorder the prefill's writes;
    ``reorder_rooms`` rewrites the trace instead). Returns the variant and why."""
    from impl.sglang.runner import rooms_before_payloads
    steps = source.script.header.timeout_steps
    early = [] if reorder_rooms else rooms_before_payloads(source.script.events)
    name = f"{patch}-no-room-order" if early and known_variant(f"{patch}-no-room-order") \
        else patch
    why = ""
    if early:
        i, rank, req = early[0]
        why = (f"the prefill writes a room before its payload (request {req} on rank {rank}, "
               f"event {i}): {name}, {patch}'s decode side")
    return get_variant(name, steps), why


def check(versions: list[str], sources: list[Source], *, deferred: bool = False,
          mode: str = "own", patch: str | None = None, timeout_s: float = 3.0,
          reorder_rooms: bool = False, source_dir: str | None = None,
          variant: str | None = None) -> list[dict]:
    """Run every release on every trace; one row per (release, trace). ``reorder_rooms``
    (with ``patch``): room writes moved after their payloads (rows say ``rewritten``);
    ``source_dir``: the release's modules read from that tree (e.g. patched);
    ``variant``: check against it instead of the one that models the release (a wrong
    one must differ: the checks' siblings)."""
    from impl.sglang.runner import Job, fit, run_jobs
    rows, jobs, job_rows = [], [], []
    for version in versions:
        vname = variant or release_variant(version, deferred, patch)
        for src in sources:
            row = {"release": version, "mode": mode, "trace": src.name, "variant": vname,
                   "deferred": deferred}
            rows.append(row)
            if not known_variant(vname):
                row.update(verdict="not checked", invariant=None, step=None,
                           detail=f"variant {vname} is not in this spec")
                continue
            checked, why = patch_variant(patch, src, reorder_rooms) if patch and not variant \
                else (get_variant(vname), "")
            fitted = fit(src.script, checked, reorder_rooms=bool(patch) and reorder_rooms)
            row["variant"] = checked.name
            note = "; ".join(x for x in (why, fitted.note) if x)
            if note:
                row["note"] = note
            jobs.append(Job(version, mode, deferred, fitted.script, note, source_dir))
            job_rows.append((row, src, fitted))
    by_ranks: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        by_ranks.setdefault(job.script.header.ranks, []).append(i)
    for ranks, idx in sorted(by_ranks.items()):
        results = run_jobs([jobs[i] for i in idx], timeout_s=timeout_s)
        for i, res in zip(idx, results):
            row, src, fitted = job_rows[i]
            row.update(_verdict(res, src, fitted), steps=res.steps, errors=res.errors,
                       stub_reads=res.reads)
    return rows


def emit_diffs(versions: list[str], out_dir: str) -> list[str]:
    """One unified diff per release, the strict patch against its decode module
    (impl.sglang.patch.strict_diff): the paths written."""
    from impl.sglang.patch import DIFF_TARGET, strict_diff
    from impl.sglang.wheels import open_wheel
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConformInputError(f"--emit-diff: {out} is not a directory")
    texts = {v: strict_diff(v, open_wheel(v).member(DIFF_TARGET)) for v in versions}
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for version, text in texts.items():
        path = out / f"sglang-{version}-strict.diff"
        path.write_text(text, encoding="utf-8")
        paths.append(str(path))
    return paths


def check_source(source_dir: str, versions: list[str], patch: str | None) -> None:
    """``--source``: one release, a tree holding its decode module, patched exactly when
    ``--patch`` asks for it (the harness does not patch a patched source again)."""
    from impl.sglang.patch import DIFF_MARK, DIFF_TARGET
    if len(versions) != 1:
        raise ConformInputError("--source names one release's source: give one --sglang release")
    target = Path(source_dir) / DIFF_TARGET
    if not target.is_file():
        raise ConformInputError(f"--source: {target} is not a file")
    try:
        patched = DIFF_MARK in target.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConformInputError(f"--source: cannot read {target}: {exc}") from None
    if patch and not patched:
        raise ConformInputError(f"--source: {target} does not carry the strict patch "
                                f"(apply the diff of `pdgate conform --emit-diff`)")
    if patched and not patch:
        raise ConformInputError(f"--source: {target} carries the strict patch: add --patch strict")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="*", help="spec traces (default: --traces DIR plus simulator runs)")
    p.add_argument("--sglang", required=True, metavar="VERSIONS",
                   help="comma-separated releases, 'pinned' (the six the heavier modes run by "
                        "default) or 'all' (every release install.sh fetches, 0.5.12 to 0.5.23)")
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
    p.add_argument("--reorder-rooms", action="store_true",
                   help="with --patch: move each trace's room writes after their payloads, as "
                        "strict's prefill writes them (A1); those rows say `rewritten`")
    p.add_argument("--source", metavar="DIR",
                   help="one release's modules read from DIR (holding sglang/...) instead of "
                        "its wheel, e.g. with the --emit-diff patch applied")
    p.add_argument("--emit-diff", metavar="DIR",
                   help="write the strict patch as DIR/sglang-V-strict.diff per release "
                        "(`patch -p1` in a tree holding sglang/) and run nothing")
    p.add_argument("--variant", metavar="V",
                   help="check against variant V instead of the one that models each release "
                        "(a wrong one must differ)")
    p.add_argument("--json", metavar="PATH", help="write one object per (release, trace)")
    p.add_argument("--collective-timeout", type=float, default=3.0, metavar="S",
                   help="timeout of every collective, seconds (default 3)")
    p.add_argument("--reads", action="store_true",
                   help="also print what each release read from the stub layer")
    p.add_argument("--points", action="store_true",
                   help="run each release's own pop_preallocated / pop_bootstrapped on T thread "
                        "ranks against its iter-* / prefill-* variant (impl/sglang/points.py); "
                        "takes --sglang, --variant (an iteration variant), --json, --seed, --random, and "
                        "TRACE: iteration traces (pdgate prove's iter-*/prefill-* cex), one "
                        "scenario per iteration")
    p.add_argument("--pp", action="store_true",
                   help="run each release's own PP decode transfer consensus (scheduler PP mixin + "
                        "pop_transferred) on 2 stages x 2 thread ranks against its pp-* variant "
                        "(impl/sglang/pprun.py); takes --sglang, --variant (a pp-* decode variant), --json")
    p.add_argument("--facts", action="store_true",
                   help="read each release's source with ast (decode iteration, offload, prefill, PP, "
                        "wall-clock timeouts: impl/sglang/*_facts.py) and compare it with the variants "
                        "that model it; takes --sglang, --source (one release), --json")
    p.add_argument("--seed", type=int, metavar="S",
                   help="with --points: the seed of the random scenarios (default 0)")
    p.add_argument("--random", type=int, metavar="N",
                   help="with --points: N random decode and N random prefill scenarios (default 6)")


def _versions(text: str) -> list[str]:
    from impl.sglang.wheels import PINNED, RELEASES, parse_version, wheel_path
    named = {"pinned": PINNED, "all": RELEASES}
    names = list(named[text]) if text in named else [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise ConformInputError("--sglang: no release given")
    for v in names:
        parse_version(v)
        wheel_path(v)                     # MissingRelease names the install command
    return names


def run(args: argparse.Namespace) -> int:
    from impl.sglang.wheels import MissingRelease
    if getattr(args, "facts", False):
        from impl.sglang.facts import run_facts
        return run_facts(args)
    if getattr(args, "pp", False):
        from impl.sglang.pprun import run_pp
        return run_pp(args)
    if args.points:
        from impl.sglang.points import run_points
        return run_points(args)
    try:
        if args.seed is not None or args.random is not None:
            raise ConformInputError("--seed and --random need --points")
        if args.swap and args.patch:
            raise ConformInputError("--swap and --patch exclude each other")
        if args.deferred and args.patch:
            raise ConformInputError("--deferred does not combine with --patch (the patch "
                                    "replaces SGLang's deferred release with its own)")
        if args.local_release and not args.patch:
            raise ConformInputError("--local-release needs --patch strict")
        if not 0 < args.collective_timeout <= 600:
            raise ConformInputError("--collective-timeout must be in (0, 600] seconds")
        if args.reorder_rooms and not args.patch:
            raise ConformInputError("--reorder-rooms needs --patch strict")
        if args.variant:
            get_variant(args.variant)              # unknown: one line naming the known ones
        versions = _versions(args.sglang)
        if not (args.patch or args.variant or args.emit_diff):
            for v in versions:
                release_variant(v, args.deferred, None)    # one a variant models
        if args.emit_diff:
            for path in emit_diffs(versions, args.emit_diff):
                print(path)
            return 0
        if args.source:
            check_source(args.source, versions, args.patch)
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
                     timeout_s=args.collective_timeout, reorder_rooms=args.reorder_rooms,
                     source_dir=args.source, variant=args.variant)
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
