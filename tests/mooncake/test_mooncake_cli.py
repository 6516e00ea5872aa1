"""``pdgate e2e``: usage errors are one line and exit 2; a real run with a delayed
metadata row shows the gate holding and writes a trace the spec accepts."""
from __future__ import annotations

import json

import pytest

from model.cli import main
from model.spec.validate import validate


def exit_code(argv: list[str]) -> int:
    """main's return value, or the code of the SystemExit argparse raises."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "--device cuda needs a CUDA GPU"),
    (["--ranks", "2", "--metadata-delay", "2:10"], "names rank 2, but ranks are 0..1"),
    (["--ranks", "0"], "--ranks must be in 1..16"),
    (["--requests", "0"], "--requests: must be >= 1"),
    (["--inflight", "100", "--slots", "8"], "--inflight"),
    (["--timeout-steps", "0"], "--timeout-steps: must be >= 1"),
    (["--heartbeat-ms", "0"], "--heartbeat-ms: must be >= 10"),
    (["--fence-grace-s", "-1"], "--fence-grace-s: must be >= 0"),
    (["--step-ms", "nan"], "--step-ms: a finite number expected"),
    (["--collective-timeout-s", "inf"], "--collective-timeout-s: a finite number expected"),
    (["--requests", "1e12"], "--requests: an integer expected"),
    (["--requests", "100000", "--max-pages", "1000", "--pages", "1000"], "MiB of prefill KV"),
    (["--json", "/nonexistent/dir/x.json"], "folder /nonexistent/dir does not exist"),
    (["--json", "/dev/full"], "--json: cannot write /dev/full: No space left on device"),
    (["--trace", "/dev/full"], "--trace: cannot write /dev/full: No space left on device"),
    (["--work-dir", "/etc/hostname"], "--work-dir: /etc/hostname exists and is not a folder"),
    (["--work-dir", "/proc/self/w"], "--work-dir: cannot create folder /proc/self/w"),
])
def test_usage_errors_are_one_line(argv, message, capsys):
    import torch
    if argv[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.fail("this check needs a machine without CUDA")
    assert exit_code(["e2e", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("pdgate e2e:")


def test_netns_on_where_no_namespace_can_be_made_is_one_line(monkeypatch, capsys):
    """``--netns on`` refuses to run unconfined (here: nsenter hidden from it)."""
    import impl.mooncake.netns as netns
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert exit_code(["e2e", "--netns", "on"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdgate e2e: --netns on:") and "nsenter" in err
    assert len(err.splitlines()) == 1


def test_malformed_delay_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["e2e", "--metadata-delay", "one:two"])
    assert exc.value.code == 2
    assert "expected RANK:MS" in capsys.readouterr().err


def test_e2e_with_a_delayed_row_holds_the_gate_and_validates(tmp_path, capsys):
    out, trace = tmp_path / "e2e.json", tmp_path / "e2e.ndjson"
    rc = main(["e2e", "--ranks", "2", "--requests", "8", "--metadata-delay", "1:40",
               "--page-bytes", "8192", "--json", str(out), "--trace", str(trace)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    figs = json.loads(out.read_text())
    for key in ("committed", "aborted", "lost", "byte_exact", "gate_holds", "commit_latency_p50_ms",
                "commit_latency_p99_ms", "mb_per_s"):
        assert key in figs and key in printed
    assert figs["committed"] == 8 and figs["aborted"] == 0 and figs["lost"] == 0
    assert figs["byte_exact"] is True
    assert figs["gate_holds"] > 0            # rank 1 saw Success 40 ms before its row
    assert figs["commit_latency_max_steps"] <= 1
    # the true timeline: the prefill's own stamps, not when the ranks saw them
    reqs = figs["timeline"]["requests"]
    assert len(reqs) == 8 and all(r["committed"] for r in reqs)
    for r in reqs:
        assert r["room"][1] - r["kv"][1] >= 39.9        # rank 1's row, written 40 ms after its KV
        assert r["room"][0] <= r["success"][0] <= r["pop"][0]   # rank 0: row, then Success
        assert r["success"][1] < r["room"][1]            # rank 1: Success first
    assert figs["gate_delay_p50_ms"] >= 35 and figs["ttft_p50_ms"] >= figs["enqueue_commit_p50_ms"]
    assert figs["setup"]["metadata_delay_ms"] == {"1": 40.0}
    for when in ("before", "after"):        # how busy the machine was, to read the timings by
        load = figs["machine_load"][when]
        assert load["loadavg_1m"] >= 0 and 0 <= load["cpu_pressure_some_avg10"] <= 100
    with open(trace, encoding="utf-8") as fp:
        result = validate(fp)
    assert result.ok, result.message


def test_e2e_gate_variant_on_three_ranks(tmp_path, capsys):
    out = tmp_path / "gate.json"
    rc = main(["e2e", "--ranks", "3", "--requests", "6", "--variant", "gate",
               "--page-bytes", "4096", "--max-pages", "4", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    figs = json.loads(out.read_text())
    assert (figs["ranks"], figs["committed"], figs["lost"]) == (3, 6, 0)
    assert figs["byte_exact"] and figs["trace_valid"] and figs["timeout_steps"] is None


def _e2e_config(tmp_path, during, requests: int = 6):
    from impl.e2e import E2EConfig, timeout_steps_for
    workload = ["--seed", "5", "--page-bytes", "4096", "--min-pages", "1", "--max-pages", "3"]
    rank_args = ["--pages", "128", "--inflight", "4", "--step-ms", "2",
                 "--collective-timeout-s", "5", "--heartbeat-ms", "100"]
    return E2EConfig(2, requests, "strict", [], workload, rank_args,
                     timeout_steps_for("strict", 2.0, None), 16, timeout_s=40,
                     work_dir=str(tmp_path / "work"), during=during)


def test_forged_status_frames_are_rejected_reported_and_fail_the_run(tmp_path):
    import zmq
    from impl.e2e import run_e2e, run_ok
    from impl.mooncake.synth import make_requests

    rooms = [s.room for s in make_requests(6, 5, 1, 3)]        # predictable from --seed

    def attack(cluster, prefill):
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        for ready in cluster.ready:
            push.connect(ready["status_endpoint"])
        for room in rooms:
            for _ in cluster.ready:      # round robin over the connected ranks
                push.send_multipart([str(room).encode(), b"0", b"0"])
        push.close(linger=2000)
    out = run_e2e(_e2e_config(tmp_path, attack))
    assert out["rejected_frames"] == len(rooms) * 2, out
    assert out["committed"] == 6 and out["aborted"] == 0        # nothing got through...
    assert out["disturbed"] and not run_ok(out)                 # ...but the run says so


def test_garbage_and_oversized_frames_are_counted_and_fail_the_run(tmp_path):
    """No ZMTP at all (an HTTP request) at the prefill and at a rank, and a part over the
    prefill's MAXMSGSIZE: ZMQ drops these connections before any handler, so no frame is
    rejected, but the monitors count them and the run is disturbed."""
    import socket
    import time
    import zmq
    from impl.e2e import run_e2e, run_ok
    from impl.mooncake import auth
    from impl.mooncake import frames as fr

    def attack(cluster, prefill):
        endpoints = [prefill.hello_line["endpoint"], cluster.ready[0]["status_endpoint"]]
        for endpoint in endpoints:
            host, port = endpoint[len("tcp://"):].rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoints[0])
        dealer.send_multipart([fr.XFER, fr.encode_rank(0), b"\0" * (fr.MAX_TO_PREFILL_PART + 1),
                               b"\0" * auth.TAG_BYTES])
        time.sleep(0.5)
        dealer.close()
    out = run_e2e(_e2e_config(tmp_path, attack))
    assert out["committed"] == 6 and out["rejected_frames"] == 0, out
    assert out["broken_connections"] >= 3, out
    assert out["disturbed"] and not run_ok(out)


def test_a_failed_run_still_writes_json_trace_and_keeps_the_rank_logs(tmp_path, capsys):
    import signal
    from impl import e2e

    def kill_rank(cluster, prefill):
        cluster.decode[1].signal(signal.SIGKILL)
    cfg = _e2e_config(tmp_path, kill_rank, requests=40)
    out = e2e.run_e2e(cfg)
    assert out["error"] and "rank" in out["error"], out["error"]
    work = tmp_path / "work"
    assert (work / "rank0.jsonl").exists() and (work / "rank1.jsonl").exists()
    assert out["trace"] == str(work / "trace.ndjson") and out["trace_partial"]
    with open(out["trace"], encoding="utf-8") as fp:
        assert fp.readline().startswith('{"kind":"header"')
    assert not e2e.run_ok(out)


def test_a_good_run_keeps_json_and_trace_and_drops_rank_logs(tmp_path, capsys):
    work = tmp_path / "w"
    rc = main(["e2e", "--ranks", "2", "--requests", "4", "--page-bytes", "4096", "--max-pages",
               "2", "--min-pages", "1", "--work-dir", str(work)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert f"json {work / 'e2e.json'}; trace {work / 'trace.ndjson'}" in printed
    figs = json.loads((work / "e2e.json").read_text())
    assert figs["rejected_frames"] == 0 and figs["dropped_frames"] == 0 and not figs["disturbed"]
    assert not (work / "rank0.jsonl").exists() and (work / "trace.ndjson").exists()


def test_a_relative_work_dir_is_the_callers_folder(tmp_path, monkeypatch, capsys):
    """The children run in the repository: a relative --work-dir still means the
    caller's folder (it failed with "No such file or directory: 'w0/rank0.jsonl'")."""
    monkeypatch.chdir(tmp_path)
    rc = main(["e2e", "--requests", "3", "--page-bytes", "4096", "--max-pages", "2",
               "--min-pages", "1", "--work-dir", "w0"])
    assert rc == 0, capsys.readouterr()
    figs = json.loads((tmp_path / "w0" / "e2e.json").read_text())
    assert figs["committed"] == 3 and figs["work_dir"] == str(tmp_path / "w0")


def test_a_prefill_killed_mid_run_still_reports_every_ranks_decisions(tmp_path):
    """kill -9 of the prefill: the run fails, naming it, but the ranks went on to decide
    every request (commit or abort, all agreeing) and the JSON says so."""
    import signal
    import time
    from impl.e2e import run_e2e, run_ok

    def kill_prefill(cluster, prefill):
        time.sleep(0.3)
        prefill.signal(signal.SIGKILL)
    out = run_e2e(_e2e_config(tmp_path, kill_prefill, requests=200))
    assert out["error"] and "prefill0" in out["error"], out["error"]
    assert out["committed"] is not None and out["aborted"] > 0, out
    assert out["committed"] + out["aborted"] == 200 and out["lost"] == 0 and out["disagree"] == 0
    assert out["trace_valid"] and not out["trace_partial"]
    assert not run_ok(out)


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_stops_the_run_and_it_still_writes_its_json(sig, code, tmp_path):
    """SIGTERM or SIGINT mid-run: the children are stopped, the JSON (naming the signal)
    and the partial trace are written, the rank logs kept, exit 128 + signal."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    work = tmp_path / "w"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "model.cli", "e2e", "--requests", "5000",
                             "--page-bytes", "4096", "--max-pages", "2", "--min-pages", "1",
                             "--work-dir", str(work)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ((work / "rank0.jsonl").exists() and (work / "rank0.jsonl").stat().st_size):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, (out, err)
    assert f"interrupted by {sig}" in err and "Traceback" not in err, err
    figs = json.loads((work / "e2e.json").read_text())
    assert figs["error"] == f"interrupted by {sig}" and figs["trace_partial"]
    assert (work / "rank0.jsonl").exists() and (work / "trace.ndjson").exists()
