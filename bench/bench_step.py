"""One scheduler step of poll + gate + MIN on T gloo processes (127.0.0.1), 1,024 queued
requests: what the gate and the length/content check add to the ungated poll + MIN.

Per step, every rank runs each of these once, in a shuffled order (the same on every
rank), so machine noise and drift hit all alike:
  ungated  - poll every receiver, one uint8 all_reduce(MIN) (SGLang's poll_and_all_reduce,
             with the same fast list->tensor conversion impl.decode uses)
  gate / strict - DecodeTransferQueue.pop_transferred(): poll, the gate, the one
             fixed-shape MIN with its header check, the pop decisions (nothing pops: half
             the receivers say Success with the row not landed, half are still waiting)
  dropin   - impl.decode.poll_and_all_reduce with SGLang's argument shapes (gate)
Figures: rank 0's median step time (us) and overhead ratios (gated / ungated - 1), from
medians (the goal) and from 10th percentiles (less sensitive to other jobs on the cores).
"""
from __future__ import annotations

import random
import statistics
import time

import torch
import torch.distributed as dist

from impl.decode import (DecodeTransferQueue, MetadataBuffers, Req,
                         SlotAllocator, poll_and_all_reduce)
from impl.ranks import run_ranks
from model.spec import KVPoll

N = 1024
TARGETS = {"overhead_strict_T2": ("<=", 0.10), "overhead_strict_T4": ("<=", 0.10)}


class _Receiver:
    def __init__(self, state: int):
        self.state = state

    def poll(self) -> int:
        return self.state

    def failure_exception(self):
        return None

    def clear(self) -> None:
        pass


def _queue(variant: str) -> tuple[DecodeTransferQueue, list]:
    buffers, alloc = MetadataBuffers(2 * N), SlotAllocator(2 * N)
    q = DecodeTransferQueue(None, buffers, alloc, variant,
                            timeout_steps=10**9 if variant == "strict" else None)
    for i in range(N):
        state = int(KVPoll.Success) if i % 2 else int(KVPoll.WaitingForInput)
        q.enqueue(Req(f"r{i}", 0x5EED0000 + i), _Receiver(state))
    return q, q.queue


def _step_body(rank: int, world: int, steps: int) -> dict:
    gate_q, reqs = _queue("gate")
    strict_q, _ = _queue("strict")
    pollers = [d.kv_receiver for d in reqs]

    def ungated():
        t = torch.frombuffer(bytearray([int(p.poll()) for p in pollers]), dtype=torch.uint8)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t.tolist()

    def dropin():
        return poll_and_all_reduce(pollers, None, reqs, gate_q.buffers)

    runs = {"ungated": ungated, "gate": gate_q.pop_transferred,
            "strict": strict_q.pop_transferred, "dropin": dropin}
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    shuffle = random.Random(0).shuffle          # same order on every rank: lockstep
    for i in range(steps + 10):
        shuffle(order)                          # no kind always runs right after another
        for name in order:
            t0 = time.perf_counter()
            out = runs[name]()
            if i >= 10:                          # warm-up steps are not counted
                times[name].append(time.perf_counter() - t0)
            assert out == [] or len(out) == N, f"{name} popped requests"
    out = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    # the 10th percentile: closer to the intrinsic cost when other jobs share the cores
    out.update({f"{k}_p10": statistics.quantiles(v, n=10)[0] * 1e6 for k, v in times.items()})
    return out


def run(quick: bool) -> dict:
    figures: dict[str, float] = {}
    for world in (2, 4):
        [rank0, *_] = run_ranks(_step_body, world, (100 if quick else 400,), deadline_s=300)
        med = rank0.value
        for name, us in med.items():
            figures[f"{name}_us_T{world}"] = round(us, 1)
        for name in ("gate", "strict", "dropin"):
            figures[f"overhead_{name}_T{world}"] = round(med[name] / med["ungated"] - 1, 3)
            figures[f"overhead_{name}_p10_T{world}"] = round(
                med[f"{name}_p10"] / med["ungated_p10"] - 1, 3)
    return figures
