"""The metadata gate: vectorized (impl.decode) against SGLang 0.5.13's per-request loop.

Same process, same tensors: ``n`` queued requests, every poll Success (the loop's worst
case: one ``.item()`` each), half the rows landed. Three ways:
  sglang   - the 0.5.13 loop: ``bootstrap_room[idx, 0].item()`` per Success entry
  dropin   - ``apply_metadata_gate`` with SGLang's argument shapes (builds the index and
             room tensors from ``decode_reqs`` every call)
  queue    - what DecodeTransferQueue does per step: the request tensors are kept across
             steps, so the gate is one gather plus the kernel's element-wise ops
             (``gate`` rule, as SGLang's; ``queue_strict`` adds strict's extra rules)
Figures are medians in microseconds and speedups (sglang time / ours).

The drop-in as a whole step (``dropin_step``): SGLang 0.5.13's own ungated
``poll_and_all_reduce(pollers, group)`` (from its wheel, through impl.sglang's stub layer)
against ``impl.decode.poll_and_all_reduce`` in 0.5.13's gated call shape, on SGLang's own
``MetadataBuffers`` (2,048 slots), 1,024 queued requests, half Success, half the rows
landed; one gloo process and T = 2, both calls interleaved in the same run. Ratio: the
drop-in's median step over SGLang's (goal <= 1.3 at both).
"""
from __future__ import annotations

import random
import statistics
import time
from types import SimpleNamespace
from typing import Callable

import torch

from impl.decode import MetadataBuffers, apply_metadata_gate, gate_tensor
from impl.decode.gate import check_polls, resolve_variant
from model.spec import KVPoll

SUCCESS, TRANSFERRING = int(KVPoll.Success), int(KVPoll.Transferring)
# The goal compares like with like: SGLang's rule (``gate``) run by the queue's path.
TARGETS = {"speedup_queue_1024": (">=", 50.0), "dropin_step_ratio_T1": ("<=", 1.3),
           "dropin_step_ratio_T2": ("<=", 1.3)}
DROPIN_N, DROPIN_RELEASE = 1024, "0.5.13"


def sglang_gate(polls, decode_reqs, metadata_buffers) -> None:
    """SGLang 0.5.13 ``_apply_metadata_gate`` (fake-transfer check kept as an attribute
    read), the baseline being measured."""
    for i, poll_val in enumerate(polls):
        if poll_val == SUCCESS:
            decode_req = decode_reqs[i]
            if decode_req.req.bootstrap_host == "2.2.2.2":
                continue
            actual_room = metadata_buffers.bootstrap_room[decode_req.metadata_buffer_index, 0].item()
            if actual_room == 0:
                polls[i] = TRANSFERRING


def _median_us(fn: Callable[[], object], budget_s: float) -> float:
    fn()
    times = []
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(n: int, budget_s: float) -> dict[str, float]:
    rng = random.Random(n)
    buffers = MetadataBuffers(2 * n)
    slots = rng.sample(range(2 * n), n)
    rooms = [rng.randrange(1, 2**63) for _ in range(n)]     # < 2^63: SGLang's .item() path
    reqs = []
    for i, (slot, room) in enumerate(zip(slots, rooms)):
        if i % 2 == 0:
            buffers.write_room(slot, room)
        reqs.append(SimpleNamespace(req=SimpleNamespace(rid=str(i), bootstrap_room=room,
                                                        bootstrap_host="10.0.0.1"),
                                    metadata_buffer_index=slot))
    polls = [SUCCESS] * n
    slot_t = torch.tensor(slots, dtype=torch.int64)
    room_t = torch.tensor(rooms, dtype=torch.int64)
    age_t = torch.zeros(n, dtype=torch.int64)

    def queue_gate(variant: str = "gate"):
        v = resolve_variant(variant)
        return lambda: gate_tensor(v, check_polls(polls),
                                   buffers.room_column.index_select(0, slot_t), room_t, age_t)

    a, b = list(polls), list(polls)
    sglang_gate(a, reqs, buffers)
    apply_metadata_gate(b, reqs, buffers, "gate")
    assert a == b == queue_gate()().tolist(), "the three gates disagree"
    out = {"sglang_us": _median_us(lambda: sglang_gate(list(polls), reqs, buffers), budget_s),
           "dropin_us": _median_us(lambda: apply_metadata_gate(list(polls), reqs, buffers, "gate"),
                                   budget_s),
           "queue_us": _median_us(queue_gate(), budget_s),
           "queue_strict_us": _median_us(queue_gate("strict"), budget_s)}
    return out


class _Receiver:
    def __init__(self, state: int):
        self.state = state

    def poll(self) -> int:
        return self.state


def _dropin_step_body(rank: int, world: int, steps: int) -> dict:
    """One rank: SGLang's ungated poll + MIN and the gated drop-in, alternating."""
    import random as _random
    import torch.distributed as dist
    from impl.decode import poll_and_all_reduce
    from impl.sglang.release import load_release
    release = load_release(DROPIN_RELEASE)
    u = release.utils
    buffers = u.MetadataBuffers(2 * DROPIN_N, 16, torch.float32)
    reqs = []
    for i in range(DROPIN_N):
        room = 0x5EED0000 + i
        if i % 4 < 2:
            buffers.bootstrap_room[i, 0] = room
        reqs.append(SimpleNamespace(req=SimpleNamespace(rid=f"r{i}", bootstrap_room=room,
                                                        bootstrap_host="10.0.0.1"),
                                    kv_receiver=_Receiver(SUCCESS if i % 2 else 2),
                                    metadata_buffer_index=i))
    pollers = [d.kv_receiver for d in reqs]
    server_args = release.server_args
    group = dist.new_group(backend="gloo")
    runs = {"sglang": lambda: u.poll_and_all_reduce(pollers, group),
            "dropin": lambda: poll_and_all_reduce(pollers, group, reqs, buffers, server_args)}
    want = [min(SUCCESS if i % 2 else 2, TRANSFERRING if i % 4 >= 2 and i % 2 else 4)
            for i in range(DROPIN_N)]
    assert runs["dropin"]() == want, "the drop-in's gate is wrong"
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    shuffle = _random.Random(0).shuffle          # same order on every rank: lockstep
    for i in range(steps + 20):
        shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            runs[name]()
            if i >= 20:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def dropin_step(quick: bool) -> dict[str, float]:
    from impl.ranks import run_ranks
    figures: dict[str, float] = {}
    for world in (1, 2):
        [rank0, *_] = run_ranks(_dropin_step_body, world, (300 if quick else 2000,),
                                deadline_s=300)
        med = rank0.value
        figures[f"dropin_step_sglang_us_T{world}"] = round(med["sglang"], 1)
        figures[f"dropin_step_us_T{world}"] = round(med["dropin"], 1)
        figures[f"dropin_step_ratio_T{world}"] = round(med["dropin"] / med["sglang"], 3)
    return figures


def run(quick: bool) -> dict:
    figures: dict[str, float] = dropin_step(quick)
    for n in (64, 1024, 16384):
        m = measure(n, 0.2 if quick else 1.0)
        for key, val in m.items():
            figures[f"{key}_{n}"] = round(val, 1)
        figures[f"speedup_dropin_{n}"] = round(m["sglang_us"] / m["dropin_us"], 1)
        figures[f"speedup_queue_{n}"] = round(m["sglang_us"] / m["queue_us"], 1)
        figures[f"speedup_queue_strict_{n}"] = round(m["sglang_us"] / m["queue_strict_us"], 1)
    return figures
