"""User-input errors of the simulator: one line naming the flag, file or line."""
from __future__ import annotations

import argparse
import sys
from typing import Callable


class SimInputError(ValueError):
    """Bad input (a flag value, a trace row, a sample file); ``str()`` is one line."""


def run_reporting(prog: str, execute: Callable[[argparse.Namespace], object],
                  args: argparse.Namespace) -> int:
    """Run a subcommand: bad input becomes one line on stderr and exit status 2."""
    try:
        execute(args)
    except SimInputError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return 0
