"""``pdgate live``: a real SGLang 0.5.23 prefill, a TP=2 decode worker and sglang_router
on this CPU machine, checked against a non-disaggregated server (docs/SGLANG.md, "Live").

Runs in its own venv (scripts/install_live.sh, ``$PDGATE_LIVE_VENV``, default
~/.cache/pdgate/live-venv) on a tiny random Llama made locally (impl/sglang/live_model.py),
each deployment inside namespaces of its own (``unshare``: a network with only ``lo``,
and a PID namespace, so no server outlives it; impl/sglang/live_driver.py): first the baseline server, then the PD deployment, the
same prompts with greedy sampling. The decode ranks log every protocol step
(impl/sglang/live_site/live_hooks.py); their logs become one spec trace that
``pdgate validate`` replays. ``--late-room RANK:MS`` hides each request's metadata room
on one decode rank for MS ms (``never``: for good); ``--fail-send RANK`` makes every KV
transfer to decode rank RANK fail in the prefill; ``--late-write RANK:MS`` reports one
metadata row to decode rank RANK failed while its write is still on its way (it lands
MS ms later, or right after the next row into the same slot); ``--kill-prefill-s S``
kills the prefill S s after a request entered the decode's transfer queue;
``--room-zero`` sends the first request with a ``bootstrap_room`` of 0. ``--patch
strict`` installs ``impl.sglang.patch`` in the decode worker and strict's prefill side
(impl/sglang/prefill_patch.py) in the prefill.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "live_site"
RELEASE = "0.5.23"
WORDS = 250


def venv_dir() -> Path:
    env = os.environ.get("PDGATE_LIVE_VENV")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdgate" / "live-venv"


class LiveError(RuntimeError):
    """A step of the live run that could not be done (one line)."""


def prompts(n: int) -> list[str]:
    """``n`` distinct prompts over the tiny model's words, 3 to 10 words long."""
    return [" ".join(f"w{(7 * i + 3 * j) % WORDS}" for j in range(3 + i % 8)) for i in range(n)]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDGATE_LIVE_", "PYTHON"))}
    env.update(PYTHONPATH=f"{SITE}{os.pathsep}{ROOT}", SGLANG_USE_CPU_ENGINE="1",
               MC_FORCE_TCP="1", SGLANG_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", MC_LOG_LEVEL="ERROR",
               # TP>1 compiles the vocab-parallel embedding with inductor at the first
               # decode batch: minutes of C++ builds on 2 loaded cores; eager is exact
               TORCH_COMPILE_DISABLE="1", **extra)
    return env


def _python() -> Path:
    py = venv_dir() / "bin" / "python"
    if not (venv_dir() / ".pdgate-live-ok").exists() or not py.exists():
        raise LiveError(f"the live venv is not in {venv_dir()}: run `bash scripts/install_live.sh`")
    return py


def ensure_model(folder: Path, timeout_s: float) -> Path:
    if not (folder / "config.json").exists():
        run = subprocess.run([str(_python()), "-m", "impl.sglang.live_model", str(folder)],
                             cwd=ROOT, env=_env({}), capture_output=True, text=True,
                             timeout=timeout_s)
        if run.returncode != 0:
            tail = (run.stderr.strip().splitlines() or ["?"])[-1]
            raise LiveError(f"making the tiny model failed: {tail}")
    return folder


def deploy(mode: str, work: Path, model: Path, cfg: argparse.Namespace,
           extra_env: dict[str, str]) -> dict[str, Any]:
    """One deployment in its own namespace and process group, killed on any exit."""
    work.mkdir(parents=True, exist_ok=True)
    result = work / "result.json"
    result.unlink(missing_ok=True)
    conf = {"mode": mode, "work_dir": str(work), "model": str(model), "result": str(result),
            "prompts": prompts(cfg.requests), "max_new_tokens": cfg.max_new_tokens,
            "start_timeout_s": cfg.start_timeout_s, "request_timeout_s": cfg.request_timeout_s,
            "kill_prefill_s": getattr(cfg, "kill_prefill_s", None),
            "room_zero": bool(getattr(cfg, "room_zero", False)),
            "second_wave_s": getattr(cfg, "second_wave_s", None),
            "release_timeout_s": getattr(cfg, "release_timeout_s", None),
            "max_running": getattr(cfg, "max_running", 2),
            "late_write": getattr(cfg, "late_write", None)}
    (work / "config.json").write_text(json.dumps(conf))
    # user, network, PID and mount namespaces: only lo; the driver is the namespace's
    # init, so when it exits or is killed the kernel kills every server left in it
    cmd = ["unshare", "-rnpm", "--fork", "--kill-child", "--mount-proc", str(_python()),
           "-m", "impl.sglang.live_driver", str(work / "config.json")]
    from impl.sglang.live_driver import budget_s
    deadline = budget_s(conf) + 120
    with open(work / "driver.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(extra_env), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)     # unshare; its namespace follows
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
    if not result.exists():
        raise LiveError(f"{mode}: the driver left no result within {deadline:g} s "
                        f"(see {work / 'driver.log'})")
    out = json.loads(result.read_text())
    if out["error"]:
        raise LiveError(f"{mode}: {out['error']}")
    return out


def baseline(work: Path, model: Path, cfg: argparse.Namespace) -> dict[str, Any]:
    """The plain server's outputs, kept next to the model under a key of everything they
    depend on (the model's files, the prompts, the token count, the release), so later
    runs reuse them; ``--fresh-baseline`` runs the server again."""
    import hashlib
    key = hashlib.sha256(json.dumps([RELEASE, prompts(cfg.requests), cfg.max_new_tokens]).encode())
    for name in sorted(p.name for p in model.iterdir() if not p.name.startswith("baseline-")):
        key.update(name.encode() + (model / name).read_bytes())
    cached = model / f"baseline-{key.hexdigest()[:16]}.json"
    if cached.exists() and not cfg.fresh_baseline:
        return {**json.loads(cached.read_text()), "cached": str(cached)}
    out = deploy("baseline", work, model, cfg, {})
    if all(e is None for e in out["errors"]):
        cached.write_text(json.dumps(out))
    return out


def write_trace(work: Path, trace_path: Path, variant: str, timeout_steps: int | None,
                bound: int) -> dict:
    """The decode ranks' logs as one spec trace (impl/sglang/live_trace.py), with a
    ``bounded_wait`` claim where some request was polled more than ``bound`` times
    without leaving, validated; and the same logs as the other side's trace (``strict``
    for a shipped run, ``deferred`` for a strict one), replayed: where they differ."""
    from impl.mooncake.report import ReportError
    from impl.sglang.live_trace import (claim_bounded_wait, first_unlatched, rank_logs,
                                        trace_from_logs)
    from model.spec.validate import ValidationResult, validate, violation_line
    try:
        logs = rank_logs(work, ranks=2)
        cut = first_unlatched(logs)
        with open(trace_path, "w", encoding="utf-8") as fp:
            steps = trace_from_logs(logs, fp, variant, timeout_steps)
    except (ReportError, KeyError, ValueError) as exc:
        return {"trace": None, "steps": None, "trace_valid": False,
                "trace_message": f"trace not written: {exc}", "bounded_wait": None,
                "cut_at_client_abort": None}
    claim = claim_bounded_wait(trace_path, bound)
    with open(trace_path, encoding="utf-8") as fp:
        check = validate(fp)
    # the same logs as the other side's trace (its own release timeout and fences)
    other = "deferred" if variant == "strict" else "strict"
    buf = io.StringIO()
    try:
        trace_from_logs(rank_logs(work, ranks=2), buf, other, timeout_steps or bound)
        against = validate(buf.getvalue().splitlines())
    except (ReportError, KeyError, ValueError) as exc:
        against = ValidationResult(False, f"trace not written: {exc}", 0)
    with open(trace_path, encoding="utf-8") as fp:
        header = json.loads(fp.readline())
    return {"trace": str(trace_path), "steps": steps, "trace_valid": check.ok,
            "trace_message": check.message, "first_violation": violation_line(check),
            "bounded_wait": claim, "cut_at_client_abort": cut, "slots": header["slots"],
            "release_timeout_steps": header.get("release_timeout_steps"),
            "other_variant": {"variant": other, "valid": against.ok,
                              "message": against.message,
                              "first_violation": violation_line(against)}}


def _prefill_counts(folder: Path) -> dict[str, int] | None:
    """What strict's prefill side did, over the prefill's processes that loaded the sender
    (impl/sglang/live_site/live_prefill.py writes one file each): metadata rows sent,
    rooms written last, rooms withheld after a failed row. None: no patched sender."""
    total: dict[str, int] | None = None
    for path in sorted(folder.glob("prefill_patch.*.json")):
        try:
            counts = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        total = total or {}
        for key, value in counts.items():
            total[key] = total.get(key, 0) + int(value)
    return total


def run_live(cfg: argparse.Namespace) -> dict[str, Any]:
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="pdgate-live-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = ensure_model(venv_dir().parent / "live-model", cfg.start_timeout_s)
    base = baseline(work / "baseline", model, cfg)
    env = {"PDGATE_LIVE_LOG_DIR": str(work / "pd")}
    if cfg.late_room:
        env["PDGATE_LIVE_LATE_ROOM"] = cfg.late_room
    if cfg.fail_send is not None:
        env["PDGATE_LIVE_FAIL_SEND"] = str(cfg.fail_send)
    if cfg.patch:
        env["PDGATE_LIVE_PATCH"] = cfg.patch
        env["PDGATE_LIVE_TIMEOUT_STEPS"] = str(cfg.timeout_steps)
    if cfg.late_write:
        env["PDGATE_LIVE_LATE_WRITE"] = cfg.late_write
    (work / "pd").mkdir(parents=True, exist_ok=True)
    for old in [*(work / "pd").glob("rank*.jsonl"), *(work / "pd").glob("prefill_patch.*"),
                work / "pd" / "late_write.json", work / "pd" / "armed"]:
        old.unlink(missing_ok=True)
    pd = deploy("pd", work / "pd", model, cfg, env)
    waves = 1 if cfg.second_wave_s is None else 2
    agree = [b == p for b, p in zip(base["outputs"] * waves, pd["outputs"])]
    variant = "strict" if cfg.patch else "deferred"
    late = work / "pd" / "late_write.json"
    out = {"release": RELEASE, "requests": len(pd["outputs"]), "late_room": cfg.late_room,
           "fail_send": cfg.fail_send, "late_write": cfg.late_write,
           "kill_prefill_s": cfg.kill_prefill_s, "room_zero": cfg.room_zero,
           "second_wave_s": cfg.second_wave_s, "release_timeout_s": cfg.release_timeout_s,
           "patch": cfg.patch, "variant": variant, "matches_baseline": sum(agree),
           "failed_requests": sum(o is None for o in pd["outputs"]),
           "errors": sorted({e for e in pd["errors"] if e}),
           "baseline_timings": base["timings"], "pd_timings": pd["timings"],
           "prefill_patch": _prefill_counts(work / "pd"),
           "late_write_landed": json.loads(late.read_text()) if late.exists() else None,
           "killed_after_enqueue_s": pd.get("killed_after_enqueue_s"),
           "work_dir": str(work)}
    out.update(write_trace(work / "pd", Path(cfg.trace or work / "trace.ndjson"), variant,
                           cfg.timeout_steps if cfg.patch else None, cfg.timeout_steps))
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from model.cli import number
    p.add_argument("--requests", type=lambda s: int(number(1, 256)(s)), default=8)
    p.add_argument("--max-new-tokens", type=lambda s: int(number(1, 256)(s)), default=8)
    p.add_argument("--late-room", metavar="RANK:MS",
                   help="hide each request's room on decode rank RANK (0 or 1) for MS ms, or "
                        "'never'")
    p.add_argument("--fail-send", type=int, choices=[0, 1], metavar="RANK",
                   help="every KV transfer to decode rank RANK fails in the prefill")
    p.add_argument("--late-write", metavar="RANK:MS",
                   help="report the first metadata row to decode rank RANK (0 or 1) failed "
                        "while its write is on its way: it lands MS ms later, or right "
                        "after the next row into the same decode slot")
    p.add_argument("--kill-prefill-s", type=number(0, 3600), metavar="S",
                   help="kill the prefill server S s after a request entered the decode's "
                        "transfer queue (it is in flight then)")
    p.add_argument("--second-wave-s", type=number(0, 3600), metavar="S",
                   help="send the prompts a second time S s after the first wave finished")
    p.add_argument("--release-timeout-s", type=number(0.1, 3600), metavar="S",
                   help="0.5.23's deferred release timeout on the decode "
                        "(SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT; "
                        "default SGLang's, 30 s; strict's decode ignores it)")
    p.add_argument("--max-running", type=number(1, 64, integer=True), default=2,
                   metavar="N", help="the decode's --max-running-requests; its metadata "
                                     "pool is 2N slots (default 2: 4 slots, reused)")
    p.add_argument("--room-zero", action="store_true",
                   help="send the first request with bootstrap_room 0, straight to both "
                        "servers as the router would")
    p.add_argument("--patch", choices=["strict"],
                   help="install impl.sglang.patch in decode and strict's prefill side")
    p.add_argument("--timeout-steps", type=lambda s: int(number(1, 2**31)(s)), default=20000,
                   help="strict's gate timeout in protocol steps (with --patch strict), and "
                        "the bound of the bounded_wait claim the trace gets when a request "
                        "waited longer")
    p.add_argument("--start-timeout-s", type=number(10, 3600), default=600.0)
    p.add_argument("--request-timeout-s", type=number(1, 3600), default=120.0)
    p.add_argument("--fresh-baseline", action="store_true",
                   help="run the plain server even where its outputs are cached")
    p.add_argument("--work-dir")
    p.add_argument("--json")
    p.add_argument("--trace")


def _rank_ms_problem(flag: str, text: str | None, never: bool) -> str | None:
    """What is wrong with a RANK:MS flag (None: nothing); ``never`` allows MS 'never'."""
    if text is None:
        return None
    rank, sep, ms = text.partition(":")
    if not sep or rank not in ("0", "1"):
        return f"{flag} {text!r}: want RANK:MS with RANK 0 or 1"
    if never and ms == "never":
        return None
    try:
        value = float(ms)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 3_600_000:
        return (f"{flag} {text!r}: MS must be a number of milliseconds in [0, 3600000]"
                + (" or 'never'" if never else ""))
    return None


class _Stopped(Exception):
    """SIGTERM or SIGHUP: unwind, so the running deployment's namespace is killed."""


def _stop(signum: int, _frame: Any) -> None:
    raise _Stopped(f"stopped by signal {signum}; every server it started is killed")


def run(args: argparse.Namespace) -> int:
    problem = (_rank_ms_problem("--late-room", args.late_room, never=True)
               or _rank_ms_problem("--late-write", args.late_write, never=False))
    if problem:
        print(f"pdgate live: {problem}", file=sys.stderr)
        return 2
    try:
        _python()                  # installed at install time (scripts/install_live.sh), never here
    except LiveError as exc:
        print(f"pdgate live: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    try:
        out = run_live(args)
    except (LiveError, OSError, subprocess.SubprocessError, _Stopped) as exc:
        print(f"pdgate live: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 1
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if out["trace_valid"] else 1
