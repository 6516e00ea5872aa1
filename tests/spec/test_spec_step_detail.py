"""``apply(state, Step(), detail=False)`` is the same transition as the full step; it
only returns a smaller record (StepPops): the per-rank pops, the step number, the hang."""
import random

from model.spec.events import Step
from model.spec.machine import StepPops, StepRecord, apply
from model.spec.state import initial_state
from model.spec.variants import ABLATIONS, VARIANTS, get_variant

from .walks import random_walk

ALL = [*VARIANTS.values(), *ABLATIONS.values(), get_variant("strict", 1)]


def test_light_step_matches_the_full_step_on_random_walks():
    rng = random.Random(11)
    pops = hangs = 0
    for trial in range(300):
        # every other walk ungated: the variant whose queues can diverge and hang the MIN
        v = VARIANTS["ungated"] if trial % 2 else rng.choice(ALL)
        full = initial_state(v, rng.randint(1, 3), rng.randint(1, 3))
        light = full.copy()
        for ev, _ in random_walk(rng, full, 60):
            rec, small = apply(full, ev), apply(light, ev, detail=False)
            if isinstance(ev, Step):
                assert isinstance(rec, StepRecord) and isinstance(small, StepPops)
                assert small == StepPops(rec.step, rec.popped, rec.hang)
                assert len(small.popped) == full.n_ranks
                pops += any(small.popped)
                hangs += small.hang is not None
            else:
                assert rec is None and small is None
            assert full.key() == light.key() and full.steps == light.steps
    assert pops > 100 and hangs >= 5      # the walks exercise pops and mismatched MINs
