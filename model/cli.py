"""``pdgate``: one console script, one subcommand per layer.

Each subcommand lives in its own layer's module (``add_arguments(parser)`` and
``run(args) -> int``) and is imported only when chosen, so ``pdgate validate`` never
loads z3, simpy or torch.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "prove": ("proofs.cli", "run the Z3 proof obligations and print the result table"),
    "validate": ("model.spec.validate", "replay a trace against the spec"),
    "simulate": ("sim.cli", "simulate a variant (or --compare several) under latencies and faults"),
    "sweep": ("sim.sweep", "grid of simulations to CSV, and a capacity search"),
    "calibrate": ("sim.calibrate", "fit the simulator to real e2e runs; --validate against held-out runs"),
    "replay": ("impl.replay", "replay a trace on T real gloo processes running impl.decode"),
    "conform": ("impl.sglang.conform", "run SGLang releases' own decode code on traces and check it against the spec"),
    "e2e": ("impl.e2e", "end to end over real Mooncake: one prefill, T decode ranks"),
    "mutate": ("proofs.mutate", "the test suite's self-test: realistic source mutants, each killed by its named tests"),
    "live": ("impl.sglang.live", "a live SGLang 0.5.23 prefill + TP=2 decode + router on CPU, checked against a plain server"),
    "bench": ("bench.cli", "run the benchmarks in bench/ and print their figures"),
}


# -- shared argument handling: every subcommand's flags go through these ------------
def number(lo: float | None = None, hi: float | None = None, *, above: bool = False,
           integer: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number (NaN and inf refused) in ``lo``..``hi``
    (``above``: strictly greater than ``lo``); ``integer`` also refuses fractions."""
    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{'an integer' if integer else 'a number'} expected, got {text[:40]!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"a finite number expected, got {text[:40]!r}")
        if lo is not None and (value <= lo if above else value < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {lo:g}, got {text[:40]}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi:g}, got {text[:40]}")
        return value
    parse.__name__ = "integer" if integer else "number"     # argparse names it in errors
    return parse


def writable_problem(path: str | os.PathLike, *inputs: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be written (checked before any work), or None. It is opened
    for appending, without blocking (a FIFO with no reader is refused, not waited on),
    and given an empty write, which /dev/full refuses (permission bits alone say nothing
    for root or for /proc); a file it created is removed again. It must not be one of
    ``inputs`` (``replay X --out X`` would overwrite its own input)."""
    out = Path(path)
    try:
        for src in inputs:
            if out.exists() and Path(src).exists() and out.samefile(src):
                return f"{path} is also the input; choose another output path"
        if out.is_dir():
            return f"{path} is a directory"
        if not out.parent.is_dir():
            return f"cannot write {path}: folder {out.parent} does not exist"
        existed = os.path.lexists(out)      # a dangling link stays (its target is made)
        fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
        try:
            os.write(fd, b"")
        finally:
            os.close(fd)
        if not existed:
            out.unlink()
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    except ValueError as exc:           # a NUL byte in the path
        return f"cannot write {str(path)[:80]!r}: {exc}"
    return None


RESOLVE_TIMEOUT_S = 5.0      # a name lookup, before any work (see resolve_problem)


def resolve_problem(host: str, port: int | None = None, timeout_s: float | None = None) -> str | None:
    """Why ``host`` cannot be used (it does not resolve, or not within ``timeout_s``,
    default RESOLVE_TIMEOUT_S), or None. The lookup runs in a daemon thread that is
    abandoned at the timeout: an unreachable DNS server would hold the command for the
    resolver's own retries."""
    timeout_s = RESOLVE_TIMEOUT_S if timeout_s is None else timeout_s
    outcome: list[BaseException | None] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, port)
            outcome.append(None)
        except (OSError, UnicodeError, ValueError) as exc:
            outcome.append(exc)
    worker = threading.Thread(target=lookup, name="pdgate-resolve", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        return f"{host[:80]!r} did not resolve within {timeout_s:g} s"
    if outcome[0] is not None:
        return f"{host[:80]!r} does not resolve ({str(outcome[0])[:80]})"
    return None


def _can_create_in(folder: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


# Output paths by subcommand (argparse dest), checked before any work: files, folders.
OUTPUT_FILES: dict[str, tuple[str, ...]] = {
    "prove": ("json",), "simulate": ("json", "trace", "perfetto"), "sweep": ("out",),
    "replay": ("out",), "e2e": ("json", "trace"), "bench": ("json",), "conform": ("json",),
    "live": ("json", "trace"),
    "mutate": ("json",), "calibrate": ("out", "json")}
OUTPUT_DIRS: dict[str, tuple[str, ...]] = {"prove": ("traces",), "simulate": ("plot",),
                                           "sweep": ("plot",), "e2e": ("work_dir",),
                                           "live": ("work_dir",)}
INPUT_FILES: dict[str, tuple[str, ...]] = {"replay": ("trace",), "simulate": ("trace_in",),
                                           "sweep": ("trace_in",), "validate": ("trace",)}


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be used as an output folder (existing, or creatable), or None."""
    out = Path(path)
    try:
        if out.exists():
            if not out.is_dir():
                return f"{path} exists and is not a folder"
            return None if _can_create_in(out) else f"cannot write into {path}"
        parent = next((q for q in out.parents if q.exists()), Path("."))
    except (OSError, ValueError) as exc:
        return f"cannot use folder {str(path)[:80]!r}: {getattr(exc, 'strerror', None) or exc}"
    if not parent.is_dir() or not _can_create_in(parent):
        return f"cannot create folder {path}: {parent} is not a writable folder"
    return None


def output_problem(command: str, args: argparse.Namespace) -> str | None:
    """The first output path of ``command`` that cannot be written, as one line."""
    inputs = [v for v in (getattr(args, n, None) for n in INPUT_FILES.get(command, ())) if v]
    seen: dict[str, str] = {}
    for name in OUTPUT_FILES.get(command, ()):
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            flag = f"--{name.replace('_', '-')}"
            problem = writable_problem(value, *inputs)
            if problem:
                return f"{flag}: {problem}"
            where = os.path.realpath(value)
            if where in seen and where != os.devnull:     # one would overwrite the other
                return f"{flag}: {value} is also {seen[where]}'s path; choose another"
            seen[where] = flag
    for name in OUTPUT_DIRS.get(command, ()):
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            problem = folder_problem(value)
            if problem:
                return f"--{name.replace('_', '-')}: {problem}"
    return None


def _finite(type_fn: Callable[[str], object]) -> Callable[[str], object]:
    """Wrap an argparse ``type`` so NaN and inf (alone or in a list) are refused for
    every subcommand's flags, whichever converter the subcommand chose."""
    def parse(text: str) -> object:
        value = type_fn(text)
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise argparse.ArgumentTypeError(f"a finite number expected, got {text[:40]!r}")
        return value
    parse.__name__ = getattr(type_fn, "__name__", "value")
    return parse


def refuse_nonfinite(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if callable(action.type) and not getattr(action.type, "_finite", False):
            action.type = _finite(action.type)
            action.type._finite = True


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


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    """The parser ``pdgate NAME`` uses, flags and checks included (tests enumerate its
    flags to generate hostile values for each)."""
    mod_name, help_text = SUBCOMMANDS[name]
    p = argparse.ArgumentParser(prog=f"pdgate {name}", description=help_text)
    p.error = _one_line_error(f"pdgate {name}")
    importlib.import_module(mod_name).add_arguments(p)
    refuse_nonfinite(p)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM: the command stops as on Ctrl-C (its finally blocks stop its children)."""


def _on_sigterm(owner: int):
    def handler(signum: int, frame: object) -> None:
        if os.getpid() != owner:          # a forked worker (sweep's pool): die as asked
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated()
    return handler


def main(argv: list[str] | None = None) -> int:
    on_term = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if on_term:
        signal.signal(signal.SIGTERM, _on_sigterm(os.getpid()))
    try:
        return _main(argv)
    except Terminated:                    # before a subcommand was chosen
        print("pdgate: terminated (SIGTERM)", file=sys.stderr)
        return 143
    finally:
        if on_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _main(argv: list[str] | None) -> int:
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
            refuse_nonfinite(p)
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help()
        return 0 if not argv or "-h" in argv or "--help" in argv else 2
    problem = output_problem(args.command, args)
    if problem:
        print(f"pdgate {args.command}: {problem}", file=sys.stderr)
        return 2
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt as exc:
        term = isinstance(exc, Terminated)
        print(f"pdgate {args.command}: {'terminated (SIGTERM)' if term else 'interrupted'}", file=sys.stderr)
        return 143 if term else 130
    except (MemoryError, RecursionError) as exc:
        print(f"pdgate {args.command}: out of {'memory' if isinstance(exc, MemoryError) else 'stack'}"
              " (input too large?)", file=sys.stderr)
        return 1
    except Exception as exc:     # a bug: still one line (the hostile suite fails on this text)
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        print(f"pdgate {args.command}: internal error: {type(exc).__name__}: {first}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
