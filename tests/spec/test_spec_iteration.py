"""The decode iteration (model/spec/iteration.py): each release's mechanism shows as the
collective sequence it makes the ranks issue, and iteration traces replay through
``pdgate validate`` with bad input refused in one line."""
import json

import pytest

from model.cli import main
from model.spec.agreement import Stage
from model.spec.iteration import (ITER_VARIANTS, check_inputs, collectives_agree, initial_stages,
                                  iteration_violations, no_local_decision_after_min, run_iteration)
from model.spec.itertrace import IterationTraceWriter, validate_iterations

S = Stage


def _inputs(v, ranks=2, reqs=1, **per_rank):
    """Every input at its 'proceed' value on every rank; per_rank overrides by name."""
    proceed = {"arrive": 1, "handshake": 2, "fits": 1, "transfer": 4, "held": 0,
               "corrupt": 0, "finish": 0, "unresolved": 0, "hold": 0, "drained": 1, "retract": 0}
    out = {n: [[proceed[n]] * reqs for _ in range(ranks)] for n in v.inputs()}
    for name, rows in per_rank.items():
        out[name] = rows
    return out


def _names(res, k):
    return [name for name, _, _ in res.records[k]]


def test_a_request_goes_from_the_broadcast_to_the_forward_in_one_iteration_on_every_variant():
    for v in ITER_VARIANTS.values():
        if v.stages is not Stage:        # prefill: below
            continue
        res = run_iteration(v, initial_stages(2, 1), _inputs(v))
        assert res.stages == ((S.RUNNING,), (S.RUNNING,)), v.name
        assert iteration_violations(res, v) == [], v.name
        assert _names(res, 0)[0] == "recv_requests" and _names(res, 0)[-1] == "forward"


def test_a_request_pending_on_one_rank_is_still_polled_by_both():
    """The releases enqueue a request in the prealloc queue before resolving its dp rank
    (``add``): a rank that has not resolved it polls Bootstrapping (the cap), and both
    ranks issue the MIN and keep it pending: no break (as the wheels run, conform
    --points)."""
    v = ITER_VARIANTS["iter-0.5.21"]
    res = run_iteration(v, initial_stages(2, 1), _inputs(v, unresolved=[[0], [1]]))
    assert "prealloc_poll" in _names(res, 0) and res.records[0] == res.records[1]
    assert res.stages == ((S.PENDING,), (S.PENDING,))
    assert iteration_violations(res, v) == []


def test_a_split_admission_splits_the_next_collective():
    """Rank-local admission (``pop_preallocated``'s token budget): one rank moves the
    request to its transfer queue, the other keeps it; the transfer queue's empty-queue
    return then skips the MIN on one rank only (#36928's shape, where the wheels have it)."""
    v = ITER_VARIANTS["iter-0.5.21"]
    res = run_iteration(v, initial_stages(2, 1), _inputs(v, fits=[[1], [0]], transfer=[[3], [3]]))
    assert "transfer_poll" in _names(res, 0) and "transfer_poll" not in _names(res, 1)
    (viol, *_) = collectives_agree(res)
    assert "transfer_poll" in viol.detail


def test_strict_gates_the_unresolved_rank_instead():
    v = ITER_VARIANTS["iter-strict"]
    res = run_iteration(v, initial_stages(2, 1), _inputs(v, unresolved=[[0], [1]]))
    assert res.records[0] == res.records[1]
    assert res.stages == ((S.PENDING,), (S.PENDING,))     # held back on both, by the MIN
    assert iteration_violations(res, v) == []


def test_the_0_5_13_skip_issues_where_a_rank_sees_failed():
    """Every member WaitingForInput: ranks skip the MIN unless their own receiver failed."""
    v = ITER_VARIANTS["iter-0.5.13"]
    ready = ((S.READY,), (S.READY,))
    res = run_iteration(v, ready, _inputs(v, fits=[[0], [0]], handshake=[[0], [2]]))
    assert "prealloc_poll" in _names(res, 0) and "prealloc_poll" not in _names(res, 1)
    v12 = ITER_VARIANTS["iter-0.5.12"]
    res12 = run_iteration(v12, ready, _inputs(v12, fits=[[0], [0]], handshake=[[0], [2]]))
    assert res12.records[0] == res12.records[1]      # 0.5.12 skips on agreed stages only


def test_checksum_drop_sets_per_rank_in_0_5_21_and_agreed_in_0_5_23():
    for name, agreed in (("iter-0.5.21", False), ("iter-0.5.23", True)):
        v = ITER_VARIANTS[name]
        res = run_iteration(v, initial_stages(2, 1), _inputs(v, corrupt=[[1], [0]]))
        assert (res.stages == ((S.GONE,), (S.GONE,))) == agreed, name
        assert (collectives_agree(res) == []) == agreed, name


def test_a_host_staging_continue_after_the_min_is_a_local_decision():
    v = ITER_VARIANTS["iter-0.5.23"]
    res = run_iteration(v, ((S.TRANSFER,), (S.TRANSFER,)), _inputs(v, held=[[1], [0]]))
    (viol,) = no_local_decision_after_min(res, v)
    assert "transfer_poll" in viol.detail and viol.ranks == (0, 1)
    strict = ITER_VARIANTS["iter-strict"]
    res = run_iteration(strict, ((S.TRANSFER,), (S.TRANSFER,)), _inputs(strict, held=[[1], [0]]))
    assert no_local_decision_after_min(res, strict) == [] and res.stages == ((S.TRANSFER,), (S.TRANSFER,))


def test_inputs_are_checked_by_name_shape_and_domain():
    v = ITER_VARIANTS["iter-0.5.21"]
    good = _inputs(v)
    check_inputs(v, good, 2, 1)
    for bad, needle in (({**good, "transfer": [[2], [4]]}, "outside"), ({**good, "fits": [[1]]}, "2 ranks"),
                        ({k: x for k, x in good.items() if k != "held"}, "'held'"),
                        ({**good, "held": [[True], [0]]}, "outside")):
        with pytest.raises(ValueError, match=needle):
            check_inputs(v, bad, 2, 1)


def _trace(tmp_path, v, inputs_seq, claim=None, records=True):
    path = tmp_path / "t.jsonl"
    stages = initial_stages(2, 1)
    with open(path, "w", encoding="utf-8") as fp:
        w = IterationTraceWriter(fp, v.name, 2, 1, "test")
        for i, inp in enumerate(inputs_seq):
            res = run_iteration(v, stages, inp)
            w.iteration(i, inp, res)
            stages = res.stages
        if claim:
            w.violation(iteration_violations(res, v)[0] if claim is True else claim, len(inputs_seq) - 1)
        w.end(len(inputs_seq))
    return path


def test_validate_replays_an_iteration_trace_and_confirms_its_claim(tmp_path, capsys):
    v = ITER_VARIANTS["iter-0.5.21"]
    path = _trace(tmp_path, v, [_inputs(v, fits=[[1], [0]], transfer=[[3], [3]])], claim=True)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "OK: 1 iterations" in out and "collectives_agree breaks at iteration 0" in out
    # the same trace against strict: its recorded collectives are not strict's
    assert main(["validate", str(path), "--variant", "iter-strict"]) == 1    # strict agrees on admission
    assert "['admission', 'min', 1]] in the spec" in capsys.readouterr().out


def test_validate_refuses_a_claim_and_records_the_spec_does_not_make(tmp_path, capsys):
    v = ITER_VARIANTS["iter-0.5.23"]
    path = _trace(tmp_path, v, [_inputs(v)])
    lines = path.read_text().splitlines()
    lines.insert(-1, json.dumps({"kind": "violation", "invariant": "collectives_agree", "iteration": 0}))
    path.write_text("\n".join(lines) + "\n")
    assert main(["validate", str(path)]) == 1
    assert "claims collectives_agree" in capsys.readouterr().out
    rec = json.loads(lines[1])
    rec["records"][1] = rec["records"][1][:-1]
    path.write_text("\n".join([lines[0], json.dumps(rec), lines[-1]]) + "\n")
    assert main(["validate", str(path)]) == 1
    assert "rank 1 issues" in capsys.readouterr().out


@pytest.mark.parametrize("mutate, needle", [
    (lambda ls: ls[:1] + ls[2:], "end record says 1 iterations"),
    (lambda ls: ls[:-1], "ended before its end record"),
    (lambda ls: [ls[0].replace('"requests":1', '"requests":-1')] + ls[1:], "requests -1 out of range"),
    (lambda ls: [ls[0].replace("iter-0.5.23", "iter-9")] + ls[1:], "unknown iteration variant"),
    (lambda ls: [ls[0], ls[1].replace('"handshake":[[2],[2]]', '"handshake":[[7],[2]]')] + ls[2:], "outside"),
    (lambda ls: ls + [ls[-1]], "record after the end record"),
    (lambda ls: [ls[0], '{"kind":"step"}'] + ls[1:], "unknown iteration trace record kind"),
    (lambda ls: [ls[0], ls[1].replace('"inputs":{', '"inputs":[{').replace(',"records"', '],"records"')] + ls[2:],
     "'inputs' must be an object"),
])
def test_bad_iteration_traces_exit_2_or_1_in_one_line(tmp_path, capsys, mutate, needle):
    v = ITER_VARIANTS["iter-0.5.23"]
    path = _trace(tmp_path, v, [_inputs(v)])
    path.write_text("\n".join(mutate(path.read_text().splitlines())) + "\n")
    code = main(["validate", str(path)])
    cap = capsys.readouterr()
    text = cap.out + cap.err
    assert code in (1, 2) and needle in text, text
    assert len(text.strip().splitlines()) == 1


def test_a_step_trace_is_not_replayed_against_an_iteration_variant(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    path.write_text('{"kind":"header","format":"pdgate-trace","version":1,"variant":"gate","ranks":1,'
                    '"slots":1,"timeout_steps":null,"source":"t"}\n{"kind":"end","steps":0}\n')
    assert main(["validate", str(path)]) == 0
    assert main(["validate", str(path), "--variant", "iter-strict"]) == 2
    assert "iteration variant" in capsys.readouterr().err


def test_validate_iterations_counts_what_it_replayed():
    v = ITER_VARIANTS["iter-strict"]
    lines = ['{"kind":"header","format":"pdgate-iteration","version":1,"variant":"iter-strict",'
             '"ranks":1,"requests":1,"source":"t"}',
             json.dumps({"kind": "iteration", "i": 0, "inputs": {n: [[0]] for n in v.inputs()}}),
             '{"kind":"end","iterations":1}']
    res = validate_iterations(lines)
    assert res.ok and res.iterations == 1


def test_prefill_pop_bootstrapped_keeps_a_request_on_the_rank_without_a_metadata_buffer():
    """#37909: after the bootstrap MIN, a rank without a free buffer ``continue``s; strict
    caps its contribution at Bootstrapping before the MIN instead."""
    from model.spec.iteration import PStage
    boot = ((PStage.BOOTSTRAP,), (PStage.BOOTSTRAP,))
    inputs = {"arrive": [[0], [0]], "bootstrap": [[2], [2]], "no_buffer": [[0], [1]], "transfer": [[3], [3]]}
    v = ITER_VARIANTS["prefill-0.5.12"]
    res = run_iteration(v, boot, inputs)
    assert res.stages == ((PStage.INFLIGHT,), (PStage.BOOTSTRAP,))
    assert [x.invariant for x in iteration_violations(res, v)] == [
        "collectives_agree", "no_local_decision_after_min", "stages_agree"]
    strict = ITER_VARIANTS["prefill-strict"]
    res = run_iteration(strict, boot, inputs)
    assert res.stages == boot and iteration_violations(res, strict) == []


def _failed_then(v, **per_rank):
    """A request the transfer MIN fails on every rank, with the hold inputs given."""
    return run_iteration(v, ((S.TRANSFER,), (S.TRANSFER,)), _inputs(v, transfer=[[0], [0]], **per_rank))


def test_the_hold_decision_after_a_failed_transfer_is_per_rank_until_0_5_23_agrees_it_by_max():
    """#35049: 0.5.19 and 0.5.21 hold a failed request's slot where this rank's receiver
    notified prefill; 0.5.23 MAX-reduces the hold flags first (decode.py 0.5.23:2960)."""
    for name in ("iter-0.5.19", "iter-0.5.21"):
        res = _failed_then(ITER_VARIANTS[name], hold=[[1], [0]])
        assert res.stages == ((S.HELD,), (S.GONE,)), name
    for name in ("iter-0.5.23", "iter-strict"):
        v = ITER_VARIANTS[name]
        res = _failed_then(v, hold=[[1], [0]])
        assert res.stages == ((S.HELD,), (S.HELD,)), name
        assert ("defer_release", "max", 1) in res.records[0] and iteration_violations(res, v) == []
    v12 = ITER_VARIANTS["iter-0.5.13"]
    assert _failed_then(v12).stages == ((S.GONE,), (S.GONE,))       # no deferred release before 0.5.19


def test_deferred_releases_free_per_rank_in_0_5_19_and_by_a_min_in_0_5_23():
    held = ((S.HELD,), (S.HELD,))
    v19 = ITER_VARIANTS["iter-0.5.19"]
    res = run_iteration(v19, held, _inputs(v19, drained=[[1], [0]]))
    assert res.stages == ((S.GONE,), (S.HELD,)) and res.records[0] == res.records[1]
    assert [x.invariant for x in iteration_violations(res, v19)] == ["stages_agree"]
    v23 = ITER_VARIANTS["iter-0.5.23"]
    res = run_iteration(v23, held, _inputs(v23, drained=[[1], [0]]))
    assert res.stages == held and ("deferred_release", "min", 1) in res.records[1]
    assert iteration_violations(res, v23) == []


def test_0_5_21_min_reduces_host_staged_holds_only_where_this_rank_has_one():
    """decode.py 0.5.21:2810-2824: ``if host_ready.numel()`` counts this rank's host-staged
    holds, so a rank that held the request on the device (or released it) skips the MIN."""
    v = ITER_VARIANTS["iter-0.5.21"]
    res = _failed_then(v, hold=[[2], [1]])
    assert res.stages == ((S.HELD_HOST,), (S.HELD,))
    nxt = run_iteration(v, res.stages, _inputs(v, drained=[[0], [0]]))
    assert "deferred_release_host" in _names(nxt, 0) and "deferred_release_host" not in _names(nxt, 1)
    (viol,) = collectives_agree(nxt)
    assert "deferred_release_host min shape 1" in viol.detail
    both = run_iteration(v, ((S.HELD_HOST,), (S.HELD_HOST,)), _inputs(v, drained=[[1], [0]]))
    assert both.stages == ((S.HELD_HOST,), (S.HELD_HOST,)) and collectives_agree(both) == []


def test_the_retraction_drain_is_issued_only_by_the_rank_that_retracts():
    """drain_before_retraction (0.5.21 on): check_offload_progress's MIN, then a MAX, on
    the rank whose own check_decode_mem failed; strict issues both wherever a batch runs."""
    running = ((S.RUNNING,), (S.RUNNING,))
    for name in ("iter-0.5.21", "iter-0.5.23"):
        v = ITER_VARIANTS[name]
        res = run_iteration(v, running, _inputs(v, retract=[[0], [1]]))
        assert _names(res, 1)[-3:] == ["offload_drain_progress", "offload_drain", "forward"], name
        assert "offload_drain" not in _names(res, 0)
        (viol,) = collectives_agree(res)
        assert "rank 0 issues forward all_reduce shape 1, rank 1 issues offload_drain_progress min shape 2" in viol.detail
    strict = ITER_VARIANTS["iter-strict"]
    res = run_iteration(strict, running, _inputs(strict, retract=[[0], [1]]))
    assert res.records[0] == res.records[1] and ("offload_drain", "max", 1) in res.records[0]
    assert "offload_drain" not in _names(run_iteration(strict, initial_stages(2, 1), _inputs(strict, arrive=[[0], [0]])), 0)


def test_prefill_waiting_queue_min_follows_the_bootstrap_min_from_0_5_18():
    """resolve_waiting_queue_bootstrap: a MIN over the waiting queue (``if not candidates:
    return``); a failed poll leaves it. On ranks the buffer continue split, the vectors differ."""
    from model.spec.iteration import PStage
    v = ITER_VARIANTS["prefill-0.5.18"]
    waiting = ((PStage.WAITING,), (PStage.WAITING,))
    res = run_iteration(v, waiting, {"arrive": [[0], [0]], "bootstrap": [[2], [0]], "no_buffer": [[0], [0]],
                                     "transfer": [[3], [3]]})
    assert res.stages == ((PStage.GONE,), (PStage.GONE,)) and iteration_violations(res, v) == []
    boot = ((PStage.BOOTSTRAP,), (PStage.BOOTSTRAP,))
    res = run_iteration(v, boot, {"arrive": [[0], [0]], "bootstrap": [[2], [2]], "no_buffer": [[0], [1]],
                                  "transfer": [[3], [3]]})
    assert "waiting_bootstrap" in [n for n, _, _ in res.records[0]]
    assert "waiting_bootstrap" not in [n for n, _, _ in res.records[1]]
    assert "waiting_bootstrap" not in [p.name for p in ITER_VARIANTS["prefill-0.5.12"].points]


def test_admission_stops_at_the_first_request_that_does_not_fit():
    """pop_preallocated walks the queue in order and ``break``s at a request that does not
    fit: the one behind it waits too, even where it fits (every release); strict's walk
    stops at the agreed MIN's first 0, so both ranks stop at the same request."""
    ready = ((S.READY, S.READY), (S.READY, S.READY))
    cut = lambda v: type(v)(v.name, v.releases, tuple(p for p in v.points if p.name == "admission"))
    v = cut(ITER_VARIANTS["iter-0.5.23"])
    assert v.points[0].halt == 0
    res = run_iteration(v, ready, {"fits": [[0, 1], [1, 1]]})
    assert res.stages == ((S.READY, S.READY), (S.TRANSFER, S.TRANSFER))
    strict = ITER_VARIANTS["iter-strict"]
    res = run_iteration(cut(strict), ready, {"fits": [[0, 1], [1, 1]]})
    assert res.stages == ((S.READY, S.READY), (S.READY, S.READY)) and iteration_violations(res, cut(strict)) == []
    res = run_iteration(cut(strict), ready, {"fits": [[1, 0], [1, 1]]})
    assert res.stages == ((S.TRANSFER, S.READY), (S.TRANSFER, S.READY))


def test_0_5_12_prefill_breaks_at_the_missing_buffer_and_0_5_13_continues():
    """A later request the MIN failed leaves the queue in 0.5.13 (``continue``) but stays
    behind 0.5.12's ``break`` on the rank without a buffer."""
    from model.spec.iteration import PStage
    boot = ((PStage.BOOTSTRAP,) * 2,) * 2
    inputs = {"bootstrap": [[2, 0], [2, 0]], "no_buffer": [[1, 0], [0, 0]]}
    cut = lambda name: type(ITER_VARIANTS[name])(name, "", tuple(
        p for p in ITER_VARIANTS[name].points if p.name == "bootstrap_poll"), PStage, PStage.INFLIGHT)
    got = {name: run_iteration(cut(name), boot, inputs).stages for name in ("prefill-0.5.12", "prefill-0.5.13")}
    assert got["prefill-0.5.12"] == ((PStage.BOOTSTRAP, PStage.BOOTSTRAP), (PStage.WAITING, PStage.GONE))
    assert got["prefill-0.5.13"] == ((PStage.BOOTSTRAP, PStage.GONE), (PStage.WAITING, PStage.GONE))
