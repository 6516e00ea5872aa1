"""The simulator's timeouts are seconds, converted to agreed step counts as a deployed
worker converts them; the defaults never abort a request whose metadata is merely slow."""
import numpy as np

from model.spec.kernel import Decision
from model.spec.timeouts import steps_for
from sim.config import SimConfig
from sim.engine import resolve_variant

from tests.sim.helpers import config, one_request, run


def test_seconds_become_the_deployed_step_counts():
    assert resolve_variant(SimConfig(variant="strict")).timeout_steps == steps_for(30.0) == 30_000
    assert resolve_variant(SimConfig(variant="strict", gate_timeout_s=2.0,
                                     timeout_step_floor_ms=10.0)).timeout_steps == 200
    assert resolve_variant(SimConfig(variant="strict", timeout_steps=7)).timeout_steps == 7
    for name in ("deferred", "deferred-local"):
        assert resolve_variant(SimConfig(variant=name)).release_timeout_steps == 30_000
        assert resolve_variant(SimConfig(variant=name, release_timeout_s=0.5)).release_timeout_steps == 500
    assert resolve_variant(SimConfig(variant="gate")).timeout_steps is None


def test_slow_metadata_commits_by_default_and_aborts_past_a_short_timeout():
    # every rank's metadata row lands 5 s after its KV: thousands of gate-held steps
    slow, _ = run(config(variant="strict", ranks=2, lag="const:5000"), one_request())
    assert list(slow.outcome) == [int(Decision.COMMIT)]
    assert slow.commit_ms[0] - slow.kv_all_ms[0] >= 5000
    short, _ = run(config(variant="strict", ranks=2, lag="const:5000", gate_timeout_s=1.0),
                   one_request())
    assert list(short.outcome) == [int(Decision.ABORT_FAILED)] and np.isnan(short.commit_ms[0])
