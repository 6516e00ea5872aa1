"""``model.spec.machine.forget`` (the simulator's memory bound) refuses live requests,
and forgetting changes nothing the simulator reports or writes."""
import pytest

import sim.engine as engine
from model.spec import Enqueue, EventNotEnabled, KvDone, Land, Step, apply, forget, get_variant, initial_state
from model.spec.events import PAYLOAD, ROOM
from model.spec.invariants import check_invariants
from sim.results import summarize
from tests.sim.helpers import config, run, workload


def test_forget_refuses_live_requests_and_drops_finished_ones():
    s = initial_state(get_variant("gate"), 2, 2)
    apply(s, Enqueue(1, 11, 5))
    with pytest.raises(EventNotEnabled, match="still queued"):
        forget(s, 1)
    for k in (0, 1):
        apply(s, KvDone(k, 1))
        apply(s, Land(k, 1, PAYLOAD))
        apply(s, Land(k, 1, ROOM))
    apply(s, Step())
    forget(s, 1)
    assert 1 not in s.requests and all(1 not in rs.outcomes for rs in s.ranks)
    assert check_invariants(s) == []
    with pytest.raises(EventNotEnabled, match="not known"):
        forget(s, 1)


@pytest.mark.source_modules
@pytest.mark.parametrize("variant,faults", [("gate", {}), ("strict", dict(fail_prob=0.2, late_write="exp:50"))])
def test_forgetting_does_not_change_results_or_traces(monkeypatch, variant, faults):
    cfg = config(variant=variant, ranks=4, seed=5, **faults)
    wl = workload(400, rate=30.0, seed=5)
    monkeypatch.setattr(engine, "FORGET_BATCH", 1)
    eager, trace_eager = run(cfg, wl, traced=True)
    monkeypatch.setattr(engine, "FORGET_BATCH", 10**9)
    never, trace_never = run(cfg, wl, traced=True)
    assert trace_eager == trace_never
    assert summarize(eager, False) == summarize(never, False)
