"""Authenticated control frames: an HMAC-SHA256 tag on every ZMQ frame.

One secret per deployment, generated at start-up (``new_secret``) by whoever starts
the prefill and the decode ranks (``pdgate e2e``'s Cluster) and handed to them out of
band (one line on their stdin, never argv or the environment). The prefill holds the
secret; decode rank r holds only ``rank_key(secret, r)``. Every frame between the
prefill and rank r carries a tag under rank r's key, bound to its direction and rank
(``Channel``), so:
- a HELLO, XFER, ABORT or PING claiming rank r verifies only for the holder of r's key
  (a rank id is registered once, and only by that holder);
- status frames and replies to rank r verify only if the prefill (or r itself) made them;
- a frame from any other local process is rejected, counted and dropped before its
  body is parsed.
Frames are authenticated, not encrypted, and not numbered: one replayed by someone who
can read loopback traffic (root) is a duplicate the protocol already ignores (a latched
receiver, a rank registered once, a room already requested).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any, Sequence

TAG_BYTES = 32
SECRET_BYTES = 32
_RANK_KEY_LABEL = b"pdgate rank key v1"


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def rank_key(secret: bytes, rank: int) -> bytes:
    """Rank ``rank``'s key, derived from the deployment secret (the prefill derives it
    again for each rank; a rank cannot derive another's)."""
    if len(secret) < 16:
        raise ValueError("the deployment secret must be at least 16 bytes")
    return hmac.new(secret, _RANK_KEY_LABEL + rank.to_bytes(2, "big"), hashlib.sha256).digest()


def parse_key(text: str, what: str = "key") -> bytes:
    """A hex key as handed out of band; ValueError (one line) if it is not one."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{what} is not hex") from None
    if len(key) < 16:
        raise ValueError(f"{what} must be at least 16 bytes")
    return key


@dataclass(frozen=True)
class Channel:
    """What a tag is bound to besides the frame: its direction and the rank."""
    direction: bytes            # b"d2p" decode -> prefill, b"p2d" replies, b"st" status
    rank: int

    def prefix(self) -> bytes:
        return b"pdgate " + self.direction + b" " + self.rank.to_bytes(2, "big")


TO_PREFILL, REPLY, STATUS = b"d2p", b"p2d", b"st"


def tag(key: bytes, channel: Channel, parts: Sequence[bytes]) -> bytes:
    mac = hmac.new(key, channel.prefix(), hashlib.sha256)
    for p in parts:      # length-prefixed, so no two part lists tag the same bytes
        mac.update(len(p).to_bytes(8, "big"))
        mac.update(bytes(p))
    return mac.digest()


def seal(key: bytes, channel: Channel, parts: Sequence[bytes]) -> list[bytes]:
    """``parts`` with their tag appended as the last part."""
    return [*parts, tag(key, channel, parts)]


def unseal(key: bytes, channel: Channel, parts: Sequence[bytes]) -> list[bytes] | None:
    """The parts without the tag if the tag verifies, else None."""
    if len(parts) < 2 or len(parts[-1]) != TAG_BYTES:
        return None
    body = list(parts[:-1])
    return body if hmac.compare_digest(tag(key, channel, body), bytes(parts[-1])) else None


def receive_key(stdin: Any, field: str, timeout_s: float = 30.0) -> bytes:
    """The first line on a child's stdin, ``{"<field>": "<hex>"}`` (its key, handed out
    of band by the parent); ValueError (one line) if it does not come in time.
    ``stdin`` is an impl.mooncake.stdio.StdinLines, which keeps any later lines."""
    import json
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stdin.closed:
        lines = stdin.poll(min(0.5, max(0.0, deadline - time.monotonic())))
        if lines:
            first, rest = lines[0], lines[1:]
            stdin.pushback(rest)
            try:
                obj = json.loads(first)
            except json.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                raise ValueError(f"the first stdin line must be {{\"{field}\": HEX}}")
            return parse_key(obj[field], field)
    raise ValueError(f"no {field} on stdin within {timeout_s:g} s")
