"""0.5.23's prefill bootstrap consensus under PP, run (``pdgate conform --pp``): the
release's own ``PrefillBootstrapQueue.pop_bootstrapped`` with ``pp_size`` 2 on every
(stage, rank): ``poll_and_all_reduce_prefill_pp`` (stage 0's TP-MIN) and ``pp_sync_polls``
(the list sent down the stages, zipped with each one's queue by position), the PP group's
``send_object`` / ``recv_object`` faked per TP rank by impl.sglang.pprun's ``Ring``;
compared with ``pp-prefill-0.5.23`` (model/spec/pipeline.py) by ``pprun.compare_pp``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from impl.sglang import stubs, threadgroup as tg
from impl.sglang.pprun import PPRun, Ring, compare_pp


class _ObjectGroup:
    """``scheduler.pp_group`` as pp_sync_polls uses it, for (stage s, TP rank k)."""

    def __init__(self, ring: Ring, s: int, k: int):
        self.ring, self.s, self.k = ring, s, k

    def send_object(self, data: Any, dst: int, async_send: bool = False, tag: Any = None) -> list:
        return self.ring.send_object(self.s, self.k, data, dst)

    def recv_object(self, src: int, tag: Any = None) -> Any:
        return self.ring.recv_object(self.s, self.k, src)


@dataclass(frozen=True)
class PPPrefillScenario:
    name: str
    pp: int
    ranks: int
    stages: tuple[tuple[int, ...], ...]          # PStage per [stage*T+rank][request]
    inputs: dict[str, list[list[int]]]           # bootstrap, no_buffer

    @property
    def requests(self) -> int:
        return len(self.stages[0])


def prefill_pp_scenarios() -> list[PPPrefillScenario]:
    """2 stages x 2 TP ranks, metadata buffers for every request (no_buffer all 0)."""
    from model.spec.iteration import PStage as P
    B, A, W, F = int(P.BOOTSTRAP), int(P.ABSENT), 2, 0
    mk = lambda name, stages, boot: PPPrefillScenario(
        name, 2, 2, tuple(tuple(r) for r in stages),
        {"bootstrap": boot, "no_buffer": [[0] * len(stages[0]) for _ in stages]})
    return [
        mk("boot-pp-ready", [[B, B]] * 4, [[W, W]] * 4),
        mk("boot-pp-later-stage-fails", [[B]] * 4, [[W], [W], [F], [F]]),   # stage 1 acts on PP0's polls
        # cex:positions_agree: stage 0's queue empty, stage 1 waits on a receive
        mk("boot-pp-stage0-empty", [[A], [A], [B], [B]], [[W]] * 4),
        # cex:positions_shifted: stage 0 holds request 1 only; its Failed lands on request 0
        mk("boot-pp-shifted", [[A, B], [A, B], [B, B], [B, B]], [[W, F], [W, F], [W, W], [W, W]]),
    ]


def run_pp_prefill(rel: Any, sc: PPPrefillScenario, timeout_s: float = 2.0) -> PPRun:
    """0.5.23's own ``pop_bootstrapped`` with ``pp_size`` 2 on every (stage, rank)
    (``poll_and_all_reduce_prefill_pp``, ``pp_sync_polls``): stage 0's TP-MIN, then the
    list sent down the stages over the fake ring."""
    from impl.sglang import points
    from impl.sglang.pointscenarios import Scenario
    ring = Ring(sc.pp, sc.ranks, timeout_s)
    hubs = [tg.Hub(sc.ranks, timeout_s) for _ in range(sc.pp)]
    built = []
    for s in range(sc.pp):
        rows = slice(s * sc.ranks, (s + 1) * sc.ranks)
        stage = Scenario(sc.name, "prefill", sc.stages[rows], {n: v[rows] for n, v in sc.inputs.items()},
                         (8,) * sc.ranks)
        for k in range(sc.ranks):
            q, reqs = points._prefill_rank(rel, stage, k, hubs[s])
            q.pp_size, q.pp_rank = sc.pp, s
            q.scheduler.pp_group = _ObjectGroup(ring, s, k)
            for req in reqs:       # what PP0 polls under PP (CommonKVSender): this row's input
                req.disagg_kv_sender.poll_pp_consensus = req.disagg_kv_sender.poll
            built.append((q, reqs))
    errors: list[str | None] = [None] * len(built)
    outs: list[Any] = [None] * len(built)

    def body(row: int) -> None:
        s, k = divmod(row, sc.ranks)
        try:
            outs[row] = built[row][0].pop_bootstrapped()
        except Exception as exc:
            errors[row] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            hubs[s].finish(k, errors[row])

    tg.join_rows([lambda r=r: body(r) for r in range(len(built))], timeout_s, sc.ranks, errors)
    tp = [[(op, shape[0] if shape else 0) for op, shape in rec] for h in hubs for rec in h.records]
    # what the spec records per row: stage 0's TP-MIN, a later stage's receive
    records = [tp[k] + [x for x in ring.records[k] if x[0] == "pp_recv"] for k in range(len(built))]
    hung = any(e and ("Hang" in e or "Mismatch" in e or "still running" in e) for e in errors)
    places = [points._prefill_places(q, reqs, out, sc.stages[k]) for k, ((q, reqs), out) in
              enumerate(zip(built, outs))]
    return PPRun(records, ring.records, places, errors, hung)


def check_pp_prefill(scenarios: Sequence[PPPrefillScenario], *, variant: str = "pp-prefill-0.5.23",
                     timeout_s: float = 2.0, source: str | None = None) -> list[dict]:
    """0.5.23 (the one release that forwards by position) on every scenario."""
    from impl.sglang import points
    rows = []
    try:
        rel = points.load("0.5.23", source)
        for sc in scenarios:
            run = run_pp_prefill(rel, sc, timeout_s)
            rows.append({"release": "0.5.23", "side": "pp-prefill", **compare_pp(sc, variant, run), "run": run})
    finally:
        stubs.purge()
    return rows
