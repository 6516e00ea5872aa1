"""``pdgate sweep`` (grid and capacity search) and the statistics of ``--compare``."""
import argparse
import csv

import numpy as np
import pytest

from model.cli import main
from sim import sweep
from sim.compare import mean_ci, paired_ttft_diff, t975, ttft_cost
from sim.draws import draw
from tests.sim.helpers import config, run, workload

GRID = ["--ranks", "2,4", "--rate", "5,20", "--variant", "gate,strict", "--requests", "60",
        "--timeout-steps", "100"]


def test_grid_to_csv_parallel_equals_serial(tmp_path, capsys):
    assert main(["sweep", *GRID, "--jobs", "2", "--out", str(tmp_path / "p.csv")]) == 0
    out, err = capsys.readouterr()
    assert "8/8 cells" in err and "cells" not in out          # the progress bar is on stderr
    assert main(["sweep", *GRID, "--jobs", "1", "--out", str(tmp_path / "s.csv")]) == 0
    assert (tmp_path / "p.csv").read_bytes() == (tmp_path / "s.csv").read_bytes()
    rows = list(csv.DictReader(open(tmp_path / "p.csv")))
    assert len(rows) == 2 * 2 * 2
    assert {(r["variant"], r["ranks"], r["rate"]) for r in rows} == {
        (v, k, r) for v in ("gate", "strict") for k in ("2", "4") for r in ("5.0", "20.0")}
    assert all(r["diverged"] == "False" and int(r["committed"]) > 0 for r in rows)


def test_capacity_search_brackets_the_target(tmp_path, capsys):
    out = tmp_path / "cap.csv"
    argv = ["--capacity", "--variant", "gate", "--ranks", "4", "--requests", "150",
            "--ttft-p99-target", "600", "--rate-lo", "1", "--rate-hi", "200",
            "--capacity-iters", "6", "--jobs", "1", "--out", str(out)]
    assert main(["sweep", *argv]) == 0
    row = list(csv.DictReader(open(out)))[0]
    cap, hi = float(row["capacity_rate"]), float(row["bracket_hi"])
    assert 1 <= cap < hi <= 200 and float(row["ttft_p99_ms_at_capacity"]) <= 600
    # re-simulate both ends of the final bracket with the same flags
    p = argparse.ArgumentParser()
    sweep.add_arguments(p)
    args = p.parse_args(argv)
    assert sweep._simulate(args, "gate", 4, "exp:0.3", cap)[0]["ttft_p99_ms"] <= 600
    assert sweep._simulate(args, "gate", 4, "exp:0.3", hi)[0]["ttft_p99_ms"] > 600


@pytest.mark.parametrize("argv,flag", [(["--rate", "0"], "--rate"), (["--ranks", "0,2"], "--ranks"),
                                       (["--variant", "gate,bogus"], "--variant"),
                                       (["--metadata-lag", "exp:zero"], "--metadata-lag")])
def test_sweep_bad_input_exit_2(argv, flag, tmp_path, capsys):
    try:
        rc = main(["sweep", *argv, "--out", str(tmp_path / "x.csv")])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and flag in err[0]


def test_common_random_numbers_across_variants():
    wl = workload(100)
    a, b = draw(config(variant="gate"), wl), draw(config(variant="strict", no_clear=True), wl)
    a, b = a.chunk(0), b.chunk(0)
    for field in ("xfer_ms", "lag_ms", "fail_rank", "fence_ms"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert a.room == b.room and a.payload == b.payload


def test_a_requests_draws_do_not_depend_on_the_workload_length_or_chunk_order():
    from sim.draws import CHUNK
    long = draw(config(variant="gate", fail_prob=0.3), workload(CHUNK + 50))
    short = draw(config(variant="gate", fail_prob=0.3), workload(60))
    first = long.chunk(1)                      # drawn out of order, then again after eviction
    assert np.array_equal(short.chunk(0).lag_ms, long.chunk(0).lag_ms[:60])
    long.kept.clear()
    again = long.chunk(1)
    assert np.array_equal(first.xfer_ms, again.xfer_ms) and first.room == again.room
    assert len(first.room) == 50


def test_mean_ci_and_paired_cost():
    m, lo, hi = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and hi - m == pytest.approx(t975(2) * 1.0 / np.sqrt(3))
    gate = [run(config(variant="gate", seed=s), workload(80, seed=s))[0] for s in (1, 2, 3)]
    ideal = [run(config(variant="ungated", seed=s, lag="const:0"), workload(80, seed=s))[0]
             for s in (1, 2, 3)]
    cost = ttft_cost(gate, ideal)
    diffs = [paired_ttft_diff(g, i) for g, i in zip(gate, ideal)]
    # holding one request shifts others' steps, so single differences may be < 0
    assert cost["mean_ms"] > 0 and all(len(d) > 50 for d in diffs)
    assert cost["mean_ms"] == pytest.approx(np.mean([d.mean() for d in diffs]), abs=1e-6)
    assert cost["ci95_ms"][0] <= cost["mean_ms"] <= cost["ci95_ms"][1]
    assert cost["pairs"] == sum(len(d) for d in diffs)
