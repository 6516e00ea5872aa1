"""Spec traces for the impl tests: random walks of enabled events through the spec."""
from __future__ import annotations

import io
import random

from model.spec import Enqueue, Fail, Step, apply, get_variant, initial_state
from model.spec.machine import enabled
from model.spec.trace import TraceWriter


def walk(variant: str, ranks: int, slots: int, length: int, seed: int,
         timeout_steps: int | None = None, fail_rate: float = 0.1) -> str:
    """A trace of ``length`` random enabled events (steps twice as likely), ending
    early if the ranks hang; rooms are distinct, non-zero 64-bit values."""
    v = get_variant(variant, timeout_steps)
    state = initial_state(v, ranks, slots)
    rng = random.Random(seed)
    fp = io.StringIO()
    w = TraceWriter(fp, variant, ranks, slots, f"walk seed={seed}", v.timeout_steps)
    n = 0
    for _ in range(length):
        candidate = Enqueue(n, rng.randrange(1, 2**64), rng.randrange(-2**31, 2**31))
        events = enabled(state, [candidate])
        if not events:
            break
        # failures are rare in practice and would otherwise abort almost everything
        events = [e for e in events if not isinstance(e, Fail) or rng.random() < fail_rate]
        ev = rng.choice(events + [Step()])
        if isinstance(ev, Enqueue):
            n += 1
        rec = apply(state, ev)
        w.step(rec) if rec is not None else w.event(ev)
        if state.hung is not None:
            break
    w.end(state.steps)
    return fp.getvalue()


DIVERGENCE = """\
{"kind":"header","format":"pdgate-trace","version":1,"variant":"ungated","ranks":RANKS,"slots":2,"timeout_steps":null,"source":"hand"}
{"kind":"enqueue","req":0,"room":77,"payload":5}
KV_DONE
{"kind":"land","rank":0,"req":0,"field":"payload"}
{"kind":"land","rank":0,"req":0,"field":"room"}
{"kind":"step"}
{"kind":"step"}
{"kind":"end","steps":1}
"""


def divergence(ranks: int) -> str:
    """docs/trace-format.md's example: Success everywhere, the row landed on rank 0 only;
    ungated rank 0 commits while the others keep the request, and the next MIN breaks."""
    kv = "\n".join(f'{{"kind":"kv_done","rank":{k},"req":0}}' for k in range(ranks))
    return DIVERGENCE.replace("RANKS", str(ranks)).replace("KV_DONE", kv)
