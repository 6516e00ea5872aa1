"""Timeouts are configured in seconds and converted to an agreed count of protocol steps
(by the impl's DecodeTransferQueue, pdgate e2e and the simulator alike).

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

from model.spec.variants import Variant, get_variant

# strict's gate timeout: SGLang's order of magnitude (its deferred release waits 30 s
# for prefill's acknowledgement, SGLang #35049), far above any healthy metadata lag.
GATE_TIMEOUT_S = 30.0
# The deferred variants' release timeout: SGLang's 30 s.
RELEASE_TIMEOUT_S = 30.0
# The shortest scheduler step the conversion assumes (an idle decode loop that only polls).
STEP_FLOOR_S = 0.001
# The largest count: exact as a float and in int64 step counters (the impl's tensors).
MAX_STEPS = 2**53


def steps_for(seconds: float, step_floor_s: float = STEP_FLOOR_S) -> int:
    """The agreed step count for a timeout of ``seconds``: at least ``seconds`` of wall
    time when every step takes at least ``step_floor_s``."""
    for name, value in (("timeout", seconds), ("step floor", step_floor_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                or math.isinf(value):
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    steps = seconds / step_floor_s
    if steps > MAX_STEPS:
        raise ValueError(f"timeout of {seconds:g} s is over {MAX_STEPS} steps of {step_floor_s:g} s")
    return max(1, math.ceil(steps - 1e-9))


def deployed_variant(name: str, timeout_steps: int | None = None, timeout_s: float | None = None,
                     release_timeout_s: float | None = None, step_floor_s: float = STEP_FLOOR_S,
                     flags: tuple[str, str, str] = ("timeout_s", "timeout_steps",
                                                    "release_timeout_s")) -> Variant:
    """The variant ``name`` as deployed: strict's timeout and the deferred variants'
    release timeout from seconds (30 s by default, never the proofs' small bounds), or
    strict's count directly as ``timeout_steps``. ``flags`` names the three settings in
    the ValueError a bad or inapplicable one raises (the caller's own spelling)."""
    base = get_variant(name)
    gate_flag, steps_flag, release_flag = flags
    if timeout_steps is not None and timeout_s is not None:
        raise ValueError(f"{gate_flag}: give strict's timeout as {gate_flag} or {steps_flag}, not both")
    for flag, value, has, what in ((gate_flag, timeout_s, base.timeout_steps, "timeout"),
                                   (steps_flag, timeout_steps, base.timeout_steps, "timeout"),
                                   (release_flag, release_timeout_s, base.release_timeout_steps,
                                    "release timeout")):
        if value is not None and has is None:
            raise ValueError(f"{flag}: variant {name!r} has no {what} to override")

    def count(flag: str, seconds: float, default_s: float) -> int:
        try:
            return steps_for(default_s if seconds is None else seconds, step_floor_s)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None

    if base.timeout_steps is not None and timeout_steps is None:
        timeout_steps = count(gate_flag, timeout_s, GATE_TIMEOUT_S)
    release = (count(release_flag, release_timeout_s, RELEASE_TIMEOUT_S)
               if base.release_timeout_steps is not None else None)
    try:
        return get_variant(name, timeout_steps, release)
    except ValueError as exc:
        raise ValueError(f"{steps_flag}: {exc}") from None
