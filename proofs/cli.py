"""``pdgate prove``: run the proof obligations, print the table, optionally write JSON.

Exit status: 0 every result matches its expectation, 1 some do not, 2 bad usage.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import TimeoutError, get_context
from pathlib import Path
from typing import NoReturn

from model.spec.clocks import CLOCK_VARIANTS
from model.spec.variants import brief
from model.spec.iteration import ITER_VARIANTS
from model.spec.pipeline import PP_VARIANTS
from proofs.obligations import (ALL_VARIANTS, FactKey, Obligation, Outcome, Settings, bundle_inductive,
                                fact_bundles, fact_key, needs_facts, obligations, run_obligation,
                                share_facts)


def _usage_error(prog: str) -> "callable":
    def error(message: str) -> NoReturn:
        print(f"{prog}: {message}", file=sys.stderr)
        raise SystemExit(2)
    return error


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.error = _usage_error("pdgate prove")            # one line, exit 2
    p.add_argument("--variant", action="append", metavar="V",
                   help=f"only this variant (repeatable; known: {brief([*ALL_VARIANTS, *ITER_VARIANTS, *PP_VARIANTS, *CLOCK_VARIANTS])}; --list names them)")
    p.add_argument("--only", action="append", metavar="TEXT",
                   help="only obligations whose name contains TEXT (repeatable)")
    p.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    p.add_argument("--traces", metavar="DIR", default="out/traces",
                   help="directory for counterexample traces (default: out/traces)")
    p.add_argument("--jobs", type=int, default=2, metavar="N", help="worker processes (default 2)")
    p.add_argument("--timeout", type=float, default=20.0, metavar="SECONDS",
                   help="per solver query (default 20)")
    p.add_argument("--list", action="store_true", help="list the obligations and exit")
    p.add_argument("--all", action="store_true",
                   help="also the slow rows (the explicit-state cross-checks, bmc-crosscheck); "
                        "--only selects among all rows")
    p.add_argument("--mutants", action="store_true",
                   help="self-test: apply each built-in mutant (a small bug, in memory) in a worker and "
                        "run obligations until one flips; exit 0 iff every mutant is killed "
                        "(--json then writes the mutants with killed and caught_by)")


def _select(args: argparse.Namespace) -> list[Obligation]:
    obs = obligations()
    if not args.all and not args.only:
        obs = [o for o in obs if not o.slow]
    if args.variant:
        obs = [o for o in obs if o.variant in args.variant]
    if args.only:
        obs = [o for o in obs if any(t in o.obligation for t in args.only)]
    return obs


def _run_one(task: tuple[int, Settings, list[str], dict]) -> tuple[int, Outcome]:
    i, settings, keys, facts = task
    share_facts(facts)
    by_key = {o.key: o for o in obligations()}
    return i, run_obligation(by_key[keys[i]], settings)


def _verdict(key: FactKey) -> tuple[FactKey, bool | None, float]:
    """A candidate fact bundle no selected row proves: its verdict (None if the check
    failed: each row that needs it then proves it itself and reports what goes wrong),
    and the CPU seconds."""
    c0 = time.process_time()
    try:
        ok = bundle_inductive(key)
    except Exception:               # noqa: BLE001 - the rows report it, one by one
        ok = None
    return key, ok, time.process_time() - c0


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def run(args: argparse.Namespace) -> int:
    err = "pdgate prove: "
    known = [*ALL_VARIANTS, *ITER_VARIANTS, *PP_VARIANTS, *CLOCK_VARIANTS]
    unknown = [v for v in args.variant or [] if v not in known]
    if unknown:
        print(f"{err}unknown variant {unknown[0]!r} (known: {brief(known)}; --list names them)",
              file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"{err}--jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(f"{err}--timeout must be > 0 seconds, got {args.timeout}", file=sys.stderr)
        return 2
    if args.mutants:
        return _run_mutants(args)
    obs = _select(args)
    if not obs:
        print(f"{err}no obligation matches the filters", file=sys.stderr)
        return 2
    if args.list:
        for o in obs:
            print(f"{o.obligation:32s} {o.variant:22s} {o.expected}")
        return 0
    traces = Path(args.traces)
    try:
        traces.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"{err}cannot create --traces directory {traces}: {exc.strerror}", file=sys.stderr)
        return 2
    settings = Settings(traces, int(args.timeout * 1000))
    t0 = time.perf_counter()
    outcomes = _execute(obs, settings, args.jobs)
    wall = time.perf_counter() - t0
    if outcomes is None:
        print(f"{err}workers did not finish within {SUITE_DEADLINE_S:.0f} s; stopped them", file=sys.stderr)
        return 1
    rows, failed = [], 0
    for o, out in zip(obs, outcomes):
        ok = out.result == o.expected
        failed += not ok
        rows.append({"obligation": o.obligation, "variant": o.variant, "expected": o.expected,
                     "result": out.result, "seconds": round(out.seconds, 3),
                     "cpu_seconds": round(out.cpu_seconds, 3),
                     "unbounded": o.unbounded, "detail": out.detail,
                     **({"trace": out.trace} if out.trace else {})})
    _print_table(rows)
    shared = (f", {settings.facts_cpu_seconds:.1f} CPU-s proving facts no row proves"
              if settings.facts_cpu_seconds else "")
    print(f"{len(rows) - failed}/{len(rows)} as expected, {wall:.1f} s wall{shared}"
          + (f"; {failed} UNEXPECTED" if failed else ""))
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as fp:
                json.dump(rows, fp, indent=1)
        except OSError as exc:
            print(f"{err}cannot write {args.json}: {exc.strerror}", file=sys.stderr)
            return 2
    return 1 if failed else 0


def _run_mutants(args: argparse.Namespace) -> int:
    from proofs.mutants import MUTANTS, run_all
    err = "pdgate prove --mutants: "
    if args.variant or args.only or args.list:
        print(f"{err}--variant, --only and --list select obligations, not mutants", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        results = run_all(jobs=args.jobs, timeout_ms=int(args.timeout * 1000))
    except TimeoutError:
        print(f"{err}a mutant worker did not finish; stopped them", file=sys.stderr)
        return 1
    width = max(len(m.name) for m in MUTANTS)
    print(f"{'mutant':{width}s}  {'area':8s}  killed  caught by")
    for r in results:
        print(f"{r.name:{width}s}  {r.area:8s}  {'yes' if r.killed else 'NO':6s}  "
              f"{', '.join(r.caught_by) or '-'}  ({r.checked} run, {r.seconds:.1f} s)")
    survivors = [r.name for r in results if not r.killed]
    print(f"{len(results) - len(survivors)}/{len(results)} mutants killed, "
          f"{time.perf_counter() - t0:.1f} s wall" + (f"; SURVIVED: {', '.join(survivors)}" if survivors else ""))
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as fp:
                json.dump([r.row() for r in results], fp, indent=1)
        except OSError as exc:
            print(f"{err}cannot write {args.json}: {exc.strerror}", file=sys.stderr)
            return 2
    return 1 if survivors else 0


SUITE_DEADLINE_S = 900.0   # the suite takes seconds; this long means a worker is stuck


def _execute(obs: list[Obligation], settings: Settings, jobs: int) -> list[Outcome] | None:
    """Run the obligations (in ``jobs`` forked workers); None if the deadline passed."""
    if jobs == 1:
        return [run_obligation(o, settings) for o in obs]
    keys = [o.key for o in obs]
    order = sorted(range(len(obs)), key=lambda i: _cost_rank(obs[i]))   # longest first
    results: list[Outcome | None] = [None] * len(obs)
    deadline = time.monotonic() + SUITE_DEADLINE_S
    # The facts the other rows assume (proved_facts) are proved once, first: most by
    # the lemma:/safety: rows that prove those bundles anyway, the rest as bare checks;
    # their verdicts then go to every worker (else each re-proves them per variant).
    t = settings.timeout_ms
    wanted = {(v, names, t) for v in {o.variant for o in obs if needs_facts(o)} for names in fact_bundles(v)}
    first = [i for i in order if fact_key(obs[i], t) in wanted]
    bare = sorted(wanted - {fact_key(obs[i], t) for i in first})
    verdicts: dict[FactKey, bool] = {}
    timeout = lambda: max(deadline - time.monotonic(), 0.0)
    with get_context("fork").Pool(jobs) as pool:     # leaving the block terminates workers
        try:
            rows = pool.imap_unordered(_run_one, [(i, settings, keys, {}) for i in first])
            checks = pool.imap_unordered(_verdict, bare)
            for _ in first:
                i, out = rows.next(timeout=timeout())
                results[i] = out
                verdicts[fact_key(obs[i], t)] = out.result == "proved"
            for _ in bare:
                key, ok, cpu = checks.next(timeout=timeout())
                settings.facts_cpu_seconds += cpu
                if ok is not None:
                    verdicts[key] = ok
            done = set(first)
            it = pool.imap_unordered(_run_one, [(i, settings, keys, verdicts) for i in order if i not in done])
            for _ in range(len(order) - len(done)):
                i, out = it.next(timeout=timeout())
                results[i] = out
        except TimeoutError:
            return None
    return [r for r in results if r is not None]


def _cost_rank(o: Obligation) -> int:
    """Rough cost order: two-request unrollings, explicit search and refinement, other
    unrollings, proofs."""
    if o.obligation == "cex:outcomes_agree" and o.variant != "ungated":
        return 0
    if o.obligation.startswith(("bmc-crosscheck", "cex:", "refines:")):
        return 1
    return 2 if not o.unbounded else 3


def _print_table(rows: list[dict]) -> None:
    head = ["obligation", "variant", "expected", "result", "seconds"]
    cells = [[r["obligation"], r["variant"], r["expected"],
              r["result"] + ("" if r["result"] == r["expected"] else "  <-- UNEXPECTED"),
              f"{r['seconds']:.2f}"] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    print(_row(head, widths))
    print(_row(["-" * w for w in widths], widths))
    for c, r in zip(cells, rows):
        print(_row(c, widths))
        if r["detail"] and r["result"] != r["expected"]:
            print(f"    {r['detail']}")
