"""The seconds-to-steps conversion the decode path uses: model/spec/timeouts.py, one
definition shared with the simulator (re-exported here for impl's callers)."""
from model.spec.timeouts import GATE_TIMEOUT_S, RELEASE_TIMEOUT_S, STEP_FLOOR_S, steps_for

__all__ = ["GATE_TIMEOUT_S", "RELEASE_TIMEOUT_S", "STEP_FLOOR_S", "steps_for"]
