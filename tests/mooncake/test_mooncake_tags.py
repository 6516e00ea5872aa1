"""The HMAC tag itself, forged in every malformed shape (no sockets, no engines): a
shorter, longer, truncated or flipped tag, a tag over another framing of the same bytes,
over another direction or rank, or under another rank's key never verifies, and the
one genuine tag always does (the sibling that shows these checks can say "yes")."""
from __future__ import annotations

import pytest

from impl.mooncake import auth

SECRET = bytes(range(32))
KEY = auth.rank_key(SECRET, 3)
CH = auth.Channel(auth.TO_PREFILL, 3)
BODY = [b"XFER", b"\x03\x00", b"room and pages"]


def test_the_genuine_tag_verifies_and_unseal_returns_the_body():
    sealed = auth.seal(KEY, CH, BODY)
    assert len(sealed) == len(BODY) + 1 and len(sealed[-1]) == auth.TAG_BYTES
    assert auth.unseal(KEY, CH, sealed) == BODY


@pytest.mark.parametrize("cut", [0, 1, 16, auth.TAG_BYTES - 1])
def test_a_shorter_tag_is_refused_even_as_a_prefix_of_the_genuine_one(cut):
    good = auth.tag(KEY, CH, BODY)
    assert auth.unseal(KEY, CH, [*BODY, good[:cut]]) is None


def test_a_longer_or_altered_tag_is_refused():
    good = auth.tag(KEY, CH, BODY)
    assert auth.unseal(KEY, CH, [*BODY, good + b"\0"]) is None
    for i in (0, 15, auth.TAG_BYTES - 1):
        flipped = bytearray(good)
        flipped[i] ^= 1
        assert auth.unseal(KEY, CH, [*BODY, bytes(flipped)]) is None


@pytest.mark.parametrize("framing", [
    [b"XFER\x03", b"\x00", b"room and pages"],          # a byte moved across a part boundary
    [b"XFER", b"\x03\x00room and pages"],               # two parts joined
    [b"XFER", b"\x03\x00", b"room and", b" pages"],      # one part split
    [b"XFER", b"", b"\x03\x00", b"room and pages"],     # an empty part inserted
    [b"XFER\x03\x00room and pages"],                     # everything in one part
])
def test_the_same_bytes_in_another_framing_do_not_verify(framing):
    assert b"".join(framing) == b"".join(BODY)
    assert auth.unseal(KEY, CH, [*framing, auth.tag(KEY, CH, BODY)]) is None


def test_a_tag_binds_direction_rank_and_key():
    sealed = auth.seal(KEY, CH, BODY)
    for other in (auth.Channel(auth.REPLY, 3), auth.Channel(auth.STATUS, 3),
                  auth.Channel(auth.TO_PREFILL, 2), auth.Channel(auth.TO_PREFILL, 3 + 256)):
        assert auth.unseal(KEY, other, sealed) is None, other
    assert auth.unseal(auth.rank_key(SECRET, 2), CH, sealed) is None
    assert len({auth.rank_key(SECRET, r) for r in (0, 1, 2, 255, 256)}) == 5


def test_a_frame_of_only_a_tag_is_refused_even_when_the_tag_is_genuine():
    assert auth.unseal(KEY, CH, auth.seal(KEY, CH, [])) is None
    assert auth.unseal(KEY, CH, []) is None


@pytest.mark.parametrize("text", ["", "00" * 15, "zz" * 16, "0" * 33])
def test_short_or_malformed_keys_and_secrets_are_refused(text):
    with pytest.raises(ValueError):
        auth.parse_key(text)
    with pytest.raises(ValueError):
        auth.rank_key(bytes(15), 0)
    assert auth.parse_key("ab" * 16) == bytes([0xAB]) * 16
