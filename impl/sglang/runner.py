"""Run SGLang releases' own transfer queues on T gloo processes, driven by spec traces,
and turn what they did into pdgate traces.

The T processes are started once per rank count and run every (release, mode, trace)
job in turn (``impl.ranks.run_ranks``), loading each release once. Each step, after
the release's ``pop_transferred``, the ranks compare notes over the default group (a
referee collective outside SGLang's code): every rank's queue length before the step and
whether its step raised. SGLang's own code skips the MIN on a rank whose queue is empty
and enters it on the others, so a divergence shows as one rank timing out in a
collective its peer never joins (the data group's timeout, seconds); the referee turns
that into the spec's ``hang`` record with every rank's queue length, and the next job
gets a fresh data group. Nothing here decides what a step should do: the merged trace
is validated by the spec (``model.spec.validate``).
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import torch.distributed as dist

from impl.ranks import run_ranks
from impl.sglang.release import RefusedEvent, StepResult
from impl.replay import Script, _merge as merge_ranks
from model.spec.events import PAYLOAD, ROOM, Land, Step
from model.spec.invariants import check_invariants
from model.spec.machine import EventNotEnabled, apply
from model.spec.state import initial_state
from model.spec.validate import ValidationResult, validate
from model.spec.variants import Variant

# own: the release as shipped; swap: pdgate's drop-ins; patch: the strict patch as
# install() deploys it (agreed release); patch-local: the patch releasing slots per rank
MODES = ("own", "swap", "patch", "patch-local")


@dataclass(frozen=True)
class Job:
    version: str
    mode: str               # one of MODES
    deferred: bool          # SGLang's deferred KV release switched on
    script: Script          # header already names the variant the job validates against
    note: str = ""          # how the script was fitted to the variant, if it was
    source: str | None = None   # a source tree replacing the wheel's modules (patched)

    @property
    def load_key(self) -> tuple:
        """Jobs with one key share a loaded release (the patch's timeout is per trace)."""
        steps = self.script.header.timeout_steps if self.mode in ("patch", "patch-local") else None
        return (self.version, self.mode, self.deferred, self.source or "", steps or 0)


@dataclass
class JobResult:
    job: Job
    trace: str                           # the merged pdgate trace (NDJSON)
    validation: ValidationResult
    steps: int
    errors: list[str]                    # per-rank step errors (collective timeouts...)
    refused: str | None                  # an event the release could not perform
    reads: list[str]                     # what the release read from the stub layer


def rooms_before_payloads(events: Sequence[Any]) -> list[tuple[int, int, int]]:
    """(event index, rank, request) of every room that lands before its payload on that
    rank: a prefill that does not write the room after the payload completed (A1)."""
    paid: set[tuple[int, int]] = set()
    early = []
    for i, ev in enumerate(events):
        if isinstance(ev, Land) and ev.field == PAYLOAD:
            paid.add((ev.rank, ev.req))
        elif isinstance(ev, Land) and (ev.rank, ev.req) not in paid:
            early.append((i, ev.rank, ev.req))
    return early


def order_rooms_after_payloads(events: Sequence[Any]) -> tuple[list, list[str]]:
    """The events as a prefill that writes the room only after its payload write completed
    would produce them (assumption A1, strict's prefill): a room that lands before its
    payload is delayed to just after it, and never lands if the payload never does.
    Returns the events and what was moved, one line per room."""
    out: list = []
    held: dict[tuple[int, int], tuple[int, Any]] = {}
    moves = []
    early = {i for i, _, _ in rooms_before_payloads(events)}
    for i, ev in enumerate(events):
        if i in early:
            held[(ev.rank, ev.req)] = (i, ev)
            continue
        out.append(ev)
        if isinstance(ev, Land) and ev.field == PAYLOAD and (ev.rank, ev.req) in held:
            at, room = held.pop((ev.rank, ev.req))
            out.append(room)
            moves.append(f"room of request {ev.req} on rank {ev.rank} moved from event {at} "
                         f"to after its payload (event {i})")
    moves += [f"room of request {req} on rank {rank} (event {at}) dropped: its payload never "
              f"lands" for (rank, req), (at, _) in held.items()]
    return out, moves


@dataclass(frozen=True)
class Fitted:
    """A source script fitted to the variant a job validates against, and how."""
    script: Script
    rewritten: tuple[str, ...] = ()     # events changed (the rows say ``rewritten``)
    cut: str = ""                       # where the script was cut and why (``cut``)
    extended: str = ""                  # a step added after the trace's end

    @property
    def note(self) -> str:
        return "; ".join([*self.rewritten, *(x for x in (self.cut, self.extended) if x)])


def fit(script: Script, variant: Variant, reorder_rooms: bool = False) -> Fitted:
    """The script with its header naming ``variant``, cut before the first event that
    ``variant`` does not allow (a source trace of another variant can leave a request
    earlier or later, or find no free slot) and after a step that hangs. The spec decides
    both. ``reorder_rooms``: the room writes moved after their payloads first (what
    strict's prefill would have written, A1). A script that ends with the queues no
    longer identical gets one more step: the next MIN, where the divergence turns into a
    mismatched collective (#26394)."""
    h = replace(script.header, variant=variant.name, timeout_steps=variant.timeout_steps)
    events: list = list(script.events)
    moves: list[str] = []
    if reorder_rooms:
        events, moves = order_rooms_after_payloads(events)
    state = initial_state(variant, h.ranks, h.slots)
    kept, cut, extended = [], "", ""
    for i, ev in enumerate(events):
        try:
            apply(state, ev, detail=False)
        except EventNotEnabled as exc:
            cut = f"cut at event {i} of {len(events)} ({variant.name} does not allow it: {exc})"
            break
        kept.append(ev)
        if state.hung is not None:
            break
    if state.hung is None and check_invariants(state, ["queues_identical"]):
        kept.append(Step())
        extended = "one step added after the queues diverged"
    return Fitted(Script(h, tuple(kept)), tuple(moves), cut, extended)


def fit_script(script: Script, variant: Variant) -> tuple[Script, str]:
    """``fit`` as (script, note), the source's events as they are."""
    fitted = fit(script, variant)
    return fitted.script, fitted.note


def _group(timeout_s: float) -> Any:
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _referee(length: int, failed: bool) -> list[tuple[int, bool]]:
    mine = torch.tensor([length, int(failed)], dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [(int(r[0]), bool(r[1])) for r in rows]


def _load(job: Job, timeout_s: float) -> Any:
    from impl.sglang.release import load_release
    release = load_release(job.version, deferred=job.deferred, source=job.source)
    release.collective_timeout_s = timeout_s
    steps = job.script.header.timeout_steps if job.script is not None else None
    if job.mode == "swap":
        from impl.sglang.patch import swap_dropins
        swap_dropins(release)
    elif job.mode in ("patch", "patch-local"):
        strict = getattr(release.decode, "_pdgate_strict", None)
        if strict is None:                   # the monkey-patch, as install() deploys it
            from impl.sglang.patch import install_into
            install_into(release, steps, agreed_release=job.mode == "patch")
        else:                                # the source carries the strict diff
            strict.collective_timeout_s, strict.server_args = timeout_s, release.server_args
            strict.timeout_steps, strict.agreed_release = steps, job.mode == "patch"
            release.strict = strict
    return release


def _run_job(release: Any, job: Job, rank: int, world: int, group: Any) -> tuple[dict, bool]:
    from impl.sglang.release import SGLangRank
    h = job.script.header
    harness = SGLangRank(release, rank, world, group, h.slots, job.deferred, h.spec_variant())
    steps, errors = [], []
    at, broken = len(job.script.events), False
    refused = None
    for i, ev in enumerate(job.script.events):
        if not isinstance(ev, Step):
            try:
                harness.apply(ev)
            except RefusedEvent as exc:      # e.g. no free slot where the spec has one
                refused = f"rank {rank} refused event {i}: {exc}"
            except Exception as exc:         # the release's code failed on this event
                refused = f"rank {rank} failed on event {i}: {type(exc).__name__}: {exc}"
            # every rank learns whether any refused, so all stop at the same event
            if any(failed for _, failed in _referee(0, refused is not None)):
                errors.append(refused or f"a peer refused event {i}")
                at, broken = i, False
                break
            continue
        length = harness.queue_length()
        try:
            res = harness.step()
        except Exception as exc:             # e.g. an abort reason pdgate does not know
            res = StepResult([], [], [], [], [], f"{type(exc).__name__}: {exc}")
        rows = _referee(length, res.error is not None)
        lengths = [n for n, _ in rows]
        hang = lengths if len(set(lengths)) > 1 else None
        rec = {"step": len(steps), "queue": [str(q) for q in res.queue], "local": res.local,
               "gated": res.gated, "reduced": [] if hang else res.reduced,
               "popped": [] if hang else res.popped, "hang": hang, "error": res.error}
        steps.append(rec)
        if res.error:
            errors.append(f"step {rec['step']}: {res.error}")
        if hang or any(failed for _, failed in rows):
            at, broken = i, True          # the data group may hold a half-done collective
            break
    return {"steps": steps, "at": at, "errors": errors, "refused": refused,
            "reads": release.recorder.reads}, broken


def _conform_rank(rank: int, world: int, jobs: list[Job], timeout_s: float) -> list[dict]:
    """Child process body: every job in turn, one release loaded at a time."""
    logging.getLogger("sglang").setLevel(logging.CRITICAL + 1)
    group = _group(timeout_s)
    release, key, out = None, None, []
    for job in jobs:
        if job.load_key != key:
            release, key = _load(job, timeout_s), job.load_key
        result, broken = _run_job(release, job, rank, world, group)
        out.append(result)
        if broken:
            group = _group(timeout_s)
    return out


def run_jobs(jobs: Sequence[Job], *, timeout_s: float = 3.0, deadline_s: float | None = None
             ) -> list[JobResult]:
    """Run every job (all with the same rank count) on one set of processes; results in
    the jobs' order. ``deadline_s`` (default: 2 minutes plus 10 s per job) bounds the
    whole run: the ranks are killed after it."""
    if not jobs:
        return []
    ranks = jobs[0].script.header.ranks
    if any(j.script.header.ranks != ranks for j in jobs):
        raise ValueError("run_jobs needs jobs of one rank count")
    order = sorted(jobs, key=lambda j: j.load_key)                   # one load each
    deadline = deadline_s if deadline_s is not None else 120.0 + 10.0 * len(jobs)
    outcomes = run_ranks(_conform_rank, ranks, (order, timeout_s), deadline_s=deadline,
                         group_timeout_s=timeout_s + 20.0)
    by_job = {}
    for j, job in enumerate(order):
        per_rank = [o.value[j] for o in outcomes]
        per_rank = [{**r, "error": None, "kind": None} for r in per_rank]
        text, steps = merge_ranks(job.script, per_rank)
        by_job[id(job)] = JobResult(job, text, validate(text.splitlines()), steps,
                                    [e for r in per_rank for e in r["errors"]],
                                    next((r["refused"] for r in per_rank if r["refused"]), None),
                                    per_rank[0]["reads"])
    return [by_job[id(job)] for job in jobs]
