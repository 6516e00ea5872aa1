"""``pdgate bench [NAME ...] [--quick] [--json PATH]``: run benchmark modules.

Every module ``bench/bench_<name>.py`` defines ``run(quick: bool) -> dict`` returning
its figures (plain JSON values) and, optionally, ``TARGETS``: {figure: (op, bound)}
with op one of ">=", "<=" so the report can say whether a goal was met.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time

import bench


class BenchInputError(Exception):
    """A benchmark cannot run as asked (its message names what is wrong)."""


def available() -> list[str]:
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(bench.__path__)
                  if m.name.startswith("bench_"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"benchmarks to run (default: all of {', '.join(available()) or 'none'})")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    p.add_argument("--json", metavar="PATH", help="write all figures as JSON")


def _check(op: str, value: float, bound: float) -> bool:
    return value >= bound if op == ">=" else value <= bound


def run(args: argparse.Namespace) -> int:
    names = args.names or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        print(f"pdgate bench: unknown benchmark {unknown[0]!r} (known: {', '.join(available())})",
              file=sys.stderr)
        return 2
    report, missed = {}, []
    for name in names:
        mod = importlib.import_module(f"bench.bench_{name}")
        t0 = time.perf_counter()
        try:
            figures = mod.run(args.quick)
        except BenchInputError as exc:
            print(f"pdgate bench {name}: {exc}", file=sys.stderr)
            return 2
        figures["bench_wall_seconds"] = round(time.perf_counter() - t0, 3)
        report[name] = figures
        print(f"== {name}")
        targets = getattr(mod, "TARGETS", {})
        for key, value in figures.items():
            mark = ""
            if key in targets:
                op, bound = targets[key]
                ok = _check(op, float(value), bound)
                mark = f"   (goal {op} {bound}: {'met' if ok else 'MISSED'})"
                if not ok:
                    missed.append(f"{name}.{key}")
            print(f"  {key:40s} {value}{mark}")
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as fp:
                json.dump(report, fp, indent=2, sort_keys=True)
        except OSError as exc:
            print(f"pdgate bench: --json: cannot write {args.json}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
    if missed:
        print(f"goals missed: {', '.join(missed)}")
    return 0
