"""User-input errors of the simulator: one line naming the flag, file or line."""
from __future__ import annotations


class SimInputError(ValueError):
    """Bad input (a flag value, a trace row, a sample file); ``str()`` is one line."""
