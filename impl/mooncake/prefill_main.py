"""A runnable prefill for tests and demos: ``python -m impl.mooncake.prefill_main ...``.

Reads the deployment secret first, one line ``{"secret": HEX}`` on stdin (out of band:
never argv or the environment; impl.mooncake.auth). Prints one JSON line
``{"endpoint", "session"}`` once it serves, then answers commands
read from stdin, one per line, each with one JSON line: ``stats``, ``baseline`` (replay
the KV writes with raw Mooncake batch writes; only with --allow-baseline), ``quit``.
It exits on ``quit``, when stdin closes (its parent is gone) or after --lifetime-s.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import zmq

from impl.mooncake.auth import receive_key
from impl.mooncake.engine import Engine, MooncakeError
from impl.mooncake.prefill import Faults, PrefillServer
from impl.mooncake.stdio import StdinLines
from impl.mooncake.synth import make_requests
from model.cli import number


def rank_ms(text: str) -> tuple[int, float]:
    """``RANK:MS`` -> (rank, seconds)."""
    try:
        rank, ms = text.split(":")
        out = int(rank), float(ms) / 1000.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:MS, got {text!r}") from None
    if out[0] < 0 or not 0 <= out[1] <= 600:      # also refuses NaN and inf
        raise argparse.ArgumentTypeError(f"RANK:MS out of range: {text!r}")
    return out


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Flags the prefill and the e2e driver share (both derive the same workload)."""
    p.add_argument("--requests", type=number(1, 1 << 20, integer=True), default=32,
                   help="number of requests N")
    p.add_argument("--seed", type=number(0, 2**63 - 1, integer=True), default=0)
    p.add_argument("--page-bytes", type=number(1, 1 << 26, integer=True), default=64 * 1024,
                   help="bytes per KV page per rank")
    p.add_argument("--min-pages", type=number(1, 1 << 16, integer=True), default=4)
    p.add_argument("--max-pages", type=number(1, 1 << 16, integer=True), default=16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefill_main", description=__doc__.splitlines()[0])
    add_workload_arguments(p)
    p.add_argument("--ranks", type=int, required=True, help="decode TP ranks served")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--request-offset", type=int, default=0,
                   help="serve requests seeded from this index on (a second prefill)")
    p.add_argument("--workers", type=int, default=1,
                   help="writer threads (on 2 cores, one beats two: concurrent Mooncake "
                        "writes slow each other down)")
    p.add_argument("--metadata-delay", type=rank_ms, action="append", default=[],
                   metavar="RANK:MS", help="send Success to RANK first, its metadata row MS later")
    p.add_argument("--drop-metadata", type=int, action="append", default=[], metavar="RANK",
                   help="send Success to RANK but never its metadata row")
    p.add_argument("--stall-ms", type=number(0, 600_000), default=0.0,
                   help="sleep between each KV write and its metadata write")
    p.add_argument("--allow-baseline", action="store_true")
    p.add_argument("--lifetime-s", type=float, default=300.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    specs = make_requests(args.request_offset + args.requests, args.seed, args.min_pages,
                          args.max_pages)[args.request_offset:]
    faults = Faults(dict(args.metadata_delay), set(args.drop_metadata), args.stall_ms / 1000.0)
    stdin = StdinLines()
    try:
        secret = receive_key(stdin, "secret")
        server = PrefillServer(Engine(args.host), specs, args.ranks, args.page_bytes,
                               secret=secret, host=args.host, port=args.port,
                               workers=args.workers, faults=faults)
    except (MooncakeError, ValueError, zmq.ZMQError) as exc:
        print(f"prefill: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"endpoint": server.endpoint, "session": server.engine.session_id}), flush=True)
    deadline = time.monotonic() + args.lifetime_s
    try:
        while time.monotonic() < deadline and not stdin.closed:
            for cmd in stdin.poll(0.5):
                if not cmd:
                    continue
                if cmd == "quit":
                    return 0
                if cmd == "stats":
                    out = {"kv_bytes": server.kv_bytes_written, "dropped": server.dropped,
                           "rejected": server.rejected,
                           "broken": server.broken.count, "idle": server.idle(), "write_seconds": server.write_seconds,
                           "digest_seconds": server.digest_seconds,
                           "write_span_seconds": max(0.0, server.last_write - server.first_write),
                           "landings": server.landings()}
                elif cmd == "baseline" and args.allow_baseline:
                    nbytes, seconds, submit_seconds = server.raw_baseline()
                    out = {"bytes": nbytes, "seconds": seconds, "submit_seconds": submit_seconds}
                else:
                    out = {"error": f"unknown command {cmd[:40]!r}"}
                print(json.dumps(out), flush=True)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
