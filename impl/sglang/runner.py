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
    note: str = ""          # why the script was cut short, if it was


@dataclass
class JobResult:
    job: Job
    trace: str                           # the merged pdgate trace (NDJSON)
    validation: ValidationResult
    steps: int
    errors: list[str]                    # per-rank step errors (collective timeouts...)
    refused: str | None                  # an event the release could not perform
    reads: list[str]                     # what the release read from the stub layer


def order_rooms_after_payloads(events: Sequence[Any]) -> tuple[list, bool]:
    """The events as a prefill that writes the room only after its payload write completed
    would produce them (assumption A1, strict's prefill): a room that lands before its
    payload is delayed to just after it, and never lands if the payload never does."""
    out, held, moved = [], {}, False
    landed: set[tuple[int, int]] = set()
    for ev in events:
        if isinstance(ev, Land) and ev.field == ROOM and (ev.rank, ev.req) not in landed:
            held[(ev.rank, ev.req)] = ev
            moved = True
            continue
        out.append(ev)
        if isinstance(ev, Land) and ev.field == PAYLOAD:
            landed.add((ev.rank, ev.req))
            room = held.pop((ev.rank, ev.req), None)
            if room is not None:
                out.append(room)
    return out, moved


def fit_script(script: Script, variant: Variant) -> tuple[Script, str]:
    """The script with its header naming ``variant``, cut before the first event that
    ``variant`` does not allow (a source trace of another variant can leave a request
    earlier or later) and after a step that hangs. The spec decides both. For a variant
    whose prefill writes the room after the payload, the room writes are ordered so
    first. A script that ends with the queues no longer identical gets one more step:
    the next MIN, where the divergence turns into a mismatched collective (#26394)."""
    h = replace(script.header, variant=variant.name, timeout_steps=variant.timeout_steps)
    events, notes = list(script.events), []
    if variant.room_after_payload:
        events, moved = order_rooms_after_payloads(events)
        if moved:
            notes.append("room writes after their payload (strict's prefill, A1)")
    state = initial_state(variant, h.ranks, h.slots)
    kept = []
    for i, ev in enumerate(events):
        try:
            apply(state, ev, detail=False)
        except EventNotEnabled as exc:
            notes.append(f"cut at event {i} ({variant.name} does not allow it: {exc})")
            break
        kept.append(ev)
        if state.hung is not None:
            break
    if state.hung is None and check_invariants(state, ["queues_identical"]):
        kept.append(Step())
        notes.append("one step added after the queues diverged")
    return Script(h, tuple(kept)), "; ".join(notes)


def _group(timeout_s: float) -> Any:
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _referee(length: int, failed: bool) -> list[tuple[int, bool]]:
    mine = torch.tensor([length, int(failed)], dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [(int(r[0]), bool(r[1])) for r in rows]


def _load(job: Job, timeout_s: float) -> Any:
    from impl.sglang.release import load_release
    release = load_release(job.version, deferred=job.deferred)
    release.collective_timeout_s = timeout_s
    if job.mode == "swap":
        from impl.sglang.patch import swap_dropins
        swap_dropins(release)
    elif job.mode in ("patch", "patch-local"):
        from impl.sglang.patch import install_into
        install_into(release, agreed_release=job.mode == "patch")
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
        if (job.version, job.mode, job.deferred) != key:
            release, key = _load(job, timeout_s), (job.version, job.mode, job.deferred)
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
    order = sorted(jobs, key=lambda j: (j.version, j.mode, j.deferred))   # one load each
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
