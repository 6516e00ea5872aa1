"""``enqueue`` / ``kv_done`` / ``fail`` / ``land`` on plain fields are ``apply`` of Enqueue /
KvDone / Fail / Land without the event object: the same transition and the same refusals."""
import random

import pytest

from model.spec.events import PAYLOAD, ROOM, Enqueue, Fail, KvDone, Land
from model.spec.machine import EventNotEnabled, enqueue, fail, kv_done, land
from model.spec.state import initial_state
from model.spec.variants import ABLATIONS, VARIANTS

from .walks import compare_with_apply

ALL = [*VARIANTS.values(), *ABLATIONS.values()]


def _by_fields(state, ev) -> None:
    if isinstance(ev, Enqueue):
        enqueue(state, ev.req, ev.room, ev.payload)
    elif isinstance(ev, Land):
        land(state, ev.rank, ev.req, ev.field)
    else:
        (kv_done if isinstance(ev, KvDone) else fail)(state, ev.rank, ev.req)


def _odd(rng: random.Random, ranks: int, nxt: int):
    """A random environment event, often refused (a rank beyond the state's, a bad field)."""
    k, r = rng.randint(0, 3), rng.randint(0, nxt + 1)
    return rng.choice([KvDone(k, r), Fail(k, r), Land(k, r, rng.choice([ROOM, PAYLOAD, "x"])),
                       Enqueue(r, rng.choice([0, 5]), 1)])


def test_field_forms_match_apply_on_random_walks_including_refused_events():
    applied, refused = compare_with_apply(random.Random(5), ALL, _by_fields,
                                          (Enqueue, KvDone, Fail, Land), _odd)
    assert applied > 1000 and refused > 1000


def test_field_forms_refuse_a_hung_state_like_apply():
    state = initial_state(VARIANTS["ungated"], 2, 1)
    state.hung = (1, 0)
    for fn in (lambda: kv_done(state, 0, 0), lambda: fail(state, 0, 0),
               lambda: land(state, 0, 0, ROOM), lambda: enqueue(state, 0, 5, 1)):
        with pytest.raises(EventNotEnabled, match="hung in a mismatched collective"):
            fn()
