"""Every trace the simulator writes replays through the spec (pdgate validate), for
every variant and under every fault knob; and the incremental divergence check agrees
with the spec's full check_invariants at every step of those runs."""
import json

import pytest

from model.spec.events import Step
from model.spec.invariants import check_invariants
from model.spec.machine import StepRecord, apply
from model.spec.state import initial_state
from model.spec.trace import parse_header, parse_record, read_records
from model.spec.validate import validate
from model.spec.variants import VARIANTS
from sim.checks import step_violations
from tests.sim.helpers import config, run, workload

FAULTS = {
    "none": {},
    "failures+late": dict(fail_prob=0.2, late_write="exp:40", slots=6, request_pool=3),
    "lost": dict(lost_metadata_prob=0.05, timeout_steps=None),
    "stall": dict(stalls=()),
    "heavy-lag": dict(lag="pareto:1.2,0.5"),
}


def _cfg(variant, fault, seed=3, ranks=4):
    kw = dict(FAULTS[fault])
    if variant != "strict":
        kw.pop("timeout_steps", None)
    if fault == "stall":
        from sim.config import Stall
        kw["stalls"] = (Stall(1, 200.0, 300.0),)
    return config(variant=variant, ranks=ranks, seed=seed, **kw)


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_simulator_traces_validate(variant, fault):
    data, text = run(_cfg(variant, fault), workload(120, rate=20.0, seed=3), traced=True)
    result = validate(text.splitlines())
    assert result.ok, result.message
    assert result.steps == data.protocol_steps
    if data.divergence is not None:     # the violation record is a claim validate confirms
        assert [c.invariant for c in result.claims] == [data.divergence.violation.invariant]
        assert result.first_violation[0] == data.divergence.step


def _replay_checks(text: str) -> int:
    """Replay a trace; at every step compare the incremental check with the full one
    (while the state was clean before the step). Returns the steps compared."""
    recs = read_records(text.splitlines())
    line, obj = next(recs)
    header = parse_header(obj, line)
    v = header.spec_variant()
    state = initial_state(v, header.ranks, header.slots)
    compared = 0
    for line, obj in recs:
        rec = parse_record(obj, line, header)
        if isinstance(rec, StepRecord):
            got = apply(state, Step())
            assert bool(step_violations(state, got)) == bool(check_invariants(state))
            assert step_violations(state, got) == check_invariants(state) or not check_invariants(state)
            compared += 1
            if check_invariants(state):
                break
        elif not isinstance(rec, int) and type(rec).__name__ != "Violation":
            apply(state, rec)
    return compared


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("seed", [1, 2])
def test_incremental_check_agrees_with_full_check(variant, seed):
    for fault in FAULTS:
        _, text = run(_cfg(variant, fault, seed=seed), workload(80, rate=30.0, seed=seed), traced=True)
        assert _replay_checks(text) > 0


def test_trace_times_are_simulated_ms_and_the_end_record_closes_it():
    data, text = run(_cfg("gate", "none"), workload(30, seed=1), traced=True)
    objs = [json.loads(x) for x in text.splitlines()]
    ts = [o["t"] for o in objs if "t" in o]
    assert ts == sorted(ts) and ts[-1] <= data.sim_ms
    assert objs[-1] == {"kind": "end", "steps": data.protocol_steps}
