"""The checks can fail: non-inductive conjunctions and unreachable goals are reported,
so a "proved" row is not an artefact of a check that always says yes."""
from model.encoding.checks import bmc, check_step, prove_inductive, violates
from model.encoding.vocab import Sizes
from model.spec.variants import ABLATIONS, VARIANTS
from proofs.obligations import BUNDLES


def test_ungated_queues_identical_is_not_inductive_at_the_step():
    log = prove_inductive(VARIANTS["ungated"], BUNDLES["queues_identical"])
    assert [f.split(":")[0] for f in log.failures("unsat")] == ["step"]


def test_strict_bundle_without_room_order_is_not_proved_where_the_room_lands():
    log = check_step(ABLATIONS["strict-no-room-order"], BUNDLES["no_corruption"], 3_000, only=["land_room"])
    assert [r.status for _, r in log.queries] != ["unsat"]


def test_gate_outcomes_agree_is_not_inductive_at_the_step():
    log = prove_inductive(VARIANTS["gate"], BUNDLES["outcomes_agree"])
    assert [f.split(":")[0] for f in log.failures("unsat")] == ["step"]


def test_bmc_finds_nothing_for_a_proved_invariant_and_is_minimal_otherwise():
    none = bmc(VARIANTS["strict"], Sizes(1, 1, 1), violates("no_corruption"), 6)
    assert none.status == "unsat" and none.depth is None
    hit = bmc(VARIANTS["gate"], Sizes(1, 1, 1), violates("no_corruption"), 6)
    assert hit.depth == 4
    assert [m.action for m in hit.steps][0] == "enqueue" and hit.steps[-1].action == "step"
