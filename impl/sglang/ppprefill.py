"""The prefill bootstrap consensus under PP, run (``pdgate conform --pp``) on 2 stages x
2 TP thread ranks, compared with the ``pp-prefill-*`` variant that models the release
(model/spec/pipeline.py) by ``pprun.compare_pp``:

* 0.5.12 to 0.5.21: the scheduler PP mixin's bootstrap ring (``_pp_pd_get_bootstrapped_ids``:
  each stage's ``get_rids`` TP-MIN, good intersected and bad united by rid;
  ``_pp_pd_send_consensus_bootstrapped_ids`` round the stages) and
  ``process_bootstrapped_queue`` -> the release's own ``PrefillBootstrapQueue.pop_bootstrapped``
  with that consensus (0.5.12 to 0.5.16: ``rids_to_check`` and a second poll; 0.5.17 on:
  ``pp_good_rids`` / ``pp_bad_rids``), over pprun's fake ring (``stage_body``);
* 0.5.22, 0.5.23: ``pop_bootstrapped`` with ``pp_size`` 2 alone (``poll_and_all_reduce_prefill_pp``:
  stage 0's TP-MIN; ``pp_sync_polls``: the list sent down the stages, zipped with each
  one's queue by position), the PP group's ``send_object`` / ``recv_object`` faked per TP
  rank by pprun's ``Ring``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from impl.sglang import stubs, threadgroup as tg
from impl.sglang.pprun import (PREFILL_RING, PPRun, Ring, compare_pp, in_ring, load_mixin, mixin_of,
                               run_rows, stage_body)


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
    bootstrap: tuple[tuple[int, ...], ...]       # each row's sender poll per request
    free: tuple[int, ...] = ()                   # free metadata buffers per row (default: plenty)

    @property
    def requests(self) -> int:
        return len(self.stages[0])

    @property
    def inputs(self) -> dict[str, list[list[int]]]:
        """The spec's inputs: a row without a free buffer has none for any request (the
        scenarios ask a row for at most as many as it has, or for one it has not)."""
        free = self.free or (8,) * len(self.stages)
        return {"bootstrap": [list(r) for r in self.bootstrap],
                "no_buffer": [[int(free[k] == 0)] * self.requests for k in range(len(self.stages))]}


def _scenario(name: str, stages: list[list[int]], boot: list[list[int]], free: tuple[int, ...] = ()
              ) -> PPPrefillScenario:
    return PPPrefillScenario(name, 2, len(stages) // 2, tuple(map(tuple, stages)), tuple(map(tuple, boot)), free)


def prefill_pp_scenarios() -> list[PPPrefillScenario]:
    """0.5.22 and 0.5.23's positional forwarding, 2 stages x 2 TP ranks, buffers for every request."""
    from model.spec.iteration import PStage as P
    B, A, W, F = int(P.BOOTSTRAP), int(P.ABSENT), 2, 0
    return [
        _scenario("boot-pp-ready", [[B, B]] * 4, [[W, W]] * 4),
        _scenario("boot-pp-later-stage-fails", [[B]] * 4, [[W], [W], [F], [F]]),   # stage 1 acts on PP0's polls
        # cex:positions_agree: stage 0's queue empty, stage 1 waits on a receive
        _scenario("boot-pp-stage0-empty", [[A], [A], [B], [B]], [[W]] * 4),
        # cex:positions_shifted: stage 0 holds request 1 only; its Failed lands on request 0
        _scenario("boot-pp-shifted", [[A, B], [A, B], [B, B], [B, B]], [[W, F], [W, F], [W, W], [W, W]]),
    ]


def ring_prefill_scenarios() -> list[PPPrefillScenario]:
    """0.5.12 to 0.5.21's bootstrap ring, 2 stages x 2 TP ranks, one request (two in the last)."""
    from model.spec.iteration import PStage as P
    B, A, W, F, BOOT = int(P.BOOTSTRAP), int(P.ABSENT), 2, 0, 1
    return [
        _scenario("ring-ready", [[B]] * 4, [[W]] * 4),
        # good needs every stage, bad any: 0.5.12/0.5.13 then pop on their own second
        # poll (stage 0 bootstraps it, stage 1 fails it); 0.5.18 on apply the consensus
        _scenario("ring-stage-fails", [[B]] * 4, [[W], [W], [F], [F]]),
        # listed nowhere: 0.5.12/0.5.13 still MIN the whole queue, 0.5.18 on MIN the unlisted
        _scenario("ring-stage-bootstrapping", [[B]] * 4, [[W], [W], [BOOT], [BOOT]]),
        # stage 1 rank 1 has no metadata buffer: it keeps the request its peer pops (#37909)
        _scenario("ring-no-buffer", [[B]] * 4, [[W]] * 4, (8, 8, 8, 0)),
        # stage 0 rank 1 no longer holds it: its get_rids MINs an empty list (shape 0)
        _scenario("ring-queue-split", [[B], [A], [B], [B]], [[W]] * 4),
        # two requests, the second Failed everywhere, stage 1 rank 1 without a buffer: 0.5.12's
        # walk breaks at the first (the Failed one stays there), 0.5.13's continues to it
        _scenario("ring-buffer-break", [[B, B]] * 4, [[W, F]] * 4, (8, 8, 8, 0)),
    ]


def _rows(rel: Any, sc: PPPrefillScenario, hubs: list[tg.Hub]) -> list[tuple[Any, list[Any]]]:
    """Every (stage, rank)'s own ``PrefillBootstrapQueue`` (``points._prefill_rank``) with
    the PP stage set, in row order."""
    from impl.sglang import points
    from impl.sglang.pointscenarios import Scenario
    free = sc.free or (8,) * len(sc.stages)
    built = []
    for s in range(sc.pp):
        rows = slice(s * sc.ranks, (s + 1) * sc.ranks)
        stage = Scenario(sc.name, "prefill", sc.stages[rows], {n: v[rows] for n, v in sc.inputs.items()}, free[rows])
        for k in range(sc.ranks):
            q, reqs = points._prefill_rank(rel, stage, k, hubs[s])
            q.pp_size, q.pp_rank = sc.pp, s
            built.append((q, reqs))
    return built


def _run(sc: PPPrefillScenario, built: list[tuple[Any, list[Any]]], hubs: list[tg.Hub], ring: Ring,
         bodies: Sequence[Any], popped: Any, timeout_s: float, received: bool) -> PPRun:
    from impl.sglang import points
    outs, tp, errors, hung = run_rows(bodies, hubs, sc.ranks, timeout_s)
    # a later stage's receive, where the spec has one (0.5.23's forwarded list)
    records = [tp[k] + ([x for x in ring.records[k] if x[0] == "pp_recv"] if received else [])
               for k in range(len(built))]
    places = [points._prefill_places(q, reqs, popped(k, outs[k]), sc.stages[k]) for k, (q, reqs) in enumerate(built)]
    return PPRun(records, ring.records, places, errors, hung)


def run_pp_prefill(rel: Any, sc: PPPrefillScenario, timeout_s: float = 2.0) -> PPRun:
    """0.5.22's or 0.5.23's own ``pop_bootstrapped`` with ``pp_size`` 2 on every (stage, rank)
    (``poll_and_all_reduce_prefill_pp``, ``pp_sync_polls``): stage 0's TP-MIN, then the
    list sent down the stages over the fake ring."""
    ring = Ring(sc.pp, sc.ranks, timeout_s)
    hubs = [tg.Hub(sc.ranks, timeout_s) for _ in range(sc.pp)]
    built = _rows(rel, sc, hubs)
    for row, (q, reqs) in enumerate(built):
        q.scheduler.pp_group = _ObjectGroup(ring, *divmod(row, sc.ranks))
        for req in reqs:       # what PP0 polls under PP (CommonKVSender): this row's input
            req.disagg_kv_sender.poll_pp_consensus = req.disagg_kv_sender.poll
    return _run(sc, built, hubs, ring, [q.pop_bootstrapped for q, _ in built], lambda k, out: out,
                timeout_s, True)


def run_ring_prefill(rel: Any, mixin: Any, sc: PPPrefillScenario, timeout_s: float = 2.0) -> PPRun:
    """0.5.12 to 0.5.21: the mixin's bootstrap ring, then ``process_bootstrapped_queue``
    (the release's ``pop_bootstrapped`` with the consensus) on every (stage, rank)."""
    ring = Ring(sc.pp, sc.ranks, timeout_s)
    hubs = [tg.Hub(sc.ranks, timeout_s) for _ in range(sc.pp)]
    built = _rows(rel, sc, hubs)
    ms = [mixin_of(mixin, *divmod(row, sc.ranks), sc.pp, sc.ranks, q.scheduler.attn_tp_cpu_group,
                   disagg_prefill_bootstrap_queue=q) for row, (q, _) in enumerate(built)]
    bodies = [lambda row=row: in_ring(ring, *divmod(row, sc.ranks), sc.pp, sc.ranks,
                                      lambda: stage_body(ms[row], row // sc.ranks == sc.pp - 1, PREFILL_RING))
              for row in range(len(built))]
    return _run(sc, built, hubs, ring, bodies, lambda k, out: ms[k].waiting_queue, timeout_s, False)


def by_position(version: str) -> bool:
    """The release's prefill variant forwards PP0's polls by position (0.5.22 on), so its
    ``pop_bootstrapped`` runs alone; the others run the mixin's bootstrap ring."""
    from impl.sglang.pp_facts import MODELLED_BY
    from model.spec.agreement import Across
    from model.spec.pipeline import PP_VARIANTS
    return any(p.across is Across.PP0 for p in PP_VARIANTS[MODELLED_BY[version][1]].points)


def check_prefill(versions: Sequence[str], *, timeout_s: float = 2.0, source: str | None = None) -> list[dict]:
    """Each release on its own prefill PP path: forwarding by position (``by_position``, 0.5.22
    on) on ``prefill_pp_scenarios``, else the mixin's bootstrap ring (0.5.12 to 0.5.21) on
    ``ring_prefill_scenarios``; each against its pp-prefill-* variant."""
    from impl.sglang import points
    from impl.sglang.pp_facts import MIXIN, MODELLED_BY
    rows = []
    try:
        for version in versions:
            positional = by_position(version)
            if not positional:
                stubs.REAL_EXTRA.add(MIXIN)
            rel = points.load(version, source)
            mixin = None if positional else load_mixin()
            for sc in prefill_pp_scenarios() if positional else ring_prefill_scenarios():
                run = run_pp_prefill(rel, sc, timeout_s) if positional else run_ring_prefill(rel, mixin, sc, timeout_s)
                rows.append({"release": version, "side": "pp-prefill",
                             **compare_pp(sc, MODELLED_BY[version][1], run), "run": run})
            stubs.REAL_EXTRA.discard(MIXIN)       # the next release may forward by position
            stubs.purge()
    finally:
        stubs.REAL_EXTRA.discard(MIXIN)
        stubs.purge()
    return rows
