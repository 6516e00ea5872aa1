"""Sweeps on Dask distributed give the same CSV as the local engine (a real local cluster
of several worker processes, reached by --address), resume from the cells already in
the CSV, and honour --cell-timeout with --jobs 1 and one cell."""
import csv
import logging
import time

import pytest

from model.cli import main

GRID = ["--ranks", "2,4", "--rate", "5,20", "--variant", "gate,strict", "--requests", "60",
        "--timeout-steps", "100", "--seed", "3"]


def _sweep(capsys, *argv):
    try:
        rc = main(["sweep", *argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.timeout(180)
def test_dask_cluster_gives_the_local_rows(tmp_path, capsys):
    from distributed import LocalCluster
    local, remote = tmp_path / "local.csv", tmp_path / "dask.csv"
    assert _sweep(capsys, *GRID, "--jobs", "1", "--out", str(local))[0] == 0
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None,
                      silence_logs=logging.ERROR) as cluster:
        assert len(cluster.workers) == 3
        rc, _, err = _sweep(capsys, *GRID, "--engine", "dask", "--address", cluster.scheduler_address,
                            "--out", str(remote))
    assert rc == 0 and "8/8 cells" in err
    assert remote.read_bytes() == local.read_bytes()
    rows = list(csv.DictReader(open(local)))
    assert len(rows) == 8 and len({r["ttft_p99_ms"] for r in rows}) > 1


def test_a_sweep_resumes_from_the_cells_in_its_csv(tmp_path, capsys):
    fresh, resumed = tmp_path / "fresh.csv", tmp_path / "resumed.csv"
    assert _sweep(capsys, *GRID, "--jobs", "1", "--out", str(fresh))[0] == 0
    lines = fresh.read_text().splitlines(keepends=True)
    resumed.write_text("".join(lines[:4]))             # header + 3 cells, as if interrupted
    rc, _, err = _sweep(capsys, *GRID, "--jobs", "1", "--out", str(resumed))
    assert rc == 0 and "3 of 8 cells already in" in err and "5/5 cells" in err
    assert resumed.read_bytes() == fresh.read_bytes()
    # other model parameters: nothing is reused
    rc, _, err = _sweep(capsys, *GRID, "--jobs", "1", "--fail-prob", "0.1", "--out", str(resumed))
    assert rc == 0 and "already in" not in err and "8/8 cells" in err


def test_cell_timeout_is_honoured_with_one_job_and_one_cell(tmp_path, capsys):
    t0 = time.perf_counter()
    rc, _, err = _sweep(capsys, "--ranks", "8", "--rate", "500", "--variant", "gate", "--requests",
                        "200000", "--jobs", "1", "--cell-timeout", "1", "--out", str(tmp_path / "x.csv"))
    assert rc == 1 and "--cell-timeout" in err and len(err.strip().splitlines()) <= 2
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("argv,flag", [
    (["--rate", "nan"], "--rate"), (["--rate", "inf"], "--rate"), (["--ranks", "8193"], "--ranks"),
    (["--address", "tcp://127.0.0.1:1"], "--address"),
    (["--out", "/nonexistent/dir/x.csv"], "--out"), (["--out", "/proc/x.csv"], "--out"),
    (["--plot", "/proc/x"], "--plot"), (["--ranks", "100000", "--rate", "1"], "--ranks"),
    (["--metadata-lag", "const:1e308", "--cell-timeout", "2", "--jobs", "1"], "--metadata-lag"),
])
def test_sweep_bad_flags_are_one_line(capsys, argv, flag, tmp_path):
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "x.csv")]
    rc, _, err = _sweep(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and flag in lines[0]


@pytest.mark.parametrize("column, value", [("ttft_p99_ms", "abc"), ("rate", "nan"), ("diverged", "maybe")])
def test_an_edited_resume_row_is_refused_in_one_line(tmp_path, capsys, column, value):
    out = tmp_path / "s.csv"
    grid = ["--variant", "gate", "--ranks", "2", "--rate", "2,4", "--requests", "30", "--jobs", "1"]
    assert _sweep(capsys, *grid, "--out", str(out))[0] == 0
    rows = list(csv.DictReader(open(out)))
    rows[1][column] = value
    with open(out, "w", newline="") as fp:
        w = csv.DictWriter(fp, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    rc, _, err = _sweep(capsys, *grid, "--out", str(out), "--plot", str(tmp_path))
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and f"line 3: {column}" in lines[0], lines


def test_sigterm_stops_a_sweep_in_one_line_and_it_resumes(tmp_path):
    """SIGTERM stops the sweep as Ctrl-C does: its pool's workers are stopped, one line,
    exit 143, and the cells already finished stay in the CSV for a resumed run."""
    import signal
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "s.csv"
    proc = subprocess.Popen([sys.executable, "-m", "model.cli", "sweep", "--variant", "gate,strict",
                             "--ranks", "2,4,8", "--rate", "1,2,4,8", "--requests", "3000", "--jobs", "2",
                             "--out", str(out)], cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and len(out.read_text().splitlines()) > 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as fp:
            workers = [int(p) for p in fp.read().split()]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert workers, "the pool had started"
    time.sleep(1)
    for pid in workers:                       # no worker left behind
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fp:
                assert b"model.cli" not in fp.read(), f"worker {pid} still runs"
        except FileNotFoundError:
            pass
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "pdgate sweep: terminated (SIGTERM)", err
    assert "Traceback" not in err
    rows = list(csv.DictReader(open(out)))
    assert 1 <= len(rows) < 24 and all(r["params"] == rows[0]["params"] for r in rows)
