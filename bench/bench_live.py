"""``pdgate live``'s fault matrix: the real SGLang 0.5.23 PD deployment (prefill, TP=2
decode, router, on this CPU) as shipped and with strict on both sides, each fault once.
Every row checks what the spec says of it: outputs equal to the plain server's where the
request commits, every request aborted on both ranks where strict aborts it, the decode
ranks' trace replayed by the spec as the variant that ran (and, for the room that never
lands, refused as shipped: the liveness counterexample). ``quick``: the two CI rows.

Minutes per row on 2 cores (each deployment starts in about 2.5 min).
"""
from __future__ import annotations

import argparse
import tempfile
from typing import Callable

from impl.sglang.live import LiveError, add_arguments, run_live

TARGETS = {"rows_as_expected": (">=", 1.0)}
REQUESTS = 4
Check = Callable[[dict], str | None]        # None: as expected; else what differs


def _all_match(got: dict) -> str | None:
    if got["matches_baseline"] != got["requests"]:
        return f"{got['matches_baseline']}/{got['requests']} outputs equal the plain server's"
    return None


def _all_failed(got: dict) -> str | None:
    if got["failed_requests"] != got["requests"]:
        return f"{got['failed_requests']}/{got['requests']} requests failed"
    return None


def _no_wrong_output(got: dict) -> str | None:
    """Killed prefill: each request either equals the plain server's output or failed."""
    wrong = got["requests"] - got["matches_baseline"] - got["failed_requests"]
    return f"{wrong} requests answered differently from the plain server" if wrong else None


def _one_failed(got: dict) -> str | None:
    """Room 0: the first request fails (strict aborts it; shipped, its client gives up
    on it), every other equals the plain server's output."""
    if (got["failed_requests"], got["matches_baseline"]) != (1, got["requests"] - 1):
        return (f"{got['failed_requests']} failed and {got['matches_baseline']} equal "
                f"(want 1 and {got['requests'] - 1})")
    return None


def _room_last(got: dict) -> str | None:
    counts = got.get("prefill_patch") or {}
    if counts.get("room_last", 0) < got["matches_baseline"]:
        return f"the prefill wrote the room last {counts.get('room_last', 0)} times"
    return None


def _held_forever(got: dict) -> str | None:
    return None if got.get("bounded_wait") else "no request held past the bound"


ROWS: list[tuple[str, list[str], tuple[Check, ...]]] = [
    ("success shipped", [], (_all_match,)),
    ("success strict", ["--patch", "strict"], (_all_match, _room_last)),
    ("late room 200 ms shipped", ["--late-room", "1:200"], (_all_match,)),
    ("late room never shipped", ["--late-room", "1:never", "--timeout-steps", "50",
                                 "--request-timeout-s", "60"], (_held_forever,)),
    ("late room never strict", ["--late-room", "1:never", "--patch", "strict",
                                "--timeout-steps", "50", "--request-timeout-s", "60"],
     (_all_failed,)),
    ("failed sends to rank 1 shipped", ["--fail-send", "1", "--request-timeout-s", "60"],
     (_all_failed,)),
    ("failed sends to rank 1 strict", ["--fail-send", "1", "--patch", "strict",
                                       "--request-timeout-s", "60"], (_all_failed,)),
    ("room 0 shipped", ["--room-zero", "--timeout-steps", "50", "--request-timeout-s", "60"],
     (_one_failed, _held_forever)),
    ("room 0 strict", ["--room-zero", "--patch", "strict", "--timeout-steps", "50",
                       "--request-timeout-s", "60"], (_one_failed,)),
    ("prefill killed shipped", ["--kill-prefill-s", "1", "--request-timeout-s", "60"],
     (_no_wrong_output,)),
    ("prefill killed strict", ["--kill-prefill-s", "1", "--patch", "strict",
                               "--request-timeout-s", "60"], (_no_wrong_output,)),
]
QUICK = ("success shipped", "late room never strict")


def _row(flags: list[str]) -> dict:
    p = argparse.ArgumentParser()
    add_arguments(p)
    with tempfile.TemporaryDirectory(prefix="pdgate-bench-live-") as work:
        cfg = p.parse_args(["--requests", str(REQUESTS), "--work-dir", work, *flags])
        return run_live(cfg)


def run(quick: bool) -> dict:
    out: dict = {}
    rows = [r for r in ROWS if not quick or r[0] in QUICK]
    good = 0
    for name, flags, checks in rows:
        try:
            got = _row(flags)
        except LiveError as exc:
            out[name] = f"not run: {exc}"
            continue
        problems = [p for p in (c(got) for c in checks) if p]
        if not got["trace_valid"]:
            problems.append(f"trace refused: {got['trace_message']}")
        good += not problems
        out[name] = (f"{got['matches_baseline']}/{got['requests']} equal, "
                     f"{got['failed_requests']} failed, trace {got['variant']} "
                     f"{'valid' if got['trace_valid'] else 'refused'}, "
                     f"{got['wall_s']} s: " + ("as expected" if not problems else "; ".join(problems)))
    out["rows"] = len(rows)
    out["rows_as_expected"] = round(good / len(rows), 3)
    return out
