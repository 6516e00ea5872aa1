"""The simulation: SimPy decides *when* each event happens; ``model.spec.machine.apply``
decides *what* every rank does with it. No protocol logic lives here.

Timing model (docs/SIMULATOR.md): a request arrives, waits for a prefill server, is
prefilled, waits (prealloc) until every rank has a free metadata slot and the request
pool has room, and is enqueued on every rank (``Enqueue``); then each rank's KV lands
(``KvDone`` or ``Fail``) and, a metadata lag later, its row (``Land`` payload, then room).
The decode scheduler loops: at a poll instant ``s`` the spec takes one ``Step``; the MIN
all-reduce costs alpha + beta * n, so pops take effect at ``s + cost``; then a forward
pass (or an idle spin when nothing runs). Environment events are scheduled at URGENT
priority, so an event at exactly a poll instant is seen by that step.
"""
from __future__ import annotations

import heapq
import math
from array import array
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import simpy
from simpy.events import URGENT, Event

from model.spec.events import PAYLOAD, ROOM, Enqueue, Fail, Fence, KvDone, Land, Step
from model.spec.invariants import Violation
from model.spec.kernel import Decision
from model.spec.machine import (EventNotEnabled, StepPops, StepRecord, apply, fail, forget, kv_done,
                                land)
from model.spec.state import ALL_FIELDS, initial_state
from model.spec.trace import TraceWriter
from model.spec.variants import VARIANTS, Variant, get_variant
from sim.checks import step_violations
from sim.config import SimConfig
from sim.draws import Draws, StepTimes, draw, stream
from sim.errors import SimInputError
from sim.workload import Workload

KV, FAIL, PAY, ROOMF = 0, 1, 2, 3          # timeline event kinds, in same-time order
_LAND_FIELD = (None, None, PAYLOAD, ROOM)   # by kind
_STEP = Step()
FORGET_BATCH = 256
_COMMIT = int(Decision.COMMIT)


# strict's bound when --timeout-steps is not given. The spec's own default (4 steps) sizes
# the proofs' small models; a simulated worker steps every 1-25 ms, so 4 steps would abort
# healthy requests whose KV transfer outlasts a few idle steps. 1,000 steps is 1-25 s.
DEFAULT_TIMEOUT_STEPS = 1000


def resolve_variant(cfg: SimConfig) -> Variant:
    """The spec variant by name, with the timeout and no-clear overrides applied."""
    base = VARIANTS.get(cfg.variant)
    if base is None:
        raise SimInputError(f"--variant: unknown variant {cfg.variant!r} (known: {', '.join(VARIANTS)})")
    steps = cfg.timeout_steps
    if steps is None and base.timeout_steps is not None:
        steps = DEFAULT_TIMEOUT_STEPS
    try:
        v = get_variant(cfg.variant, steps)      # the spec refuses a timeout gate lacks
    except ValueError as exc:
        raise SimInputError(f"--timeout-steps: {exc}") from None
    return replace(v, clear_on_free=False) if cfg.no_clear else v


def trace_name(v: Variant) -> str | None:
    """The named variant a trace header can carry for ``v`` (None if it has none)."""
    for name, named in VARIANTS.items():
        if replace(named, name=v.name, timeout_steps=v.timeout_steps) == v and (
                (named.timeout_steps is None) == (v.timeout_steps is None)):
            return name
    return None


def _refused(exc: EventNotEnabled) -> None:
    """The driver broke its own physics: a bug, not a user error."""
    raise RuntimeError(f"simulator delivered an event the spec refuses: {exc}") from exc


class _At(Event):
    """A callback at now + delay, URGENT so it precedes a scheduler step at that time."""

    def __init__(self, env: simpy.Environment, delay: float, fn: Any, arg: Any):
        self.env, self._value, self._ok = env, None, True
        self.fn, self.arg = fn, arg
        self.again(delay)

    def again(self, delay: float) -> None:
        """Schedule the callback (once more: a fired _At is reused, and SimPy orders by
        time, priority and scheduling order, so a fresh event would sort the same)."""
        self.callbacks = [self._fire]
        self.env.schedule(self, URGENT, delay)

    def _fire(self, _: Event) -> None:
        self.fn(self.arg)


class _Timeline:
    """One request's per-rank events (KV, then metadata), delivered in time order with
    a single pending SimPy event at a time (keeps memory per request small)."""
    __slots__ = ("req", "times", "codes", "pos", "due")

    def __init__(self, req: int, times: Sequence[float], codes: Sequence[int]):
        self.req, self.times, self.codes, self.pos = req, array("d", times), array("h", codes), 0
        self.due: _At | None = None     # its SimPy event, rescheduled for each batch


@dataclass
class Divergence:
    step: int
    time_ms: float
    violation: Violation

    def as_dict(self) -> dict[str, Any]:
        v = self.violation
        return {"step": self.step, "time_ms": round(self.time_ms, 6), "invariant": v.invariant,
                "ranks": list(v.ranks), "requests": list(v.reqs), "detail": v.detail}


@dataclass
class RunData:
    """What a run produced (summaries are in sim/results.py)."""
    cfg: SimConfig
    variant: Variant
    workload: Workload
    arrival_ms: np.ndarray
    commit_ms: np.ndarray          # nan unless committed
    kv_all_ms: np.ndarray          # nan unless every rank's KV reached Success
    outcome: np.ndarray            # -1 undecided, else a Decision value
    protocol_steps: int
    decode_steps: int
    sim_ms: float
    wall_seconds: float
    divergence: Divergence | None
    stuck: int                     # requests held forever (no timeout can free them)
    peak_in_flight: int            # most requests arrived and not yet done at once
    spans: list[tuple] = field(default_factory=list)   # Perfetto data, when recorded


class Simulation:
    def __init__(self, cfg: SimConfig, workload: Workload, trace: TraceWriter | None = None,
                 record_spans: bool = False, draws: Draws | None = None):
        self.cfg = cfg.validate()
        self.variant = resolve_variant(cfg)
        self.wl = workload
        self.d = draws if draws is not None else draw(cfg, workload)
        self.trace, self.record = trace, record_spans
        n, T = len(workload), cfg.ranks
        self.T = T
        self.env = simpy.Environment()
        self.state = initial_state(self.variant, T, cfg.n_slots())
        self.commit_ms = np.full(n, np.nan)
        self.kv_all_ms = np.full(n, np.nan)
        self.outcome = np.full(n, -1, dtype=np.int8)
        self.write_end = np.full((n, T), -math.inf)
        self.prealloc: deque[int] = deque()
        self.running: list[tuple[int, int]] = []   # (finishing decode step, request)
        self.in_pool = 0
        self.peak_in_flight = 0
        self.arrived = self.finished = 0       # in flight: arrived, not done decoding/aborted
        self.prefills: list[tuple[float, int]] = []   # (prefill done, request)
        self.prefill_next: float | None = None
        self.pending = 1          # arrivals still to come + scheduled callbacks
        self.decided = 0
        self.decode_steps = 0
        self.since_poll = 0       # environment events since the last protocol step
        self.to_forget: list[int] = []   # decided requests whose records the spec may drop
        self.wake: Event | None = None
        self.divergence: Divergence | None = None
        self.stuck = 0
        self.spans: list[tuple] = []
        self.forward = StepTimes(cfg.forward, stream(cfg.seed, "forward"))
        self.idle = StepTimes(cfg.idle_step, stream(cfg.seed, "idle"))
        self.room_rtt = cfg.te_overhead_ms if self.variant.room_after_payload else 0.0
        # timeline code -> (kind, rank): a table lookup instead of a divmod per event
        self.decode = [divmod(code, T) for code in range(4 * T)]

    # -- environment events ------------------------------------------------------------
    def _env_events(self, events: list[Any]) -> None:
        state = self.state
        try:
            for ev in events:
                apply(state, ev)
        except EventNotEnabled as exc:
            _refused(exc)
        self.since_poll += len(events)
        if self.trace is not None:
            for ev in events:
                self.trace.event(ev, self.env.now)

    def _arrivals(self):
        env, wl = self.env, self.wl
        servers = [0.0] * self.cfg.prefill_servers
        for i in range(len(wl)):
            t = float(wl.arrival_ms[i])
            if t > env.now:
                yield env.timeout(t - env.now)
            done = max(env.now, heapq.heappop(servers)) + float(self.d.prefill_ms[i])
            heapq.heappush(servers, done)
            self.arrived += 1
            self.peak_in_flight = max(self.peak_in_flight, self.arrived - self.finished)
            heapq.heappush(self.prefills, (done, i))
            self._wake_prefills()
        self._settle()

    def _wake_prefills(self) -> None:
        """One pending SimPy event for the earliest prefill completion (not one per request)."""
        head = self.prefills[0][0] if self.prefills else None
        if head is not None and (self.prefill_next is None or head < self.prefill_next):
            self.prefill_next = head
            self.pending += 1
            _At(self.env, head - self.env.now, self._prefilled, head)

    def _prefilled(self, target: float) -> None:
        if self.prefill_next == target:
            self.prefill_next = None
        while self.prefills and self.prefills[0][0] <= target:
            self.prealloc.append(heapq.heappop(self.prefills)[1])
        self._wake_prefills()
        self._admit()
        self._settle()

    def _admit(self) -> None:
        ranks, prealloc, pool = self.state.ranks, self.prealloc, self.cfg.request_pool
        while prealloc and self.in_pool < pool:
            for rs in ranks:        # a loop, not all(): this runs after every delivery
                if not rs.free:
                    return
            self._enqueue(prealloc.popleft())

    def _shift_stalls(self, k: int, t: float) -> float:
        """``t`` moved past any stall of rank ``k`` that covers it."""
        for s in self.cfg.stalls:
            if s.rank == k and s.start_ms <= t < s.start_ms + s.duration_ms:
                t = s.start_ms + s.duration_ms
        return t

    def _enqueue(self, i: int) -> None:
        d, now, T, rtt = self.d, self.env.now, self.T, self.room_rtt
        self._env_events([Enqueue(i, d.room[i], d.payload[i])])
        self.in_pool += 1
        fr = int(d.fail_rank[i])
        extra = float(d.late_ms[i]) if fr >= 0 else 0.0
        xfer, lag, lost = d.xfer_ms[i].tolist(), d.lag_ms[i].tolist(), d.lost[i].tolist()
        write_end = [-math.inf] * T
        events: list[tuple[float, int]] = []
        kv_all = -math.inf
        stalls, record = self.cfg.stalls, self.record
        for k in range(T):
            kv = now + xfer[k]
            if stalls:
                kv = self._shift_stalls(k, kv)
            if kv > kv_all:
                kv_all = kv
            events.append((kv, (FAIL if k == fr else KV) * T + k))
            if k == fr or lost[k]:
                continue
            land = kv + lag[k] + extra
            if stalls:
                land = self._shift_stalls(k, land)
            events.append((land, PAY * T + k))
            events.append((land + rtt, ROOMF * T + k))
            write_end[k] = land + rtt
            if record:
                self.spans.append(("kv", k, i, now, kv))
                self.spans.append(("lag", k, i, kv, land + rtt))
        self.write_end[i] = write_end
        if fr < 0:
            self.kv_all_ms[i] = kv_all
        events.sort()
        times, codes = zip(*events)
        tl = _Timeline(i, times, codes)
        self.pending += 1
        tl.due = _At(self.env, tl.times[0] - now, self._timeline, tl)
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def _timeline(self, tl: _Timeline) -> None:
        """Deliver the timeline's events due at its next time (one batch, one SimPy event).
        Without a trace, the spec's transitions are called on plain fields: the same
        transitions as ``apply`` of the events, minus building an object per event."""
        now, decode, i, state = self.env.now, self.decode, tl.req, self.state
        ranks, direct = state.ranks, self.trace is None
        times, codes, pos, end = tl.times, tl.codes, tl.pos, len(tl.times)
        target = times[pos]      # exact, where now may differ from it in the last bit
        batch: list[Any] = []
        delivered = 0
        try:
            while True:
                kind, k = decode[codes[pos]]
                pos += 1
                if kind >= PAY:
                    delivered += 1
                    if direct:
                        land(state, k, i, _LAND_FIELD[kind])
                    else:
                        batch.append(Land(k, i, _LAND_FIELD[kind]))
                elif i in ranks[k].recv:   # else the request already left: its KV is moot
                    delivered += 1
                    if direct:
                        (kv_done if kind == KV else fail)(state, k, i)
                    else:
                        batch.append(KvDone(k, i) if kind == KV else Fail(k, i))
                if pos == end or times[pos] > target:
                    break
        except EventNotEnabled as exc:
            _refused(exc)
        if direct:
            self.since_poll += delivered
        else:
            self._env_events(batch)   # env events never pop: the checks above stay valid
        tl.pos = pos
        if pos < end:
            tl.due.again(times[pos] - now)
        else:
            self._settle()
        if self.prealloc:       # a landed write may have freed a quarantined slot
            self._admit()

    def _fence(self, key: tuple[int, int]) -> None:
        k, i = key
        rs, now = self.state.ranks[k], self.env.now
        if i in rs.landed and i not in rs.fenced:
            if self.write_end[i, k] >= now and rs.landed[i] != ALL_FIELDS:
                # prefill acknowledges only once its writes are done: wait for them
                _At(self.env, self.write_end[i, k] - now, self._fence, key)
                return
            self._env_events([Fence(k, i)])
            self._admit()       # the fence may have freed a quarantined slot
        self._settle()

    def _settle(self) -> None:
        """One scheduled callback finished; with none left, wake an idle scheduler so it
        can see that nothing will ever happen again."""
        self.pending -= 1
        if self.pending == 0 and self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    # -- the decode scheduler ----------------------------------------------------------
    def _scheduler(self):
        env, state, cfg = self.env, self.state, self.cfg
        ranks, n = state.ranks, len(self.wl)
        timeout = self.variant.timeout_steps
        detail = self.trace is not None      # the trace needs the full StepRecord
        while self.decided < n:
            if not ranks[0].queue and not self.running:
                if self.pending == 0:      # nothing can arrive or land any more
                    self.stuck = len(self.prealloc)
                    return
                self.wake = env.event()
                yield self.wake
                self.wake = None
                continue
            queued = len(ranks[0].queue)
            if queued:
                s = env.now
                rec = apply(state, _STEP, detail=detail)
                self.since_poll = 0
                if self.trace is not None:
                    self.trace.step(rec, s)
                found = step_violations(state, rec)
                if found:
                    self.divergence = Divergence(rec.step, s, found[0])
                    return
                cost = cfg.allreduce_alpha_ms + cfg.allreduce_beta_ms * queued
                if self.record:
                    self.spans.append(("step", -1, rec.step, s, s + cost))
                yield env.timeout(cost)
                popped = self._record_pops(rec)
                if (not popped and not self.since_poll and timeout is None and self.pending == 0
                        and not self.running):   # nothing can change any more: held forever
                    self.stuck = len(ranks[0].queue) + len(self.prealloc)
                    return
            self.decode_steps += 1
            while self.running and self.running[0][0] <= self.decode_steps:
                heapq.heappop(self.running)
                self.in_pool -= 1
                self.finished += 1
            self._admit()
            yield env.timeout(self.forward.next() if self.running else self.idle.next())

    def _record_pops(self, rec: StepRecord | StepPops) -> int:
        popped = rec.popped
        if not popped[0]:       # the checks passed, so every rank popped the same: nothing
            return 0
        now, d = self.env.now, self.d
        for r, dec, _ in popped[0]:
            self.outcome[r] = dec
            self.decided += 1
            if dec == _COMMIT:
                self.commit_ms[r] = now
                heapq.heappush(self.running, (self.decode_steps + int(self.wl.output_len[r]), r))
            else:
                self.in_pool -= 1
                self.finished += 1
            if self.record:
                self.spans.append(("pop", -1, r, now, dec))
        self.to_forget.extend(r for r, _, _ in popped[0])
        if len(self.to_forget) >= FORGET_BATCH:
            self._forget_done()
        for k, rank_popped in enumerate(popped):
            rs = self.state.ranks[k]
            for r, dec, _ in rank_popped:
                if dec != _COMMIT and r in rs.landed and r not in rs.fenced:
                    self.pending += 1
                    _At(self.env, float(d.fence_ms[r, k]), self._fence, (k, r))
        return len(popped[0])

    def _forget_done(self) -> None:
        """Let the spec drop decided requests no write can reach any more, so memory
        follows the requests in flight (their outcomes are in the results and trace)."""
        ranks, keep = self.state.ranks, []
        for r in self.to_forget:
            if any(r in rs.slot_of for rs in ranks):
                keep.append(r)
            else:
                forget(self.state, r)
        self.to_forget = keep

    def run(self) -> RunData:
        env = self.env
        env.process(self._arrivals())
        proc = env.process(self._scheduler())
        t0 = time.perf_counter()
        env.run(until=proc)
        wall = time.perf_counter() - t0
        if self.trace is not None:
            if self.divergence is not None:
                self.trace.violation(self.divergence.violation, self.divergence.step)
            self.trace.end(self.state.steps)
        return RunData(self.cfg, self.variant, self.wl, self.wl.arrival_ms, self.commit_ms,
                       self.kv_all_ms, self.outcome, self.state.steps, self.decode_steps,
                       env.now, wall, self.divergence, self.stuck, self.peak_in_flight, self.spans)
