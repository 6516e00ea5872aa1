"""One rank-agreement point: poll -> optional local gate -> collective -> act.

Every place where SGLang's TP ranks must agree (a queue's poll MIN, the checksum drop
set's MAX, the request broadcast, a forward's all-reduce) is a ``Point``: a
configuration of the functions below, never a copy of them. They are written per (rank,
request) over the kernel's ``Ops`` algebra, so the spec (model/spec/iteration.py, on
ints) and the Z3 encoding (model/encoding/iteration.py, on terms) run the same code; the
caller supplies the only thing that differs, the reduction over ranks (a Python
``min`` there, the MIN's axioms here).

A request's place on a rank is one stage number (``Stage`` on decode, ``PStage`` in
model/spec/iteration.py on prefill). A point holds the requests
in its ``members`` stages; each rank contributes, per member, its local value (the
iteration's input named ``input``), capped at ``gate_value`` where the rank's gate flag
(input ``gate``) is set; the collective reduces over the ranks that hold the request;
each member then moves to ``moves[value]`` (absent: it stays), unless the reduced value
is ``veto_value`` and the rank's veto flag (input ``veto``) keeps it: a rank-local
decision after the collective (SGLang's ``continue``s in ``pop_transferred``). A point
with a ``halt`` walks its members in queue order (the request order) and stops at the
first whose value is ``halt`` (and, where the point has a veto, which the veto keeps):
every later member stays where it is (SGLang's FIFO ``break``s in ``pop_preallocated``
and 0.5.12's ``pop_bootstrapped``). Whether an earlier member halted is a fold over
requests, which the caller supplies as it supplies the reduction over ranks. Where a
queue's poll covers more than the requests it acts on (a PP stage's second MIN polls its
whole queue and pops only the checked rids), ``moving`` names the member stages that move.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any

from model.spec.kernel import Ops


class Stage(IntEnum):
    ABSENT = 0       # not received yet
    PENDING = 1      # received (broadcast), prefill dp rank not resolved here yet
    PREALLOC = 2     # in DecodePreallocQueue, handshake under way
    READY = 3        # in DecodePreallocQueue, WaitingForInput: may be admitted
    TRANSFER = 4     # in DecodeTransferQueue
    PREBUILT = 5     # transferred, in the next prebuilt batch (checksum not verified)
    RUNNING = 6      # in the running batch
    GONE = 7         # finished, aborted or dropped
    FAILED = 8       # the transfer MIN said Failed; whether this rank holds its slot comes next
    HELD = 9         # failed, its KV slot held for deferred release (#35049)
    HELD_HOST = 10   # failed, held, host-staged destination (0.5.21: released only by a MIN)


STAGES = frozenset(int(s) for s in Stage)


class Op(Enum):
    """The collective a point issues. ``LOCAL``: none, each rank acts on its own value."""
    MIN = "min"
    MAX = "max"
    BROADCAST = "broadcast"     # from rank 0: every rank acts on rank 0's value
    ALL_REDUCE = "all_reduce"   # the forward's: outputs identical on every rank (rank 0's)
    LOCAL = "local"


class Across(Enum):
    """Which ranks a point's value comes from when TP groups stand in PP stages
    (model/spec/pipeline.py); one TP group alone: always ``GROUP``."""
    GROUP = "group"   # this stage's TP group only
    ALL = "all"       # one collective over every (stage, rank)
    RING = "ring"     # each stage's own; the PP ring then keeps the moves every stage makes (by rid)
    PP0 = "pp0"       # PP stage 0's, forwarded to the later stages by queue position


class Skip(Enum):
    """When a rank issues the point's collective: ``issues`` is "some member triggers"."""
    NEVER = "never"                     # always issued
    EMPTY = "empty"                     # not when this rank holds no member
    ALL_READY = "all-ready"             # nor when every member is READY (0.5.12)
    ALL_READY_NO_LOCAL_FAIL = "all-ready-no-local-fail"   # ... and none polls Failed here (0.5.13-0.5.19)
    LOCAL_FLAG = "local-flag"           # only where a member's local value is 1 here (a rank-local test)


@dataclass(frozen=True)
class Point:
    name: str
    op: Op
    members: tuple[int, ...] = ()               # stages (the decode's Stage, or prefill's)
    moves: tuple[tuple[int, int], ...] = ()     # reduced value -> next stage
    skip: Skip = Skip.NEVER
    input: str | None = None            # the local value's input (None: 0)
    gate: str | None = None             # a rank-local flag that caps the contribution...
    gate_value: int = 0                 # ... at this value, before the collective
    veto: str | None = None             # a rank-local flag that keeps a member after it...
    veto_value: int = 0                 # ... when the reduced value is this one
    shape: int | None = None            # a fixed vector length (else: the member count)
    across: Across = Across.GROUP       # PP: whose values the stages act on
    halt: int | None = None             # a FIFO ``break``: the first member with this value stops the walk
    moving: tuple[int, ...] | None = None   # the members that move (None: all; the rest only poll)
    union: tuple[int, ...] = ()         # RING: values one stage's list carries to all (a union: bad rids)

    @property
    def collective(self) -> bool:
        return self.op is not Op.LOCAL

    @property
    def neutral(self) -> int:
        """What a rank that does not hold a request adds to its reduction."""
        return 1 << 16 if self.op is Op.MIN else -1


def any_of(ops: Ops, *xs: Any) -> Any:
    return ops.not_(ops.and_(*[ops.not_(x) for x in xs]))


def is_member(p: Point, stage: Any, ops: Ops) -> Any:
    if not p.members:
        return ops.false
    return any_of(ops, *[ops.eq(stage, int(m)) for m in p.members])


def triggers(p: Point, stage: Any, local: Any, ops: Ops) -> Any:
    """This member makes its rank issue the collective (``issues``: some member triggers)."""
    member = is_member(p, stage, ops)
    if p.skip is Skip.ALL_READY:
        return ops.and_(member, ops.not_(ops.eq(stage, int(Stage.READY))))
    if p.skip is Skip.LOCAL_FLAG:
        return ops.and_(member, ops.eq(local, 1))
    if p.skip is Skip.ALL_READY_NO_LOCAL_FAIL:
        return ops.and_(member, any_of(ops, ops.not_(ops.eq(stage, int(Stage.READY))),
                                       ops.eq(local, 0)))
    return member


def issues(p: Point, some_trigger: Any, ops: Ops) -> Any:
    """Whether a rank issues the collective, given whether some member triggers there."""
    if not p.collective:
        return ops.false
    return ops.not_(ops.false) if p.skip is Skip.NEVER else some_trigger


def acts(p: Point, issued: Any, ops: Ops) -> Any:
    """A rank acts on the point's members: always where it is local, else only where it
    issued the collective (a rank that returns early leaves its queue alone)."""
    return issued if p.collective else ops.not_(ops.false)


def contribution(p: Point, issued: Any, stage: Any, local: Any, gate: Any, ops: Ops) -> Any:
    """What this rank puts into the reduction for one request (neutral unless it holds it
    and issued the collective)."""
    value = local
    if p.gate is not None:
        capped = ops.ite(ops.ge(local, p.gate_value), p.gate_value, local)
        value = ops.ite(ops.eq(gate, 1), capped, local)
    return ops.ite(ops.and_(acts(p, issued, ops), is_member(p, stage, ops)), value, p.neutral)


def halts(p: Point, issued: Any, stage: Any, reduced: Any, veto: Any, ops: Ops) -> Any:
    """This member stops the rank's walk of its queue: the later members stay."""
    if p.halt is None:
        return ops.false
    stop = ops.and_(acts(p, issued, ops), is_member(p, stage, ops), ops.eq(reduced, p.halt))
    return ops.and_(stop, ops.eq(veto, 1)) if p.veto is not None else stop


def next_stage(p: Point, issued: Any, stage: Any, reduced: Any, veto: Any, ops: Ops,
               halted: Any = None) -> Any:
    """Where one request goes on this rank once the reduced value is known (``halted``:
    an earlier member of this rank's queue halted the walk, so it stays)."""
    out = stage
    for value, target in p.moves:
        out = ops.ite(ops.eq(reduced, value), int(target), out)
    if p.veto is not None:
        out = ops.ite(ops.and_(ops.eq(veto, 1), ops.eq(reduced, p.veto_value)), stage, out)
    if halted is not None:
        out = ops.ite(halted, stage, out)
    held = is_member(p, stage, ops)
    if p.moving is not None:
        held = ops.and_(held, any_of(ops, *[ops.eq(stage, int(m)) for m in p.moving]))
    return ops.ite(ops.and_(acts(p, issued, ops), held), out, stage)
