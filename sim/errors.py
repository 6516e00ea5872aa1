"""User-input errors of the simulator: one line naming the flag, file or line."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable


class SimInputError(ValueError):
    """Bad input (a flag value, a trace row, a sample file); ``str()`` is one line."""


class SimCutShort(Exception):
    """A run stopped at --max-sim-seconds / --max-steps (its outputs were written)."""


def check_writable(path: str | None, flag: str, directory: bool = False) -> None:
    """Refuse, before any work, an output path that could not be written: probed by
    opening it (an existing file in append mode, so it is left as it is; a new one is
    created and removed), because permission bits say nothing to root or about /proc."""
    if path is None:
        return
    target = Path(path)
    try:
        if directory:
            if target.exists() and not target.is_dir():
                raise SimInputError(f"{flag}: {path} exists and is not a directory")
            made = not target.exists()
            target.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=target).close()
            if made:
                target.rmdir()
        elif target.is_dir():
            raise SimInputError(f"{flag}: {path} is a directory")
        elif target.exists():
            open(target, "a").close()
        else:
            open(target, "x").close()
            target.unlink()
    except OSError as exc:
        raise SimInputError(f"{flag}: cannot write {path}: {exc.strerror or exc}") from None


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
