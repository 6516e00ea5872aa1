"""The per-rank, per-request decisions: the gate before the MIN and the pop after it.

Written once over a tiny algebra (``Ops``) so that the same definitions run on Python
ints (the spec, the simulator, the impl's reference) and on Z3 terms (model.encoding
passes its own Ops). That is what keeps the Z3 encoding from drifting from the spec.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from typing import Any, Callable

from model.spec.kvpoll import KVPoll
from model.spec.variants import GateRule, Variant


class Decision(IntEnum):
    KEEP = 0
    COMMIT = 1
    ABORT_FAILED = 2        # the MIN said Failed (this rank or another failed or timed out)
    ABORT_ROOM_ZERO = 3     # MIN Success but the local room reads 0 (gated variants)
    ABORT_ROOM_MISMATCH = 4  # MIN Success but the local room is another request's

    @property
    def leaves(self) -> bool:
        return self is not Decision.KEEP

    @property
    def outcome(self) -> str | None:
        """'commit', 'abort' or None (kept): what the invariants compare across ranks."""
        if self is Decision.KEEP:
            return None
        return "commit" if self is Decision.COMMIT else "abort"


@dataclass(frozen=True)
class Ops:
    """The operations the kernel needs; Python's by default."""
    ite: Callable[[Any, Any, Any], Any]
    and_: Callable[..., Any]
    not_: Callable[[Any], Any]
    eq: Callable[[Any, Any], Any]
    ge: Callable[[Any, Any], Any]
    false: Any


PY = Ops(
    ite=lambda c, a, b: a if c else b,
    and_=lambda *xs: all(xs),
    not_=lambda x: not x,
    eq=lambda a, b: a == b,
    ge=lambda a, b: a >= b,
    false=False,
)

SUCCESS, TRANSFERRING, FAILED = int(KVPoll.Success), int(KVPoll.Transferring), int(KVPoll.Failed)


def gate_holds(v: Variant, room_seen: Any, room_expected: Any, ops: Ops = PY) -> Any:
    """True while the gate must turn this rank's Success into Transferring."""
    if v.gate is GateRule.NONE:
        return ops.false
    if v.gate is GateRule.NONZERO:
        return ops.eq(room_seen, 0)
    return ops.not_(ops.eq(room_seen, room_expected))


def gated_poll(v: Variant, local: Any, room_seen: Any, room_expected: Any, age: Any,
               ops: Ops = PY) -> Any:
    """The value this rank contributes to the MIN for one request.

    ``local`` is the receiver's poll, ``room_seen`` the room this rank reads in the
    request's slot, ``age`` the protocol steps the request has been polled before.
    """
    out = ops.ite(ops.and_(ops.eq(local, SUCCESS), gate_holds(v, room_seen, room_expected, ops)),
                  TRANSFERRING, local)
    if v.fail_zero_room:
        out = ops.ite(ops.eq(room_expected, 0), FAILED, out)
    if v.timeout_steps is not None:
        out = ops.ite(ops.and_(ops.not_(ops.eq(out, SUCCESS)), ops.ge(age, v.timeout_steps)),
                      FAILED, out)
    return out


def pop_decision(v: Variant, reduced: Any, room_seen: Any, room_expected: Any,
                 ops: Ops = PY) -> Any:
    """What this rank does with one request once the MIN is known (a Decision value)."""
    on_zero = Decision.KEEP if v.keep_on_room_zero else Decision.ABORT_ROOM_ZERO
    on_success = ops.ite(
        ops.eq(room_seen, 0), int(on_zero),
        ops.ite(ops.eq(room_seen, room_expected), int(Decision.COMMIT),
                int(Decision.ABORT_ROOM_MISMATCH)))
    return ops.ite(ops.eq(reduced, FAILED), int(Decision.ABORT_FAILED),
                   ops.ite(ops.eq(reduced, SUCCESS), on_success, int(Decision.KEEP)))


# Fast path for Python ints (used by machine.py). gated_poll and pop_decision see the
# rooms and the age only through the comparisons in ``compare_index`` (and age >=
# timeout), so on ints each is a table over (poll value, comparisons), filled by
# evaluating the definitions above at one representative per feasible combination.
def compare_index(room_seen: int, room_expected: int) -> int:
    """Bit 0: seen == 0; bit 1: seen == expected; bit 2: expected == 0."""
    return (room_seen == 0) | (room_seen == room_expected) << 1 | (room_expected == 0) << 2


_REPRESENTATIVES = [(0, 5), (5, 5), (9, 5), (0, 0), (7, 0)]   # (room_seen, room_expected)


@lru_cache(maxsize=None)
def gate_table(v: Variant) -> tuple[int | None, ...]:
    """gate_table(v)[poll * 16 + 8 * timed_out + compare_index(...)] == gated_poll(...)."""
    table: list[int | None] = [None] * (5 * 16)
    for poll in range(5):
        for timed in (0, 1):
            age = (v.timeout_steps or 0) if timed else 0
            for seen, expected in _REPRESENTATIVES:
                table[poll * 16 + 8 * timed + compare_index(seen, expected)] = gated_poll(
                    v, poll, seen, expected, age)
    return tuple(table)


@lru_cache(maxsize=None)
def pop_table(v: Variant) -> tuple[Decision | None, ...]:
    """pop_table(v)[reduced * 8 + compare_index(...)] == Decision(pop_decision(...))."""
    table: list[Decision | None] = [None] * (5 * 8)
    for reduced in range(5):
        for seen, expected in _REPRESENTATIVES:
            table[reduced * 8 + compare_index(seen, expected)] = Decision(
                pop_decision(v, reduced, seen, expected))
    return tuple(table)


@lru_cache(maxsize=None)
def keep_regardless(v: Variant) -> tuple[bool, ...]:
    """keep_regardless(v)[reduced]: pop_table says KEEP for every room combination."""
    table = pop_table(v)
    return tuple(all(table[reduced * 8 + compare_index(seen, expected)] is Decision.KEEP
                     for seen, expected in _REPRESENTATIVES) for reduced in range(5))
