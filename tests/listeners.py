"""The listening TCP sockets of a process, from /proc (Linux): what a test checks
against the configured host."""
from __future__ import annotations

import ipaddress
import os
import socket


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # /proc prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    return f"{ip}:{int(port, 16)}" if ip.version == 4 else f"[{ip}]:{int(port, 16)}"


def listening(pid: int) -> list[str]:
    """``host:port`` of every socket ``pid`` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}", encoding="ascii") as fp:
            for line in fp.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:      # 0A: LISTEN
                    out.append(_address(fields[1]))
    return sorted(out)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.rsplit(":", 1)[0].strip("[]")).is_loopback


__all__ = ["listening", "port_of", "is_loopback", "socket"]
