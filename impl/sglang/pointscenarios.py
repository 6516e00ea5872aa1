"""The scenarios of ``pdgate conform --points`` (impl/sglang/points.py): the stages of
every request on every rank and the spec's inputs for the points a queue method covers,
fixed ones (the spec's counterexample inputs among them) and seeded random ones.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from model.spec.agreement import Stage
from model.spec.iteration import INPUTS, PStage

S, P = Stage, PStage
DECODE_START = (S.PENDING, S.PREALLOC, S.READY)     # the stages pop_preallocated holds
PREFILL_START = (P.ABSENT, P.BOOTSTRAP)


@dataclass(frozen=True)
class Scenario:
    name: str
    side: str                                   # "decode" or "prefill"
    stages: tuple[tuple[int, ...], ...]         # [rank][request]
    inputs: dict[str, list[list[int]]]          # the spec's inputs, [rank][request]
    free: tuple[int, ...] = ()                  # prefill: free metadata buffers per rank

    @property
    def ranks(self) -> int:
        return len(self.stages)

    @property
    def requests(self) -> int:
        return len(self.stages[0])


# -- the environment's meaning of the prefill's free buffers ----------------------------
def no_buffer(stages: Sequence[Sequence[int]], bootstrap: Sequence[Sequence[int]],
              free: Sequence[int]) -> list[list[int]]:
    """The spec's ``no_buffer`` input for ``free`` metadata buffers per rank: the
    requests whose agreed poll is WaitingForInput ask for one in queue order (the MIN
    over the ranks holding them); a rank's asker finds none once its free ones are
    taken."""
    ranks, reqs = len(stages), len(stages[0])
    out = [[0] * reqs for _ in range(ranks)]
    for k in range(ranks):
        asked = 0
        for r in range(reqs):
            holders = [j for j in range(ranks) if stages[j][r] == P.BOOTSTRAP]
            if stages[k][r] != P.BOOTSTRAP or min(bootstrap[j][r] for j in holders) != 2:
                continue
            out[k][r] = int(asked >= free[k])
            asked += 1
    return out


def prefill_scenario(name: str, stages: Sequence[Sequence[int]], bootstrap: list[list[int]],
                     free: Sequence[int]) -> Scenario:
    st = tuple(tuple(int(x) for x in row) for row in stages)
    return Scenario(name, "prefill", st, {"bootstrap": bootstrap,
                                          "no_buffer": no_buffer(st, bootstrap, free)}, tuple(free))


def decode_scenario(name: str, stages: Sequence[Sequence[int]], **inputs: list[list[int]]) -> Scenario:
    st = tuple(tuple(int(x) for x in row) for row in stages)
    proceed = {"resolved": 1, "handshake": 2, "fits": 1}
    full = {n: inputs.get(n, [[proceed[n]] * len(st[0]) for _ in st]) for n in proceed}
    # strict's gate, as the environment means it: pending here and not resolved now
    full["unresolved"] = [[int(s == S.PENDING and not ok) for s, ok in zip(row, res)]
                          for row, res in zip(st, full["resolved"])]
    return Scenario(name, "decode", st, full)


# -- the fixed scenarios and seeded random ones -----------------------------------------
def fixed_scenarios() -> list[Scenario]:
    D, R, pre, rdy = decode_scenario, prefill_scenario, S.PREALLOC, S.READY
    both = lambda *row: [list(row), list(row)]
    return [
        D("all-proceed", [[S.PENDING]] * 2),
        D("resolve-split", [[S.PENDING]] * 2, resolved=[[1], [0]]),      # cex:collectives_agree (#36928)
        D("bootstrapping", [[pre]] * 2, handshake=both(1)),
        D("handshake-fail-one", [[pre]] * 2, handshake=[[0], [2]]),
        D("fits-split", [[rdy]] * 2, fits=[[1], [0]]),                  # local admission
        D("ready-fail-one", [[rdy]] * 2, handshake=[[0], [2]], fits=both(0)),   # the 0.5.13 skip
        D("queue-split", [[rdy], [S.TRANSFER]], fits=[[0], [1]]),        # after a split admission
        D("fits-head-of-line", [[rdy, rdy]] * 2, fits=both(0, 1)),         # the FIFO break
        D("head-of-line-split", [[rdy, rdy]] * 2, fits=[[0, 1], [1, 1]]),
        D("two-mixed", [[pre, rdy]] * 2, handshake=[[2, 2], [1, 2]], fits=[[1, 1], [1, 0]]),
        R("boot-ready", [[P.BOOTSTRAP]] * 2, both(2), (2, 2)),
        R("boot-fail-one", [[P.BOOTSTRAP]] * 2, [[0], [2]], (2, 2)),
        R("no-buffer-split", [[P.BOOTSTRAP]] * 2, both(2), (0, 2)),   # #37909
        R("boot-queue-split", [[P.BOOTSTRAP], [P.ABSENT]], [[2], [2]], (2, 2)),
        R("no-buffer-then-fail", [[P.BOOTSTRAP] * 2] * 2, both(2, 0), (0, 0)),
    ]


def random_scenarios(seed: int, count: int) -> list[Scenario]:
    """``count`` decode and ``count`` prefill scenarios, T=2 N=2 and every third T=3 N=1,
    from agreed stages (every third split on one rank), inputs uniform in their domains."""
    rng, out = random.Random(seed), []
    for i in range(count):
        ranks, reqs = (3, 1) if i % 3 == 2 else (2, 2)
        # ``resolved`` is the fake resolver's (the dp-rank query answers): 0 or 1
        domain = lambda n: (0, 1) if n == "resolved" else INPUTS[n]
        pick = lambda n: [[rng.choice(domain(n)) for _ in range(reqs)] for _ in range(ranks)]
        for side, start in (("decode", DECODE_START), ("prefill", PREFILL_START)):
            row = [rng.choice(start) for _ in range(reqs)]
            stages = [list(row) for _ in range(ranks)]
            if i % 3 == 1:
                stages[-1][rng.randrange(reqs)] = rng.choice(start)
            name = f"random-{seed}-{i}"
            if side == "decode":
                out.append(decode_scenario(name, stages, resolved=pick("resolved"),
                                           handshake=pick("handshake"), fits=pick("fits")))
            else:
                out.append(prefill_scenario(name, stages, pick("bootstrap"),
                                            [rng.choice((0, 1, 2)) for _ in range(ranks)]))
    return out


# -- the spec's own counterexamples (pdgate prove --traces) -----------------------------
def trace_scenarios(path: str, covered: dict[str, tuple[str, ...]]) -> list[Scenario]:
    """One scenario per iteration of an iteration trace (``pdgate prove``'s cex traces):
    the stages every rank holds where the iteration reaches the first point of
    ``covered`` that its variant has, and the iteration's inputs. A prefill iteration
    whose ``no_buffer`` no count of free buffers gives (``no_buffer``) is left out.
    TraceInputError (one line) where the trace is malformed or not the spec's."""
    from model.spec.iteration import get_iter_variant, run_iteration
    from model.spec.itertrace import validate_iterations
    from model.spec.trace import TraceInputError, read_records, read_trace_file

    def parse(lines: Any) -> list[Scenario]:
        lines = list(lines)
        check = validate_iterations(lines)
        if not check.ok:
            raise TraceInputError(f"{path}: {check.message}")
        records = [obj for _, obj in read_records(lines)]
        v = get_iter_variant(records[0]["variant"])
        side = "decode" if v.stages is Stage else "prefill"
        first = next(i for i, p in enumerate(v.points) if p.name in covered[side])
        stages = tuple(tuple(0 for _ in range(records[0]["requests"])) for _ in range(records[0]["ranks"]))
        out = []
        for obj in (o for o in records if o.get("kind") == "iteration"):
            res = run_iteration(v, stages, obj["inputs"])
            before, inp = res.points[first].before, obj["inputs"]
            name = f"{Path(path).stem}#{obj['i']}"
            if side == "decode":
                # the spec's ``unresolved`` cap is the resolver not answering this rank
                resolved = [[1 - x for x in row] for row in inp["unresolved"]]
                out.append(decode_scenario(name, before, resolved=resolved,
                                           **{n: inp[n] for n in ("handshake", "fits")}))
            else:
                free = [sum(1 for r, s in enumerate(row) if s == P.BOOTSTRAP and not inp["no_buffer"][k][r])
                        for k, row in enumerate(before)]
                sc = prefill_scenario(name, before, inp["bootstrap"], free)
                if sc.inputs["no_buffer"] == [list(r) for r in inp["no_buffer"]] or not any(
                        s == P.BOOTSTRAP for row in before for s in row):
                    out.append(sc)
            stages = res.stages
        return out
    return read_trace_file(path, parse)
