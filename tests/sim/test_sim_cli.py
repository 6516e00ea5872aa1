"""``pdgate simulate``: the output keys, same seed -> same bytes, the Perfetto and plot
files, and one-line exit-2 errors for bad input."""
import json
import struct

import pytest

from model.cli import main
from model.spec.validate import validate
from sim.results import SUMMARY_KEYS

SMALL = ["--requests", "60", "--ranks", "4", "--rate", "20"]


def _run(capsys, *argv):
    try:
        rc = main(["simulate", *argv])
    except SystemExit as exc:      # argparse's own errors (type conversions)
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_has_exactly_the_issue_keys_first(tmp_path, capsys):
    rc, out, _ = _run(capsys, *SMALL, "--json", str(tmp_path / "s.json"))
    assert rc == 0
    s = json.loads((tmp_path / "s.json").read_text())
    assert tuple(s)[:len(SUMMARY_KEYS)] == SUMMARY_KEYS
    assert s["variant"] == "gate" and s["ranks"] == 4 and s["requests"] == 60
    assert s["committed"] + s["aborted"] == 60 and s["diverged"] is False
    assert s["diverged_at_step"] is None and s["wall_seconds"] >= 0
    assert s["ttft_p50_ms"] <= s["ttft_p99_ms"] and s["gate_delay_p50_ms"] <= s["gate_delay_p99_ms"]
    assert out.splitlines()[0].split()[:3] == ["variant", "ranks", "requests"]


def test_divergence_is_reported_and_stops_the_run(tmp_path, capsys):
    rc, out, _ = _run(capsys, *SMALL, "--variant", "ungated", "--metadata-lag", "exp:5",
                      "--json", str(tmp_path / "s.json"))
    s = json.loads((tmp_path / "s.json").read_text())
    assert rc == 0 and s["diverged"] is True and isinstance(s["diverged_at_step"], int)
    assert s["divergence"]["invariant"] in ("queues_identical", "outcomes_agree")
    assert "DIVERGED at step" in out and "the run stopped" in out
    assert s["committed"] + s["aborted"] < 60


def _outputs(tmp_path, tag, extra=()):
    d = tmp_path / tag
    d.mkdir()
    argv = ["simulate", *SMALL, "--variant", "strict", "--seed", "7", "--fail-prob", "0.1",
            "--trace", str(d / "t.ndjson"), "--json", str(d / "s.json"), *extra]
    assert main(argv) == 0
    return (d / "t.ndjson").read_bytes(), (d / "s.json").read_bytes()


def test_same_seed_gives_byte_identical_trace_and_json(tmp_path, capsys):
    a = _outputs(tmp_path, "a", ["--no-wall-clock"])
    b = _outputs(tmp_path, "b", ["--no-wall-clock"])
    assert a == b
    # without --no-wall-clock only wall_seconds may differ
    c = _outputs(tmp_path, "c")
    assert c[0] == a[0]
    sc, sa = json.loads(c[1]), json.loads(a[1])
    assert sa.pop("wall_seconds") is None and isinstance(sc.pop("wall_seconds"), float) and sc == sa
    assert validate(a[0].decode().splitlines()).ok


def test_compare_reports_the_cost_with_a_confidence_interval(tmp_path, capsys):
    rc, out, _ = _run(capsys, *SMALL, "--compare", "ungated,gate,strict", "--replications", "3",
                      "--timeout-steps", "100", "--json", str(tmp_path / "c.json"),
                      "--trace", str(tmp_path / "t.ndjson"))
    assert rc == 0
    c = json.loads((tmp_path / "c.json").read_text())
    assert [s["variant"] for s in c["compare"]] == ["ungated", "gate", "strict"]
    ideal = [x for x in c["ttft_cost"] if x["baseline"] == "ideal" and x["variant"] == "gate"][0]
    lo, hi = ideal["ci95_ms"]
    assert lo <= ideal["mean_ms"] <= hi and ideal["replications"] == 3 and ideal["pairs"] > 0
    assert "TTFT cost of gate vs ideal" in out and "95% CI" in out
    for v in ("ungated", "gate", "strict"):
        assert validate((tmp_path / f"t.{v}.ndjson").read_text().splitlines()).ok


def test_perfetto_has_one_track_per_rank_and_plots_are_pngs(tmp_path, capsys):
    rc, out, _ = _run(capsys, *SMALL, "--compare", "gate,strict", "--replications", "1",
                      "--perfetto", str(tmp_path / "p.json"), "--plot", str(tmp_path / "plots"))
    assert rc == 0
    events = json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert names == {**{(p, k): f"rank {k}" for p in (1, 2) for k in range(4)},
                     **{(p, 4 + k): f"prefill server {k}" for p in (1, 2) for k in range(4)}}
    slices = [e for e in events if e["ph"] == "X" and e["cat"] != "prefill"]
    assert {e["tid"] for e in slices} == set(range(4)) and all(e["dur"] >= 0 for e in slices)
    assert any(e["name"].startswith("commit r") for e in events)
    # a track per prefill server (tids 4..7, after the ranks): every request arrives,
    # then is prefilled once, never two at a time on one server
    for pid in (1, 2):
        arrive = {e["name"][len("arrive r"):]: e["ts"] for e in events
                  if e["pid"] == pid and e.get("cat") == "arrival"}
        prefill = [e for e in events if e["pid"] == pid and e.get("cat") == "prefill"]
        assert len(arrive) == len(prefill) == 60 and {e["tid"] for e in prefill} == {4, 5, 6, 7}
        assert all(e["ts"] >= arrive[str(e["args"]["request"])] for e in prefill)
        for tid in range(4, 8):
            mine = [e for e in prefill if e["tid"] == tid]
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(mine, mine[1:]))
    for name, size in (("ttft_cdf.png", (700, 640)), ("gate_delay_cdf.png", (700, 400))):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", data[16:24]) == size       # TTFT: CDF over the cost panel


def test_plots_show_the_cost_name_divergence_and_keep_legends_off_the_data(tmp_path, capsys, monkeypatch):
    """The TTFT figure's second panel is the per-request difference from the ideal
    reference (symlog x), its legend names the diverged variant; the hazard plot's x axis
    is logarithmic; the sweep's legend sits beside the axes."""
    import sim.outputs
    figs = {}
    save = sim.outputs._save
    monkeypatch.setattr(sim.outputs, "_save", lambda fig, d, name: figs.setdefault(name, fig) and save(fig, d, name))
    rc, out, _ = _run(capsys, "--requests", "300", "--ranks", "8", "--fail-prob", "0.02",
                      "--compare", "gate,ungated", "--replications", "1", "--plot", str(tmp_path))
    assert rc == 0 and "ungated: DIVERGED" in out, out
    # ungated broke before its first commit: no pairs with one replication (was a crash)
    assert "TTFT cost of ungated vs gate: no request committed in both runs" in out
    top, cost = figs["ttft_cdf.png"].axes
    assert cost.get_xscale() == "symlog" and "ideal reference" in cost.get_title()
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert any(t.startswith("ungated (DIVERGED at t=") for t in labels) and "gate" in labels, labels
    assert "diverged: ungated" in top.get_title()
    gate_cost = [t.get_text() for t in cost.get_legend().get_texts() if t.get_text().startswith("gate:")]
    assert gate_cost and "mean +" in gate_cost[0], gate_cost
    assert len(figs["gate_delay_cdf.png"].axes) == 1
    rc, _, _ = _run(capsys, "--hazard", "--compare", "ungated,strict", "--replications", "2",
                    "--requests", "100", "--ranks", "4", "--plot", str(tmp_path))
    assert rc == 0 and figs["hazard.png"].axes[0].get_xscale() == "log"
    assert main(["sweep", "--variant", "gate", "--ranks", "2", "--rate", "2,4", "--requests", "40", "--jobs", "1",
                 "--out", str(tmp_path / "s.csv"), "--plot", str(tmp_path)]) == 0
    sweep = figs["ttft_p99_vs_rate.png"]
    assert sweep.axes[0].get_legend() is None and len(sweep.legends) == 1


BAD = [
    (["--metadata-lag", "weibull:1"], "--metadata-lag"),
    (["--metadata-lag", "exp:-1"], "--metadata-lag"),
    (["--metadata-lag", "lognormal:1"], "--metadata-lag"),
    (["--metadata-lag", "9=const:1"], "--metadata-lag"),
    (["--forward", "const:abc"], "--forward"),
    (["--metadata-lag", "empirical:/nonexistent/lags.txt"], "--metadata-lag"),
    (["--rate", "0"], "--rate"),
    (["--rate", "-3"], "--rate"),
    (["--ranks", "0"], "--ranks"),
    (["--requests", "0"], "--requests"),
    (["--fail-prob", "1.5"], "--fail-prob"),
    (["--variant", "nope"], "--variant"),
    (["--compare", "gate,nope"], "--compare"),
    (["--timeout-steps", "3"], "--timeout-steps"),          # gate has no timeout
    (["--gate-timeout-s", "3"], "--gate-timeout-s"),
    (["--release-timeout-s", "3"], "--release-timeout-s"),  # only the deferred variants
    (["--variant", "strict", "--gate-timeout-s", "3", "--timeout-steps", "4"], "--gate-timeout-s"),
    (["--variant", "strict", "--gate-timeout-s", "1e300"], "--gate-timeout-s"),
    (["--variant", "strict", "--gate-timeout-s", "inf"], "--gate-timeout-s"),
    (["--variant", "strict", "--timeout-step-floor", "0"], "--timeout-step-floor"),
    (["--stall", "9:0:10"], "--stall"),
    (["--lag-skew", "1,2"], "--lag-skew"),
    (["--trace-in", "/nonexistent/x.jsonl"], "--trace-in"),
]


@pytest.mark.parametrize("extra,flag", BAD)
def test_bad_input_is_one_line_naming_the_flag_exit_2(extra, flag, capsys):
    rc, out, err = _run(capsys, *SMALL, *extra)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in err


def test_argparse_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--ranks", "zero"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ranks" in err[0]


@pytest.mark.parametrize("name,text,line", [
    ("t.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1, "input_length": 5\n', 2),
    ("t.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1, "output_length": 2}\n', 2),
    ("t.jsonl", '{"timestamp": 9, "input_length": 5, "output_length": 2}\n{"timestamp": 1, "input_length": 5, "output_length": 2}\n', 2),
    ("t.jsonl", '{"timestamp": 0, "input_length": -5, "output_length": 2}\n', 1),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,10,2\n2.0,ten,2\n", 3),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.1,10,2\nyesterday,1,2\n", 3),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,10\n", 2),
    ("t.csv", "TIME,Context\n1.0,10\n", 1),
])
def test_malformed_trace_rows_name_the_line(tmp_path, capsys, name, text, line):
    path = tmp_path / name
    path.write_text(text)
    rc, _, err = _run(capsys, "--trace-in", str(path), "--ranks", "2")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and f"line {line}" in lines[0] and "--trace-in" in lines[0]


def test_no_clear_traces_as_the_named_variant_or_refuses(tmp_path, capsys):
    path = tmp_path / "t.ndjson"
    rc, _, _ = _run(capsys, *SMALL, "--variant", "gate", "--no-clear", "--trace", str(path))
    text = path.read_text()
    assert rc == 0 and '"variant":"gate-noclear"' in text.splitlines()[0]
    assert validate(text.splitlines()).ok
    rc, _, err = _run(capsys, *SMALL, "--variant", "strict", "--no-clear", "--trace", str(path))
    assert rc == 2 and "--trace" in err and len(err.strip().splitlines()) == 1
