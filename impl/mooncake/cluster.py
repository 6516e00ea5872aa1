"""Child processes of an end-to-end run: one or more prefills and T decode ranks.

Every wait has a timeout; on any failure ``close()`` kills whatever is still running
(by pid, only the children this object started). Used by ``pdgate e2e``, the tests
and bench/bench_e2e.py.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from impl.mooncake.auth import new_secret, rank_key

REPO = Path(__file__).resolve().parents[2]
# Mooncake's start-up lines, which say nothing about why a child failed
_STDERR_NOISE = ("Local segment descriptor", "Logging before InitGoogleLogging")


class ClusterError(RuntimeError):
    """A child failed, exited early or did not answer in time (one line)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Child:
    """A child process speaking one JSON object per line on stdin/stdout."""

    def __init__(self, name: str, argv: list[str], workdir: Path, env: dict[str, str],
                 pass_fds: tuple[int, ...] = ()):
        self.name = name
        self.err_path = workdir / f"{name}.stderr"
        self._err = open(self.err_path, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, env=env, cwd=str(REPO), pass_fds=pass_fds)
        self._buf = b""

    def send(self, obj: dict[str, Any] | str) -> None:
        line = obj if isinstance(obj, str) else json.dumps(obj)
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise ClusterError(f"{self.name} is gone ({self.tail()})") from None

    def read(self, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterError(f"{self.name}: no {what} within {timeout:.3g} s ({self.tail()})")
            if select.select([fd], [], [], min(left, 0.2))[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.proc.wait(timeout=5)
                    raise ClusterError(f"{self.name} exited with code {self.proc.returncode} "
                                       f"before {what} ({self.tail()})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise ClusterError(f"{self.name}: unexpected output {line[:200]!r}") from None

    def tail(self) -> str:
        try:
            lines = [ln for ln in self.err_path.read_text(errors="replace").splitlines()
                     if ln.strip() and not any(noise in ln for noise in _STDERR_NOISE)]
        except OSError:
            return "no stderr"
        return "stderr: " + (lines[-1][:300] if lines else "empty")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._err.close()

    def close(self, timeout: float) -> int:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ClusterError(f"{self.name} did not exit within {timeout:g} s; killed") from None
        finally:
            self._err.close()


class Cluster:
    """One deployment: a fresh secret (impl.mooncake.auth) handed to every prefill and,
    as its own key, to every decode rank on their stdin before they open any socket.
    With ``netns`` every child runs in one private network namespace with only a
    loopback (impl.mooncake.netns): nothing outside reaches Mooncake's listeners."""

    def __init__(self, ranks: int, workdir: Path, workload: list[str], rank_args: list[str],
                 host: str = "127.0.0.1", timeout_s: float = 120.0, netns: bool = False):
        self.ranks, self.workdir, self.host = ranks, Path(workdir), host
        self.net = None
        if netns:
            from impl.mooncake.netns import PrivateNet
            self.net = PrivateNet()
        self.secret = new_secret()
        self.workload, self.rank_args, self.timeout_s = workload, rank_args, timeout_s
        self.deadline = time.monotonic() + timeout_s     # every child's lifetime ends by then
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.env.setdefault("MC_LOG_LEVEL", "ERROR")
        self.prefills: list[Child] = []
        self.decode: list[Child] = []
        self.master_port: int | None = None     # the gloo store (rank 0), once started

    def _child(self, name: str, argv: list[str]) -> Child:
        if self.net is None:
            return Child(name, argv, self.workdir, self.env)
        return Child(name, self.net.wrap(argv), self.workdir, self.env, (self.net.fd,))

    def start_prefill(self, offset: int, count: int, extra: list[str] = ()) -> tuple[Child, str]:
        name = f"prefill{len(self.prefills)}"
        argv = [sys.executable, "-m", "impl.mooncake.prefill_main", *self.workload,
                "--requests", str(count), "--request-offset", str(offset),
                "--ranks", str(self.ranks), "--host", self.host,
                "--lifetime-s", str(self.timeout_s), *extra]
        child = self._child(name, argv)
        self.prefills.append(child)
        child.send({"secret": self.secret.hex()})
        child.hello_line = child.read(self.left(), "endpoint line")      # endpoint, session
        return child, child.hello_line["endpoint"]

    def start_ranks(self) -> list[dict[str, Any]]:
        """Start the T decode ranks; returns their ready lines (status endpoint, session)."""
        port = self.master_port = free_port(self.host)
        for r in range(self.ranks):
            argv = [sys.executable, "-m", "impl.mooncake.rank", *self.workload, *self.rank_args,
                    "--rank", str(r), "--world", str(self.ranks), "--master-port", str(port),
                    "--host", self.host, "--log", str(self.workdir / f"rank{r}.jsonl"),
                    "--lifetime-s", str(self.timeout_s)]
            child = self._child(f"rank{r}", argv)
            self.decode.append(child)
            child.send({"key": rank_key(self.secret, r).hex()})
        return [c.read(self.left(), "ready line") for c in self.decode]

    def left(self) -> float:
        """Start-up waits follow the run's bound (``timeout_s``), not a fixed guess: a
        loaded machine may take long to import torch, but never past the children's
        lifetime."""
        return max(1.0, self.deadline - time.monotonic())

    def serve(self, endpoint: str, offset: int, count: int) -> None:
        for c in self.decode:
            c.send({"cmd": "serve", "endpoint": endpoint, "offset": offset, "count": count})

    def wait_idle(self, timeout: float) -> list[list[dict[str, Any]]]:
        """Wait until every rank emptied its queue; returns each rank's outcomes since
        the previous idle report ({req, decision, step, local, kv_ok, row_ok, token_ok})."""
        out = []
        for c in self.decode:
            msg = c.read(timeout, "idle report")
            if not msg.get("idle"):
                raise ClusterError(f"{c.name}: expected an idle report, got {msg}")
            out.append(msg["outcomes"])
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Stop every rank at the same step and load their result files."""
        for c in self.decode:
            c.send({"cmd": "quit"})
        out = []
        for c in self.decode:
            path = c.read(60, "result line")["result"]
            with open(path, encoding="utf-8") as fp:
                out.append(json.load(fp))
        for c in self.decode:
            rc = c.close(30)
            if rc != 0:
                raise ClusterError(f"{c.name} exited with code {rc} ({c.tail()})")
        return out

    def close(self) -> None:
        for c in [*self.decode, *self.prefills]:
            c.kill()
        if self.net is not None:
            self.net.close()
