"""Trace replay: the published formats as published (Mooncake FAST'25, Azure 2023/2024/
2025, BurstGPT), read as a stream, whole by default, UTC, failed rows as failed
transfers, the prefix cache, and the flags that do or do not apply to a replay."""
import csv
import json
import os
import subprocess
import sys
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from model.cli import main
from model.spec.kernel import Decision
from sim.errors import SimInputError
from sim.traces import datetime_ns, read_trace
from sim.workload import load_trace

DATA = Path(__file__).resolve().parents[2] / "sim" / "data"
MOONCAKE = str(DATA / "mooncake_conversation_head1000.jsonl")
AZURE = str(DATA / "azure2023_code_head500.csv")


def _run(capsys, cmd, *argv):
    try:
        rc = main([cmd, *argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("text,expected", [
    ("2023-11-16 18:17:03.9799600", datetime(2023, 11, 16, 18, 17, 3, 979960, timezone.utc)),
    ("2024-05-10 00:00:00.009930+00:00", datetime(2024, 5, 10, 0, 0, 0, 9930, timezone.utc)),
    ("2024-05-10 00:00:01+00:00", datetime(2024, 5, 10, 0, 0, 1, 0, timezone.utc)),
    ("2024-10-15T12:00:00.269Z", datetime(2024, 10, 15, 12, 0, 0, 269000, timezone.utc)),
    ("2024-10-15T14:00:00.5+02:00", datetime(2024, 10, 15, 12, 0, 0, 500000, timezone.utc)),
    ("0001-01-01 00:00:00", datetime(1, 1, 1, tzinfo=timezone.utc)),
    ("2024-02-29 23:59:59.999999999", datetime(2024, 2, 29, 23, 59, 59, 999999, timezone.utc)),
])
def test_date_times_are_utc_to_the_nanosecond(text, expected):
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
    delta = expected - epoch
    want_us = (delta.days * 86400 + delta.seconds) * 10**6 + delta.microseconds
    assert datetime_ns(text, "x") // 1000 == want_us


@pytest.mark.parametrize("text", ["2023-02-29 00:00:00", "2023-13-01 00:00:00", "yesterday",
                                  "2023-11-16 18:17:03.", "2023-11-16 25:00:00"])
def test_bad_date_times_are_refused(text):
    with pytest.raises(SimInputError, match="TIMESTAMP"):
        datetime_ns(text, "x")


def test_plain_date_times_do_not_depend_on_the_time_zone(tmp_path):
    code = ("from sim.traces import read_trace; r = read_trace(%r); print(list(r.arrival_ms))" % AZURE)
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "TZ": tz}).stdout for tz in ("UTC", "America/New_York")}
    assert len(outs) == 1 and len(outs.pop()) > 100


def _write(path: Path, header: list[str], rows: list[list]) -> str:
    with open(path, "w", newline="") as fp:
        w = csv.writer(fp)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


def test_every_csv_format_reads_as_published(tmp_path):
    azure24 = _write(tmp_path / "a24.csv", ["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
                     [["2024-05-10 00:00:00+00:00", 100, 5], ["2024-05-10 00:00:00.009930+00:00", 50, 7]])
    azure25 = _write(tmp_path / "a25.csv", ["TIMESTAMP", "NumImages", "ContextTokens", "GeneratedTokens"],
                     [["2024-10-15T12:00:00.269Z", 2, 300, 9], ["2024-10-15T12:00:01.000Z", 0, 30, 1]])
    burst = _write(tmp_path / "b.csv", ["Timestamp", "Model", "Request tokens", "Response tokens",
                                        "Total tokens", "Log Type"],
                   [[5, "ChatGPT", 472, 18, 490, "Conversation log"], [45, "GPT-4", 1087, 0, 1087, "API log"]])
    burst12 = _write(tmp_path / "b12.csv", ["Timestamp", "Session ID", "Elapsed time", "Model",
                                            "Request tokens", "Response tokens", "Total tokens", "Log Type"],
                     [[0, 7, 1.5, "GPT-4", 10, 3, 13, "API log"], [2, 7, 0.2, "GPT-4", 20, 4, 24, "API log"]])
    got = {p: read_trace(p) for p in (azure24, azure25, burst, burst12)}
    assert [got[azure24].fmt, got[azure25].fmt, got[burst].fmt, got[burst12].fmt] == \
        ["azure", "azure-2025", "burstgpt", "burstgpt"]
    assert list(got[azure24].arrival_ms) == [0.0, 9.93]
    assert list(got[azure25].arrival_ms) == pytest.approx([0.0, 731.0])
    assert list(got[azure25].input_len) == [300, 30]
    assert list(got[burst].arrival_ms) == [0.0, 40000.0] and list(got[burst].failed) == [0, 1]
    assert list(got[burst12].input_len) == [10, 20] and list(got[burst12].arrival_ms) == [0.0, 2000.0]


def test_shipped_real_heads_replay_whole(capsys, tmp_path):
    for path, n in ((MOONCAKE, 1000), (AZURE, 500)):
        rc, out, _ = _run(capsys, "simulate", "--trace-in", path, "--ranks", "2", "--json",
                          str(tmp_path / "s.json"))
        summary = json.loads((tmp_path / "s.json").read_text())
        assert rc == 0 and summary["requests"] == n and summary["committed"] == n
        assert "truncates" not in out
    rc, out, _ = _run(capsys, "simulate", "--trace-in", MOONCAKE, "--ranks", "2", "--requests", "100")
    assert rc == 0 and "--requests truncates" in out


def test_failed_rows_become_failed_transfers_and_are_counted(tmp_path, capsys):
    path = _write(tmp_path / "b.csv", ["Timestamp", "Model", "Request tokens", "Response tokens",
                                       "Total tokens", "Log Type"],
                  [[i, "GPT-4", 100, 0 if i % 3 == 0 else 20, 120, "API log"] for i in range(30)])
    rc, out, _ = _run(capsys, "simulate", "--trace-in", path, "--ranks", "4", "--json", str(tmp_path / "s.json"))
    s = json.loads((tmp_path / "s.json").read_text())
    assert rc == 0 and s["trace"]["failed_rows"] == 10 and s["aborted"] == 10 and s["committed"] == 20
    assert s["aborted_by_reason"]["abort_failed"] == 10 and "10 failed rows" in out


def test_window_cuts_by_time_and_scaling_changes_arrivals():
    whole = load_trace(MOONCAKE)
    part = load_trace(MOONCAKE, window_s=(60.0, 120.0))
    t = whole.arrival_ms
    inside = (t >= 60_000) & (t < 120_000)
    assert len(part) == int(inside.sum()) > 0 and part.arrival_ms[0] == 0.0
    assert np.allclose(part.arrival_ms, t[inside] - t[inside][0])
    half = load_trace(MOONCAKE, time_scale=0.5)
    assert np.allclose(half.arrival_ms, whole.arrival_ms * 0.5)
    rated = load_trace(MOONCAKE, target_rate=10.0)
    assert (len(rated) - 1) / (rated.arrival_ms[-1] / 1000) == pytest.approx(10.0)


def test_a_sweep_over_rate_on_a_replay_gives_different_rows(tmp_path, capsys):
    out = tmp_path / "s.csv"
    rc, _, err = _run(capsys, "sweep", "--trace-in", AZURE, "--requests", "150", "--rate", "2,16",
                      "--ranks", "2", "--variant", "gate", "--jobs", "1", "--out", str(out))
    rows = list(csv.DictReader(open(out)))
    assert rc == 0 and [r["rate"] for r in rows] == ["2.0", "16.0"]
    assert rows[0]["sim_seconds"] != rows[1]["sim_seconds"]
    assert float(rows[0]["sim_seconds"]) > 4 * float(rows[1]["sim_seconds"])


@pytest.mark.parametrize("argv,flag", [
    (["--trace-in", AZURE, "--burstiness", "0.5"], "--burstiness"),
    (["--trace-in", AZURE, "--input-len", "const:5"], "--input-len"),
    (["--trace-in", AZURE, "--output-len", "const:5"], "--output-len"),
    (["--trace-in", AZURE, "--rate", "3", "--time-scale", "2"], "--time-scale"),
    (["--time-scale", "2"], "--time-scale"),
    (["--trace-window", "0:10"], "--trace-window"),
    (["--trace-in", AZURE, "--trace-window", "10:5"], "--trace-window"),
    (["--trace-in", AZURE, "--trace-window", "9000:9999"], "--trace-window"),
    (["--prefix-cache-blocks", "10"], "--prefix-cache-blocks"),
])
def test_flags_that_do_not_apply_are_refused(capsys, argv, flag):
    rc, _, err = _run(capsys, "simulate", "--ranks", "2", *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and flag in lines[0]


def test_prefix_cache_hits_shorten_prefill():
    cached = load_trace(MOONCAKE)
    off = load_trace(MOONCAKE, cache_blocks=0)
    tiny = load_trace(MOONCAKE, cache_blocks=8)
    rate = cached.info["prefix_hit_rate"]
    assert 0.1 < rate < 0.9 and off.info["prefix_hit_rate"] == 0.0
    assert 0 < tiny.info["prefix_hit_rate"] < rate
    assert (cached.cached_tokens <= cached.input_len).all() and cached.cached_tokens.sum() > 0
    from sim.results import summarize, ttft_ms
    from tests.sim.helpers import config, run
    fast, _ = run(config(variant="gate", ranks=2), cached)
    slow, _ = run(config(variant="gate", ranks=2), off)
    assert ttft_ms(fast).mean() < ttft_ms(slow).mean()


def _big_csv(path: Path, rows: int) -> str:
    with open(path, "w") as fp:
        fp.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for i in range(rows):
            fp.write(f"2024-05-10 00:{i // 60000 % 60:02d}:{i // 1000 % 60:02d}.{i % 1000:03d}000+00:00,100,5\n")
    return str(path)


def test_reading_is_streamed_memory_does_not_grow_with_the_file(tmp_path):
    peaks = []
    for rows in (3_000, 30_000):
        path = _big_csv(tmp_path / f"t{rows}.csv", rows)
        tracemalloc.start()
        got = read_trace(path, window_s=(rows / 1000 - 1, rows / 1000))   # the last second only
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert len(got) == 1000 and got.rows_read == rows
    assert peaks[1] < 1.5 * peaks[0] and peaks[1] < 2_000_000


@pytest.mark.parametrize("text,what", [
    ('{"timestamp": 0, "input_length": %s, "output_length": 2}\n' % (2**64), "input_length"),
    ('{"timestamp": 0, "input_length": 1%s, "output_length": 2}\n' % ("0" * 400), "input_length"),
    ('{"timestamp": 0, "input_length": 1%s, "output_length": 2}\n' % ("0" * 5000), "malformed JSON"),
    ('{"timestamp": NaN, "input_length": 5, "output_length": 2}\n', "timestamp"),
    ('{"timestamp": 0, "input_length": 1e15, "output_length": 2}\n', "input_length"),
    ('[' * 100000 + '\n', "malformed JSON"),
    ('{"timestamp": 0, "input_length": [1], "output_length": 2}\n', "input_length"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": "x"}\n', "hash_ids"),
    ('7\n', "JSON object"),
])
def test_hostile_jsonl_rows_are_one_line_errors(tmp_path, capsys, text, what):
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    rc, _, err = _run(capsys, "simulate", "--trace-in", str(path), "--ranks", "2")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and what in lines[0] and "line 1" in lines[0]


@pytest.mark.parametrize("row,what", [
    ("0001-01-01 00:00:00,5,2", "beyond --max-sim-seconds"),
    ("nan,5,2", "TIMESTAMP"),
    ("2024-05-10 00:00:00,18446744073709551616,2", "input tokens"),
])
def test_hostile_csv_rows_are_one_line_errors(tmp_path, capsys, row, what):
    path = tmp_path / "t.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{row}\n2024-05-10 00:00:01,5,2\n")
    if what.startswith("beyond"):
        path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{row}\n2024-05-10 00:00:01,5,2\n")
    rc, _, err = _run(capsys, "simulate", "--trace-in", str(path), "--ranks", "2")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and what in lines[0]


def test_a_line_without_newline_is_cut_at_the_cap(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("{" + " " * (2 << 20))
    rc, _, err = _run(capsys, "simulate", "--trace-in", str(path), "--ranks", "2")
    assert rc == 2 and "longer than" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,flag", [
    (["--metadata-lag", "const:1e308"], "--metadata-lag"),
    (["--metadata-lag", "lognormal:1e6,1"], "--metadata-lag"),
    (["--metadata-lag", "pareto:0.01,1"], "--metadata-lag"),
    (["--stall", "0:0:1e300"], "--stall"),
    (["--kv-bytes-per-token", "100000000000000000000000"], "--kv-bytes-per-token"),
    (["--allreduce-alpha", "1e308"], "--allreduce-alpha"),
    (["--requests", "1000000000000"], "--requests"),
    (["--ranks", "8193"], "--ranks"),
    (["--input-len", "const:1e15"], "--input-len"),
    (["--rate", "nan"], "--rate"), (["--forward", "const:inf"], "--forward"),
    (["--slots", "1000000000"], "--slots"),
    (["--metadata-lag", "empirical:/dev/zero"], "--metadata-lag"),
    (["--trace-in", "/dev/zero"], "--trace-in"),
    (["--json", "/nonexistent/dir/s.json"], "--json"), (["--plot", "/dev/null"], "--plot"),
    (["--perfetto", "/nonexistent/p.json"], "--perfetto"), (["--trace", "/"], "--trace"),
])
def test_runs_that_would_not_end_or_fit_are_refused_up_front(capsys, argv, flag):
    rc, out, err = _run(capsys, "simulate", "--requests", "50", *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and flag in lines[0] and "Traceback" not in err
    assert "variant" not in out          # refused before any run


def test_a_run_past_its_step_bound_stops_with_one_line(capsys):
    rc, out, err = _run(capsys, "simulate", "--requests", "5", "--ranks", "2",
                        "--metadata-lag", "const:1e7", "--max-steps", "2000")
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "--max-steps reached" in lines[0]


def _packed(path: Path, kind: str, source: Path) -> None:
    """``source`` as Excel saves it (a UTF-8 BOM), gzip'd (as Azure 2025 is published),
    both, or cut short."""
    import gzip
    data = source.read_bytes()
    if kind in ("bom", "bom+gz"):
        data = b"\xef\xbb\xbf" + data
    if kind.endswith("gz"):
        data = gzip.compress(data)
    if kind == "cut gz":
        data = data[:len(data) // 2]
    path.write_bytes(data)


@pytest.mark.parametrize("name, kind", [("a.csv", "bom"), ("a.csv.gz", "gz"), ("a.csv.gz", "bom+gz"),
                                        ("a.gz.unnamed", "gz")])
def test_bom_and_gzip_csv_read_as_the_plain_file(tmp_path, name, kind):
    plain = read_trace(str(DATA / "azure_sample.csv"))
    path = tmp_path / name
    _packed(path, kind, DATA / "azure_sample.csv")
    got = read_trace(str(path))
    assert got.fmt == plain.fmt == "azure" and len(got) == len(plain) > 0
    assert list(got.arrival_ms) == list(plain.arrival_ms) and list(got.input_len) == list(plain.input_len)


def test_gzip_jsonl_reads_as_the_plain_file(tmp_path):
    path = tmp_path / "m.jsonl.gz"
    _packed(path, "gz", DATA / "mooncake_sample.jsonl")
    got, plain = read_trace(str(path)), read_trace(str(DATA / "mooncake_sample.jsonl"))
    assert got.fmt == "mooncake" and list(got.cached_tokens) == list(plain.cached_tokens)


@pytest.mark.parametrize("content, what", [
    (b"PK\x03\x04rest", "is a zip archive; unzip it first"),
    (b"BZh91AY", "is bzip2 data; bunzip2 it first"),
    (b"\xfd7zXZ\x00", "is xz data; unxz it first"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n".encode("utf-16"), "is UTF-16 text; convert it first"),
    (None, "cannot read: Compressed file ended"),
    (b"\x1f\x8bnot gzip at all", "cannot read"),
])
def test_other_packings_are_refused_with_a_hint(tmp_path, capsys, content, what):
    path = tmp_path / "t.csv"
    if content is None:
        _packed(path, "cut gz", DATA / "azure_sample.csv")
    else:
        path.write_bytes(content)
    rc, _, err = _run(capsys, "simulate", "--trace-in", str(path), "--ranks", "2")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and what in lines[0], lines


def test_a_fifo_nobody_writes_to_is_an_empty_trace_not_a_hang(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for argv in (["--trace-in", str(fifo)], ["--forward", f"empirical:{fifo}"]):
        rc, _, err = _run(capsys, "simulate", "--requests", "5", "--ranks", "2", *argv)
        assert rc == 2 and ("holds no requests" in err or "holds no values" in err), err


@pytest.mark.parametrize("row", ["9" * 5000 + ",5,2", "2024-01-01 00:00:00." + "9" * 5000 + ",5,2",
                                 "1," + "9" * 5000 + ",2", "nan,5,2", "1,inf,2", "1,1e400,2"])
def test_hostile_csv_rows_are_short_one_line_errors(tmp_path, capsys, row):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + row + "\n")
    rc, _, err = _run(capsys, "simulate", "--trace-in", str(path), "--ranks", "2")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "line 2" in lines[0] and len(lines[0]) < 300, lines
