"""The pdgate dispatcher: help, unknown subcommands, lazy imports."""
import os
import subprocess
import sys

from model.cli import SUBCOMMANDS, main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_help_lists_every_subcommand():
    out = run_cli("--help")
    assert out.returncode == 0
    for name in SUBCOMMANDS:
        assert name in out.stdout


def test_unknown_subcommand_is_usage_error():
    out = run_cli("frobnicate")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


def test_validate_does_not_import_heavy_layers(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"kind":"header","format":"pdgate-trace","version":1,"variant":"gate",'
                     '"ranks":1,"slots":1,"source":"test"}\n{"kind":"end","steps":0}\n')
    code = ("import sys; from model.cli import main; rc = main(['validate', sys.argv[1]]); "
            "heavy = [m for m in ('z3', 'simpy', 'torch') if m in sys.modules]; "
            "print('HEAVY', heavy); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(trace)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout


def test_no_arguments_prints_help_and_succeeds(capsys):
    assert main([]) == 0
    assert "COMMAND" in capsys.readouterr().out


# -- shared argument handling --------------------------------------------------------
import argparse  # noqa: E402

import pytest  # noqa: E402

from model.cli import folder_problem, number, output_problem, refuse_nonfinite, writable_problem  # noqa: E402


@pytest.mark.parametrize("text, kwargs, ok", [
    ("3", {"lo": 1, "hi": 5, "integer": True}, 3), ("0", {"lo": 0, "above": True}, None),
    ("nan", {}, None), ("inf", {}, None), ("-inf", {"lo": -10}, None), ("1e400", {}, None),
    ("2.5", {"integer": True}, None), ("1e12", {"integer": True}, None), ("6", {"hi": 5}, None),
    ("0.5", {"lo": 0, "above": True}, 0.5), ("x", {}, None),
])
def test_number_accepts_only_finite_values_in_range(text, kwargs, ok):
    parse = number(**kwargs)
    if ok is None:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
    else:
        assert parse(text) == ok


def test_every_float_flag_refuses_nonfinite_values():
    p = argparse.ArgumentParser()
    p.add_argument("--x", type=float)
    p.add_argument("--xs", type=lambda t: [float(v) for v in t.split(",")])
    p.add_argument("--n", type=int)
    refuse_nonfinite(p)
    assert p.parse_args(["--x", "1.5", "--xs", "1,2", "--n", "3"]) == argparse.Namespace(x=1.5, xs=[1.0, 2.0], n=3)
    for argv in (["--x", "nan"], ["--x", "inf"], ["--xs", "1,-inf"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)


def test_outputs_are_checked_by_opening_them_not_by_permission_bits(tmp_path):
    assert writable_problem(tmp_path / "new.json") is None
    assert not (tmp_path / "new.json").exists()                 # created, then removed
    existing = tmp_path / "keep.json"
    existing.write_text("data")
    assert writable_problem(existing) is None and existing.read_text() == "data"
    assert "does not exist" in writable_problem(tmp_path / "no" / "x.json")
    assert "is a directory" in writable_problem(tmp_path)
    assert "cannot write" in writable_problem("/proc/pdgate-x.json")   # even as root
    assert "also the input" in writable_problem(existing, existing)
    assert folder_problem(tmp_path / "a" / "b") is None and folder_problem(existing)
    assert "not a writable folder" in folder_problem("/proc/pdgate-dir")


def test_output_problem_names_the_flag(tmp_path):
    args = argparse.Namespace(json="/proc/x.json", trace=None, perfetto=None, plot=None, trace_in=None)
    assert output_problem("simulate", args).startswith("--json: cannot write /proc/x.json")
    assert output_problem("simulate", argparse.Namespace(json=str(tmp_path / "ok.json"))) is None
    assert output_problem("validate", args) is None             # validate writes nothing


def test_an_unexpected_exception_is_one_line_exit_1(monkeypatch, capsys):
    import model.spec.validate as v

    def boom(args):
        raise KeyError(777)
    monkeypatch.setattr(v, "run", boom)
    assert main(["validate", "x"]) == 1
    err = capsys.readouterr().err
    assert err == "pdgate validate: internal error: KeyError: 777\n"


@pytest.mark.parametrize("tree", ["", "not-a-dir", "TMP"])
def test_bench_refuses_a_before_tree_that_is_not_a_checkout_before_running(tree, tmp_path, monkeypatch,
                                                                           capsys):
    tree = str(tmp_path) if tree == "TMP" else tree
    monkeypatch.setenv("PDGATE_BENCH_BEFORE", tree)
    assert main(["bench", "sim", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"pdgate bench sim: PDGATE_BENCH_BEFORE: {tree!r} is not a pdgate "
                   f"checkout (no sim/engine.py there)")


def test_bench_before_tree_is_made_absolute(monkeypatch):
    from bench.bench_sim import _before_tree
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("PDGATE_BENCH_BEFORE", ".")
    assert _before_tree() == os.getcwd()
