"""--hazard: each variant until its first invariant break over independent seeds; the
weaker variants break, strict (the sibling) never does; the sweep grids it; the plots."""
import csv
import json
import struct

from model.cli import main
from sim.hazard import first_break, summarize_hazard
from tests.sim.helpers import config, run, workload

FAULTS = ["--fail-prob", "0.1", "--late-write", "exp:40"]


def _png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_hazard_reports_breaks_for_weak_variants_and_none_for_strict(tmp_path, capsys):
    out = tmp_path / "h.json"
    rc = main(["simulate", "--hazard", "--replications", "4", "--compare", "ungated,gate,strict",
               "--ranks", "4", "--requests", "300", "--rate", "20", *FAULTS,
               "--json", str(out), "--plot", str(tmp_path)])
    text = capsys.readouterr().out
    rows = {(r["variant"], r["invariant"]): r for r in json.loads(out.read_text())["hazard"]}
    assert rc == 0 and "strict: no invariant broke in 4 replication(s)" in text
    strict = rows[("strict", "-")]
    assert strict["breaks"] == 0 and strict["no_break"] == 4
    ungated = [r for (v, _), r in rows.items() if v == "ungated"]
    assert sum(r["breaks"] for r in ungated) == 4 - ungated[0]["no_break"] > 0
    for r in ungated:
        if r["breaks"] > 1:
            assert 0 <= r["requests_to_break_ci95_lo"] <= r["requests_to_break_mean"] <= r["requests_to_break_ci95_hi"]
            assert 0 < r["seconds_to_break_mean"]
    assert _png_size(tmp_path / "hazard.png") == (840, 400)


def test_first_break_counts_the_requests_arrived_by_then():
    wl = workload(300, 20.0, 1)
    data, _ = run(config(variant="ungated", ranks=4, seed=1), wl)
    b = first_break(data)
    assert b is not None and b["seconds"] * 1000 == data.divergence.time_ms
    assert b["requests"] == int((wl.arrival_ms <= data.divergence.time_ms).sum()) >= 1
    clean, _ = run(config(variant="strict", ranks=4, seed=1), wl)
    assert first_break(clean) is None
    assert summarize_hazard("strict", [clean])[0]["breaks"] == 0


def test_sweep_grids_the_hazard_and_plots_the_grid(tmp_path, capsys):
    out = tmp_path / "h.csv"
    assert main(["sweep", "--hazard", "--replications", "3", "--variant", "ungated,strict",
                 "--ranks", "2,4", "--rate", "20", "--requests", "200", *FAULTS, "--jobs", "1",
                 "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert {(r["variant"], r["ranks"]) for r in rows} == {(v, k) for v in ("ungated", "strict") for k in ("2", "4")}
    assert all(r["breaks"] == "0" for r in rows if r["variant"] == "strict")
    assert sum(int(r["breaks"]) for r in rows if r["variant"] == "ungated") > 0
    grid = tmp_path / "g.csv"
    assert main(["sweep", "--variant", "gate,strict", "--ranks", "4", "--rate", "4,16", "--requests", "100",
                 "--jobs", "1", "--out", str(grid), "--plot", str(tmp_path)]) == 0
    assert _png_size(tmp_path / "ttft_p99_vs_rate.png") == (960, 440)
