"""``enqueue`` / ``kv_done`` / ``fail`` / ``land`` on plain fields are ``apply`` of Enqueue /
KvDone / Fail / Land without the event object: the same transition and the same refusals."""
import random

import pytest

from model.spec.events import PAYLOAD, ROOM, Enqueue, Fail, KvDone, Land
from model.spec.machine import EventNotEnabled, apply, enqueue, fail, kv_done, land
from model.spec.state import initial_state
from model.spec.variants import ABLATIONS, VARIANTS

from .walks import random_walk

ALL = [*VARIANTS.values(), *ABLATIONS.values()]


def _by_fields(state, ev) -> None:
    if isinstance(ev, Enqueue):
        enqueue(state, ev.req, ev.room, ev.payload)
    elif isinstance(ev, Land):
        land(state, ev.rank, ev.req, ev.field)
    else:
        (kv_done if isinstance(ev, KvDone) else fail)(state, ev.rank, ev.req)


def _outcome(fn):
    try:
        fn()
    except EventNotEnabled as exc:
        return str(exc)
    return None


def test_field_forms_match_apply_on_random_walks_including_refused_events():
    rng = random.Random(5)
    applied = refused = 0
    for _ in range(200):
        by_event = initial_state(rng.choice(ALL), rng.randint(1, 3), rng.randint(1, 3))
        by_fields = by_event.copy()
        for ev, nxt in random_walk(rng, by_event, 50):
            if not isinstance(ev, (Enqueue, KvDone, Fail, Land)):
                apply(by_event, ev)
                apply(by_fields, ev)
            else:
                applied += 1
                _by_fields(by_fields, ev)
                apply(by_event, ev)
            # a random, often refused, environment event: same message, state untouched
            k, r = rng.randint(0, 3), rng.randint(0, nxt + 1)
            odd = rng.choice([KvDone(k, r), Fail(k, r), Land(k, r, rng.choice([ROOM, PAYLOAD, "x"])),
                              Enqueue(r, rng.choice([0, 5]), 1)])
            msg = _outcome(lambda: apply(by_event, odd))
            assert _outcome(lambda: _by_fields(by_fields, odd)) == msg
            refused += msg is not None
            assert by_event.key() == by_fields.key()
    assert applied > 1000 and refused > 1000


def test_field_forms_refuse_a_hung_state_like_apply():
    state = initial_state(VARIANTS["ungated"], 2, 1)
    state.hung = (1, 0)
    for fn in (lambda: kv_done(state, 0, 0), lambda: fail(state, 0, 0),
               lambda: land(state, 0, 0, ROOM), lambda: enqueue(state, 0, 5, 1)):
        with pytest.raises(EventNotEnabled, match="hung in a mismatched collective"):
            fn()
