"""Run T ranks as T processes on one gloo group over 127.0.0.1, with timeouts everywhere.

The parent owns the rendezvous store (a TCPStore on an ephemeral port, so no port race,
bound to 127.0.0.1 only),
spawns the children, and kills every child it started if one fails or the deadline
passes. Each child calls ``target(rank, world_size, *args)`` after joining the group and
its JSON-able return value comes back through a file.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from impl.decode.collective import rendezvous_store


class RanksFailed(RuntimeError):
    """A child crashed, or the ranks did not finish before the deadline."""


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    exitcode: int | None
    value: Any


HOST = "127.0.0.1"      # the store and gloo's pair sockets listen here only


def _child(target: Callable[..., Any], rank: int, world: int, port: int, group_timeout_s: float,
           out_path: str, args: tuple) -> None:
    timeout = datetime.timedelta(seconds=group_timeout_s)
    try:
        store = rendezvous_store(HOST, port, world, is_master=False, timeout_s=group_timeout_s)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        value = target(rank, world, *args)
        payload = {"ok": True, "value": value}
    except BaseException as exc:      # reported to the parent, which decides
        payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()}
    with open(out_path, "w", encoding="utf-8") as fp:
        json.dump(payload, fp)
    os._exit(0)     # skip gloo teardown, which can block on a peer that already left


def _context() -> Any:
    """forkserver where available: one clean server process imports torch once and every
    later rank forks from it (fork from a parent that ran torch ops can deadlock)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "impl.replay"])
    return ctx


def run_ranks(target: Callable[..., Any], world: int, args: tuple = (), *,
              deadline_s: float = 60.0, group_timeout_s: float = 10.0) -> list[RankOutcome]:
    """Run ``target`` on ``world`` gloo ranks; returns each rank's value in rank order.

    Raises RanksFailed naming the rank when a child dies or the deadline passes (all
    children are then killed)."""
    if world < 1:
        raise ValueError(f"need at least one rank, got {world}")
    store = rendezvous_store(HOST, 0, world + 1, is_master=True, timeout_s=group_timeout_s)
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="pdgate-ranks-") as tmp:
        paths = [os.path.join(tmp, f"rank{k}.json") for k in range(world)]
        procs = [ctx.Process(target=_child, daemon=True,
                             args=(target, k, world, store.port, group_timeout_s, paths[k], args))
                 for k in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        try:
            for k, p in enumerate(procs):
                p.join(max(0.0, end - time.monotonic()))
                if p.is_alive():
                    raise RanksFailed(f"rank {k} did not finish within {deadline_s:g} s")
            outcomes = []
            for k, (p, path) in enumerate(zip(procs, paths)):
                if not os.path.exists(path):
                    raise RanksFailed(f"rank {k} died (exit code {p.exitcode}) without a result")
                with open(path, encoding="utf-8") as fp:
                    payload = json.load(fp)
                if not payload["ok"]:
                    raise RanksFailed(f"rank {k} failed: {payload['error']}")
                outcomes.append(RankOutcome(k, p.exitcode, payload["value"]))
            return outcomes
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
            del store


def timeout_probe(rank: int, world: int, timeout_s: float) -> dict:
    """Diagnostic target: rank 0 enters a step's collective that no peer joins and must
    get CollectiveTimeout after about ``timeout_s``; the peers stay away meanwhile."""
    from impl.decode.collective import GlooExchange, agree_min
    from impl.decode.errors import CollectiveTimeout
    import torch

    if rank != 0:
        time.sleep(timeout_s + 1.0)
        return {"rank": rank}
    start = time.monotonic()
    try:
        agree_min(GlooExchange(None, timeout_s), torch.tensor([4], dtype=torch.uint8), capacity=8)
        error = None
    except CollectiveTimeout as exc:
        error = str(exc)
    return {"rank": 0, "elapsed_s": time.monotonic() - start, "error": error}
