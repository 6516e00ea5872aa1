"""Non-blocking line input for the child processes (select on the fd, own buffer, so a
line already read from the pipe is never stranded in Python's buffered stdin)."""
from __future__ import annotations

import os
import select
import sys


class StdinLines:
    def __init__(self, fd: int | None = None):
        self.fd = sys.stdin.fileno() if fd is None else fd
        self._buf = b""
        self._pending: list[str] = []     # lines handed back by pushback()
        self.closed = False

    def pushback(self, lines: list[str]) -> None:
        """Lines a caller read but did not consume: the next poll returns them first."""
        self._pending = list(lines) + self._pending

    def poll(self, timeout: float = 0.0) -> list[str]:
        """Complete lines available within ``timeout`` seconds; sets ``closed`` on EOF."""
        if self._pending:
            timeout = 0.0
        while not self.closed and select.select([self.fd], [], [], timeout)[0]:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.closed = True
                break
            self._buf += chunk
            timeout = 0.0
        *lines, self._buf = self._buf.split(b"\n")
        out, self._pending = self._pending, []
        return out + [ln.decode("utf-8", "replace").strip() for ln in lines]
