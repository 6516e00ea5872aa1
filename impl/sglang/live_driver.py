"""The inside of ``pdgate live``: run by the live venv's Python in namespaces of its own
(``unshare -rnpm``): a network with only ``lo`` (brought up here), so Mooncake's
listeners on 0.0.0.0 reach nothing outside, and a PID namespace whose init this is, so
no server outlives it.

``python -m impl.sglang.live_driver CONFIG.json`` starts one deployment (``baseline``:
one non-disaggregated server; ``pd``: a prefill, a TP=2 decode worker and
sglang_router), waits for it with a deadline, sends the prompts (greedy; a second time
after ``second_wave_s`` where set), writes
``RESULT.json`` ({"outputs": [text or null], "errors": [...], "timings": {...}}) and
stops every server it started (their process groups). The parent (impl/sglang/live.py)
kills the namespace on its own deadline.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SERVER_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native",
                "--sampling-backend", "pytorch", "--disable-radix-cache",
                "--host", "127.0.0.1", "--skip-server-warmup", "--max-total-tokens", "4096"]
PREFILL, DECODE, ROUTER, BASE, BOOTSTRAP = 30000, 30001, 30080, 31000, 8998
LINGER_S = 2.0


class DriverError(RuntimeError):
    """A deployment step that did not finish (one line)."""


def _post(port: int, path: str, body: dict, timeout_s: float) -> Any:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


class Deployment:
    """The servers of one run, each in its own process group, all killed on exit."""

    def __init__(self, cfg: dict):
        self.cfg, self.work = cfg, Path(cfg["work_dir"])
        self.procs: list[subprocess.Popen] = []
        self.names: list[str] = []

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.work / f"{name}.log", "ab")
        self.names.append(name)
        self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, **(env or {})},
                                           start_new_session=True))

    def server(self, name: str, port: int, extra: list[str], env: dict[str, str] | None = None
               ) -> None:
        self.start(name, [sys.executable, "-m", "sglang.launch_server", "--model-path",
                          self.cfg["model"], *SERVER_FLAGS, "--port", str(port), *extra], env)

    def wait(self, ports: list[int], deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise DriverError(f"{what}: a server exited during start-up (see its log in "
                                  f"{self.work})")
            if all(_healthy(port) for port in ports):
                return
            time.sleep(1)
        raise DriverError(f"{what} not healthy within {self.cfg['start_timeout_s']:g} s")

    def kill_in_flight(self, name: str, after_s: float, deadline_s: float) -> dict:
        """SIGKILL server ``name``'s process group ``after_s`` s after the next request
        enters decode rank 0's transfer queue (its rank log's next ``enq`` record), so
        that request is in flight when it dies (a fault); gives up at ``deadline_s``.
        The returned dict gets ``killed_after_enqueue_s`` when it fired."""
        proc = self.procs[self.names.index(name)]
        log = self.work / "rank0.jsonl"
        start = log.stat().st_size if log.exists() else 0
        out: dict = {}

        def watch() -> None:
            end = time.monotonic() + deadline_s
            while time.monotonic() < end:
                if log.exists() and b'"k": "enq"' in log.read_bytes()[start:]:
                    t0 = time.monotonic()
                    time.sleep(after_s)
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    out["killed_after_enqueue_s"] = round(time.monotonic() - t0, 3)
                    return
                time.sleep(0.005)
        threading.Thread(target=watch, daemon=True).start()
        return out

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(timeout=30)


def _generate(port: int, prompts: list[str], max_new_tokens: int, timeout_s: float,
              room_zero: bool = False) -> tuple[list[str | None], list[str | None]]:
    """Every prompt through ``port`` (greedy), four at a time. ``room_zero``: the first
    is sent as the router would, with an explicit ``bootstrap_room`` of 0, to the prefill
    and to the decode server at once (the decode's answer is its output)."""
    def post(target: int, body: dict) -> tuple[str | None, str | None]:
        try:
            out = _post(target, "/generate", body, timeout_s)
        except urllib.error.HTTPError as exc:
            return None, f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}"
        except (OSError, urllib.error.URLError) as exc:
            return None, f"{type(exc).__name__}: {exc}"
        return out.get("text"), None

    def one(i: int) -> tuple[str | None, str | None]:
        body = {"text": prompts[i], "sampling_params": {"temperature": 0,
                                                        "max_new_tokens": max_new_tokens}}
        if not (room_zero and i == 0):
            return post(port, body)
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=BOOTSTRAP, bootstrap_room=0)
        with ThreadPoolExecutor(max_workers=2) as both:
            prefill = both.submit(post, PREFILL, body)
            got = post(DECODE, body)
            prefill.result()
        return got
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(one, range(len(prompts))))
    return [g[0] for g in got], [g[1] for g in got]


def _routed(deadline: float) -> None:
    """The router answers /health before it has registered its workers (then it says
    503 "No available servers"): send one short warm-up request until the router hands
    it to them. Any other outcome (an answer, an error from the workers, no answer in
    10 s: a fault run may hold it) means the workers are registered."""
    body = {"text": "w0", "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    while time.monotonic() < deadline:
        try:
            _post(ROUTER, "/generate", body, 10)
            return
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                return
        except TimeoutError:
            return
        except (OSError, urllib.error.URLError) as exc:
            if isinstance(getattr(exc, "reason", None), TimeoutError):
                return
        time.sleep(2)
    raise DriverError("the router registered no workers before the start deadline")


def run(cfg: dict) -> dict:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=30)
    dep = Deployment(cfg)
    start_s = float(cfg["start_timeout_s"])
    t0 = time.monotonic()
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    try:
        if cfg["mode"] == "baseline":
            dep.server("baseline", BASE, ["--tp", "1"])
            dep.wait([BASE], t0 + start_s, "the baseline server")
            port = BASE
        else:
            pd = ["--disaggregation-transfer-backend", "mooncake"]
            dep.server("prefill", PREFILL, [*pd, "--tp", "1", "--disaggregation-mode", "prefill",
                                            "--disaggregation-bootstrap-port", str(BOOTSTRAP)],
                       {"PDGATE_LIVE_ROLE": "prefill"})
            decode_env = {**env, "PDGATE_LIVE_ROLE": "decode"}
            if cfg.get("release_timeout_s") is not None:     # 0.5.23's own setting
                decode_env["SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"] = \
                    str(cfg["release_timeout_s"])
            # a metadata pool of twice --max-running-requests slots: small, so a run
            # reuses slots and the trace's replay checks every reuse
            dep.server("decode", DECODE, [*pd, "--tp", "2", "--disaggregation-mode", "decode",
                                          "--disaggregation-decode-retraction-backup",
                                          "cpu_tensor", "--max-running-requests",
                                          str(cfg.get("max_running", 2))], decode_env)
            dep.wait([PREFILL, DECODE], t0 + start_s, "the prefill and decode servers")
            dep.start("router", [sys.executable, "-m", "sglang_router.launch_router",
                                 "--pd-disaggregation", "--prefill",
                                 f"http://127.0.0.1:{PREFILL}", str(BOOTSTRAP), "--decode",
                                 f"http://127.0.0.1:{DECODE}", "--host", "127.0.0.1",
                                 "--port", str(ROUTER),
                                 # an aborted request is the outcome under test: not
                                 # resent, and not a reason to stop routing to a worker
                                 "--disable-retries", "--disable-circuit-breaker"])
            dep.wait([ROUTER], t0 + start_s, "the router")
            _routed(t0 + start_s)
            port = ROUTER
        t_up = time.monotonic()
        pd_mode = cfg["mode"] == "pd"
        if pd_mode:                  # faults that wait for the warm-up to be over
            (dep.work / "armed").write_text("")
        killed = {}
        if cfg.get("kill_prefill_s") is not None and pd_mode:
            killed = dep.kill_in_flight("prefill", float(cfg["kill_prefill_s"]),
                                        float(cfg["request_timeout_s"]))
        outputs, errors = _generate(port, cfg["prompts"], cfg["max_new_tokens"],
                                    cfg["request_timeout_s"], bool(cfg.get("room_zero")) and pd_mode)
        if cfg.get("second_wave_s") is not None and pd_mode:
            time.sleep(float(cfg["second_wave_s"]))
            more, more_errors = _generate(port, cfg["prompts"], cfg["max_new_tokens"],
                                          cfg["request_timeout_s"])
            outputs, errors = outputs + more, errors + more_errors
        t_done = time.monotonic()
        if pd_mode:       # what follows the last answer (releases, acks) reaches the rank logs
            late = dep.work / "late_write.json"
            end = time.monotonic() + float(cfg["request_timeout_s"])
            while cfg.get("late_write") and not late.exists() and time.monotonic() < end:
                time.sleep(0.1)           # the held write lands, and what follows it is logged
            time.sleep(LINGER_S)
        return {"outputs": outputs, "errors": errors, "error": None, **killed,
                "timings": {"start_s": round(t_up - t0, 1),
                            "requests_s": round(t_done - t_up, 1)}}
    except (DriverError, subprocess.SubprocessError, OSError) as exc:
        return {"outputs": None, "errors": None, "error": str(exc).splitlines()[0],
                "timings": {"failed_after_s": round(time.monotonic() - t0, 1)}}
    finally:
        dep.stop()


def budget_s(cfg: dict) -> float:
    """The longest ``run(cfg)`` may take when every wait runs to its timeout: the start, a
    kill waiting for a request in flight, the waves, the late write's landing, the linger
    (its parent's deadline, with a margin for stopping the servers)."""
    r = float(cfg["request_timeout_s"])
    second = cfg.get("second_wave_s")
    return (float(cfg["start_timeout_s"]) + (r if cfg.get("kill_prefill_s") is not None else 0.0) + r
            + (float(second) + r if second is not None else 0.0)
            + (r if cfg.get("late_write") else 0.0) + LINGER_S)


def main(argv: list[str]) -> int:
    cfg = json.loads(Path(argv[0]).read_text())
    result = run(cfg)
    Path(cfg["result"]).write_text(json.dumps(result))
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
