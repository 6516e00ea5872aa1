"""The simulator on the packed state (model/spec/packed.py) reports exactly what it
reports on machine.py's own state: every per-request result, count and divergence, for
the packed variants under faults that reach late writes into reused slots,
quarantines, fences, timeouts and divergences."""
import pytest

import model.spec.packed as packed
from tests.sim.digests import digest
from tests.sim.helpers import config, workload

CASES = [
    ("gate", dict(ranks=8, fail_prob=0.1, lost_metadata_prob=0.05, late_write="exp:30")),
    ("gate", dict(ranks=4, fail_prob=0.3, late_write="exp:50", slots=2, request_pool=2)),
    ("gate-noclear", dict(ranks=4, fail_prob=0.2, late_write="exp:100", slots=3, request_pool=3,
                          lag="exp:2")),
    ("ungated", dict(ranks=4, lag="exp:3")),
    ("strict", dict(ranks=8, fail_prob=0.1, lost_metadata_prob=0.1, late_write="exp:20",
                    lag="exp:4")),
    ("strict", dict(ranks=2, forward="exp:10", idle_step="uniform:0.5,2", kv_jitter="exp:0.2",
                    fail_prob=0.3, slots=3, request_pool=3)),
]


@pytest.mark.source_modules
@pytest.mark.parametrize("variant,faults", CASES)
def test_packed_and_machine_state_give_the_same_run(monkeypatch, variant, faults):
    cfg, wl = config(variant=variant, seed=3, **faults), workload(300, rate=40.0, seed=3)
    on_packed = digest(cfg, wl)
    monkeypatch.setattr(packed, "packs", lambda v: False)     # machine.py's form throughout
    assert digest(cfg, wl) == on_packed


def test_the_cases_reach_commits_aborts_and_divergences():
    """The cases above are not all quiet: they commit, abort, and some run diverges."""
    found = aborted = committed = 0
    for variant, faults in CASES:
        got = digest(config(variant=variant, seed=3, **faults), workload(300, rate=40.0, seed=3))
        found += got["divergence"] is not None
        committed += 1 in got["outcomes"]
        aborted += max(got["outcomes"]) > 1
    assert found >= 1 and committed >= 4 and aborted >= 3, (found, committed, aborted)


@pytest.mark.source_modules
def test_a_packed_state_blind_to_late_writes_changes_the_runs(monkeypatch):
    """The comparison can fail: a packed form that misses late writes into reused slots
    (and so trusts the tenant's own rows) misses divergences the runs above find."""
    honest = [digest(config(variant=v, seed=3, **f), workload(300, rate=40.0, seed=3))
              for v, f in CASES]
    monkeypatch.setattr(packed.PackedState, "_mark_tenant", lambda self, k, slot, bit: None)
    blind = [digest(config(variant=v, seed=3, **f), workload(300, rate=40.0, seed=3))
             for v, f in CASES]
    assert sum(a != b for a, b in zip(honest, blind)) >= 2
