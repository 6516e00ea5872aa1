"""Pipeline parallel as PP stages x TP ranks (model/spec/pipeline.py): each release's
mechanism on hand-made states, the strict designs holding on them, and the iteration
trace reader replaying ``pp-*`` traces."""
import json
import random

import pytest

from model.spec.agreement import Across
from model.spec.itertrace import IterationTraceWriter, validate_iterations
from model.spec.pipeline import (PP_VARIANTS, STAY, BStage, PStage, QStage, check_pp_inputs, forwarded,
                                 get_pp_variant, initial_pp_stages, pipeline_violations, ring_value,
                                 run_pipeline)
from model.spec.iteration import INPUTS, PYF
from model.spec.trace import TraceFormatError

Q, P, B = QStage, PStage, BStage


def run(name, pp, ranks, inputs, stages=None, reqs=1):
    v = PP_VARIANTS[name]
    res = run_pipeline(v, pp, stages or initial_pp_stages(v, pp, ranks, reqs), inputs)
    return res, [x.invariant for x in pipeline_violations(res, v)]


LANDED = {"unlanded": [[0], [0]]}


def test_0512_ring_counts_success_and_failed_alike_so_stages_split():
    """Stage 0 Success, stage 1 Failed: both 'finished', both in the consensus, each then
    applies its own second MIN (#31798's 'one finished set')."""
    res, bad = run("pp-0.5.12", 2, 1, {"transfer": [[4], [0]], **LANDED})
    assert res.stages == ((Q.PREBUILT,), (Q.GONE,)) and bad == ["stages_agree"]


def test_the_ring_keeps_a_request_no_stage_has_finished_on_every_stage():
    res, bad = run("pp-0.5.12", 2, 2, {"transfer": [[4], [4], [3], [4]], "unlanded": [[0]] * 4})
    assert res.stages == ((Q.TRANSFER,),) * 4 and bad == []


def test_0512s_commit_and_0513s_gated_second_min_both_split_without_failures():
    """All Success, stage 1's metadata row not landed: 0.5.12's ungated second MIN says
    Success and its commit keeps the request there (a rank-local keep, back in the
    queue); 0.5.13's gate caps stage 1 at Transferring. Landed everywhere, both agree."""
    inputs = {"transfer": [[4], [4]], "unlanded": [[0], [1]]}
    for name in ("pp-0.5.12", "pp-0.5.13"):
        res, bad = run(name, 2, 1, inputs)
        assert res.stages == ((Q.PREBUILT,), (Q.TRANSFER,)) and bad == ["stages_agree"], name
        res, bad = run(name, 2, 1, {"transfer": [[4], [4]], **LANDED})
        assert res.stages == ((Q.PREBUILT,),) * 2 and bad == [], name
    # within one stage, 0.5.12's keep parts the TP ranks; the next ring MINs an empty list
    res, _ = run("pp-0.5.12", 1, 2, {"transfer": [[4], [4]], "unlanded": [[0], [1]]})
    assert res.stages == ((Q.PREBUILT,), (Q.TRANSFER,))
    after = run_pipeline(PP_VARIANTS["pp-0.5.12"], 1, res.stages, {"transfer": [[3], [3]], "unlanded": [[0], [0]]})
    assert after.records[0][0] == ("transfer_consensus", "min", 0)
    assert after.records[1][0] == ("transfer_consensus", "min", 1)
    assert [x.invariant for x in pipeline_violations(after, PP_VARIANTS["pp-0.5.12"])][0] == "collectives_agree"


def test_an_empty_queue_mins_up_to_0521_and_skips_in_0523():
    stages = ((Q.GONE,), (Q.TRANSFER,))
    inputs = {"transfer": [[3], [3]], "unlanded": [[0], [0]]}
    for name, first in (("pp-0.5.13", (("transfer_consensus", "min", 0),)), ("pp-0.5.23", ())):
        res = run_pipeline(PP_VARIANTS[name], 1, stages, inputs)
        assert res.records[0] == first, name
        assert res.records[1][0] == ("transfer_consensus", "min", 1)


def test_0523_max_reduces_the_failed_requests_hold_flags():
    res, bad = run("pp-0.5.23", 2, 2, {"transfer": [[0], [4], [4], [0]], "unlanded": [[0]] * 4})
    assert res.stages == ((Q.GONE,),) * 4 and bad == []
    assert res.records[0] == (("transfer_consensus", "min", 1), ("transfer_poll", "min", 1),
                              ("defer_release", "max", 1))
    ok, _ = run("pp-0.5.23", 2, 2, {"transfer": [[4]] * 4, "unlanded": [[0]] * 4})
    assert [x[0] for x in ok.records[0]] == ["transfer_consensus", "transfer_poll"]   # none failed: no MAX


def test_the_second_min_polls_the_whole_queue_and_pops_the_listed_only():
    """Request 0 finished on both stages (listed), request 1 only on stage 0: the second
    MIN's vector holds both, only request 0 moves."""
    res, bad = run("pp-0.5.13", 2, 1, {"transfer": [[4, 4], [4, 3]], "unlanded": [[0, 0], [0, 0]]}, reqs=2)
    assert res.stages == ((Q.PREBUILT, Q.TRANSFER), (Q.PREBUILT, Q.TRANSFER)) and bad == []
    assert res.records[0] == (("transfer_consensus", "min", 2), ("transfer_poll", "min", 2))


def test_the_ring_value_unites_its_union_values_and_intersects_the_rest():
    v = PP_VARIANTS["pp-prefill-0.5.18"]
    ring = v.points[0]
    assert ring.union == (0,)
    assert [ring_value(ring, [2, 0], s, PYF.ops) for s in (0, 1)] == [0, 0]        # bad on any stage
    assert [ring_value(ring, [2, 2], s, PYF.ops) for s in (0, 1)] == [2, 2]        # good on every stage
    assert [ring_value(ring, [2, 1], s, PYF.ops) for s in (0, 1)] == [STAY, STAY]  # neither: unlisted
    finished = PP_VARIANTS["pp-0.5.13"].points[0]
    assert [ring_value(finished, [4, 0], s, PYF.ops) for s in (0, 1)] == [4, 0]    # each stage its own


def test_prefill_ring_0512_pops_on_its_own_poll_0518_on_the_consensus():
    """Stage 1 Failed: bad for everyone. 0.5.12/0.5.13 list it and each stage pops it
    on its own second poll (stage 0 bootstraps it); 0.5.18 on fail it everywhere."""
    inputs = {"bootstrap": [[2], [0]], "no_buffer": [[0], [0]]}
    res, bad = run("pp-prefill-0.5.12", 2, 1, inputs)
    assert res.stages == ((B.WAITING,), (B.GONE,)) and bad == ["stages_agree"]
    res, bad = run("pp-prefill-0.5.18", 2, 1, inputs)
    assert res.stages == ((B.GONE,), (B.GONE,)) and bad == []
    assert res.records == ((("bootstrap_consensus", "min", 1),),) * 2


def test_prefill_ring_0518_mins_the_unlisted_and_keeps_a_request_without_a_buffer():
    res, bad = run("pp-prefill-0.5.18", 2, 1, {"bootstrap": [[2], [1]], "no_buffer": [[0], [0]]})
    assert res.stages == ((B.BOOTSTRAP,),) * 2 and bad == []
    assert res.records[0] == (("bootstrap_consensus", "min", 1), ("bootstrap_uncovered", "min", 1))
    res, bad = run("pp-prefill-0.5.18", 1, 2, {"bootstrap": [[2], [2]], "no_buffer": [[0], [1]]})
    assert res.stages == ((B.WAITING,), (B.BOOTSTRAP,)) and bad == ["stages_agree"]


def test_strict_reduces_over_every_stage_and_rank():
    for transfer, unlanded, want in (([[4], [4], [4], [0]], [[0]] * 4, Q.GONE),
                                     ([[4]] * 4, [[0], [0], [1], [0]], Q.TRANSFER),
                                     ([[4]] * 4, [[0]] * 4, Q.PREBUILT)):
        res, bad = run("pp-strict", 2, 2, {"transfer": transfer, "unlanded": unlanded})
        assert res.stages == ((want,),) * 4 and bad == []
        assert len(set(res.records)) == 1


def test_strict_keeps_every_row_agreed_on_random_runs():
    rng = random.Random(19)
    for name in ("pp-strict", "pp-prefill-strict"):
        v = PP_VARIANTS[name]
        for _ in range(60):
            pp, t, n = rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 3)
            stages = initial_pp_stages(v, pp, t, n)
            for _ in range(3):
                inp = {x: [[rng.choice(INPUTS[x]) for _ in range(n)] for _ in range(pp * t)] for x in v.inputs()}
                res = run_pipeline(v, pp, stages, inp)
                assert pipeline_violations(res, v) == []
                stages = res.stages


def test_pp0_forwards_by_position_so_a_shifted_queue_gets_another_requests_value():
    """0.5.23 prefill: stage 1 kept request 0 (no metadata buffer), so its queue is
    [0, 1] while stage 0's is [1]: PP0's value for request 1 (Failed) aborts request 0."""
    stages = ((P.WAITING, P.BOOTSTRAP), (P.BOOTSTRAP, P.BOOTSTRAP))
    res, bad = run("pp-prefill-0.5.23", 2, 1, {"bootstrap": [[0, 0], [2, 2]], "no_buffer": [[0, 0], [0, 0]]},
                   stages=stages, reqs=2)
    assert res.stages == ((P.WAITING, P.GONE), (P.GONE, P.BOOTSTRAP))
    assert bad == ["positions_agree", "stages_agree"]
    assert res.records[1] == (("bootstrap_poll", "pp_recv", 2),)


def test_pp0_with_empty_stage0_queue_leaves_a_later_stage_waiting_on_a_receive():
    res, bad = run("pp-prefill-0.5.23", 2, 1, {"bootstrap": [[2], [2]], "no_buffer": [[0], [0]]},
                   stages=((P.WAITING,), (P.BOOTSTRAP,)))
    assert res.records == ((), (("bootstrap_poll", "pp_recv", 1),))
    assert "positions_agree" in bad


def test_forwarded_zips_by_position_and_stays_past_stage0s_list():
    p = PP_VARIANTS["pp-prefill-0.5.23"].points[0]
    row0 = (P.GONE, P.BOOTSTRAP, P.WAITING)          # stage 0's queue: [1]
    row = (P.BOOTSTRAP, P.BOOTSTRAP, P.BOOTSTRAP)    # this stage's: [0, 1, 2]
    assert forwarded(p, row0, [7, 8, 9], row, PYF) == [8, STAY, STAY]
    assert p.across is Across.PP0


def test_agreed_queues_make_pp0_forwarding_exact():
    v = PP_VARIANTS["pp-prefill-0.5.23"]
    res = run_pipeline(v, 3, initial_pp_stages(v, 3, 1, 2),
                       {"bootstrap": [[0, 2], [1, 1], [1, 1]], "no_buffer": [[0, 0]] * 3})
    assert res.stages == ((P.GONE, P.WAITING),) * 3 and pipeline_violations(res, v) == []


def test_inputs_are_checked_and_unknown_variants_named():
    v = PP_VARIANTS["pp-0.5.13"]
    check_pp_inputs(v, {"transfer": [[4], [4]], "unlanded": [[0], [1]]}, 2, 1, 1)
    for bad, msg in (({"transfer": [[4]], "unlanded": [[0], [1]]}, "2 (stage, rank) rows"),
                     ({"transfer": [[4], [2]], "unlanded": [[0], [1]]}, "outside"),
                     ({"transfer": [[4], [True]], "unlanded": [[0], [1]]}, "outside")):
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            check_pp_inputs(v, bad, 2, 1, 1)
    with pytest.raises(ValueError, match="unknown pipeline variant"):
        get_pp_variant("pp-0.5.99")


def _trace(name, pp, ranks, reqs, iterations, claim=None):
    import io
    v = PP_VARIANTS[name]
    fp = io.StringIO()
    w = IterationTraceWriter(fp, name, ranks, reqs, "test", stages=pp)
    stages = initial_pp_stages(v, pp, ranks, reqs)
    for i, inp in enumerate(iterations):
        res = run_pipeline(v, pp, stages, inp)
        w.iteration(i, inp, res)
        stages = res.stages
    if claim:
        w.violation(pipeline_violations(res, v)[0], len(iterations) - 1)
    w.end(len(iterations))
    return fp.getvalue().splitlines()


def test_pp_traces_replay_and_their_claims_are_checked():
    lines = _trace("pp-0.5.13", 2, 1, 1, [{"transfer": [[4], [0]], "unlanded": [[0], [0]]}], claim=True)
    res = validate_iterations(lines)
    assert res.ok and [c.invariant for c in res.claims] == ["stages_agree"]
    assert "stage 0 rank 0 PREBUILT, stage 1 rank 0 GONE" in res.claims[0].detail
    # the same inputs against strict: no violation, so the claim is refuted
    refuted = validate_iterations(lines, "pp-strict")
    assert not refuted.ok
    # a tampered stage is caught
    rec = json.loads(lines[1])
    rec["stages"] = [[2], [2]]
    assert not validate_iterations([lines[0], json.dumps(rec), *lines[2:]]).ok


def test_pp_trace_headers_need_their_stage_count():
    head = json.loads(_trace("pp-strict", 2, 1, 1, [])[0])
    del head["stages"]
    with pytest.raises(TraceFormatError, match="stages"):
        validate_iterations([json.dumps(head)])


def test_one_stage_is_one_tp_group_and_the_releases_agree_there():
    """With pp = 1 the ring and the second MIN read one TP group's MIN: with every
    metadata row landed (0.5.12's commit reads it on its own rank) agreement holds, so
    every other break above is one between stages."""
    rng = random.Random(3)
    for name in ("pp-0.5.12", "pp-0.5.13", "pp-0.5.23"):
        v = PP_VARIANTS[name]
        for _ in range(100):
            t, n = rng.randint(1, 3), rng.randint(1, 3)
            inp = {x: [[rng.choice(INPUTS[x]) for _ in range(n)] for _ in range(t)] for x in v.inputs()}
            inp["unlanded"] = [[0] * n for _ in range(t)]
            res = run_pipeline(v, 1, initial_pp_stages(v, 1, t, n), inp)
            assert pipeline_violations(res, v) == []
            assert not {Q.CHECKED, Q.FAILED} & {x for row in res.stages for x in row}
