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
from bisect import bisect_right
from array import array
import time
from collections import deque
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import simpy
from simpy.events import NORMAL, URGENT, Event

from model.spec.batch import KV_DONE, KV_FAILED, PAYLOAD_LANDS, ROOM_LANDS
from model.spec.events import PAYLOAD, ROOM, Enqueue, Fail, Fence, KvDone, Land, Step
from model.spec.invariants import Violation
from model.spec.kernel import Decision
from model.spec.machine import EventNotEnabled, StepPops, StepRecord, apply
from model.spec.packed import PackedState
from model.spec.trace import TraceWriter
from model.spec.timeouts import deployed_variant
from model.spec.variants import VARIANTS, Admission, Variant
from sim.config import SimConfig
from sim.draws import Draws, draw, prefill_schedule, stream
from sim.steptimes import StepTimes
from sim.errors import SimInputError
from sim.rundata import Divergence, RunData
from sim.workload import Workload

# timeline event kinds, in same-time order (codes kind * ranks + rank, as batch.deliver's)
KV, FAIL, PAY, ROOMF = KV_DONE, KV_FAILED, PAYLOAD_LANDS, ROOM_LANDS
CHUNK = 4096      # requests whose timelines are laid out together (see _layout)
_LAND_FIELD = {PAY: PAYLOAD, ROOMF: ROOM}   # by kind
_STEP = Step()
FORGET_BATCH = 256
_COMMIT = int(Decision.COMMIT)


TIMEOUT_FLAGS = ("--gate-timeout-s", "--timeout-steps", "--release-timeout-s")


def resolve_variant(cfg: SimConfig) -> Variant:
    """The spec variant by name with its timeouts converted from seconds as a deployed
    worker converts them (30 s by default: the proofs' small bounds would abort healthy
    requests), and the no-clear override applied."""
    if cfg.variant not in VARIANTS:
        raise SimInputError(f"--variant: unknown variant {cfg.variant!r} (known: {', '.join(VARIANTS)})")
    try:
        v = deployed_variant(cfg.variant, cfg.timeout_steps, cfg.gate_timeout_s,
                             cfg.release_timeout_s, cfg.timeout_step_floor_ms / 1000, TIMEOUT_FLAGS)
    except ValueError as exc:       # the spec refuses a timeout the variant lacks
        raise SimInputError(str(exc)) from None
    return replace(v, clear_on_free=False) if cfg.no_clear else v


def trace_name(v: Variant) -> str | None:
    """The named variant a trace header can carry for ``v`` (None if it has none)."""
    for name, named in VARIANTS.items():
        if replace(named, name=v.name, timeout_steps=v.timeout_steps,
                   release_timeout_steps=v.release_timeout_steps) == v:
            return name
    return None


def traced_variant(cfg: SimConfig) -> tuple[str, Variant]:
    """The name a trace header gives cfg's variant, and the variant; refused if it has none."""
    v = resolve_variant(cfg)
    name = trace_name(v)
    if name is None:
        raise SimInputError(f"--trace: variant {cfg.variant} with --no-clear is not a named variant, "
                            f"so pdgate validate could not replay it")
    return name, v


def trace_writer(fp: Any, cfg: SimConfig, source: str, **extra: Any) -> TraceWriter:
    """A writer whose header carries what ``pdgate validate`` needs to replay the run:
    the named variant and its step counts (strict's timeout, the release timeout)."""
    name, v = traced_variant(cfg)
    return TraceWriter(fp, name, cfg.ranks, cfg.n_slots(), source, v.timeout_steps,
                       v.release_timeout_steps, **extra)


def _refused(exc: EventNotEnabled) -> None:
    """The driver broke its own physics: a bug, not a user error."""
    raise RuntimeError(f"simulator delivered an event the spec refuses: {exc}") from exc


def _array_of(typecode: str, values: np.ndarray) -> array:
    """A copy of a numpy array of that item size, sized exactly (array() from bytes
    over-allocates by 1/16, and a chunk's layout is large) and without a bytes copy."""
    out = array(typecode, [0]) * values.size
    memoryview(out).cast("B")[:] = np.ascontiguousarray(values).data.cast("B")
    return out


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


class _Tick(Event):
    """The scheduler's wait of ``delay`` (a Timeout, reused: SimPy orders by time, priority
    and scheduling order, so a fresh Timeout would sort the same)."""

    def __init__(self, env: simpy.Environment):
        self.env, self._value, self._ok = env, None, True
        self.callbacks: Any = []        # (SimPy sets it to None once processed)

    def after(self, delay: float) -> "_Tick":
        self.callbacks = []          # the process that yields it adds its resume
        self.env.schedule(self, NORMAL, delay)
        return self


class _Timeline:
    """One request's per-rank events (KV, then metadata), in time order: event ``k`` at
    ``base + offsets[k]`` (offsets from the enqueue, as laid out, need no per-request
    arithmetic; a timeline built with absolute times has base 0). While its request is
    queued they wait, undelivered, until a protocol step needs them (``lazy``, see
    Simulation._drain); otherwise a single pending SimPy event at a time delivers them at
    their times (keeps memory per request small)."""
    __slots__ = ("req", "base", "offsets", "codes", "pos", "due", "lazy", "events")

    def __init__(self, req: int, base: float, offsets: array, codes: array, events: int = 0):
        # (arrays, kept as given: an enqueue passes fresh slices of its chunk's layout)
        self.req, self.base, self.pos = req, base, 0
        self.offsets, self.codes = offsets, codes
        self.events = events        # the set of its codes (bit per code), where laid out
        self.due: _At | None = None     # its SimPy event, rescheduled for each batch
        self.lazy = False

    def time(self, k: int) -> float:
        return self.base + self.offsets[k]

    def due_by(self, now: float) -> int:
        """The index after the events from ``pos`` on that happen at or before ``now``.
        Those are a prefix: offsets are sorted and base + offset grows with the offset.
        The bisect on ``now - base`` (rounded) lands at the boundary or next to it."""
        offsets, base, pos = self.offsets, self.base, self.pos
        if base + offsets[-1] <= now:      # all of them: the usual case at a step
            return len(offsets)
        end = bisect_right(offsets, now - base, pos)
        while end > pos and base + offsets[end - 1] > now:
            end -= 1
        while end < len(offsets) and base + offsets[end] <= now:
            end += 1
        return end


class Simulation:
    def __init__(self, cfg: SimConfig, workload: Workload, trace: TraceWriter | None = None,
                 record_spans: bool = False, draws: Draws | None = None, eager: bool = False,
                 wall_limit_s: float | None = None):
        """``eager``: every environment batch and every scheduler step is its own SimPy
        event (always so with a trace, whose records are then in time order); otherwise
        the same run with far fewer SimPy events (see _drain and _scheduler).
        ``wall_limit_s``: stop (cut short) after that many wall seconds (a sweep's
        --cell-timeout, which works in any process or thread)."""
        self.cfg = cfg.validate()
        self.variant = resolve_variant(cfg)
        self.wl = workload
        if len(workload) and not float(workload.arrival_ms[-1]) <= cfg.max_sim_s * 1000.0:
            raise SimInputError(f"the workload's arrivals span {float(workload.arrival_ms[-1]) / 1000:.4g} s, "
                                f"beyond --max-sim-seconds ({cfg.max_sim_s:g} s)")
        self.d = draws if draws is not None else draw(cfg, workload)
        self.trace, self.record = trace, record_spans
        n, T = len(workload), cfg.ranks
        self.T = T
        self.env = simpy.Environment()
        # the ranks' state: packed across ranks, or machine.py's own form (a trace's
        # records need it, and variants the packed form does not hold)
        self.spec = PackedState(self.variant, T, cfg.n_slots(), general=trace is not None)
        # per-request results as arrays (cheaper to set one at a time than numpy's;
        # RunData views them as numpy arrays)
        self.commit_ms = array("d", np.full(n, np.nan).tobytes())
        self.kv_all_ms = array("d", self.commit_ms)
        self.outcome = array("b", bytes([0xFF]) * n)     # -1
        # for an aborted request's fences, its last write per rank: from its enqueue time
        # and its chunk's layout, or kept here when its timeline was built alone
        self.enqueued_ms = array("d", bytes(8 * n))
        self.write_end: dict[int, list[float]] = {}
        self.prealloc: deque[int] = deque()
        self.running: list[tuple[int, int]] = []   # (finishing decode step, request)
        self.in_pool = 0
        self.peak_in_flight = 0
        self.arrived = self.finished = 0       # in flight: arrived, not done decoding/aborted
        # (arrived is counted lazily, by _finish)
        self.arrivals = workload.arrival_ms.tolist()   # sorted: bisect, no numpy call per finish
        self.output_len = workload.output_len.tolist()
        self.pending = 1          # prefill completions still to come + scheduled callbacks
        self.decided = 0
        self.decode_steps = 0
        self.since_poll = 0       # environment events since the last protocol step
        self.to_forget: list[int] = []   # decided requests whose records the spec may drop
        self.wake: Event | None = None
        self.tick = _Tick(self.env)
        self.divergence: Divergence | None = None
        self.stuck = 0
        self.spans: list[tuple] = []
        self.forward = StepTimes(cfg.forward, stream(cfg.seed, "forward"))
        self.idle = StepTimes(cfg.idle_step, stream(cfg.seed, "idle"))
        # a calibrated run's measured residual of each pop's delay (None: alpha + beta x n)
        self.cost_extra: StepTimes | None = (None if cfg.allreduce_extra is None else
                                             StepTimes(cfg.allreduce_extra, stream(cfg.seed, "allreduce")))
        self.room_rtt = cfg.te_overhead_ms if self.variant.room_after_payload else 0.0
        # timeline code -> (kind, rank): a table lookup instead of a divmod per event
        self.decode = [divmod(code, T) for code in range(4 * T)]
        self.eager = eager or trace is not None
        # timelines built by _timeline_of (the writer's queue needs each enqueue's time)
        self.per_event = bool(cfg.stalls) or record_spans or cfg.writer is not None
        self.writer_free = 0.0     # when the calibrated prefill writer is next free
        # a calibrated e2e's KV page pool (cfg.page_pool; 0: not modelled)
        self.page_pool = cfg.page_pool or 0
        self.page_free = self.page_pool
        self.page_held: deque[int] = deque()      # committed requests' pages, oldest first
        self.pages_freed = False                  # this decode step freed held pages
        self.pages_of: list[int] = workload.input_len.tolist() if self.page_pool else []
        self.lazy: list[tuple[float, int, _Timeline]] = []   # heap of waiting timelines
        self.active: dict[int, _Timeline] = {}                # queued request -> its lazy timeline
        self.end_ms = 0.0
        self.cut_short: str | None = None      # why the run stopped before every request was decided
        self.wall_limit_s = wall_limit_s
        self.layouts: dict[int, tuple] = {}    # chunk -> _layout's arrays
        self.enqueuing: tuple = (-1, None, None)   # the chunk of the last enqueue, its draws, layout
        # only local admission can leave a rank without the request (machine.admitting)
        self.local_admission = self.variant.admission is not Admission.AGREED

    # -- environment events ------------------------------------------------------------
    def _env_events(self, events: list[Any], now: float) -> None:
        """Traced runs: the events on machine.py's state, each written to the trace."""
        state = self.spec.system()
        try:
            for ev in events:
                apply(state, ev)
        except EventNotEnabled as exc:
            _refused(exc)
        self.since_poll += len(events)
        trace = self.trace
        assert trace is not None       # (only traced runs come here)
        for ev in events:
            trace.event(ev, now)

    def _prefill_plan(self) -> tuple[list[float], list[int]]:
        """Prefill completion times and requests, in completion order. Prefill depends
        on nothing the decode side does (FIFO servers, fixed durations), so it is planned
        up front and SimPy gets one event per completion instant, none per arrival."""
        ends, _ = prefill_schedule(self.arrivals, self.d.prefill_ms.tolist(), self.cfg.prefill_servers)
        times = np.asarray(ends, dtype=np.float64)
        order = np.argsort(times, kind="stable")
        return times[order].tolist(), order.tolist()     # lists: an index and a slice per completion

    def _prefilled(self, pos: int) -> None:
        """Every prefill completing at the plan's ``pos``-th time joins the prealloc queue."""
        times, reqs = self.plan
        now, end = times[pos], len(times)
        stop = pos + 1
        if stop < end and times[stop] == now:     # (rare: the bisect only for ties)
            stop = bisect_right(times, now, stop)
        self.prealloc.extend(reqs[pos:stop])
        pos = stop
        if pos < end:
            self.prefill_due.arg = pos
            self.prefill_due.again(times[pos] - self.env.now)
        self._admit(self.env.now)
        if pos == end:
            self._settle()

    def _finish(self, now: float, n: int = 1) -> None:
        """``n`` requests are done (decoded or aborted) at ``now``."""
        self._in_flight_peak(now)      # (before they count: the peak is just before)
        self.finished += n

    def _decoded(self, step: int, now: float) -> None:
        """The running requests whose last decode step is ``step`` are done (at ``now``)."""
        running, n = self.running, 0
        while running and running[0][0] <= step:
            heapq.heappop(running)
            n += 1
        self.in_pool -= n
        self._finish(now, n)

    def _in_flight_peak(self, now: float) -> None:
        """Count the arrivals up to ``now``. In flight (arrived - finished) falls only at
        a finish, so its peak is reached just before one (or at the end of the run)."""
        k, arrivals = self.arrived, self.arrivals
        if k < len(arrivals) and arrivals[k] <= now:     # (often none since the last call)
            k = self.arrived = bisect_right(arrivals, now, k)   # now never goes back
        if k - self.finished > self.peak_in_flight:
            self.peak_in_flight = k - self.finished

    def _admit(self, now: float) -> None:
        """Enqueue waiting requests (at simulated time ``now``) while the pool and every
        rank's free list have room."""
        spec, prealloc, pool = self.spec, self.prealloc, self.cfg.request_pool
        while prealloc and self.in_pool < pool:
            if not spec.admitting():      # the spec's admission rule (agreed, or per rank)
                return
            if self.page_pool and not self._take_pages(self.pages_of[prealloc[0]]):
                return
            self._enqueue(prealloc.popleft(), now)

    def _take_pages(self, need: int) -> bool:
        """A calibrated e2e's KV pages (cfg.page_pool): committed requests keep theirs
        until an admission is short, which frees the oldest, once per decode step and
        only enough for the first waiting request (the e2e's byte check, rank.py)."""
        if self.page_free < need and not self.pages_freed:
            self.pages_freed = True
            held = self.page_held
            while held and self.page_free < need:
                self.page_free += held.popleft()
        if self.page_free < need:
            return False
        self.page_free -= need
        return True

    def _shift_stalls(self, k: int, t: float) -> float:
        """``t`` moved past any stall of rank ``k`` that covers it."""
        for s in self.cfg.stalls:
            if s.rank == k and s.start_ms <= t < s.start_ms + s.duration_ms:
                t = s.start_ms + s.duration_ms
        return t

    def _layout(self, c: int) -> tuple[array, array, list[int], np.ndarray, array, list[int]]:
        """Timelines of requests ``c * CHUNK ..`` relative to their enqueue time, laid out
        with numpy: event offsets sorted per request (absent events last, at +inf) and
        their codes (float64 and int64 arrays, ``3 * ranks`` per request), the count of
        real events, the last write per rank (-inf: none) and the latest KV completion
        (NaN where a transfer fails). The offsets, codes, counts and KV completions are
        in forms an enqueue reads without numpy work, and as compact as arrays (the kept
        chunks count in the memory per request in flight). Without stalls an event's
        time is enqueue + offset, and adding the same number keeps the order, so the
        order is known up front."""
        cached = self.layouts.get(c)
        if cached is not None:
            return cached
        ch, T = self.d.chunk(c), self.T
        xfer, lag, fr = ch.xfer_ms, ch.lag_ms, ch.fail_rank
        failed = np.arange(T)[None, :] == fr[:, None]
        extra = np.where(fr >= 0, ch.late_ms, 0.0)
        land = xfer + lag + extra[:, None]
        meta = ~(failed | ch.lost)
        room = np.where(meta, land + self.room_rtt, np.inf)
        rel = np.concatenate([xfer, np.where(meta, land, np.inf), room], axis=1)
        k = np.arange(T)[None, :]
        codes = np.concatenate([np.where(failed, FAIL * T + k, KV * T + k),
                                np.broadcast_to(PAY * T + k, xfer.shape),
                                np.broadcast_to(ROOMF * T + k, xfer.shape)], axis=1)
        order = np.lexsort((codes, rel))
        rel = np.take_along_axis(rel, order, axis=1)
        codes = np.take_along_axis(codes, order, axis=1).astype(np.int64)
        count = np.isfinite(rel).sum(axis=1).tolist()
        kv_all = array("d", np.where(fr >= 0, np.nan, xfer.max(axis=1)).tobytes())
        # each request's codes as one set, for spec.deliver_set (as int64: up to 15 ranks)
        sets = (np.bitwise_or.reduce(np.where(np.isfinite(rel), np.left_shift(1, codes), 0), axis=1)
                .tolist() if 4 * T < 63 else [0] * len(count))
        out = (_array_of("d", rel), _array_of("q", codes), count, np.where(meta, room, -math.inf),
               kv_all, sets)
        if len(self.layouts) >= 4:       # requests enqueue in about arrival order
            self.layouts.pop(next(iter(self.layouts)))
        self.layouts[c] = out
        return out

    def _enqueue(self, i: int, now: float) -> None:
        c, j = divmod(i, CHUNK)
        if c != self.enqueuing[0]:      # requests enqueue in about arrival order
            self.enqueuing = (c, self.d.chunk(c), None if self.per_event else self._layout(c))
        _, ch, layout = self.enqueuing
        room, payload = ch.room[j], ch.payload[j]
        try:
            self.spec.enqueue(i, room, payload)     # apply(Enqueue) without the event object
        except EventNotEnabled as exc:
            _refused(exc)
        self.since_poll += 1
        if self.trace is not None:
            self.trace.event(Enqueue(i, room, payload), now)
        self.in_pool += 1
        if self.per_event:
            tl = self._timeline_of(i, now)
            self.enqueued_ms[i] = now
        else:
            rel, codes, count, _, kv_all, sets = layout
            at = j * 3 * self.T                        # 3 * ranks events per request
            end = at + count[j]
            tl = _Timeline(i, now, rel[at:end], codes[at:end], sets[j])
            self.enqueued_ms[i] = now
            self.kv_all_ms[i] = now + kv_all[j]        # NaN (its default) where a transfer fails
        spec = self.spec
        if self.local_admission and not all(spec.in_queue(k, i) for k in range(self.T)):
            # some ranks left it out: only their events happen
            keep = [j for j, c in enumerate(tl.codes) if spec.in_queue(c % self.T, i)]
            tl = _Timeline(i, tl.base, array("d", [tl.offsets[j] for j in keep]),
                           array("q", [tl.codes[j] for j in keep]))
            if not keep:
                return
        if self.eager:
            self._schedule(tl)
        else:
            tl.lazy = True
            self.active[i] = tl
            heapq.heappush(self.lazy, (tl.base + tl.offsets[0], i, tl))
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def _timeline_of(self, i: int, now: float) -> _Timeline:
        """Request ``i``'s timeline one event at a time: with stalls (which move events
        by their absolute time) or Perfetto spans to record."""
        (ch, j), T, rtt = self.d.row(i), self.T, self.room_rtt
        fr = int(ch.fail_rank[j])
        extra = float(ch.late_ms[j]) if fr >= 0 else 0.0
        xfer, lag, lost = ch.xfer_ms[j].tolist(), ch.lag_ms[j].tolist(), ch.lost[j].tolist()
        if self.cfg.writer is not None:
            xfer, lag = self._written(now, xfer, lag)
        write_end = [-math.inf] * T
        events: list[tuple[float, int]] = []
        kv_all = -math.inf
        record = self.record
        for k in range(T):
            kv = self._shift_stalls(k, now + xfer[k])
            kv_all = max(kv_all, kv)
            events.append((kv, (FAIL if k == fr else KV) * T + k))
            if k == fr or lost[k]:
                continue
            land = self._shift_stalls(k, kv + lag[k] + extra)
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
        return _Timeline(i, 0.0, array("d", times), array("q", codes))

    def _written(self, now: float, service: list[float], waits: list[float]
                 ) -> tuple[list[float], list[float]]:
        """A request enqueued at ``now`` through the calibrated prefill writer (a FIFO
        server, sim/config.py WriterFit) whose KV writes take ``service`` per rank:
        each rank's Success (relative to ``now``) and its row's lag after it. A delayed
        row waits ``waits`` (drawn from measured waits) or, without measurements, the
        backlog the request found."""
        w = self.cfg.writer
        assert w is not None
        free = self.writer_free
        # a delayed row's writes queue behind the backlog of their time, taken to be the
        # backlog this request found (the queue's later arrivals are not known yet)
        backlog = max(0.0, free - now - w.xfer_delay_ms)
        xfer: list[float] = []
        lag: list[float] = []
        for k in range(self.T):
            kv = max(now + w.xfer_delay_ms, free) + service[k]
            delay = w.delay_ms[k]
            if delay > 0:           # Success first, the row (payload, room) later
                success, free = kv + w.push_ms, kv
                land = kv + delay + (backlog + 2 * w.room_ms if w.queue_delayed else waits[k])
            else:                   # the room, then Success
                free = kv + w.room_ms
                success, land = free + w.push_ms, free
            xfer.append(success - now)
            lag.append(max(0.0, land - success))
        self.writer_free = free
        return xfer, lag

    def _schedule(self, tl: _Timeline) -> None:
        """Deliver ``tl``'s remaining events at their times, by SimPy events."""
        self.pending += 1
        tl.due = _At(self.env, tl.time(tl.pos) - self.env.now, self._timeline, tl)

    def _deliver(self, tl: _Timeline, until: float) -> None:
        """Deliver the timeline's events due at its next time or, with ``until``, every
        event up to that time. Without a trace, the spec's transitions are called on
        plain fields: the same transitions as ``apply`` of the events, minus building an
        object per event."""
        decode, i, spec = self.decode, tl.req, self.spec
        direct = self.trace is None
        base, offsets, codes, pos, end = tl.base, tl.offsets, tl.codes, tl.pos, len(tl.codes)
        target = max(base + offsets[pos], until)   # exact, where now may differ from it in the last bit
        batch: list[Any] = []      # codes for the spec, or (traced) events
        try:
            while True:
                code = codes[pos]
                kind, k = decode[code]
                pos += 1
                if kind >= PAY:
                    if direct:
                        batch.append(code)
                    else:
                        batch.append(Land(k, i, _LAND_FIELD[kind]))
                elif spec.in_queue(k, i):   # else the request already left: its KV is moot
                    if direct:
                        batch.append(code)
                    else:
                        batch.append(KvDone(k, i) if kind == KV else Fail(k, i))
                if pos == end or base + offsets[pos] > target:
                    break
            if direct:
                spec.deliver(i, batch)
        except EventNotEnabled as exc:
            _refused(exc)
        if direct:
            self.since_poll += len(batch)
        else:
            self._env_events(batch, self.env.now)   # env events never pop: the checks above stay valid
        tl.pos = pos

    def _timeline(self, tl: _Timeline) -> None:
        """The SimPy callback of a scheduled timeline: one batch, then the next. A
        request that left the queue may still write into a slot that now has a new,
        queued tenant, whose own writes wait in the heap: those due first land first."""
        if self.lazy:
            self._drain(self.env.now)
        self._deliver(tl, -math.inf)
        if tl.pos < len(tl.codes):
            assert tl.due is not None      # (this callback is its _At)
            tl.due.again(tl.time(tl.pos) - self.env.now)
        else:
            self._settle()
        if self.prealloc:       # a landed write may have freed a quarantined slot
            self._admit(self.env.now)

    def _drain(self, now: float) -> None:
        """Deliver every waiting event of the queued requests due at or before ``now``.
        Exact: until a request leaves the queue, its KV and metadata events change only
        its own receiver, row and landed bits, which nothing reads before the next
        protocol step (admission reads the free lists, which they cannot change); events
        of different queued requests commute; and a late write of a request that left
        (which may hit a reused slot) drains the heap up to its own time first."""
        heap = self.lazy
        while heap and heap[0][0] <= now:
            tl = heapq.heappop(heap)[2]
            if not tl.lazy:
                continue            # its request left the queue: SimPy delivers the rest
            pos = tl.pos
            end = tl.due_by(now)
            try:
                if end - pos == len(tl.codes) and tl.events:
                    # all its events at once: in code order, which is as good as time
                    # order (each rank's KV, payload and room come in that order, and
                    # events on different ranks commute: PackedState.deliver_set)
                    self.spec.deliver_set(tl.req, tl.events)
                else:
                    self.spec.deliver(tl.req, tl.codes[pos:end])
            except EventNotEnabled as exc:
                _refused(exc)
            self.since_poll += end - pos
            tl.pos = end
            if end < len(tl.codes):
                heapq.heappush(heap, (tl.time(end), tl.req, tl))
            else:
                tl.lazy = False
                del self.active[tl.req]

    def _leave(self, popped: Sequence[tuple[int, int, int]]) -> None:
        """Requests that left the queue: their undelivered events (late writes, which can
        free a quarantined slot) now happen at their own times."""
        for r, _, _ in popped:
            tl = self.active.pop(r, None)
            if tl is not None:
                tl.lazy = False
                self._schedule(tl)

    def _fence(self, key: tuple[int, int]) -> None:
        k, i = key
        spec, now = self.spec, self.env.now
        if spec.fenceable(k, i):
            end = self._last_write(i, k)
            if end >= now and spec.writes_pending(k, i):
                # prefill acknowledges only once its writes are done: wait for them
                _At(self.env, end - now, self._fence, key)
                return
            if self.trace is not None:
                self._env_events([Fence(k, i)], now)
            else:
                try:
                    spec.fence(k, i)
                except EventNotEnabled as exc:
                    _refused(exc)
                self.since_poll += 1
            self._admit(now)    # the fence may have freed a quarantined slot
        self._settle()

    def _last_write(self, i: int, k: int) -> float:
        """When request ``i``'s last write to rank ``k`` lands (-inf: it has none)."""
        alone = self.write_end.get(i)
        if alone is not None:
            return alone[k]
        c, j = divmod(i, CHUNK)
        return self.enqueued_ms[i] + float(self._layout(c)[3][j, k])

    def _settle(self) -> None:
        """One scheduled callback finished; with none left, wake an idle scheduler so it
        can see that nothing will ever happen again."""
        self.pending -= 1
        if self.pending == 0 and self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    # -- the decode scheduler ----------------------------------------------------------
    def _catch_up(self, t: float):
        """Let every SimPy event due at or before ``t`` happen (then the scheduler acts at
        ``t`` on what they did). When none is due, the scheduler runs ahead of SimPy's
        clock without yielding: nothing could have happened in between. Eager: a SimPy
        event for every scheduler action, as a trace wants."""
        env = self.env
        if self.eager:
            yield env.timeout(t - env.now)
            return
        while env.peek() <= t:
            yield self.tick.after(max(0.0, t - env.now))

    def _scheduler(self):
        env, spec, cfg = self.env, self.spec, self.cfg
        n = len(self.wl)
        timeout = self.variant.timeout_steps
        detail = self.trace is not None      # the trace needs the full StepRecord
        eager, running = self.eager, self.running
        forward, idle = self.forward.next, self.idle.next      # a decode step's duration
        prealloc = self.prealloc
        t = env.now                          # the scheduler's clock (>= SimPy's)
        limit_ms = cfg.max_sim_s * 1000.0
        alpha, beta = cfg.allreduce_alpha_ms, cfg.allreduce_beta_ms     # the all-reduce's cost
        extra = self.cost_extra
        # protocol steps bound the work (decode steps are bounded by the output tokens)
        max_steps = cfg.max_steps if cfg.max_steps is not None else 10**5 + 1000 * n
        deadline = None if self.wall_limit_s is None else time.perf_counter() + self.wall_limit_s
        while self.decided < n:
            steps = spec.steps
            if t > limit_ms or steps >= max_steps or (
                    deadline is not None and not steps & 1023 and time.perf_counter() > deadline):
                bound = ("--max-sim-seconds" if t > limit_ms else "--max-steps"
                         if steps >= max_steps else f"--cell-timeout ({self.wall_limit_s:g} s)")
                self.cut_short = (f"stopped at simulated t={t / 1000:.6g} s after {steps} "
                                  f"protocol steps with {n - self.decided} request(s) undecided: "
                                  f"{bound} reached (raise it to go on)")
                break
            if eager or env.peek() <= t:
                yield from self._catch_up(t)
            queued = spec.queued()
            if not queued and not running:
                if self.pending == 0 and not self.active:   # nothing can arrive or land any more
                    self.stuck = len(self.prealloc)
                    break
                self.wake = env.event()
                yield self.wake
                self.wake = None
                t = env.now
                continue
            if queued:
                s = t
                if self.lazy:
                    self._drain(s)
                # quiet: no event since the last step (every delivery counts in since_poll)
                rec = apply(spec.general, _STEP) if detail else spec.step(self.since_poll == 0)
                self.since_poll = 0
                if self.trace is not None:
                    self.trace.step(rec, s)
                found = spec.violations(rec)
                if found:
                    self.divergence = Divergence(rec.step, s, found[0])
                    break
                if rec.popped[0] and self.active:
                    self._leave(rec.popped[0])
                cost = alpha + beta * queued
                if extra is not None:
                    cost = max(cost + extra.next(), 0.0)
                if self.record:
                    self.spans.append(("step", -1, rec.step, s, s + cost))
                t = s + cost
                if eager or env.peek() <= t:
                    yield from self._catch_up(t)
                popped = self._record_pops(rec, t)
                if (not popped and not self.since_poll and timeout is None and self.pending == 0
                        and not running and not self.active):   # nothing can change: held forever
                    self.stuck = spec.queued() + len(self.prealloc)
                    break
            # A decode step; with an empty transfer queue several run back to back (no
            # protocol step between them) until something is due or a request enqueues.
            nxt = env.peek() if not (queued or eager) else t
            done = self.decode_steps      # a local in this hot loop (nothing it calls reads it)
            while True:
                done += 1
                if running and running[0][0] <= done:
                    self._decoded(done, t)
                if prealloc:
                    self.pages_freed = False
                    self._admit(t)
                if not running:
                    t += idle()
                    break
                t += forward()
                if t >= nxt or spec.queued():
                    break
                if not prealloc:
                    # Until the next request finishes (at step running[0][0]) the steps
                    # only take their forward passes: nothing to pop, nor to admit (only
                    # a SimPy callback fills prealloc), so they are taken in one call.
                    t, taken = self.forward.advance(t, nxt, running[0][0] - done - 1)
                    done += taken
                    if t >= nxt:
                        break
            self.decode_steps = done
        self.end_ms = t

    def _record_pops(self, rec: StepRecord | StepPops, now: float) -> int:
        """Book the step's pops, which take effect at ``now`` (after the all-reduce)."""
        popped = rec.popped
        if not popped[0]:       # the checks passed, so every rank popped the same: nothing
            return 0
        pops = popped[0]
        outcome, commit_ms, write_end, running = self.outcome, self.commit_ms, self.write_end, self.running
        first_step, output_len = self.decode_steps, self.output_len
        aborted = False
        for r, dec, _ in pops:
            outcome[r] = dec
            if dec == _COMMIT:
                write_end.pop(r, None)      # a commit gets no fence
                commit_ms[r] = now
                heapq.heappush(running, (first_step + output_len[r], r))
                if self.page_pool:
                    self.page_held.append(self.pages_of[r])
            else:
                if self.page_pool:
                    self.page_free += self.pages_of[r]
                aborted = True
                self.in_pool -= 1
                self._finish(now)
            if self.record:
                self.spans.append(("pop", -1, r, now, dec))
        self.decided += len(pops)
        self.to_forget.extend([r for r, _, _ in pops])
        if len(self.to_forget) >= FORGET_BATCH:
            self._forget_done()
        if not aborted and popped.count(pops) == len(popped):
            return len(pops)             # commits only, on every rank: no fence to wait for
        d = self.d
        for k, rank_popped in enumerate(popped):
            for r, dec, _ in rank_popped:
                if dec != _COMMIT and self.spec.fenceable(k, r):
                    self.pending += 1
                    ch, j = d.row(r)
                    _At(self.env, now + float(ch.fence_ms[j, k]) - self.env.now, self._fence, (k, r))
        return len(pops)

    def _forget_done(self) -> None:
        """Let the spec drop decided requests no write can reach any more, so memory
        follows the requests in flight (their outcomes are in the results and trace)."""
        keep = self.spec.forget_done(self.to_forget)
        if self.write_end:
            held = set(keep)
            for r in self.to_forget:
                if r not in held:
                    self.write_end.pop(r, None)
        self.to_forget = keep

    def run(self) -> RunData:
        env = self.env
        self.plan = self._prefill_plan()
        if self.plan[0]:
            self.prefill_due = _At(env, self.plan[0][0], self._prefilled, 0)   # reused by each
        else:
            self._settle()
        proc = env.process(self._scheduler())
        t0 = time.perf_counter()
        env.run(until=proc)
        wall = time.perf_counter() - t0
        self._in_flight_peak(self.end_ms)
        if self.trace is not None:
            if self.divergence is not None:
                self.trace.violation(self.divergence.violation, self.divergence.step)
            self.trace.end(self.spec.steps)
        return RunData(self.cfg, self.variant, self.wl, self.wl.arrival_ms,
                       np.frombuffer(self.commit_ms), np.frombuffer(self.kv_all_ms),
                       np.frombuffer(self.outcome, dtype=np.int8), self.spec.steps, self.decode_steps,
                       self.end_ms, wall, self.divergence, self.stuck, self.peak_in_flight, self.spans,
                       self.cut_short, np.frombuffer(self.enqueued_ms))
