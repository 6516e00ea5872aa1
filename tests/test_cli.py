"""The pdgate dispatcher: help, unknown subcommands, lazy imports."""
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
