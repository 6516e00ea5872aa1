"""A private network namespace with only a loopback interface, for one deployment.

Mooncake's P2P listeners (its handshake RPC port and its TCP transport's port) bind
every interface whatever host the engine is given, and serve any peer that connects:
a process with no key can ask a rank for its first registered buffer (the KV pool),
read it and overwrite it (docs/MOONCAKE.md, "What Mooncake exposes"). The engine
offers no bind address or authentication for them (0.3.13.post1; its MC_TCP_BIND_ADDRESS
picks the address it advertises, not the one it listens on), so ``pdgate e2e`` runs the
prefill and the decode ranks in a namespace of their own: nothing outside it can reach
any of their sockets. Needs root (CAP_SYS_ADMIN) and util-linux's ``nsenter``.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import socket
import struct
import threading

CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


class NetnsError(OSError):
    """The namespace could not be made here (not root, no nsenter, no unshare)."""


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:    # in the new namespace
        ifr = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack_from("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


class PrivateNet:
    """A new network namespace with ``lo`` up, held open by a file descriptor (no
    process lives in it until children are started with ``wrap``). Made by a helper
    thread, since a namespace switch applies to the calling thread only: the caller's
    own threads stay where they are."""

    def __init__(self) -> None:
        self.nsenter = shutil.which("nsenter")
        if self.nsenter is None:
            raise NetnsError("a private network namespace needs nsenter (util-linux)")
        result: list[object] = []

        def make() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.unshare(CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise NetnsError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)} "
                                          f"(needs root)")
                _loopback_up()
                result.append(os.open("/proc/thread-self/ns/net", os.O_RDONLY))
            except OSError as exc:
                result.append(exc)
        t = threading.Thread(target=make, name="netns")
        t.start()
        t.join(timeout=10)
        if not result or isinstance(result[0], BaseException):
            raise NetnsError(str(result[0]) if result else "netns helper did not finish")
        self.fd: int = result[0]          # type: ignore[assignment]

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` to run inside the namespace (the child must inherit ``self.fd``)."""
        return [self.nsenter, f"--net=/proc/self/fd/{self.fd}", "--", *argv]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def problem() -> str | None:
    """Why a PrivateNet cannot be made here, or None if it can."""
    try:
        PrivateNet().close()
    except OSError as exc:
        return str(exc).splitlines()[0]
    return None
