"""Hostile and careless input for every subcommand: one line naming the problem,
exit 1 or 2, never a traceback, in bounded time and memory (tests/hostile/cases.py
generates the classes). Cases run in-process through ``model.cli.main``; one
subprocess under a memory limit replays the trace classes to bound their memory."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.cli import SUBCOMMANDS, main
from tests.hostile.cases import (FIFO, FLAG_CASES, INPUT_CASES, SIM_BOUND_CASES, TraceCase, good_trace,
                                 output_path_cases, trace_cases, typed_flag_cases, verdict_traces)

ROOT = Path(__file__).resolve().parents[2]
TRACES = trace_cases()
SECONDS = 10.0             # per in-process case; the worst today is well under 1 s
MEMORY_BYTES = 1 << 30     # the validate subprocess's address-space limit


def run_cli(argv: list[str], capsys) -> tuple[int, str, str, float]:
    start = time.monotonic()
    try:
        rc = main(argv)
    except SystemExit as exc:     # argparse errors exit 2 through _one_line_error
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err, time.monotonic() - start


def assert_clean(rc: int, out: str, err: str, codes=(1, 2)) -> None:
    """Exit 1 or 2; a usage error (2) is exactly one stderr line; nothing is a traceback
    or the CLI's last-resort handler (which would mean a bug slipped through)."""
    text = out + err
    assert rc in codes, (rc, text[-500:])
    assert "Traceback" not in text and "internal error" not in text and "out of memory" not in text, text[-500:]
    err_lines = [ln for ln in err.splitlines() if ln.strip()]
    if rc == 2:
        assert len(err_lines) == 1, err_lines[:5]
        assert len(err_lines[0]) < 400
    else:
        assert len(err_lines) <= 1 and (err_lines or out.strip()), text[-500:]


def case_path(case: TraceCase, tmp_path: Path, name: str = "case.jsonl") -> str:
    if case.path == FIFO:
        fifo = tmp_path / "fifo"
        if not fifo.exists():
            os.mkfifo(fifo)
        return str(fifo)
    if case.path is not None:
        return case.path
    path = tmp_path / name
    path.write_bytes(case.content)
    return str(path)


@pytest.mark.parametrize("case", TRACES, ids=str)
def test_validate_refuses_hostile_traces_in_one_line(case, tmp_path, capsys):
    """A one-line error, or a correct run: some mutations leave a trace the spec allows
    (a null hang, a huge timeout for a variant without one)."""
    rc, out, err, seconds = run_cli(["validate", case_path(case, tmp_path)], capsys)
    if rc == 0:
        assert out.startswith("OK: ") and not err, (out, err)
    else:
        assert_clean(rc, out, err)
    assert seconds < SECONDS, f"{case}: {seconds:.1f} s"


def _malformed(case: TraceCase) -> bool:
    """Whether validate calls the case bad input (its other verdicts are the spec's,
    and replay, which drives events and ignores step numbers, may well run them)."""
    from model.spec.trace import TraceInputError, read_trace_file
    from model.spec.validate import validate
    if case.path is not None:
        return True
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as fp:
        fp.write(case.content)
        fp.flush()
        try:
            read_trace_file(fp.name, validate)
        except TraceInputError:
            return True
    return False


MALFORMED = [c for c in TRACES if _malformed(c)]


def test_most_trace_cases_are_malformed_input():
    assert len(MALFORMED) > 0.8 * len(TRACES), (len(MALFORMED), len(TRACES))


@pytest.mark.parametrize("case", MALFORMED, ids=str)
def test_replay_refuses_what_validate_calls_malformed_before_starting_ranks(case, tmp_path, capsys):
    rc, out, err, seconds = run_cli(["replay", case_path(case, tmp_path), "--out",
                                     str(tmp_path / "impl.jsonl")], capsys)
    assert_clean(rc, out, err, codes=(2,))
    assert seconds < SECONDS, f"{case}: {seconds:.1f} s (ranks started?)"


def test_verdict_traces_get_a_verdict_not_a_crash(tmp_path, capsys):
    """Well-formed traces the spec rejects or accepts: a verdict from validate; replay
    refuses a trace without its end; an enqueue beyond capacity is refused by the impl's
    agreed admission, the same verdict as validate (1)."""
    expected = {"no end": (1, 2), "bare steps": (0, 0), "SlotsExhausted": (1, 1)}
    for name, content in verdict_traces().items():
        path = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        path.write_bytes(content)
        want_validate, want_replay = expected[name]
        rc, out, err, _ = run_cli(["validate", str(path)], capsys)
        assert rc == want_validate, (name, out, err)
        rc, out, err, _ = run_cli(["replay", str(path), "--out", str(tmp_path / "o.jsonl"),
                                   "--deadline", "60"], capsys)
        assert rc == want_replay, (name, out, err)
        if rc:
            assert_clean(rc, out, err)
    assert "no free metadata slot" in out + err          # the admission refusal, named


@pytest.mark.parametrize("argv", FLAG_CASES + typed_flag_cases() + output_path_cases() + INPUT_CASES,
                         ids=lambda a: " ".join(a))
def test_bad_flags_are_refused_before_any_work(argv, tmp_path, capsys):
    trace = tmp_path / "good.jsonl"
    trace.write_text("\n".join(good_trace()) + "\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    argv = [a.format(trace=trace, dir=tmp_path, fifo=fifo) for a in argv]
    rc, out, err, seconds = run_cli(argv, capsys)
    assert_clean(rc, out, err, codes=(2,))
    assert seconds < SECONDS, seconds
    assert not (tmp_path / "good.impl.jsonl").exists()       # nothing ran


@pytest.mark.parametrize("address, problem", [
    ("not a host", r"'not a host' is not a scheduler address \(tcp://HOST:PORT\)"),
    ("tcp://127.0.0.1:99999", r"port 99999 out of range"),
    # NXDOMAIN at once, or no DNS answer within the bounded lookup: refused either way
    ("tcp://no-such-host.invalid:8786",
     r"host 'no-such-host\.invalid' (does not resolve|did not resolve within 5 s)"),
])
def test_sweep_on_dask_refuses_a_bad_scheduler_address_before_any_work(address, problem, tmp_path, capsys):
    """--engine dask with an address that is malformed or does not resolve: one line
    naming it, exit 2, in bounded time, and no CSV started."""
    out = tmp_path / "s.csv"
    rc, stdout, err, seconds = run_cli(["sweep", "--engine", "dask", "--address", address,
                                        "--out", str(out)], capsys)
    assert_clean(rc, stdout, err, codes=(2,))
    assert re.search(r"^pdgate sweep: --address: .*" + problem, err), err
    assert seconds < SECONDS and not out.exists(), seconds


@pytest.mark.parametrize("argv", [["sweep", "--engine", "dask", "--address", "tcp://stalled.example:8786"],
                                  ["e2e", "--host", "stalled.example"]], ids=lambda a: a[0])
def test_a_name_lookup_that_never_answers_is_cut_at_its_timeout(argv, tmp_path, capsys, monkeypatch):
    """A resolver that never answers (an unreachable DNS server): the lookup is given
    up after model.cli.RESOLVE_TIMEOUT_S, in one line, instead of holding the command."""
    import socket
    import threading
    import model.cli
    release = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: release.wait(60))
    monkeypatch.setattr(model.cli, "RESOLVE_TIMEOUT_S", 0.5)
    try:
        rc, out, err, seconds = run_cli([*argv, "--out" if argv[0] == "sweep" else "--json",
                                         str(tmp_path / "x")], capsys)
    finally:
        release.set()
    assert_clean(rc, out, err, codes=(2,))
    assert "'stalled.example' did not resolve within 0.5 s" in err, err
    assert seconds < 3, seconds


@pytest.mark.parametrize("argv", SIM_BOUND_CASES, ids=lambda a: " ".join(a))
def test_simulations_that_would_not_end_are_refused_or_bounded(argv, tmp_path, capsys):
    argv = [a.format(dir=tmp_path) for a in argv]
    rc, out, err, seconds = run_cli(argv, capsys)
    assert_clean(rc, out, err)
    assert seconds < 60, seconds


def test_every_subcommand_has_flag_cases():
    """Hand-written cases for each subcommand known today; typed_flag_cases covers any
    subcommand added later through its own parser."""
    assert {a[0] for a in FLAG_CASES} >= {"prove", "validate", "simulate", "sweep", "replay", "e2e", "bench", "live"}
    typed = typed_flag_cases()
    assert {a[0] for a in typed} == set(SUBCOMMANDS)
    assert sum(a[0] == "simulate" for a in typed) > 40      # every numeric simulate flag


def python_limited(body: str, *argv: str, timeout: float) -> subprocess.CompletedProcess:
    """``body`` run by a fresh interpreter whose address space is capped at MEMORY_BYTES
    (a MemoryError or a kill says the input was read without bound)."""
    code = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({MEMORY_BYTES}, {MEMORY_BYTES}))\n"
    return subprocess.run([sys.executable, "-c", code + body, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


_VALIDATE_ALL = """
import json, sys
from model.cli import main
out = {}
for path in sys.argv[1:]:
    try:
        out[path] = main(["validate", path])
    except SystemExit as exc:
        out[path] = exc.code
print("RESULT " + json.dumps(out))
"""


def test_trace_classes_stay_within_a_memory_limit(tmp_path):
    """Every trace case in one process whose address space is capped at 1 GiB: a
    MemoryError would end it without the RESULT line."""
    paths = [case_path(case, tmp_path, f"{i}.jsonl") for i, case in enumerate(TRACES)]
    proc = python_limited(_VALIDATE_ALL, *paths, timeout=240)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-1000:]
    codes = json.loads(line[len("RESULT "):])
    assert set(codes.values()) <= {0, 1, 2}, codes
    assert "Traceback" not in proc.stderr and "out of memory" not in proc.stderr, proc.stderr[-500:]


def _read_only(folder: Path) -> list[str]:
    """A command prefix under which ``folder`` exists and nothing can be created in it,
    whoever runs the tests: mode 0555 stops any user but root; root, whom mode bits do
    not stop, runs the command in a private mount namespace where ``folder`` is bound
    read-only onto itself (util-linux unshare; the mount ends with the command)."""
    folder.chmod(0o555)
    try:
        with open(folder / "probe", "x"):
            pass
    except OSError:
        return []                                   # the mode bits are enough
    (folder / "probe").unlink()
    return ["unshare", "--mount", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(folder)]


@pytest.mark.parametrize("kind", ["read-only folder", "/proc/sys"])
def test_e2e_refuses_an_existing_work_dir_it_cannot_write_into(kind, tmp_path):
    """``e2e --work-dir`` an existing folder it cannot create files in: one line naming
    it, exit 2, before any child starts (it was an internal error once the run began)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    prefix = _read_only(folder) if kind == "read-only folder" else []
    work = str(folder) if kind == "read-only folder" else "/proc/sys"
    try:
        proc = subprocess.run([*prefix, sys.executable, "-m", "model.cli", "e2e", "--work-dir", work],
                              cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        folder.chmod(0o755)
    assert proc.returncode == 2, (proc.stdout[-500:], proc.stderr[-500:])
    assert proc.stderr == f"pdgate e2e: --work-dir: cannot write into {work}\n" and not proc.stdout
    assert list(folder.iterdir()) == []


_SWEEP_LIMITED = """
import sys
from model.cli import main
sys.exit(main(["sweep", "--ranks", "2", "--rate", "2", "--requests", "20", "--out", sys.argv[1]]))
"""


def test_sweep_resuming_from_a_huge_file_without_newlines_is_refused_in_bounded_memory(tmp_path):
    """--out an existing 3 GiB regular file with no newline (sparse: no disk used), as
    /dev/full was: the resume read stops at MAX_RESUME_LINE, under a 1 GiB limit on the
    address space, in one line; the file is left as it was."""
    big = tmp_path / "big.csv"
    with open(big, "wb") as fp:
        fp.truncate(3 << 30)
    proc = python_limited(_SWEEP_LIMITED, str(big), timeout=120)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert proc.stderr.count("\n") == 1 and f"--out: {big} line 1 is longer than" in proc.stderr
    assert big.stat().st_size == 3 << 30
