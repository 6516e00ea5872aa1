"""TraceWriter and the validator agree: any run of the spec, written as a trace, replays
to the same state; and the first invariant break the validator reports is the one the
run hit first."""
from __future__ import annotations

import io
import json
import random

import pytest

from model.spec.events import Enqueue
from model.spec.invariants import check_invariants
from model.spec.machine import apply, enabled
from model.spec.state import initial_state
from model.spec.trace import TraceWriter
from model.spec.validate import validate
from model.spec.variants import VARIANTS


def fresh(state) -> list[Enqueue]:
    r = len(state.requests)
    return [Enqueue(r, 100 + r, 500 + r)]


def random_trace(variant: str, seed: int, length: int = 40):
    rng = random.Random(seed)
    fp = io.StringIO()
    v = VARIANTS[variant]
    writer = TraceWriter(fp, variant, 3, 2, f"seed {seed}", v.timeout_steps)
    s = initial_state(v, 3, 2)
    first = None
    for _ in range(length):
        events = enabled(s, fresh(s))
        if not events:
            break
        ev = rng.choice(events)
        rec = apply(s, ev)
        if rec is None:
            writer.event(ev, t=float(len(fp.getvalue())))
            continue
        writer.step(rec)
        found = check_invariants(s)
        if found and first is None:
            first = (rec.step, found[0])
            writer.violation(found[0], rec.step)
    writer.end(s.steps)
    return fp.getvalue().splitlines(), s, first


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_random_runs_replay_exactly(variant):
    broke = 0
    for seed in range(25):
        lines, final, first = random_trace(variant, seed)
        result = validate(lines)
        assert result.ok, result.message
        assert result.state.key() == final.key() and result.steps == final.steps
        assert result.first_violation == first
        broke += first is not None
        assert all(json.loads(line)["kind"] for line in lines)
    if variant == "strict":
        assert broke == 0


def test_enqueue_slots_round_trip_and_bad_ones_are_malformed():
    from model.spec.trace import TraceFormatError, parse_record, parse_header
    fp = io.StringIO()
    writer = TraceWriter(fp, "gate", 2, 4, "hand")
    writer.event(Enqueue(0, 9, 1, slots=(3, 0)))
    header_obj, rec = (json.loads(x) for x in fp.getvalue().splitlines())
    header = parse_header(header_obj, 1)
    assert rec["slots"] == [3, 0] and parse_record(rec, 2, header) == Enqueue(0, 9, 1, (3, 0))
    for bad in ([3], [3, 4], [3, True], "3,0", [3, -1]):
        with pytest.raises(TraceFormatError, match="'slots' must name one slot in 0..3"):
            parse_record({**rec, "slots": bad}, 2, header)
