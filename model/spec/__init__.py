"""The executable specification of the decode-side metadata gate.

Pure Python: no z3, simpy, torch or sockets. One entry point, ``step(state, event)``,
returns the next state and the effects (what every rank polled, gated, reduced and
popped). Everything else in pdgate calls this package or is checked against it.
"""
from model.spec.kvpoll import KVPoll, min_reduce
from model.spec.variants import VARIANTS, GateRule, Variant, get_variant
from model.spec.kernel import Decision, gated_poll, pop_decision
from model.spec.events import Enqueue, Event, Fail, Fence, KvDone, Land, Step
from model.spec.state import SystemState, RankState, Request, initial_state
from model.spec.machine import EventNotEnabled, StepRecord, apply, enabled, forget, step
from model.spec.invariants import INVARIANTS, Violation, check_invariants

__all__ = [
    "KVPoll", "min_reduce", "VARIANTS", "GateRule", "Variant", "get_variant",
    "Decision", "gated_poll", "pop_decision",
    "Enqueue", "Event", "Fail", "Fence", "KvDone", "Land", "Step",
    "SystemState", "RankState", "Request", "initial_state",
    "EventNotEnabled", "StepRecord", "apply", "enabled", "forget", "step",
    "INVARIANTS", "Violation", "check_invariants",
]
