"""Hypothesis drives the impl (T ranks of the real queue in one process) and the spec
side by side with the same events; every step must agree rank by rank, and so must
every admission: strict's quarantine and the deferred variants' held slots give the
ranks uneven capacity, which agreed admission (one MIN) absorbs and local admission
(SGLang's) turns into diverging queues."""
from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from impl.decode import CollectiveLengthMismatch, QueueContentMismatch
from impl.decode.lockstep import LockstepGroup, run_ranks
from impl.scripted import RankHarness
from model.spec import Enqueue, Step, apply, check_invariants, get_variant, initial_state
from model.spec.machine import enabled


class ImplAgainstSpec(RuleBasedStateMachine):
    @initialize(variant=st.sampled_from(["gate", "strict", "ungated", "deferred-local", "deferred",
                                         "strict-local-admission"]),
                ranks=st.integers(1, 3), slots=st.integers(1, 3), timeout=st.integers(1, 4))
    def setup(self, variant, ranks, slots, timeout):
        base = get_variant(variant)
        v = get_variant(variant, timeout if base.timeout_steps else None,
                        timeout if base.release_timeout_steps else None)
        self.spec = initial_state(v, ranks, slots)
        group = LockstepGroup(ranks, timeout_s=10)
        self.ranks = [RankHarness(k, v, slots, group.exchange(k)) for k in range(ranks)]
        self.n = 0
        self.over = False

    @precondition(lambda self: hasattr(self, "spec") and not self.over)
    @rule(data=st.data())
    def event(self, data):
        room = data.draw(st.integers(0, 2**24 - 1)) * 2**40 + self.n + 1   # distinct, non-zero
        candidate = Enqueue(self.n, room, data.draw(st.integers(-2**31, 2**31 - 1)))
        ev = data.draw(st.sampled_from(enabled(self.spec, [candidate])))
        if isinstance(ev, Step):
            self._step()
            return
        if isinstance(ev, Enqueue):
            self.n += 1
            got = run_ranks([lambda h=h: h.queue.capacity() for h in self.ranks])
            assert got == [len(rs.free) for rs in self.spec.ranks]      # uneven is fine
            apply(self.spec, ev)
            run_ranks([lambda h=h: h.apply(ev) for h in self.ranks])    # the agreed admit step
            assert [[int(d.req.rid) for d in h.queue.queue] for h in self.ranks] == \
                [rs.queue for rs in self.spec.ranks]
            return
        apply(self.spec, ev)
        for h in self.ranks:
            h.apply(ev)

    @rule()
    def idle(self):
        """Always enabled, so the machine can run on after the ranks stopped agreeing."""

    def _step(self):
        got = run_ranks([lambda h=h: h.apply(Step()) for h in self.ranks])
        # the queues as the step found them (its pops can make them equal again)
        diverged = [v.invariant for v in check_invariants(self.spec, ["queues_identical"])]
        want = apply(self.spec, Step())
        if want.hang is not None:
            assert all(isinstance(e, CollectiveLengthMismatch) and e.lengths == want.hang
                       for e in got), (got, want.hang)
            self.over = True
            return
        if any(isinstance(e, Exception) for e in got):
            # same lengths, other requests: the impl refuses to mix them; only ungated
            # gets there, and the spec state shows the broken invariant
            assert all(isinstance(e, QueueContentMismatch) for e in got), got
            assert self.spec.variant.name in ("ungated", "deferred-local", "strict-local-admission")
            assert diverged
            self.over = True
            return
        for rec, rank_step in zip(got, want.ranks):
            assert tuple(int(q) for q in rec.queue) == rank_step.queue
            assert (rec.local, rec.gated, rec.reduced) == (rank_step.local, rank_step.gated,
                                                           rank_step.reduced)
            assert tuple((int(r), d, p) for r, d, p in rec.popped) == rank_step.popped


ImplAgainstSpec.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                             deadline=None)
TestImplAgainstSpec = ImplAgainstSpec.TestCase
