"""Counting connections a listener lost to garbage or abuse (ZMQ socket monitor events).

ZMQ drops a connection that speaks no ZMTP (a port scan, an HTTP request, random bytes)
or sends a part over the socket's MAXMSGSIZE before any handler sees a frame, so the
frame counters (``rejected``, ``dropped``) cannot see it. The monitor can: a failed
ZMTP handshake, or a connection closing while the run is going on (the legitimate
peers of a listener keep their connections until the run's figures are read).
"""
from __future__ import annotations

import zmq
import zmq.utils.monitor

BROKEN = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)


class BrokenConnections:
    """``count``: connections of ``sock`` that failed their handshake or were dropped.
    ``monitor`` is to be polled by the thread that owns ``sock``; ``drain`` counts."""

    def __init__(self, sock: zmq.Socket):
        self.monitor = sock.get_monitor_socket(BROKEN)
        self.count = 0

    def drain(self) -> None:
        while self.monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self.monitor)["event"]
            if event & BROKEN:
                self.count += 1

    def close(self) -> None:
        self.monitor.close()
