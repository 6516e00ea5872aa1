"""Frame codecs: round trips, and every malformed frame is a one-line FrameError."""
from __future__ import annotations

import pytest

from impl.mooncake import frames as fr


def hello(**kw) -> fr.Hello:
    base = dict(rank=1, session="127.0.0.1:1234", status_endpoint="tcp://127.0.0.1:5555",
                kv_addr=4096, page_bytes=64, pages=8,
                fields=(fr.FieldLayout("output_ids", 8192, 64, 4),
                        fr.FieldLayout("bootstrap_room", 16384, 64, 4)))
    base.update(kw)
    return fr.Hello(**base)


def test_round_trips():
    h = hello()
    assert fr.decode_hello(h.encode()[1]) == h
    x = fr.Xfer(2**64 - 1, 3, 7, (0, 5, 9))
    assert fr.decode_xfer(x.encode()[1]) == x
    assert fr.decode_abort(fr.encode_abort(99, 2)[1]) == (99, 2)
    assert fr.decode_ping(fr.encode_ping(1, 42)[1]) == (1, 42)
    st = fr.Status(2**64 - 1, fr.STATUS_SUCCESS, 0)
    assert fr.decode_status(st.encode()) == st
    assert fr.decode_hello_ok(fr.encode_hello_ok(0, "h:1")[1]) == (0, "h:1", None)


@pytest.mark.parametrize("body", [
    b"", b"\xff", b"[]", b"x" * (fr.MAX_JSON_BYTES + 1),
    hello(rank=-1).encode()[1], hello(status_endpoint="ipc:///tmp/x").encode()[1],
    hello(room_field="nope").encode()[1], hello(page_bytes=0).encode()[1],
    hello(fields=()).encode()[1],
    hello(fields=(fr.FieldLayout("bootstrap_room", 1, 64, 4),
                  fr.FieldLayout("output_ids", 2, 64, 5))).encode()[1],
])
def test_bad_hello(body):
    with pytest.raises(fr.FrameError) as exc:
        fr.decode_hello(body)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("body", [
    b"", b"\x00" * 17,
    fr.Xfer(0, 0, 0, (1,)).encode()[1],                       # room 0
    fr.Xfer(5, 0, 0, (1, 2)).encode()[1][:-1],                # truncated
    fr.Xfer(5, 0, 0, (1,)).encode()[1] + b"\x00" * 4,         # trailing bytes
])
def test_bad_xfer(body):
    with pytest.raises(fr.FrameError):
        fr.decode_xfer(body)


def test_xfer_with_no_pages_is_refused():
    body = fr.Xfer(5, 0, 0, ()).encode()[1]
    with pytest.raises(fr.FrameError, match="page count"):
        fr.decode_xfer(body)


@pytest.mark.parametrize("frames_", [
    [], [b"1"], [b"1", b"4", b"0", b"extra"], [b"1", b"4", "0"], [b"1", b"7", b"0"],
    [b"1", b"4", b"9999"], [b"+1", b"4", b"0"], [b" 1", b"4", b"0"], [b"18446744073709551616", b"4", b"0"],
])
def test_bad_status(frames_):
    with pytest.raises(fr.FrameError):
        fr.decode_status(frames_)
