"""Timeouts are configured in seconds and converted to an agreed count of protocol steps.

The spec counts steps, never time (model/spec/events.py). The TP ranks step together,
so a step count derived from the same configuration is agreed by construction, where
per-rank clocks are not. The conversion assumes every scheduler step takes at least
``step_floor_s``: the timeout then never fires before ``seconds`` of wall time, and slower
steps only lengthen it. strict's timeout counts only steps in which the gate holds a
latched Success on some rank (a MIN of Transferring), so a request whose KV transfer is
merely slow (WaitingForInput: the receiver's own timeout, 300 s in SGLang) never ages.
"""
from __future__ import annotations

import math

# strict's gate timeout: SGLang's order of magnitude (its deferred release waits 30 s
# for prefill's acknowledgement, SGLang #35049), far above any healthy metadata lag.
GATE_TIMEOUT_S = 30.0
# The deferred variants' release timeout: SGLang's 30 s.
RELEASE_TIMEOUT_S = 30.0
# The shortest scheduler step the conversion assumes (an idle decode loop that only polls).
STEP_FLOOR_S = 0.001


def steps_for(seconds: float, step_floor_s: float = STEP_FLOOR_S) -> int:
    """The agreed step count for a timeout of ``seconds``: at least ``seconds`` of wall
    time when every step takes at least ``step_floor_s``."""
    for name, value in (("timeout", seconds), ("step floor", step_floor_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                or math.isinf(value):
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return max(1, math.ceil(seconds / step_floor_s - 1e-9))
