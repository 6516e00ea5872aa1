"""``pdgate calibrate`` and ``pdgate simulate --calibration`` on a committed real e2e
run (bench/data/fidelity/, 300 requests, 2 ranks, real Mooncake on the development
machine): the fit, the correlated draws, the writer's queue, and that a calibrated run
reproduces the run it was fitted to while a wrong calibration does not."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model.cli import main
from sim.calibrate import simulated
from sim.config import SimConfig, TransferFit
from sim.fit import fit, load_e2e

DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "fidelity"
CAL = str(DATA / "cal-r2.json.gz")


@pytest.fixture(scope="module")
def cal() -> dict:
    return fit([(CAL, load_e2e(CAL))])


def test_the_fit_reads_the_measured_run(cal):
    doc = load_e2e(CAL)
    assert cal["setup"]["ranks"] == 2 and cal["setup"]["inflight"] == doc["setup"]["inflight"]
    # one step trace entry per measured step; the replay table is the measured times
    assert len(cal["step_rest_ms"]) == len(doc["timeline"]["step_ms"])
    first = doc["timeline"]["requests"][0]
    want = [s - e for s, e in zip(first["success"], first["enq"])]
    assert cal["transfer"]["replay_ms"][0] == pytest.approx(want, abs=1e-3)
    # real per-rank transfer times share the prefill's queue: strongly correlated
    assert cal["transfer"]["correlation"] > 0.9
    assert 0 < cal["writer"]["room_ms"] < 5 and cal["writer"]["per_page_ms"] > 0


def _draws(fit_: TransferFit) -> np.ndarray:
    pages = np.full(4096, 10.0)
    return fit_.draw(np.random.default_rng(0), pages, 0, 2, 4096)


def test_correlated_draws_keep_the_measured_correlation(cal):
    t = cal["transfer"]
    fitted = TransferFit(t["base_ms"], t["per_page_ms"], tuple(t["common"]), tuple(t["noise"]))
    x = np.log(_draws(fitted))
    assert np.corrcoef(x[:, 0], x[:, 1])[0, 1] > 0.8
    # the sibling: the same noise without the common factor is not correlated
    alone = TransferFit(t["base_ms"], t["per_page_ms"], (0.0,), tuple(t["noise"]))
    y = np.log(_draws(alone))
    assert abs(np.corrcoef(y[:, 0], y[:, 1])[0, 1]) < 0.2


def _p50(cal: dict, model: str, setup: dict) -> float:
    return float(np.percentile(simulated(cal, setup, model, 2)["enqueue_commit"], 50))


@pytest.mark.parametrize("model", ["correlated", "replay"])
def test_a_calibrated_run_reproduces_its_own_run_and_a_wrong_one_does_not(cal, model):
    """In-sample, the median enqueue -> commit within 25% (the writer model is further
    off in-sample: docs/SIMULATOR.md's table); four times slower transfers are not."""
    doc = load_e2e(CAL)
    real = doc["enqueue_commit_p50_ms"]
    assert _p50(cal, model, doc["setup"]) == pytest.approx(real, rel=0.25)
    slow = json.loads(json.dumps(cal))
    for part in ("transfer", "writer"):
        slow[part]["base_ms"] *= 4
        slow[part]["per_page_ms"] *= 4
    slow["transfer"]["replay_ms"] = [[v * 4 for v in row] for row in slow["transfer"]["replay_ms"]]
    assert not _p50(slow, model, doc["setup"]) == pytest.approx(real, rel=0.25)


def test_the_writer_queues_more_ranks_and_a_delayed_row(cal):
    doc = load_e2e(CAL)
    base = _p50(cal, "writer", doc["setup"])
    assert _p50(cal, "writer", {**doc["setup"], "ranks": 4}) > 1.5 * base
    gd = simulated(cal, {**doc["setup"], "metadata_delay_ms": {"1": 20.0}}, "writer", 1)["gate_delay"]
    assert np.percentile(gd, 50) > 20


def test_simulate_calibration_cli(cal, tmp_path, capsys):
    path = tmp_path / "cal.json"
    assert main(["calibrate", CAL, "--out", str(path)]) == 0
    out = tmp_path / "sim.json"
    rc = main(["simulate", "--calibration", str(path), "--variant", "strict", "--ranks", "2",
               "--json", str(out), "--no-wall-clock"])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["committed"] == cal["setup"]["requests"]
    assert "closed loop" in summary["workload"]


@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--inflight", "4"], "--inflight: applies only with --calibration"),
    (["simulate", "--metadata-delay", "1:20"], "--metadata-delay: applies only with --calibration"),
    (["simulate", "--calibration", "/nonexistent.json"], "cannot read"),
    (["simulate", "--calibration", "{bad}", "--ranks", "2"], "missing or malformed 'allreduce'"),
    (["simulate", "--calibration", "{e2e}", "--ranks", "2"], "not a pdgate calibration"),
    (["simulate", "--calibration", "{good}", "--ranks", "2", "--metadata-delay", "5:1"], "out of range"),
    (["simulate", "--calibration", "{good}", "--ranks", "2", "--metadata-delay", "1:nan"], "RANK:MS"),
    (["calibrate", "/etc/hostname"], "not JSON"),
    (["calibrate", "{bad}"], "not a pdgate e2e JSON"),
    (["calibrate", CAL, "--validate", "{e2e_bad_setup}"], "malformed setup"),
    (["calibrate", CAL, "--validate", "{e2e_no_commit}"], "held2.json: malformed e2e timeline request (KeyError"),
    (["calibrate", CAL, "{e2e_no_commit}"], "held2.json: malformed e2e timeline request (KeyError"),
])
def test_bad_calibration_input_is_one_line(argv, needle, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1}')
    good = tmp_path / "good.json"
    good.write_text(json.dumps(fit([(CAL, load_e2e(CAL))])))
    e2e = tmp_path / "e2e.json"
    e2e.write_text('{"setup": {}}')
    held = load_e2e(CAL)
    held["setup"]["metadata_delay_ms"] = [1]
    e2e_bad_setup = tmp_path / "held.json"
    e2e_bad_setup.write_text(json.dumps(held))
    held = load_e2e(CAL)                  # a committed request without its commit time
    del next(r for r in held["timeline"]["requests"] if r["committed"])["commit"]
    e2e_no_commit = tmp_path / "held2.json"
    e2e_no_commit.write_text(json.dumps(held))
    argv = [a.format(bad=bad, good=good, e2e=e2e, e2e_bad_setup=e2e_bad_setup, e2e_no_commit=e2e_no_commit)
            for a in argv]
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_default_configs_have_no_calibration():
    cfg = SimConfig()
    assert cfg.transfer is None and cfg.writer is None and cfg.allreduce_extra is None


def test_a_delay_run_gives_delayed_rows_their_measured_wait(cal):
    delay = str(DATA / "cal-r2-delay10.json.gz")
    both = fit([(CAL, load_e2e(CAL)), (delay, load_e2e(delay))])
    waits = both["delayed_wait_ms"]
    assert not cal["delayed_wait_ms"] and len(waits) == 300      # rank 1 of 300 requests
    setup = {**load_e2e(CAL)["setup"], "metadata_delay_ms": {"1": 20.0}}
    measured = np.percentile(simulated(both, setup, "writer", 1)["gate_delay"], 50)
    estimated = np.percentile(simulated(cal, setup, "writer", 1)["gate_delay"], 50)
    # the measured waits (a median of tens of ms here) replace the backlog estimate
    assert measured > 20 + 0.5 * np.median(waits) and measured != estimated


QUIET = DATA / "quiet"


def test_repeats_of_the_fitted_setup_are_pooled_and_other_setups_are_not():
    runs = [str(QUIET / n) for n in ("r2-s1.json.gz", "r2-s2.json.gz", "r4-s1.json.gz")]
    docs = [(p, load_e2e(p)) for p in runs]
    both = fit(docs)
    alone = fit(docs[:1])
    assert both["pooled"] == runs[:2] and alone["pooled"] == runs[:1]
    steps = [len(d["timeline"]["step_ms"]) for _, d in docs]
    assert len(alone["step_rest_ms"]) == steps[0]
    assert len(both["step_rest_ms"]) == steps[0] + steps[1]       # the T=4 run's steps stay out
    assert len(both["transfer"]["replay_ms"]) == 2 * len(alone["transfer"]["replay_ms"])
    assert both["step_growth_per_rank_doubling"] > 0              # ... but give the growth


def test_validate_pools_each_setups_repeats_and_reports_their_spread(tmp_path, capsys):
    from impl.mooncake.timeline import latencies
    held = [str(QUIET / n) for n in ("r2-s2.json.gz", "r2-s3.json.gz", "r2-inflight4-s1.json.gz")]
    out = tmp_path / "v.json"
    rc = main(["calibrate", str(QUIET / "r2-s1.json.gz"), "--validate", *held, "--seeds", "1",
               "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    pair = [r for r in rows if r["run"] == "r2-s2, r2-s3" and r["role"] == "held out"]
    single = [r for r in rows if r["run"] == "r2-inflight4-s1"]
    assert len(pair) == len(single) == 6 and {r["runs"] for r in pair} == {2}
    pooled = latencies(load_e2e(held[0])["timeline"]["requests"])["gate_delay"] + \
        latencies(load_e2e(held[1])["timeline"]["requests"])["gate_delay"]
    p50 = next(r for r in pair if (r["metric"], r["quantile"]) == ("gate_delay", "p50"))
    assert p50["e2e_ms"] == pytest.approx(np.percentile(pooled, 50), abs=1e-3)
    singles = [load_e2e(p)["gate_delay_p50_ms"] for p in held[:2]]
    assert p50["spread_pct"] == pytest.approx(
        max(abs(v - p50["e2e_ms"]) / p50["e2e_ms"] * 100 for v in singles), abs=0.1)
    assert p50["spread_pct"] > 0 and all(r["spread_pct"] == 0 for r in single)
    # the calibration's own setup run again is a repeat row: real runs against real runs
    repeat = [r for r in rows if r["role"] == "repeat"]
    assert len(repeat) == 6 and all(r["run"] == "r2-s2, r2-s3" for r in repeat)
