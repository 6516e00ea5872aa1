"""The live decode ranks' logs (impl/sglang/live_site/live_hooks.py) as one spec trace.

What differs from an e2e rank log is settled here, checked, before the e2e merge
(impl.mooncake.report.write_trace) writes the trace:
- a client that gives up makes the router abort its request: the receiver leaves its
  latched Success, which the spec's receiver never does; the trace ends before it;
- a rank observes the environment at its polls, after the requests it enqueued before
  the step: a segment's enqueues are written before the events it logged after them
  (what it logged before them, a fence or a late write seen before admission, stays
  before);
- a request's first token is not known when it enters the queue: its ``enq`` payload
  is the ``output_ids`` value its row carried when a rank first saw the row land (the
  token its commit read where no rank logged one; 0 where neither: nothing reads it);
- each enqueue names the metadata slot every rank's allocator gave it, and the header
  the allocator's size (``pool``), so the replay checks every reuse of a slot;
- a rank logs the prefill's ack of a held slot also where the row had landed whole
  (``landed``): the deferred variants release a hold on it; for the others the spec has
  forgotten such a request, and those fences are left out;
- 0.5.23 releases a held slot after a wall-clock timeout: the trace's
  ``release_timeout_steps`` is what the first timeout release took in steps (held from
  the step after the abort to the last step before the release), or one more than the
  trace's steps where none fired;
- SGLang's receiver reports Bootstrapping, WaitingForInput or Transferring before its
  outcome, where the spec's receiver has one state (WaitingForInput) until it latches
  Success or Failed: those polls are written as WaitingForInput, and the MIN recomputed
  over the ranks' normalized values, after checking it falls in the same class (Failed,
  in between, Success) as the MIN SGLang's ranks computed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from impl.mooncake.report import ReportError, load_log, write_trace
from model.spec.kernel import Decision
from model.spec.variants import Deferral, get_variant

WAITING, SUCCESS, FAILED = 2, 4, 0


def rank_logs(folder: Path, ranks: int) -> list[list[dict[str, Any]]]:
    return [load_log(str(folder / f"rank{r}.jsonl"), partial=True) for r in range(ranks)]


def _class(v: int) -> int:
    return 0 if v == FAILED else 2 if v == SUCCESS else 1


def _normalize(steps: list[dict[str, Any]], k: int) -> None:
    """Rewrite one protocol step (every rank's record) in the spec's poll values."""
    for st in steps:
        st["gated"] = [WAITING if g not in (SUCCESS, FAILED) and raw != SUCCESS else g
                       for raw, g in zip(st["local"], st["gated"])]
        st["local"] = [v if v in (SUCCESS, FAILED) else WAITING for v in st["local"]]
    reduced = [min(col) for col in zip(*(st["gated"] for st in steps))]
    for st in steps:
        if len(st["reduced"]) != len(reduced) or any(
                _class(a) != _class(b) for a, b in zip(st["reduced"], reduced)):
            raise ReportError(f"step {k}: SGLang's MIN {st['reduced']} does not match the "
                              f"ranks' gated polls (MIN {reduced})")
        st["reduced"] = reduced


def first_unlatched(logs: list[list[dict[str, Any]]]) -> int | None:
    """The first step at which some rank's receiver left a latched outcome (Success,
    then anything else): a client abort (the router's ``AbortReq`` after a request
    timed out), outside the protocol the spec models. None if no receiver did."""
    first = None
    for log in logs:
        latched: dict[int, int] = {}
        for rec in log:
            if rec["k"] != "step":
                continue
            st = rec["rec"]
            for req, value in zip(st["queue"], st["local"]):
                if latched.get(req, value) != value:
                    first = st["step"] if first is None else min(first, st["step"])
                    break
                if value in (SUCCESS, FAILED):
                    latched[req] = value
    return first


def cut_before(logs: list[list[dict[str, Any]]], step: int) -> list[list[dict[str, Any]]]:
    """Each rank's log up to its record of protocol step ``step - 1``."""
    out = []
    for log in logs:
        kept = []
        for rec in log:
            if rec["k"] == "step" and rec["rec"]["step"] >= step:
                break
            kept.append(rec)
        out.append(kept)
    return out


def _pool(logs: list[list[dict[str, Any]]]) -> int:
    sizes = {int(rec["slots"]) for log in logs for rec in log if rec["k"] == "pool"}
    if len(sizes) != 1:
        raise ReportError(f"the ranks logged metadata pools of sizes {sorted(sizes)}, want one")
    return sizes.pop()


def _payloads(logs: list[list[dict[str, Any]]]) -> dict[int, int]:
    """Each request's first token: what its row carried when a rank first saw it land,
    else what its commit read."""
    seen: dict[int, int] = {}
    for log in logs:
        for rec in log:
            if rec["k"] == "env" and rec["ev"]["kind"] == "land" and rec.get("value") is not None:
                seen.setdefault(rec["ev"]["req"], int(rec["value"]))
    for log in logs:
        for rec in log:
            if rec["k"] == "step":
                for req, decision, value in rec["rec"]["popped"]:
                    if decision == Decision.COMMIT:
                        seen.setdefault(req, value)
    return seen


def release_steps(log: list[dict[str, Any]], steps: int) -> int:
    """0.5.23's wall-clock release timeout in protocol steps, from one rank's log: a
    request aborted at step a and released by the timeout before step r was held for
    r - 1 - a of the spec's held steps (the spec releases before its step's pops, the
    release before the next iteration's admission). ``steps + 1`` where no timeout
    release fired in the logged steps."""
    aborted: dict[int, int] = {}
    done = 0
    for rec in log:
        if rec["k"] == "step":
            done = rec["rec"]["step"] + 1
            for req, decision, _ in rec["rec"]["popped"]:
                if decision == Decision.ABORT_FAILED:
                    aborted[req] = rec["rec"]["step"]
        elif rec["k"] == "release" and rec["why"] == "timeout" and rec["req"] in aborted:
            if done > steps:
                break
            return max(1, done - 1 - aborted[rec["req"]])
    return steps + 1


def trace_from_logs(logs: list[list[dict[str, Any]]], fp: IO[str], variant: str,
                    timeout_steps: int | None) -> int:
    """Write the spec trace of ``logs`` to ``fp`` (cut before the first client abort,
    ``first_unlatched``); returns the number of steps."""
    cut = first_unlatched(logs)
    if cut is not None:
        logs = cut_before(logs, cut)
    deferred = get_variant(variant).defer_failed is not Deferral.NONE
    if not deferred:          # a fence of a row that landed whole says nothing there
        logs = [[rec for rec in log if not (rec["k"] == "env" and rec.get("landed"))]
                for log in logs]
    payload = _payloads(logs)
    for log in logs:
        for rec in log:
            if rec["k"] == "enq":
                rec["payload"] = payload.get(rec["req"], 0)
    by_step = [[rec["rec"] for rec in log if rec["k"] == "step"] for log in logs]
    for k, steps in enumerate(zip(*by_step)):
        _normalize(list(steps), k)
    n = min(len(s) for s in by_step)
    return write_trace(logs, fp, variant, _pool(logs), timeout_steps, partial=True,
                       enqueues_first=True, source="live",
                       release_timeout_steps=release_steps(logs[0], n) if deferred else None)


def claim_bounded_wait(path: Path, bound: int) -> str | None:
    """If the replayed trace at ``path`` leaves a request polled more than ``bound``
    times without leaving (liveness, the spec's ``bounded_wait``), add that claim before
    its ``end`` record, for ``pdgate validate`` to confirm; returns the claim's detail."""
    from model.spec.invariants import bounded_wait
    from model.spec.trace import violation_record
    from model.spec.validate import validate
    with open(path, encoding="utf-8") as fp:
        lines = fp.read().splitlines()
    result = validate(lines)
    found = bounded_wait(result.state, bound) if result.ok and result.state else []
    if not found:
        return None
    claim = json.dumps(violation_record(found[0], result.steps, bound), separators=(",", ":"))
    with open(path, "w", encoding="utf-8") as fp:       # the claim goes before ``end``
        fp.write("\n".join([*lines[:-1], claim, lines[-1]]) + "\n")
    return found[0].detail
