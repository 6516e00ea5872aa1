"""``pdgate prove --mutants``: the proof suite's self-test.

Each mutant is one small, plausible bug, applied in memory in a fresh worker process
(a replaced function, a changed variant field, a wrapped mechanism: never an edited
file). The worker then runs the obligations of ``pdgate prove`` (those most likely to
notice first, then all the others) and stops at the first whose result differs from
its expectation: that obligation killed the mutant. A mutant no obligation notices
survives, and is a finding (docs/PROOFS.md).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from multiprocessing import get_context
from typing import Any, Callable

import z3

MUTANT_DEADLINE_S = 600.0     # one mutant: the whole suite is far quicker than this


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str                       # kernel, variant, machine, min, encoding, lemmas, iteration, agreement, pipeline, clocks
    bug: str                        # what it gets wrong, in words
    apply: Callable[[], None]       # patches the running process
    first: tuple[str, ...] = ()     # obligation keys (obligation@variant) to try first


# -- patching helpers -------------------------------------------------------------------
def _replace_everywhere(original: Any, new: Any) -> None:
    """Every module of the project that holds ``original`` (``from m import f`` copies it)
    gets ``new`` instead."""
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "")
        if not name.startswith(("model.", "proofs.")):
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                setattr(mod, attr, new)


def _swap(module: str, attr: str, make: Callable[[Any], Any]) -> None:
    original = getattr(sys.modules[module], attr)
    _replace_everywhere(original, make(original))


def _variant(name: str, **changes: Any) -> Callable[[], None]:
    """Change fields of one variant everywhere it is looked up (spec and proofs)."""
    def apply() -> None:
        from model.spec import variants
        from proofs import obligations
        for table in (variants.VARIANTS, variants.ABLATIONS, obligations.ALL_VARIANTS):
            if name in table:
                table[name] = replace(table[name], **changes)
    return apply


def _clear_caches() -> None:
    from model.spec import kernel, machine
    from proofs import obligations
    for f in (kernel.gate_table, kernel.pop_table, kernel.keep_regardless, machine._tables,
              obligations.proved_facts):
        f.cache_clear()


# -- the mutants ----------------------------------------------------------------------------
def _gate_match_as_nonzero() -> None:
    from model.spec import kernel
    from model.spec.variants import GateRule

    def gate_holds(v, room_seen, room_expected, ops=kernel.PY):
        if v.gate is GateRule.NONE:
            return ops.false
        return ops.eq(room_seen, 0)          # MATCH forgotten: any non-zero room passes
    _replace_everywhere(kernel.gate_holds, gate_holds)


def _timeout_off_by_one() -> None:
    from model.spec import kernel
    _swap("model.spec.kernel", "gated_poll", lambda orig: lambda v, local, seen, exp, age, ops=kernel.PY: orig(
        v, local, seen, exp, age, replace(ops, ge=lambda a, b: ops.ge(a, b + 1))))


def _timeout_ignored() -> None:
    from model.spec import kernel
    _swap("model.spec.kernel", "gated_poll", lambda orig: lambda v, local, seen, exp, age, ops=kernel.PY: orig(
        replace(v, timeout_steps=None), local, seen, exp, age, ops))


def _commit_on_mismatch() -> None:
    from model.spec import kernel
    _swap("model.spec.kernel", "pop_decision", lambda orig: lambda v, reduced, seen, exp, ops=kernel.PY: ops.ite(
        ops.eq(orig(v, reduced, seen, exp, ops), int(kernel.Decision.ABORT_ROOM_MISMATCH)),
        int(kernel.Decision.COMMIT), orig(v, reduced, seen, exp, ops)))


def _lifo_free_list() -> None:
    from model.spec import machine

    def enqueue(orig):
        def lifo(state, ev):
            if ev.req not in state.requests and all(rs.free for rs in state.ranks):
                for rs in state.ranks:           # the original pops the front: put the last there
                    rs.free.insert(0, rs.free.pop())
            orig(state, ev)
        return lifo
    machine._ENV_HANDLERS[machine.Enqueue] = enqueue(machine._ENV_HANDLERS[machine.Enqueue])


def _enqueue_skips_full_rank() -> None:
    from model.spec import machine
    from model.spec.state import Request, WAITING

    def enqueue(state, ev):
        if ev.req in state.requests:
            raise machine.EventNotEnabled(f"enqueue: request {ev.req} was already enqueued")
        if not any(rs.free for rs in state.ranks):
            raise machine.EventNotEnabled("enqueue: no rank has a free metadata slot")
        state.requests[ev.req] = Request(ev.room, ev.payload)
        for rs in state.ranks:
            if not rs.free:
                continue                          # the bug: this rank never queues it
            rs.queue.append(ev.req)
            rs.recv[ev.req], rs.age[ev.req] = WAITING, 0
            rs.slot_of[ev.req], rs.landed[ev.req] = rs.free.pop(0), 0
    machine._ENV_HANDLERS[machine.Enqueue] = enqueue


def _fence_keeps_quarantine() -> None:
    from model.spec import machine

    def fence(state, ev):
        rs = machine._rank(state, ev.rank)
        if ev.req not in rs.outcomes:
            raise machine.EventNotEnabled(f"fence: request {ev.req} has not left rank {ev.rank}")
        if ev.req not in rs.landed:
            raise machine.EventNotEnabled(f"fence: request {ev.req} has nothing in flight")
        rs.fenced.add(ev.req)                     # the bug: its quarantined slot stays held
    machine._ENV_HANDLERS[machine.Fence] = fence


def _agreed_fence_waits() -> None:
    from model.spec import machine

    def fence(state, ev):
        rs = machine._rank(state, ev.rank)
        if ev.req not in rs.outcomes:
            raise machine.EventNotEnabled(f"fence: request {ev.req} has not left rank {ev.rank}")
        if ev.req not in rs.landed or ev.req in rs.fenced:
            raise machine.EventNotEnabled(f"fence: request {ev.req} has nothing in flight")
        rs.fenced.add(ev.req)                     # the bug: agreed holds wait for a step
        machine._writes_done(state, rs, ev.req)
    machine._ENV_HANDLERS[machine.Fence] = fence


def _no_clear_on_free() -> None:
    from model.spec import machine

    def free_slots(state, freed):
        for rs, req in freed:
            rs.free.append(rs.slot_of[req])      # the row keeps the old room
    _replace_everywhere(machine._free_slots, free_slots)


def _room_before_payload_allowed() -> None:
    from model.spec import machine
    orig = machine._land

    def land(state, rank, req, field):
        v = state.variant
        state.variant = replace(v, room_after_payload=False)
        try:
            orig(state, rank, req, field)
        finally:
            state.variant = v
    _replace_everywhere(orig, land)
    machine._ENV_HANDLERS[machine.Land] = lambda state, ev: land(state, ev.rank, ev.req, ev.field)


def _relatch_failed() -> None:
    from model.spec import machine

    def latch(state, rank, req, value):
        recv = machine._rank(state, rank).recv
        if req not in recv:
            raise machine.EventNotEnabled(f"latch: request {req} is not queued on rank {rank}")
        if recv[req] == int(machine.KVPoll.Success) and value != int(machine.KVPoll.Failed):
            raise machine.EventNotEnabled("latch: already latched")    # as the spec
        recv[req] = value                        # the bug: a Failed receiver can turn Success
    _replace_everywhere(machine._latch, latch)


def _max_reduce() -> None:
    from model.spec import kvpoll
    orig = kvpoll.min_reduce

    def max_reduce(vectors):
        orig(vectors)                            # the same length check
        return list(map(max, zip(*vectors)))
    _replace_everywhere(orig, max_reduce)


def _min_strict_axiom() -> None:
    from model.encoding import vocab
    orig = vocab.Ctx.rank_min

    def rank_min(self, g):
        m, side = orig(self, g)
        if self.finite:
            return m, side
        # below every rank's value, strictly: contradicts the witness axiom
        return m, [self.forall(("Rank", "Req"), lambda k, r: m(r) < g(k, r))] + side[1:]
    vocab.Ctx.rank_min = rank_min


def _min_no_witness() -> None:
    from model.encoding import vocab
    orig = vocab.Ctx.rank_min

    def rank_min(self, g):
        m, side = orig(self, g)
        return (m, side[:1]) if not self.finite else (m, side)   # a lower bound only
    vocab.Ctx.rank_min = rank_min


def _aligned_no_skolem() -> None:
    from model.encoding import vocab
    orig = vocab.Ctx.aligned

    def aligned(self, s):
        al, side = orig(self, s)
        return (al, side[:1]) if not self.finite else (al, side)  # "aligned" may be false anyway
    vocab.Ctx.aligned = aligned


def _forall_first_sort_only() -> None:
    from model.encoding import vocab
    orig = vocab.Ctx.forall

    def forall(self, sorts, body):
        if self.finite or len(sorts) == 1:
            return orig(self, sorts, body)
        rest = [self.fresh(s.lower(), s) for s in sorts[1:]]
        return orig(self, sorts[:1], lambda x: body(x, *rest))
    vocab.Ctx.forall = forall


def _fresh_not_checked() -> None:
    from model.encoding import vocab
    orig = vocab.Ctx.first_fresh
    vocab.Ctx.first_fresh = lambda self, s, r0: orig(self, s, r0) if self.finite else z3.BoolVal(True)


def _named_slots_ignored() -> None:
    """The encoding's enqueue takes the FIFO front even where a trace names the slots."""
    from model.encoding import actions
    orig = actions.enqueue
    actions.enqueue = lambda ctx, s, r0=None, slots=None: orig(ctx, s, r0)


def _member_false() -> None:
    from model.encoding import vocab
    orig = vocab.Ctx.member
    vocab.Ctx.member = lambda self, t, sort: orig(self, t, sort) if self.finite else z3.BoolVal(False)


def _bundle_drops_lemma() -> None:
    from proofs import obligations
    obligations.BUNDLES["no_corruption"] = [n for n in obligations.BUNDLES["no_corruption"]
                                            if n != "room_is_own_or_zero"]


def _lemma_too_strong() -> None:
    from model.encoding import invariants
    from model.spec.kvpoll import KVPoll

    def recv_range(c, s):      # "a queued receiver is still waiting": kv_done breaks it
        return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(
            s.inq(k, r), s.recv(k, r) == int(KVPoll.WaitingForInput)))
    invariants.LEMMAS["recv_range"] = invariants.PREDICATES["recv_range"] = recv_range


def _timeout_floor() -> None:
    import math
    from model.spec import timeouts

    def steps_for(seconds, step_floor_s=timeouts.STEP_FLOOR_S):
        return max(1, math.floor(seconds / step_floor_s))   # rounds down: fires early
    _replace_everywhere(timeouts.steps_for, steps_for)


def _bound_loose() -> None:
    import z3
    from model.encoding import invariants

    def bounded_wait(c, s):
        bound = c.variant.timeout_steps if c.variant.timeout_steps is not None else c.wait_bound
        return c.forall(("Rank", "Req"), lambda k, r: z3.Implies(s.inq(k, r), s.age(k, r) <= bound + 1))
    invariants.PREDICATES["bounded_wait"] = bounded_wait
    _replace_everywhere(invariants.bounded_wait, bounded_wait)


def _invariant_trivial() -> None:
    from model.encoding import invariants
    trivial = lambda c, s: z3.BoolVal(True)
    invariants.SAFETY["no_corruption"] = invariants.PREDICATES["no_corruption"] = trivial


MUTANTS: list[Mutant] = [
    Mutant("kernel-match-as-nonzero", "kernel", "strict's MATCH gate only holds on room 0",
           _gate_match_as_nonzero, ("safety:outcomes_agree@strict",)),
    Mutant("kernel-timeout-off-by-one", "kernel", "the timeout fires one step late",
           _timeout_off_by_one, ("liveness:bounded_wait@strict",)),
    Mutant("kernel-timeout-ignored", "kernel", "gated_poll never reports a timeout",
           _timeout_ignored, ("liveness:bounded_wait@strict",)),
    Mutant("kernel-commit-on-mismatch", "kernel", "a MIN Success with another request's room commits",
           _commit_on_mismatch, ("cex:outcomes_agree@gate-noclear",)),
    Mutant("variant-strict-no-clear", "variant", "strict does not zero a freed row",
           _variant("strict", clear_on_free=False), ("safety:no_corruption@strict",)),
    Mutant("variant-strict-room-any-order", "variant", "strict's room may land before the payload",
           _variant("strict", room_after_payload=False), ("safety:no_corruption@strict",)),
    Mutant("variant-strict-no-fence", "variant", "strict reuses a slot with writes still in flight",
           _variant("strict", fence_before_reuse=False), ("safety:no_corruption@strict",)),
    Mutant("variant-gate-keeps-room0", "variant", "gate keeps a request whose room reads 0 after a MIN Success",
           _variant("gate", keep_on_room_zero=True), ("safety:queues_identical@gate",)),
    Mutant("machine-lifo-free-list", "machine", "enqueue takes the most recently freed slot",
           _lifo_free_list, ("refines:spec@strict",)),
    Mutant("machine-enqueue-skips-full-rank", "machine", "enqueue skips a rank with no free slot",
           _enqueue_skips_full_rank, ("refines:spec@strict",)),
    Mutant("machine-fence-keeps-quarantine", "machine", "a fence does not free a quarantined slot",
           _fence_keeps_quarantine, ("refines:spec@strict",)),
    Mutant("machine-agreed-fence-waits", "machine", "the last holder's fence leaves an agreed hold held until a step",
           _agreed_fence_waits, ("refines:spec@deferred",)),
    Mutant("machine-no-clear-on-free", "machine", "freeing a slot never zeroes its room",
           _no_clear_on_free, ("refines:spec@gate",)),
    Mutant("machine-room-before-payload", "machine", "land ignores the room-after-payload order",
           _room_before_payload_allowed, ("refines:spec@strict",)),
    Mutant("machine-relatch-failed", "machine", "a Failed receiver can still turn Success",
           _relatch_failed, ("refines:spec@strict",)),
    Mutant("min-is-max", "min", "the all-reduce takes the MAX",
           _max_reduce, ("refines:spec@gate",)),
    Mutant("min-strict-axiom", "min", "unbounded MIN: strictly below every rank (contradicts the witness)",
           _min_strict_axiom, ("consistent:actions@strict",)),
    Mutant("min-no-witness", "min", "unbounded MIN: a lower bound only, no witness rank",
           _min_no_witness, ("refines:spec@strict",)),
    Mutant("encoding-aligned-no-skolem", "encoding", "unbounded alignment: its existential half dropped",
           _aligned_no_skolem, ("refines:spec@strict",)),
    Mutant("encoding-forall-first-sort", "encoding", "unbounded forall binds only its first variable",
           _forall_first_sort_only, ("safety:queues_identical@strict",)),
    Mutant("encoding-fresh-unchecked", "encoding", "unbounded enqueue may reuse an enqueued request",
           _fresh_not_checked, ("safety:exactly_once@strict",)),
    Mutant("encoding-member-false", "encoding", "unbounded membership is false (every guard vacuous)",
           _member_false, ("consistent:actions@strict",)),
    Mutant("encoding-named-slots-ignored", "encoding", "enqueue takes the FIFO front where a trace names the slots",
           _named_slots_ignored, ("refines:spec@strict",)),
    Mutant("lemmas-bundle-drops-room", "lemmas", "no_corruption's bundle lacks room_is_own_or_zero",
           _bundle_drops_lemma, ("safety:no_corruption@strict",)),
    Mutant("lemmas-recv-too-strong", "lemmas", "recv_range claims a queued receiver is always waiting",
           _lemma_too_strong, ("safety:outcomes_agree@strict",)),
    Mutant("timeouts-round-down", "timeouts", "seconds become steps rounded down (the timeout fires early)",
           _timeout_floor, ("deployed:timeouts@strict",)),
    Mutant("encoding-liveness-bound-plus-one", "encoding", "the encoded bounded_wait allows T + 1 steps",
           _bound_loose, ("nonvacuous:bound-reached@strict",)),
    Mutant("invariant-no-corruption-trivial", "lemmas", "the encoded no_corruption is True",
           _invariant_trivial, ("induction:no_corruption@gate",)),
]


# -- the decode iteration's mutants (model/spec/agreement.py, iteration.py, its encoding) --
def _iter_point(variant: str, point: str, **changes: Any) -> Callable[[], None]:
    """Change one point of one iteration variant (the table every module reads); an
    ``op`` is given by its value."""
    def apply() -> None:
        from model.spec.agreement import Op, Skip
        from model.spec.iteration import ITER_VARIANTS
        if "op" in changes:
            changes["op"] = Op(changes["op"])
        if "skip" in changes:
            changes["skip"] = Skip(changes["skip"])
        v = ITER_VARIANTS[variant]
        points = tuple(replace(p, **changes) if p.name == point else p for p in v.points)
        ITER_VARIANTS[variant] = replace(v, points=points)
    return apply


def _skip_ignores_local_fail() -> None:
    from model.spec import agreement
    original = agreement.triggers

    def triggers(p, stage, local, ops):
        if p.skip is agreement.Skip.ALL_READY_NO_LOCAL_FAIL:
            p = replace(p, skip=agreement.Skip.ALL_READY)
        return original(p, stage, local, ops)
    _replace_everywhere(original, triggers)


def _local_flag_ignored() -> None:
    """The LOCAL_FLAG skip issues wherever the rank holds a member (as EMPTY)."""
    from model.spec import agreement
    original = agreement.triggers

    def triggers(p, stage, local, ops):
        if p.skip is agreement.Skip.LOCAL_FLAG:
            p = replace(p, skip=agreement.Skip.EMPTY)
        return original(p, stage, local, ops)
    _replace_everywhere(original, triggers)


def _gate_ignored() -> None:
    from model.spec import agreement
    original = agreement.contribution
    _replace_everywhere(original, lambda p, issued, stage, local, gate, ops:
                        original(p, issued, stage, local, 0, ops))


def _drop_witness(method: str) -> Callable[[], None]:
    """An unbounded iteration skolem (the MIN's witness rank, or the witness request of
    "some member triggers") loses its axiom: only the first half stays."""
    def apply() -> None:
        from model.encoding import iteration
        original = getattr(iteration.Unbounded, method)

        def weakened(self, *args):
            out = original(self, *args)
            del self.axioms[-1]            # each adds its witness axiom last
            return out
        setattr(iteration.Unbounded, method, weakened)
    return apply


def _collectives_agree_trivial() -> None:
    from model.spec import iteration
    _replace_everywhere(iteration.collectives_agree, lambda res: [])


ITERATION_MUTANTS: list[Mutant] = [
    Mutant("iter-strict-admission-local", "iteration", "strict admits on each rank's own budget",
           _iter_point("iter-strict", "admission", op="local"),
           ("safety:point:admission@iter-strict",)),
    Mutant("iter-strict-transfer-veto", "iteration", "strict keeps a held request after the MIN instead of gating it",
           _iter_point("iter-strict", "transfer_poll", gate=None, veto="held", veto_value=4),
           ("safety:no_local_decision_after_min@iter-strict",)),
    Mutant("iter-0.5.23-checksum-local", "iteration", "0.5.23 drops checksum mismatches per rank (as 0.5.21)",
           _iter_point("iter-0.5.23", "kv_checksum", op="local"),
           ("safety:point:kv_checksum@iter-0.5.23",)),
    Mutant("agreement-skip-ignores-local-fail", "agreement", "the 0.5.13 prealloc skip ignores a local Failed",
           _skip_ignores_local_fail, ("induction:point:prealloc_poll@iter-0.5.13",)),
    Mutant("agreement-gate-ignored", "agreement", "a point's gate never caps the contribution",
           _gate_ignored, ("nonvacuous:iteration@iter-strict",)),
    Mutant("iter-encoding-min-no-witness", "encoding", "unbounded iteration MIN: a lower bound only",
           _drop_witness("reduction"), ("refines:iteration@iter-strict",)),
    Mutant("iter-encoding-issues-no-witness", "encoding", "unbounded 'some member triggers' may hold with none",
           _drop_witness("some_member"), ("refines:iteration@iter-strict",)),
    Mutant("prefill-strict-buffer-veto", "iteration", "strict prefill keeps a request without a metadata buffer after the MIN",
           _iter_point("prefill-strict", "bootstrap_poll", gate=None, veto="no_buffer", veto_value=2),
           ("safety:point:bootstrap_poll@prefill-strict",)),
    Mutant("iter-collectives-agree-trivial", "iteration", "the spec's collectives_agree never reports",
           _collectives_agree_trivial, ("cex:collectives_agree@iter-0.5.12",)),
    Mutant("iter-strict-hold-local", "iteration", "strict decides per rank whether a failed request keeps its slot",
           _iter_point("iter-strict", "defer_release", op="local"), ("safety:point:defer_release@iter-strict",)),
    Mutant("iter-strict-release-local", "iteration", "strict frees a held slot on each rank's own ack or deadline",
           _iter_point("iter-strict", "deferred_release", op="local"), ("safety:point:deferred_release@iter-strict",)),
    Mutant("iter-strict-drain-on-retract", "iteration", "strict drains offloads only on the rank that retracts",
           _iter_point("iter-strict", "offload_drain_progress", skip="local-flag"),
           ("safety:point:offload_drain_progress@iter-strict",)),
    Mutant("agreement-local-flag-ignored", "agreement", "a rank-local issue test (LOCAL_FLAG) reads as the queue's emptiness",
           _local_flag_ignored, ("induction:point:offload_drain@iter-0.5.23",)),
    Mutant("prefill-waiting-local", "iteration", "0.5.18's waiting queue acts on each rank's own poll (no MIN)",
           _iter_point("prefill-0.5.18", "waiting_bootstrap", op="local"),
           ("safety:point:waiting_bootstrap@prefill-0.5.18",)),
]
MUTANTS += ITERATION_MUTANTS


# -- the iteration mechanisms added later: a release's host-staged MIN, the ALL_READY skip,
# the broadcast, the FIFO halt -----------------------------------------------------------------
def _all_ready_reads_local_poll() -> None:
    """0.5.12's skip tests each rank's own handshake poll (WaitingForInput here) instead
    of the agreed READY stage (``waiting_for_input``, set from the MIN)."""
    from model.spec import agreement
    original = agreement.triggers

    def triggers(p, stage, local, ops):
        if p.skip is agreement.Skip.ALL_READY:
            return ops.and_(agreement.is_member(p, stage, ops), ops.not_(ops.eq(local, 2)))
        return original(p, stage, local, ops)
    _replace_everywhere(original, triggers)


def _broadcast_own_value() -> None:
    """The unbounded encoding's broadcast gives each rank its own value, not rank 0's."""
    from model.encoding import iteration
    from model.spec.agreement import Op
    original = iteration.Unbounded.reduced

    def reduced(self, p, contrib):
        return contrib if p.op is Op.BROADCAST else original(self, p, contrib)
    iteration.Unbounded.reduced = reduced


def _halt_ignored() -> None:
    """The spec's walk never halts (each member moves on its own value, as the variants
    had it before conform --points ran the wheels' admission); the encoding still halts."""
    from model.spec import iteration
    original = iteration.act

    def act(p, stages, inputs, issued, values, f=iteration.PYF):
        return original(replace(p, halt=None), stages, inputs, issued, values, f)
    _replace_everywhere(original, act)


LATER_ITERATION_MUTANTS: list[Mutant] = [
    Mutant("iter-0.5.21-host-release-local", "iteration",
           "0.5.21 frees host-staged holds on each rank's own ack (no MIN)",
           _iter_point("iter-0.5.21", "deferred_release_host", op="local"),
           ("safety:point:deferred_release_host@iter-0.5.21",)),
    Mutant("agreement-all-ready-reads-local-poll", "agreement",
           "0.5.12's prealloc skip tests each rank's own poll, not the agreed WaitingForInput",
           _all_ready_reads_local_poll, ("safety:point:prealloc_poll@iter-0.5.12",)),
    Mutant("iter-encoding-broadcast-own", "encoding", "unbounded broadcast: each rank acts on its own value",
           _broadcast_own_value, ("safety:point:recv_requests@iter-strict",)),
    Mutant("agreement-halt-ignored", "agreement", "the spec's FIFO walk never halts (admits each request on its own)",
           _halt_ignored, ("refines:iteration@iter-0.5.12",)),
    Mutant("iter-encoding-halt-no-witness", "encoding", "unbounded FIFO halt may hold with no request ahead halting",
           _drop_witness("halted"), ("safety:point:admission@iter-strict",)),
]
ITERATION_MUTANTS += LATER_ITERATION_MUTANTS
MUTANTS += LATER_ITERATION_MUTANTS


# -- pipeline parallel's mutants (model/spec/pipeline.py, model/encoding/pipeline.py) ------
def _pp_point(variant: str, point: str, **changes: Any) -> Callable[[], None]:
    """Change one point of one pipeline variant; an ``across`` is given by its value."""
    def apply() -> None:
        from model.spec.agreement import Across, Skip
        from model.spec.pipeline import PP_VARIANTS
        if "across" in changes:
            changes["across"] = Across(changes["across"])
        if "skip" in changes:
            changes["skip"] = Skip(changes["skip"])
        v = PP_VARIANTS[variant]
        PP_VARIANTS[variant] = replace(v, points=tuple(replace(p, **changes) if p.name == point else p
                                                       for p in v.points))
    return apply


def _pp_drop_witness(method: str) -> Callable[[], None]:
    """A pipeline skolem (a stage's MIN witness rank, or the ring's witness stage) loses
    its axiom (each adds it last)."""
    def apply() -> None:
        from model.encoding import pipeline
        original = getattr(pipeline.PipelineUnbounded, method)

        def weakened(self, *args):
            out = original(self, *args)
            del self.axioms[-1]
            return out
        setattr(pipeline.PipelineUnbounded, method, weakened)
    return apply


def _positions_agree_trivial() -> None:
    from model.spec import pipeline
    _replace_everywhere(pipeline.positions_agree, lambda res, v: [])


def _forwarded_by_rid() -> None:
    """PP0's value for a request lands on the same request id (not the same position)."""
    from model.spec import pipeline

    def by_rid(p, row0, values0, row, f):
        ops = f.ops
        return [ops.ite(pipeline.is_member(p, row0[r], ops), values0[r], pipeline.STAY) for r in range(len(row))]
    _replace_everywhere(pipeline.forwarded, by_rid)


PIPELINE_MUTANTS: list[Mutant] = [
    Mutant("pp-strict-per-stage", "pipeline", "strict's transfer MIN reduces over each stage's TP group only",
           _pp_point("pp-strict", "transfer_poll", across="group"), ("safety:pp_agree@pp-strict",)),
    Mutant("pp-strict-no-gate", "pipeline", "strict's MIN takes Success from a rank whose metadata has not landed",
           _pp_point("pp-strict", "transfer_poll", gate=None), ("nonvacuous:pipeline@pp-strict",)),
    Mutant("pp-0.5.13-second-min-ungated", "pipeline", "0.5.13's second MIN is modelled ungated (as 0.5.12)",
           _pp_point("pp-0.5.13", "transfer_poll", gate=None), ("induction:pp_agree_no_failure@pp-0.5.13",)),
    Mutant("pp-0.5.12-no-ring", "pipeline", "0.5.12's consensus is each stage's own (no ring intersection)",
           _pp_point("pp-0.5.12", "transfer_consensus", across="group"),
           ("safety:point:transfer_consensus@pp-0.5.12",)),
    Mutant("pp-prefill-strict-buffer-veto", "pipeline", "strict prefill keeps a request without a metadata buffer after the MIN",
           _pp_point("pp-prefill-strict", "bootstrap_poll", gate=None, veto="no_buffer", veto_value=2),
           ("safety:pp_agree@pp-prefill-strict",)),
    Mutant("pp-encoding-ring-no-witness", "encoding", "unbounded ring: 'every stage moves it' may fail with none failing",
           _pp_drop_witness("ring"), ("refines:pipeline@pp-0.5.12",)),
    Mutant("pp-encoding-stage-min-no-witness", "encoding", "unbounded stage MIN: a lower bound only",
           _pp_drop_witness("group_reduction"), ("refines:pipeline@pp-0.5.12",)),
    Mutant("pp-positions-agree-trivial", "pipeline", "the spec's positions_agree never reports",
           _positions_agree_trivial, ("cex:positions_agree@pp-prefill-0.5.23",)),
    Mutant("pp-forwarded-by-rid", "pipeline", "a later stage gets PP0's value by request id, not queue position",
           _forwarded_by_rid, ("cex:positions_shifted@pp-prefill-0.5.23",)),
    Mutant("pp-0.5.23-hold-max-local", "pipeline", "0.5.23's hold-flag MAX issued only where this rank holds",
           _pp_point("pp-0.5.23", "defer_release", skip="local-flag", input="hold"),
           ("safety:point:defer_release@pp-0.5.23",)),
    Mutant("pp-0.5.12-empty-min-skipped", "pipeline", "0.5.12's consensus MIN skipped on an empty queue",
           _pp_point("pp-0.5.12", "transfer_consensus", skip="empty"), ("cex:empty_min@pp-0.5.12",)),
    Mutant("pp-0.5.12-commit-unchecked", "pipeline", "0.5.12's commit pops a request whose metadata has not landed",
           _pp_point("pp-0.5.12", "transfer_poll", veto=None), ("induction:pp_agree_no_failure@pp-0.5.12",)),
    Mutant("pp-0.5.12-list-kept", "pipeline", "0.5.12 keeps a request its commit held back in the round's list",
           _pp_point("pp-0.5.12", "requeue", moves=((0, 1),)), ("cex:empty_min@pp-0.5.12",)),
    Mutant("pp-second-min-pops-unchecked", "pipeline", "the second MIN pops every polled request, listed or not",
           _pp_point("pp-0.5.13", "transfer_poll", moving=None), ("safety:pp_agree_landed@pp-0.5.13",)),
    Mutant("pp-prefill-bad-intersected", "pipeline", "0.5.18's ring intersects the bad lists (no union)",
           _pp_point("pp-prefill-0.5.18", "bootstrap_consensus", union=()),
           ("safety:pp_agree_buffers@pp-prefill-0.5.18",)),
    Mutant("pp-prefill-uncovered-pops", "pipeline", "0.5.18's uncovered MIN pops a WaitingForInput request too",
           _pp_point("pp-prefill-0.5.18", "bootstrap_uncovered", moves=((0, 4), (2, 2))),
           ("safety:pp_agree_buffers@pp-prefill-0.5.18",)),
    Mutant("pp-prefill-pop-ignores-buffer", "pipeline", "0.5.18 pops a good request without a metadata buffer",
           _pp_point("pp-prefill-0.5.18", "bootstrap_pop", input=None), ("induction:pp_agree@pp-prefill-0.5.18",)),
    Mutant("pp-encoding-union-no-witness", "encoding", "unbounded ring: a bad rid with no stage failing it",
           _pp_drop_witness("some_stage"), ("refines:pipeline@pp-prefill-0.5.18",)),
]
MUTANTS += PIPELINE_MUTANTS


# -- per-rank clocks' mutants (model/spec/clocks.py, its encoding) ------------------------
def _clock_strict(point: str | None = None, **changes: Any) -> Callable[[], None]:
    """Change clocks-strict: one point's fields (``op`` by its value), or its timers
    (``timers``); the bound bounded_wait asks for is not the variant's and stays."""
    def apply() -> None:
        from model.spec.agreement import Op
        from model.spec.clocks import CLOCK_VARIANTS
        v = CLOCK_VARIANTS["clocks-strict"]
        if point is None:
            CLOCK_VARIANTS[v.name] = replace(v, **changes)
            return
        fields = {k: Op(x) if k == "op" else x for k, x in changes.items()}
        points = tuple(replace(p, **fields) if p.name == point else p for p in v.iter.points)
        CLOCK_VARIANTS[v.name] = replace(v, iter=replace(v.iter, points=points))
    return apply


def _strict_transfer_untimed() -> None:
    from model.spec import clocks
    timers = tuple(clocks.WAIT_RECEIVER if t is clocks.WAIT_ANY else t for t in clocks.STRICT_TIMERS)
    _clock_strict(timers=timers)()


def _clock_frozen() -> None:
    from model.spec import clocks
    original = clocks.advance
    _replace_everywhere(original, lambda start, after, elapsed, age, dt, ops=clocks.PY:
                        original(start, after, elapsed, age, 0, ops))


def _limit_zero_allowed() -> None:
    from model.encoding import clocks
    original = clocks.symbolic_limits

    def weakened(tag=""):
        limits, _ = original(tag)
        return limits, [x >= 0 for x in limits.values()]
    _replace_everywhere(original, weakened)


def _timer_no_restart() -> None:
    """A timer runs on when its request moves to the next timed stage (elapsed and age
    carried over): only leaving (GONE) restarts it."""
    from model.spec import clocks
    original = clocks.advance

    def advance(start, after, elapsed, age, dt, ops=clocks.PY):
        moved_on = ops.ite(ops.eq(after, int(clocks.C.GONE)), after, start)   # a move reads as staying
        return original(start, moved_on, elapsed, age, dt, ops)
    _replace_everywhere(original, advance)


CLOCK_MUTANTS: list[Mutant] = [
    Mutant("clocks-strict-transfer-untimed", "clocks", "strict times WaitingForInput only, as the receivers (#31800)",
           _strict_transfer_untimed, ("liveness:bounded_wait@clocks-strict",)),
    Mutant("clocks-strict-abort-local", "clocks", "strict aborts a timed-out request on each rank's own clock (#27221)",
           _clock_strict("abort_on_timeout", op="local"), ("safety:point:abort_on_timeout@clocks-strict",)),
    Mutant("clocks-strict-release-local", "clocks", "strict releases a held request on each rank's own ack or clock",
           _clock_strict("deferred_release", op="local"), ("safety:point:deferred_release@clocks-strict",)),
    Mutant("clocks-strict-poll-unguarded", "clocks", "strict's poll ignores the timeout verdict",
           _clock_strict("transfer_poll", gate=None), ("liveness:bounded_wait@clocks-strict",)),
    Mutant("clocks-frozen", "clocks", "a rank's clock does not advance while a request waits",
           _clock_frozen, ("liveness:bounded_wait@clocks-strict",)),
    Mutant("clocks-encoding-limit-zero", "encoding", "the encoded limits may be 0 units",
           _limit_zero_allowed, ("liveness:bounded_wait@clocks-strict",)),
    Mutant("clocks-timer-no-restart", "clocks", "a timer runs on when its request moves to the next stage",
           _timer_no_restart, ("liveness:bounded_wait@clocks-strict",)),
]
MUTANTS += CLOCK_MUTANTS


@dataclass
class MutantResult:
    name: str
    area: str
    bug: str
    killed: bool
    caught_by: list[str]
    detail: str
    checked: int
    seconds: float

    def row(self) -> dict:
        return {"mutant": self.name, "area": self.area, "bug": self.bug, "killed": self.killed,
                "caught_by": self.caught_by, "detail": self.detail,
                "obligations_run": self.checked, "seconds": round(self.seconds, 2)}


MUTANT_TIMEOUT_MS = 20_000    # per solver query, as pdgate prove: a kill is what prove itself would show


def run_mutant(name: str, timeout_ms: int = MUTANT_TIMEOUT_MS) -> MutantResult:
    """Apply one mutant to this process and run obligations until one flips (call it in
    a throw-away worker: the patches are never undone)."""
    from pathlib import Path
    import tempfile

    from proofs.obligations import Settings, obligations, run_obligation
    m = next(m for m in MUTANTS if m.name == name)
    t0 = time.perf_counter()
    _clear_caches()
    m.apply()
    _clear_caches()
    obs = obligations()
    first = [o for key in m.first for o in obs if o.key == key]
    order = first + [o for o in obs if o not in first]
    with tempfile.TemporaryDirectory() as tmp:
        st = Settings(Path(tmp), timeout_ms)
        errors = []
        for i, ob in enumerate(order, 1):
            out = run_obligation(ob, st)
            if out.result == "error":       # a check crashed: a bug, not a detection
                errors.append(f"{ob.key}: {out.detail}")
                continue
            if out.result != ob.expected:
                return MutantResult(m.name, m.area, m.bug, True, [ob.key],
                                    f"{out.result} (expected {ob.expected}): {out.detail[:300]}",
                                    i, time.perf_counter() - t0)
    return MutantResult(m.name, m.area, m.bug, False, [],
                        "; ".join(errors) or "every obligation as expected",
                        len(order), time.perf_counter() - t0)


def run_all(names: list[str] | None = None, jobs: int = 2, timeout_ms: int = MUTANT_TIMEOUT_MS
            ) -> list[MutantResult]:
    """Every mutant in its own forked worker (``jobs`` at a time)."""
    names = names or [m.name for m in MUTANTS]
    ctx = get_context("fork")
    with ctx.Pool(jobs, maxtasksperchild=1) as pool:
        pending = [pool.apply_async(run_mutant, (n, timeout_ms)) for n in names]
        deadline = time.monotonic() + MUTANT_DEADLINE_S * max(1, len(names) // jobs)
        return [p.get(timeout=max(deadline - time.monotonic(), 1.0)) for p in pending]
