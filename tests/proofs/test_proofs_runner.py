"""``pdgate prove`` end to end: every result as expected, every exported trace accepted
by ``validate`` with its violation confirmed, and bad flags rejected in one line."""
import json

import pytest

from model.cli import main
from model.spec.validate import validate
from model.spec.clocks import CLOCK_VARIANTS
from model.spec.iteration import ITER_VARIANTS
from model.spec.pipeline import PP_VARIANTS
from proofs.obligations import obligations


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("prove")
    code = main(["prove", "--all", "--json", str(out / "r.json"), "--traces", str(out / "traces")])
    return code, json.loads((out / "r.json").read_text())


def test_every_result_matches_its_expectation(suite):
    code, rows = suite
    assert [r for r in rows if r["result"] != r["expected"]] == []
    assert code == 0
    assert len(rows) == len(obligations())


def test_the_default_set_leaves_out_only_the_slow_rows(capsys):
    assert main(["prove", "--list"]) == 0
    default = capsys.readouterr().out
    assert main(["prove", "--list", "--all"]) == 0
    every = capsys.readouterr().out
    slow = [o for o in obligations() if o.slow]
    assert slow and all(o.obligation == "bmc-crosscheck" for o in slow)
    assert len(every.splitlines()) - len(default.splitlines()) == len(slow)
    assert "bmc-crosscheck" in every and "bmc-crosscheck" not in default
    assert main(["prove", "--list", "--only", "bmc-crosscheck"]) == 0    # named: run
    assert capsys.readouterr().out.count("bmc-crosscheck") == len(slow)


def test_rows_have_the_documented_keys(suite):
    _, rows = suite
    for r in rows:
        assert {"obligation", "variant", "expected", "result", "seconds", "unbounded"} <= set(r)
        assert r["expected"] in ("proved", "counterexample", "not inductive")
        assert r["unbounded"] == r["obligation"].startswith(
            ("safety:", "lemma:", "induction:", "consistent:")) or (
            r["obligation"] == "liveness:bounded_wait" and r["expected"] == "proved")
        if r["expected"] == "counterexample":
            assert r.get("trace"), r


def test_every_broken_invariant_has_a_negative_unbounded_row_with_a_cti(suite):
    """A vacuous encoding (every query unsat) would prove these too: they must come out
    not inductive, each with a concrete counterexample to induction."""
    _, rows = suite
    # the iteration's, pipeline's and clocks' rows: test_proofs_iteration.py, _pipeline.py, _clocks.py
    rows = [r for r in rows if r["variant"] not in {**ITER_VARIANTS, **PP_VARIANTS, **CLOCK_VARIANTS}]
    cex = {(r["obligation"].split(":")[1], r["variant"]) for r in rows if r["obligation"].startswith("cex:")}
    cex |= {("bounded_wait", r["variant"]) for r in rows
            if r["obligation"] == "liveness:bounded_wait" and r["expected"] == "counterexample"}
    neg = {(r["obligation"].split(":")[1], r["variant"]): r for r in rows
           if r["obligation"].startswith("induction:")}
    assert set(neg) == cex
    for (inv, _), r in neg.items():
        assert r["result"] == "not inductive" and r["unbounded"]
        assert r["detail"].startswith("CTI with") and "| event " in r["detail"] and "| post " in r["detail"]
        assert f"| breaks {inv}" in r["detail"], r["detail"]     # the post-state breaks it


def test_refinement_and_consistency_rows_cover_every_variant(suite):
    _, rows = suite
    from proofs.obligations import ALL_VARIANTS
    assert {r["variant"] for r in rows if r["obligation"] == "refines:spec"} == set(ALL_VARIANTS)
    assert {r["variant"] for r in rows if r["obligation"] == "consistent:actions"} == set(ALL_VARIANTS)
    live = next(r for r in rows if r["obligation"] == "liveness:bounded_wait" and r["variant"] == "strict")
    assert "every timeout T >= 1" in live["detail"]


def test_the_gate_liveness_counterexample_uses_a_nonzero_room(suite):
    """The impl refuses room 0, so the trace it could replay must use another room."""
    _, rows = suite
    row = next(r for r in rows if r["obligation"] == "liveness:bounded_wait" and r["variant"] == "gate")
    with open(row["trace"], encoding="utf-8") as fp:
        enqueues = [json.loads(x) for x in fp if '"enqueue"' in x]
    assert enqueues and all(e["room"] != 0 for e in enqueues), enqueues


def test_the_expected_verdicts_per_variant(suite):
    _, rows = suite
    proved = {(r["obligation"], r["variant"]) for r in rows if r["result"] == "proved"}
    for inv in ("queues_identical", "outcomes_agree", "no_corruption", "exactly_once"):
        assert (f"safety:{inv}", "strict") in proved
    assert ("liveness:bounded_wait", "strict") in proved
    for v in ("gate", "gate-noclear"):
        assert {(f"safety:queues_identical", v), ("safety:exactly_once", v)} <= proved
    cex = {(r["obligation"], r["variant"]) for r in rows if r["result"] == "counterexample"}
    assert {("cex:queues_identical", "ungated"), ("cex:outcomes_agree", "gate-noclear"),
            ("cex:outcomes_agree", "gate"), ("cex:no_corruption", "gate"),
            ("liveness:bounded_wait", "gate"), ("cex:no_corruption", "strict-no-room-order"),
            ("cex:no_corruption", "strict-no-fence"),
            ("liveness:bounded_wait", "strict-no-timeout")} <= cex


def test_every_trace_validates_and_its_violation_is_confirmed(suite):
    _, rows = suite
    traced = [r for r in rows if r.get("trace")
              and r["variant"] not in {**ITER_VARIANTS, **PP_VARIANTS, **CLOCK_VARIANTS}]
    assert len(traced) >= 12
    for r in traced:
        with open(r["trace"], encoding="utf-8") as fp:
            lines = fp.readlines()
        res = validate(lines)
        assert res.ok, (r["trace"], res.message)
        claims = [json.loads(x) for x in lines if '"kind":"violation"' in x]
        if r["expected"] == "counterexample":
            want = r["obligation"].split(":")[1].split()[0]
            assert [c["invariant"] for c in claims] == [want], r["trace"]
            assert [v.invariant for v in res.claims] == [want]   # validate confirmed it
            assert claims[0]["ranks"] and claims[0]["reqs"]
        else:
            assert claims == []


def test_counterexamples_are_minimal_in_ranks(suite):
    _, rows = suite
    by = {(r["obligation"], r["variant"]): r for r in rows}
    for key, ranks in ((("cex:no_corruption", "gate"), 1), (("cex:queues_identical", "ungated"), 2),
                       (("cex:outcomes_agree", "gate"), 2)):
        header = json.loads(open(by[key]["trace"], encoding="utf-8").readline())
        assert header["ranks"] == ranks, key


@pytest.mark.parametrize("argv, needle", [
    (["--variant", "nope"], "unknown variant 'nope'"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--jobs", "two"], "invalid int value"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--only", "no-such-obligation"], "no obligation matches"),
])
def test_bad_flags_exit_2_with_one_line(capsys, argv, needle):
    with pytest.raises(SystemExit) if argv[1] == "two" else _nothing() as exc:
        code = main(["prove", *argv])
    if argv[1] == "two":
        code = exc.value.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and needle in err


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_list_names_every_obligation(capsys):
    assert main(["prove", "--list", "--variant", "strict"]) == 0
    out = capsys.readouterr().out
    assert "safety:no_corruption" in out and "ungated" not in out


def test_a_result_that_differs_from_its_expectation_exits_1(monkeypatch, capsys, tmp_path):
    import proofs.cli
    from proofs.obligations import Obligation, _inductive
    wrong = Obligation("safety:queues_identical", "ungated", "proved", True, _inductive, "queues_identical")
    monkeypatch.setattr(proofs.cli, "obligations", lambda: [wrong])
    assert main(["prove", "--jobs", "1", "--traces", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "not inductive  <-- UNEXPECTED" in out and "step: sat" in out


def test_stuck_workers_are_stopped_at_the_deadline(monkeypatch, capsys, tmp_path):
    import proofs.cli
    monkeypatch.setattr(proofs.cli, "SUITE_DEADLINE_S", 0.2)
    assert main(["prove", "--only", "cex:outcomes_agree", "--traces", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "did not finish" in err
