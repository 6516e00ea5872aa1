"""``pdgate``: one console script, one subcommand per layer.

Each subcommand lives in its own layer's module (``add_arguments(parser)`` and
``run(args) -> int``) and is imported only when chosen, so ``pdgate validate`` never
loads z3, simpy or torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "prove": ("proofs.cli", "run the Z3 proof obligations and print the result table"),
    "validate": ("model.spec.validate", "replay a trace against the spec"),
    "simulate": ("sim.cli", "simulate a variant (or --compare several) under latencies and faults"),
    "sweep": ("sim.sweep", "grid of simulations to CSV, and a capacity search"),
    "replay": ("impl.replay", "replay a trace on T real gloo processes running impl.decode"),
    "conform": ("impl.sglang.conform", "run SGLang releases' own decode code on traces and check it against the spec"),
    "e2e": ("impl.e2e", "end to end over real Mooncake: one prefill, T decode ranks"),
    "bench": ("bench.cli", "run the benchmarks in bench/ and print their figures"),
}


def _parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(
        prog="pdgate",
        description="Formal model, simulator and implementation of the metadata gate that keeps "
                    "the TP ranks of a disaggregated decode worker in agreement.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.error = _one_line_error("pdgate")
    return parser, sub


def _one_line_error(prog: str):
    """argparse's error(), as one line naming the problem, exit status 2."""
    def error(message: str):
        print(f"{prog}: {message} (see {prog} --help)", file=sys.stderr)
        raise SystemExit(2)
    return error


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, sub = _parser()
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (mod_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.error = _one_line_error(f"pdgate {name}")
        if name == chosen:
            try:
                module = importlib.import_module(mod_name)
            except ImportError as exc:
                print(f"pdgate {name}: cannot load {mod_name}: {exc}", file=sys.stderr)
                return 2
            module.add_arguments(p)
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help()
        return 0 if not argv or "-h" in argv or "--help" in argv else 2
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"pdgate {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
