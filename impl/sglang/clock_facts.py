"""Where each SGLang release puts its wall-clock timeout verdicts, read from its cached
wheel with ``ast`` (as impl/sglang/iteration_facts.py does for the decode iteration) and
compared with the ``clocks-*`` variant that models it (model/spec/clocks.py). Nothing is
imported from the wheel and nothing downloads.

The facts: the waiting-queue timeout's abort (``SGLANG_REQ_WAITING_TIMEOUT``: each rank
acts on its own clock, #27221, or attn-TP rank 0 decides and its aborts ride the request
broadcast, 0.5.21 on); the poll states in which the Mooncake receiver's own poll times
out (WaitingForInput only: Transferring never does, #31800); and a held slot's deferred
release (#35049, #38961): what frees it (prefill's drain ack, this rank's deadline) and
whether that verdict reaches the other ranks through a collective.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Callable

from impl.sglang.iteration_facts import DECODE, SCHEDULER, _functions, _text, differences
from impl.sglang.wheels import open_wheel
from model.spec.agreement import Op
from model.spec.clocks import CLOCK_INPUTS, CLOCK_VARIANTS, ClockVariant, CStage
from model.spec.kvpoll import KVPoll

MOONCAKE = "sglang.srt.disaggregation.mooncake.conn"
COMMON = "sglang.srt.disaggregation.common.conn"
RECEIVER = "MooncakeKVReceiver"
# The variant that models each release, 0.5.12 to 0.5.23 (docs/PROOFS.md, "Per-rank
# clocks"): rank 0's broadcast abort came in 0.5.20, the release's MIN in 0.5.23.
MODELLED_BY = {**{f"0.5.{n}": "clocks-0.5.12" for n in range(12, 19)}, "0.5.19": "clocks-0.5.19",
               **{f"0.5.{n}": "clocks-0.5.21" for n in range(20, 23)}, "0.5.23": "clocks-0.5.23"}
# the receiver states the model's transfer-queue poll takes (the others are outside it:
# 0.5.23's Bootstrapping timeout is the prefill wait of the non-early allocation policy)
POLLED = tuple(KVPoll(x).name for x in CLOCK_INPUTS["poll"])


@dataclass(frozen=True)
class ClockMechanisms:
    abort: Op | None               # the waiting timeout's abort: LOCAL (each rank's clock) or BROADCAST (rank 0's)
    receiver_times: tuple[str, ...]  # the receiver's own poll times out in these states (of POLLED)
    release: Op | None             # a held device slot's verdict: per rank (LOCAL) or MIN; None: no deferred release
    release_on: tuple[str, ...]    # what frees a held slot: "ack" (prefill's drain), "deadline" (this rank's clock)


# -- the scheduler's abort ------------------------------------------------------------------
def _abort(scheduler: str) -> Op | None:
    """The function reading SGLANG_REQ_WAITING_TIMEOUT is either called by every rank and
    acts there (LOCAL), or its result is passed as ``local_reqs`` to ``recv_requests``,
    the request broadcast from rank 0 (BROADCAST)."""
    fns = _functions(ast.parse(scheduler))
    timed = next((f.name for f in fns.values() if "SGLANG_REQ_WAITING_TIMEOUT" in _text(f)), None)
    if timed is None:
        return None
    called = False
    for caller in fns.values():
        results = {t.id for n in ast.walk(caller) if isinstance(n, ast.Assign)
                   and _text(n.value) == f"self.{timed}()" for t in n.targets if isinstance(t, ast.Name)}
        for call in (n for n in ast.walk(caller) if isinstance(n, ast.Call)):
            called |= _text(call.func) == f"self.{timed}"
            if _text(call.func).endswith("recv_requests") and any(
                    k.arg == "local_reqs" and isinstance(k.value, ast.Name) and k.value.id in results
                    for k in call.keywords):
                return Op.BROADCAST
    return Op.LOCAL if called else None


# -- the receiver's timeout -----------------------------------------------------------------
def _classes(*sources: str) -> dict[str, ast.ClassDef]:
    return {c.name: c for s in sources for c in ast.walk(ast.parse(s)) if isinstance(c, ast.ClassDef)}


def _method_lookup(classes: dict[str, ast.ClassDef], name: str) -> Callable[[str], ast.FunctionDef | None]:
    """A method of class ``name`` by its bases' order (the bases found among ``classes``)."""
    order, todo = [], [name]
    while todo:
        c = classes.get(todo.pop(0))
        if c is not None and c not in order:
            order.append(c)
            todo += [_text(b) for b in c.bases]
    return lambda m: next((f for c in order for f in c.body if isinstance(f, ast.FunctionDef) and f.name == m), None)


def _self_calls(node: ast.AST) -> list[str]:
    return [_text(n.func)[5:] for n in ast.walk(node) if isinstance(n, ast.Call) and _text(n.func).startswith("self.")]


def _reaches(node: ast.AST, method: Callable[[str], Any], marker: str, depth: int = 3) -> bool:
    """``marker`` is in ``node`` or in a ``self.`` method it calls (``depth`` deep)."""
    if marker in _text(node):
        return True
    return depth > 0 and any((m := method(name)) is not None and _reaches(m, method, marker, depth - 1)
                             for name in _self_calls(node))


def _status_tests(test: ast.AST) -> list[str]:
    """The KVPoll states a test compares ``status`` with (``==`` or ``in``)."""
    out = []
    for c in (n for n in ast.walk(test) if isinstance(n, ast.Compare) and _text(n.left) == "status"):
        out += [a.attr for x in c.comparators for a in ast.walk(x)
                if isinstance(a, ast.Attribute) and _text(a.value) == "KVPoll"]
    return out


def receiver_timeout_states(mooncake: str, common: str) -> set[str]:
    """The states in which the receiver's ``poll`` (and the methods it calls) runs a
    branch that reaches ``waiting_timeout``."""
    method = _method_lookup(_classes(common, mooncake), RECEIVER)
    poll = method("poll")
    bodies = [poll] + [m for name in _self_calls(poll) if (m := method(name)) is not None] if poll else []
    return {s for fn in bodies for node in ast.walk(fn) if isinstance(node, ast.If)
            and any(_reaches(b, method, "waiting_timeout") for b in node.body) for s in _status_tests(node.test)}


# -- the deferred release -------------------------------------------------------------------
def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _deadline_test(node: ast.AST) -> bool:
    return any(isinstance(c, ast.Compare) and "deadline" in _names(c) for c in ast.walk(node))


def _tainted(fn: ast.FunctionDef, seed: Callable[[ast.AST], bool]) -> set[str]:
    """The names a value ``seed`` marks flows into: assigned from it, or appended to a list."""
    out: set[str] = set()
    while True:
        before = len(out)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and (seed(node.value) or _names(node.value) & out):
                out |= {n for t in node.targets for n in _names(t)}
            elif isinstance(node, ast.Call) and _text(node.func).endswith(".append") and \
                    any(seed(a) or _names(a) & out for a in node.args):
                out |= _names(node.func.value)
        if len(out) == before:
            return out


def _release(decode: str) -> tuple[Op | None, tuple[str, ...]]:
    """``resolve_deferred_releases``: a device hold's deadline verdict (on this rank's
    clock) reduced by a MIN with the other ranks', or acted on here."""
    fn = _functions(ast.parse(decode)).get("resolve_deferred_releases")
    if fn is None:
        return None, ()
    on = tuple(x for x, found in (("ack", "is_abort_release_safe" in _text(fn)), ("deadline", _deadline_test(fn)))
               if found)
    tainted = _tainted(fn, _deadline_test)
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        args = [*call.args, *(k.value for k in call.keywords)]
        if "all_reduce" in _text(call.func) and any(_names(a) & tainted for a in args):
            return (Op.MIN if "ReduceOp.MIN" in _text(call) else Op.MAX), on
    return Op.LOCAL, on


def mechanisms_of(scheduler: str, decode: str, mooncake: str, common: str) -> ClockMechanisms:
    states = receiver_timeout_states(mooncake, common)
    return ClockMechanisms(_abort(scheduler), tuple(s for s in POLLED if s in states), *_release(decode))


def mechanisms_modelled(v: ClockVariant) -> ClockMechanisms:
    """The same facts, as the variant places its verdicts."""
    by = {p.name: p for p in v.iter.points}
    wait = next(t for t in v.timers if t.stage == CStage.WAITING)
    times = POLLED if wait.polls is None else tuple(KVPoll(x).name for x in wait.polls)
    release = by.get("deferred_release")
    on = ("ack",) + (("deadline",) if any(t.stage == CStage.HELD for t in v.timers) else ())
    return ClockMechanisms(by["abort_on_timeout"].op, tuple(s for s in POLLED if s in times),
                           release.op if release else None, on if release else ())


def release_mismatches(version: str, source: str | None = None) -> list[str]:
    """What the release's source does that its clocks-* variant does not model (empty:
    none); ``source``: a tree whose modules replace the wheel's (an edited copy)."""
    w = open_wheel(version, source)
    got = mechanisms_of(*(w.source_of(m)[0] for m in (SCHEDULER, DECODE, MOONCAKE, COMMON)))
    name = MODELLED_BY[version]
    return differences(version, name, got, mechanisms_modelled(CLOCK_VARIANTS[name]))
