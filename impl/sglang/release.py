"""One SGLang release's own decode transfer queue, built on CPU from its wheel and driven
by spec events on one rank.

``load_release(version)`` executes the release's decode-side modules through the stub
layer (``impl.sglang.stubs``); ``SGLangRank`` gives that release's ``DecodeTransferQueue``
fake receivers, its own ``MetadataBuffers`` and slot allocator, and performs a trace's
events on them: ``enqueue`` allocates a slot and ``add``s a ``DecodeRequest``, ``kv_done``
/ ``fail`` latch the receiver, ``land`` writes the room or the first token into the slot
this rank gave the request (also after it left: a late write), ``fence`` marks the abort
acknowledged, and ``step`` calls the release's own ``pop_transferred``. What the step did
is read back from the outside: the queue before and after, the polls the receivers
returned, the vector the release handed to ``all_reduce`` and what came back (an
observing wrapper around ``torch.distributed`` in the release's ``utils``; it forwards
every call unchanged), and each request's ``finished_reason`` message.
"""
from __future__ import annotations

import importlib
import inspect
import os
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from impl.sglang import fakes, stubs
from impl.sglang.reasons import decision_of
from impl.sglang.wheels import open_wheel
from model.spec.events import ROOM, Enqueue, Event, Fail, Fence, KvDone, Land
from model.spec.kernel import Decision
from model.spec.variants import Variant

DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"


class RefusedEvent(RuntimeError):
    """The release cannot perform a trace event the spec allows (no free slot)."""


class UnknownAbort(RuntimeError):
    """A request left with a finished_reason none of the known messages names."""


@dataclass
class Release:
    version: str
    decode: types.ModuleType
    utils: types.ModuleType
    recorder: stubs.Recorder
    server_args: fakes.ServerArgs
    parallel: list          # [fakes.Parallel]: get_parallel() reads it when a queue is built
    collective_timeout_s: float = 3.0       # pdgate's swapped-in collectives wait this long
    observer: Any = None                    # the current SGLangRank's ObservingDist
    strict: Any = None      # what a patched source's own install_at_import patched


def load_release(version: str, *, deferred: bool = False, source: str | None = None) -> Release:
    """Execute ``version``'s decode modules (MissingRelease if not cached). Replaces any
    release loaded before in this process. ``deferred``: SGLang's deferred KV release
    (#35049, 0.5.19+) on or off (its environment switch). ``source``: a source tree whose
    modules replace the wheel's (the release with a diff applied)."""
    wheel = open_wheel(version, source)
    os.environ[DEFERRED_ENV] = "true" if deferred else "false"
    server_args, parallel = fakes.ServerArgs(), [None]
    recorder = stubs.install(wheel.source_of, fakes.provided(server_args, parallel))
    fakes._Recording._recorder = recorder
    decode = importlib.import_module("sglang.srt.disaggregation.decode")
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    return Release(version, decode, utils, recorder, server_args, parallel)


def _call_with(fn: Callable[..., Any], available: dict[str, Any]) -> Any:
    """Call ``fn`` with the parameters of its signature that ``available`` names (the
    constructors' shapes change from release to release)."""
    params = inspect.signature(fn).parameters
    missing = [n for n, p in params.items() if n not in available and n != "self"
               and p.default is inspect.Parameter.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        raise TypeError(f"{getattr(fn, '__qualname__', fn)} needs {missing}: unknown to pdgate")
    return fn(**{n: available[n] for n in params if n in available})


class ObservingDist:
    """``torch.distributed`` as the release's utils sees it: every call forwarded; each
    ``all_reduce`` of the step is logged as (input values, output values)."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self.returned: list[list[int]] = []      # what the queue's poll function returned

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def note(self, gated: list) -> None:
        """What a swapped-in pdgate function puts into its own collective (the reduced
        values are what it returns)."""
        self.calls.append([list(gated), []])

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        call = [tensor.tolist(), []]        # noted first: the call may time out
        self.calls.append(call)
        out = dist.all_reduce(tensor, *args, **kwargs)
        call[1] = tensor.tolist()
        return out


def _observed(release: Release, fn: Callable[..., list]) -> Callable[..., list]:
    """The release's poll function as its queue calls it, its result noted by the
    current rank's observer."""
    def call(*args: Any, **kwargs: Any) -> list:
        out = fn(*args, **kwargs)
        release.observer.returned.append(list(out))
        return out
    call._pdgate_observed = True          # type: ignore[attr-defined]
    return call


class StepClock:
    """``time`` as the release's decode module sees it: ``monotonic()`` counts protocol
    steps (so SGLang's deferred-release deadline, in seconds, becomes the spec's
    ``release_timeout_steps``); everything else is the real module."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@dataclass
class StepResult:
    queue: list[int]
    local: list[int]
    gated: list[int]
    reduced: list[int]
    popped: list[list[int]]          # [req, Decision, payload]
    error: str | None = None


@dataclass
class SGLangRank:
    """One rank of a release's transfer queue, driven by spec events."""
    release: Release
    rank: int
    world: int
    group: Any
    slots: int
    deferred: bool = False
    variant: Variant | None = None      # what the job validates against (admission, release)
    receivers: dict[int, fakes.KvReceiver] = field(default_factory=dict)
    slot_of: dict[int, int] = field(default_factory=dict)
    rooms: dict[int, Enqueue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        u, d = self.release.utils, self.release.decode
        self.release.parallel[0] = fakes.Parallel(self.group, self.rank, self.world)
        self.kv_mgr = fakes.KvManager(self.deferred)
        self.buffers = _call_with(u.MetadataBuffers, {
            "size": self.slots, "hidden_size": 16, "hidden_states_dtype": torch.float32,
            "max_sampling_mask_tokens": 16})
        self.allocator = u.ReqToMetadataIdxAllocator(self.slots)
        self.scheduler = fakes.Scheduler(self.release.server_args)
        self.queue = _call_with(d.DecodeTransferQueue, {
            "gloo_group": self.group, "req_to_metadata_buffer_idx_allocator": self.allocator,
            "tp_rank": self.rank, "metadata_buffers": self.buffers,
            "scheduler": self.scheduler, "tree_cache": fakes.TreeCache()})
        self.clock = StepClock()
        d.time = self.clock
        release_steps = getattr(self.variant, "release_timeout_steps", None)
        if release_steps is not None and hasattr(self.queue, "deferred_kv_release_timeout"):
            self.queue.deferred_kv_release_timeout = float(release_steps)
        self.local_admission = getattr(getattr(self.variant, "admission", None), "value",
                                       "agreed") == "local"
        self.observer = ObservingDist()
        u.dist = self.observer
        self.release.observer = self.observer
        if self.release.strict is not None:
            self.release.strict.observer = self.observer
        for name in ("poll_and_all_reduce", "poll_and_all_reduce_with_staging"):
            fn = getattr(d, name, None)
            if fn is not None and not getattr(fn, "_pdgate_observed", False):
                setattr(d, name, _observed(self.release, fn))

    def queue_length(self) -> int:
        return len(self.queue.queue)

    def apply(self, ev: Event) -> None:
        if isinstance(ev, Enqueue):
            agree = getattr(self.queue, "agree_releases", None)
            if agree is not None:       # the strict patch: agreed releases before admission
                agree()
            resolve = getattr(self.queue, "resolve_deferred_releases", None)
            if resolve is not None and self.variant is not None \
                    and self.variant.defer_failed.value == "agreed":
                # 0.5.23 resolves its holds before each admission (a collective: every
                # rank applies every enqueue), as the spec releases a hold at the fence
                # that makes every holder ready
                resolve()
            slot = self.allocator.alloc()
            if slot is None and self.local_admission:
                return       # SGLang's prealloc keeps it on this rank (local admission)
            if slot is None:
                raise RefusedEvent(f"no free metadata slot for request {ev.req}")
            recv = fakes.KvReceiver(self.kv_mgr)
            req = fakes.Req(str(ev.req), ev.room)
            dr = self.release.decode.DecodeRequest(req=req, kv_receiver=recv,
                                                   metadata_buffer_index=slot)
            self.receivers[ev.req], self.slot_of[ev.req], self.rooms[ev.req] = recv, slot, ev
            self.queue.add(dr)
            return
        if ev.rank != self.rank or ev.req not in self.receivers:
            return
        recv = self.receivers[ev.req]
        if isinstance(ev, KvDone):
            recv.state = fakes.SUCCESS
        elif isinstance(ev, Fail):
            recv.state = fakes.FAILED
        elif isinstance(ev, Land):
            slot = self.slot_of[ev.req]
            if ev.field == ROOM:
                self.buffers.bootstrap_room[slot, 0] = self.rooms[ev.req].room
            else:
                self.buffers.output_ids[slot, 0] = self.rooms[ev.req].payload
            recv.landed.add(ev.field)
        elif isinstance(ev, Fence):
            self.kv_mgr.fenced.add(self.rooms[ev.req].room)
            recv.fenced = True
            if self.variant is not None and self.variant.defer_failed.value == "local":
                # a rank-local deferral releases on the rank's own acknowledgement (0.5.21
                # resolves per rank, no collective): what its next iteration does first
                self.queue.resolve_deferred_releases()
        release_fenced = getattr(self.queue, "release_fenced", None)
        if release_fenced is not None:          # the strict patch's quarantine
            release_fenced()

    def step(self) -> StepResult:
        """The release's own step: deferred releases resolved, then ``pop_transferred``."""
        before = list(self.queue.queue)
        receivers = [d.kv_receiver for d in before]
        local: list[int] = []
        for r in receivers:
            r.polled = local
        self.observer.calls.clear()
        self.observer.returned.clear()
        returned = self.observer.returned
        error = None
        transferred: list[Any] = []
        self.clock.now += 1.0
        try:
            resolve = getattr(self.queue, "resolve_deferred_releases", None)
            if resolve is not None:       # what the scheduler's iteration does first
                resolve()
            self.observer.calls.clear()   # 0.5.23 agrees its releases with an all_reduce
            transferred = self.queue.pop_transferred()
        except Exception as exc:         # a collective timeout or mismatch: the divergence
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        for r in receivers:
            r.polled = None
        # the first all_reduce of pop_transferred is the poll MIN; a single rank may reduce
        # nothing (0.5.23 skips the collective), and then the MIN is its own vector
        polls = self.observer.calls[0] if self.observer.calls else None
        if polls is None and returned:
            polls = [returned[0], []]
        if polls is not None and not polls[1] and returned:
            polls[1] = returned[0]
        gated, reduced = polls if polls is not None else ([], [])
        after = {id(d) for d in self.queue.queue}
        committed = {id(r) for r in transferred}
        popped = [] if error else [self._popped(d, committed) for d in before
                                   if id(d) not in after]
        return StepResult([int(d.req.rid) for d in before], local, list(gated), list(reduced),
                          popped, error)

    def _popped(self, d: Any, committed: set[int]) -> list[int]:
        req = d.req
        if id(req) in committed:
            return [int(req.rid), int(Decision.COMMIT), int(req.output_ids[-1])]
        message = getattr(req.finished_reason, "message", None) or str(req.finished_reason)
        decision = decision_of(message)
        if decision is not None:
            return [int(req.rid), int(decision), 0]
        raise UnknownAbort(f"request {req.rid} left with an unknown reason: {message!r}")
