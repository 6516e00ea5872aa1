"""User-input errors of the simulator: one line naming the flag, file or line."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable


class SimInputError(ValueError):
    """Bad input (a flag value, a trace row, a sample file); ``str()`` is one line."""


class SimCutShort(Exception):
    """A run stopped at --max-sim-seconds / --max-steps (its outputs were written)."""


def check_writable(path: str | None, flag: str, directory: bool = False) -> None:
    """Refuse, before any work, an output path (a file, or a ``directory``) that could
    not be written: model.cli's probes, which every subcommand shares."""
    from model.cli import folder_problem, writable_problem
    if path is None:
        return
    problem = folder_problem(path) if directory else writable_problem(path)
    if problem:
        raise SimInputError(f"{flag}: {problem}")


def run_reporting(prog: str, execute: Callable[[argparse.Namespace], object],
                  args: argparse.Namespace) -> int:
    """Run a subcommand: bad input becomes one line on stderr and exit status 2; a run
    cut short by its bounds, one line and exit status 1."""
    try:
        execute(args)
    except SimInputError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except SimCutShort as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"{prog}: out of memory (use fewer --requests or --ranks)", file=sys.stderr)
        return 1
    except BrokenPipeError:      # stdout closed early (``| head``): stop quietly
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 1
    return 0
