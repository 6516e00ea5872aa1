"""The live decode ranks' logs (impl/sglang/live_site/live_hooks.py) as one spec trace.

Four things differ from an e2e rank log, and are settled here, checked, before the e2e
merge (impl.mooncake.report.write_trace) writes the trace:
- a client that gives up makes the router abort its request: the receiver leaves its
  latched Success, which the spec's receiver never does; the trace ends before it;
- a rank observes the environment at its polls, after the requests it enqueued before
  the step: a segment's enqueues are written before its events;
- a request's first token is not known when it enters the queue: its ``enq`` payload
  is the token its commit read (0 for a request no rank committed: nothing reads it);
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

WAITING, SUCCESS, FAILED = 2, 4, 0
SLOTS = 4096            # spec slots per rank: more than the requests a run queues at once


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


def trace_from_logs(logs: list[list[dict[str, Any]]], fp: IO[str], variant: str,
                    timeout_steps: int | None) -> int:
    """Write the spec trace of ``logs`` to ``fp`` (cut before the first client abort,
    ``first_unlatched``); returns the number of steps."""
    cut = first_unlatched(logs)
    if cut is not None:
        logs = cut_before(logs, cut)
    payload = {}
    for log in logs:
        for rec in log:
            if rec["k"] == "step":
                for req, decision, value in rec["rec"]["popped"]:
                    if decision == Decision.COMMIT:
                        payload.setdefault(req, value)
    for log in logs:
        for rec in log:
            if rec["k"] == "enq":
                rec["payload"] = payload.get(rec["req"], 0)
    by_step = [[rec["rec"] for rec in log if rec["k"] == "step"] for log in logs]
    for k, steps in enumerate(zip(*by_step)):
        _normalize(list(steps), k)
    return write_trace(logs, fp, variant, SLOTS, timeout_steps, partial=True,
                       enqueues_first=True, source="live")


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
