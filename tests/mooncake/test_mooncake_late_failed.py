"""A Failed after Success for a request the gate still holds is honoured (the spec's
rule, model.spec.machine._latch): the spec allows it, the real impl on gloo ranks
replays it step for step, and both abort the request on every rank in that step."""
from __future__ import annotations

import io

from impl.replay import load_script, replay_scripts
from model.spec.events import PAYLOAD, ROOM, Enqueue, Fail, KvDone, Land, Step
from model.spec.kernel import Decision
from model.spec.machine import apply
from model.spec.state import initial_state
from model.spec.trace import TraceWriter
from model.spec.validate import validate
from model.spec.variants import get_variant

# Both ranks receive Success; only rank 0's row lands, so rank 1's gate holds. Then
# rank 1 learns the prefill died (a late Failed): the next step aborts on both ranks.
EVENTS = [Enqueue(0, 91, 7), KvDone(0, 0), KvDone(1, 0), Land(0, 0, PAYLOAD), Land(0, 0, ROOM),
          Step(), Fail(1, 0), Step()]


def late_failed_trace(variant: str) -> tuple[str, list]:
    v = get_variant(variant, 50) if variant == "strict" else get_variant(variant)
    fp = io.StringIO()
    writer = TraceWriter(fp, v.name, 2, 2, "test", v.timeout_steps)
    state, records = initial_state(v, 2, 2), []
    for ev in EVENTS:
        rec = apply(state, ev)
        writer.event(ev) if rec is None else (writer.step(rec), records.append(rec))
    writer.end(state.steps)
    return fp.getvalue(), records


def test_spec_and_impl_abort_at_once_on_a_late_failed():
    texts = {}
    for variant in ("strict", "gate"):
        text, records = late_failed_trace(variant)
        held, failed = records
        assert held.ranks[1].local == (4,) and held.ranks[1].gated == (3,) and not held.popped[0]
        assert [[p[:2] for p in rank] for rank in failed.popped] == [[(0, int(Decision.ABORT_FAILED))]] * 2
        assert validate(text.splitlines()).ok
        texts[variant] = text
    results = replay_scripts([load_script(t.splitlines()) for t in texts.values()], 2,
                             collective_timeout_s=10, deadline_s=90)
    for r in results:
        assert r.error is None and r.validation.ok, (r.error, r.validation.message)
        assert '"abort_failed"' in r.trace.splitlines()[-2]       # the impl's last step
