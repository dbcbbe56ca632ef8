"""Wire codec: every bad input is a WireError of its own kind; a real server survives them all."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import struct
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pft.core.meta import NodeSpec
from p2pft.net.admin import admin_request
from p2pft.net.driver import ConnLimits, NodeServer
from p2pft.net.wire import (DEFAULT_MAX_FRAME, FLAG_MAC, PROTOCOL_VERSION, FrameDecoder, Message, WireError, encode,
                            load_secret)

SECRET = b"cluster-secret"
OTHER = b"another-secret"


def raw_frame(payload: bytes, flags: int = 0, mac: bytes = b"") -> bytes:
    """A frame built by hand, bypassing encode()'s checks."""
    return struct.pack(">IB", 1 + len(mac) + len(payload), flags) + mac + payload


def signed_raw(body: bytes, secret: bytes = SECRET) -> bytes:
    """A correctly signed frame around arbitrary payload bytes."""
    mac = hmac.new(secret, bytes([FLAG_MAC]) + body, hashlib.sha256).digest()
    return raw_frame(body, FLAG_MAC, mac)


def payload(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode_error(data: bytes, **kw: object) -> WireError:
    dec = FrameDecoder(**kw)  # type: ignore[arg-type]
    with pytest.raises(WireError) as info:
        dec.feed(data)
        dec.eof()
    return info.value


# ---------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("secret", [None, SECRET])
def test_round_trip(secret: bytes | None) -> None:
    body = {"seq": 7, "pb": [{"k": "alive", "n": "a.1", "i": 3, "m": {"s": "ready"}}], "f": 1.5, "x": b"\x00\xff"}
    frame = encode("g.ping", "node-a.1234", body, secret=secret)
    assert frame[4] == (FLAG_MAC if secret else 0)
    msgs = FrameDecoder(secret=secret).feed(frame)
    assert msgs == [Message("g.ping", "node-a.1234", body, PROTOCOL_VERSION)]


def test_stream_split_anywhere_yields_the_same_messages() -> None:
    frames = [encode("t", f"s{i}", {"i": i, "pad": "x" * i * 7}, secret=SECRET) for i in range(20)]
    stream = b"".join(frames)
    for chunk in (1, 3, 5, 64, len(stream)):
        dec = FrameDecoder(secret=SECRET)
        got: list[Message] = []
        for i in range(0, len(stream), chunk):
            got += dec.feed(stream[i:i + chunk])
        dec.eof()
        assert [m.body["i"] for m in got] == list(range(20))
        assert dec.pending == 0


def test_encode_refuses_oversized() -> None:
    with pytest.raises(WireError) as info:
        encode("t", "s", {"blob": b"x" * 2000}, max_frame=1000)
    assert info.value.kind == "oversized"


# ---------------------------------------------------------------------------------- bad input
def test_random_bytes_are_rejected() -> None:
    # A random 4-byte length is almost always beyond the limit: rejected before buffering.
    assert decode_error(b"\xde\xad\xbe\xef" + os.urandom(60)).kind == "oversized"
    # Garbage inside a well-sized frame is malformed, not a crash.
    assert decode_error(raw_frame(b"\xc1\xc1\xc1 not msgpack")).kind == "malformed"


def test_oversized_length_rejected_before_the_body_arrives() -> None:
    dec = FrameDecoder(max_frame=1024)
    with pytest.raises(WireError) as info:
        dec.feed(struct.pack(">I", 1025))  # only the header: no need to wait for 1 KiB
    assert info.value.kind == "oversized"


def test_truncated_frames() -> None:
    good = encode("t", "s", {"a": 1})
    dec = FrameDecoder()
    assert dec.feed(good[:-3]) == []            # incomplete: wait for more
    assert dec.pending == len(good) - 3
    with pytest.raises(WireError) as info:
        dec.eof()                               # ... but the stream ended inside the frame
    assert info.value.kind == "truncated"
    # A frame whose msgpack payload itself is cut short is malformed.
    cut = payload({"v": PROTOCOL_VERSION, "t": "x", "s": "y", "b": {}})[:-2]
    assert decode_error(raw_frame(cut)).kind == "malformed"
    # A signed frame too short to hold its MAC.
    assert decode_error(raw_frame(b"abc", flags=FLAG_MAC), secret=SECRET).kind == "malformed"
    # Zero-length frame.
    assert decode_error(struct.pack(">I", 0)).kind == "malformed"


def test_wrong_protocol_version() -> None:
    err = decode_error(encode("t", "s", {}, version=PROTOCOL_VERSION + 1))
    assert err.kind == "version"
    # True == 1 in Python; the decoder must not take a boolean for version 1.
    assert decode_error(raw_frame(payload({"v": True, "t": "x", "s": "y", "b": {}}))).kind == "version"


V = PROTOCOL_VERSION
STAMP = {"q": 1, "w": 0.0}


@pytest.mark.parametrize("obj", [[1, 2], {"v": V, "t": 5, "s": "y", "b": {}, **STAMP},
                                 {"v": V, "t": "x", "s": "y", "b": [], **STAMP}, {"v": V, "t": "x", "b": {}, **STAMP},
                                 {"v": V, "t": "x", "s": "y", "b": {}}, {"v": V, "t": "x", "s": "y", "b": {}, "q": -1,
                                                                         "w": 0.0},
                                 {"v": V, "t": "x", "s": "y", "b": {}, "q": 1, "w": "now"}, 42])
def test_mistyped_payloads_are_malformed(obj: object) -> None:
    assert decode_error(raw_frame(payload(obj))).kind == "malformed"


def test_unknown_flags_are_malformed() -> None:
    frame = raw_frame(payload({"v": V, "t": "x", "s": "y", "b": {}, **STAMP}), flags=0x80)
    assert decode_error(frame).kind == "malformed"


def test_secret_mismatches_each_have_their_own_kind() -> None:
    signed = encode("t", "s", {"a": 1}, secret=SECRET)
    unsigned = encode("t", "s", {"a": 1})
    assert decode_error(signed, secret=OTHER).kind == "bad_mac"          # wrong secret
    assert decode_error(unsigned, secret=SECRET).kind == "no_mac"        # missing secret at the sender
    assert decode_error(signed).kind == "unexpected_mac"                 # secret at the sender only
    tampered = bytearray(signed)
    tampered[-1] ^= 0x01
    assert decode_error(bytes(tampered), secret=SECRET).kind == "bad_mac"


def test_error_kinds_are_distinct() -> None:
    kinds = {
        decode_error(b"\xff\xff\xff\xff").kind,
        decode_error(encode("t", "s", {})[:-1]).kind,
        decode_error(raw_frame(b"\xc1")).kind,
        decode_error(encode("t", "s", {}, version=9)).kind,
        decode_error(encode("t", "s", {}, secret=SECRET), secret=OTHER).kind,
        decode_error(encode("t", "s", {}), secret=SECRET).kind,
        decode_error(encode("t", "s", {}, secret=SECRET)).kind,
    }
    assert kinds == {"oversized", "truncated", "malformed", "version", "bad_mac", "no_mac", "unexpected_mac"}


def test_load_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("P2PFT_SECRET", raising=False)
    f = tmp_path / "s"
    f.write_bytes(b"  s3cret\n")
    assert load_secret(str(f)) == b"s3cret"
    assert load_secret(None) is None
    monkeypatch.setenv("P2PFT_SECRET", "from-env")
    assert load_secret(None) == b"from-env"
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    with pytest.raises(ValueError, match="empty"):
        load_secret(str(empty))


# ---------------------------------------------------------------------------------- fuzzing
def _check_messages(msgs: list[Message]) -> None:
    for m in msgs:
        assert isinstance(m, Message)
        assert isinstance(m.type, str) and isinstance(m.sender, str) and isinstance(m.body, dict)
        assert m.version == PROTOCOL_VERSION


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=2048), cuts=st.lists(st.integers(0, 2048), max_size=6),
       secret=st.sampled_from([None, SECRET]))
def test_fuzz_decoder_random_streams(data: bytes, cuts: list[int], secret: bytes | None) -> None:
    """Arbitrary bytes, split arbitrarily: only WireError, and anything returned is well formed."""
    dec = FrameDecoder(secret=secret, max_frame=4096)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    try:
        for a, b in zip(points, points[1:]):
            _check_messages(dec.feed(data[a:b]))
        dec.eof()
    except WireError as exc:
        assert exc.kind in {"oversized", "truncated", "malformed", "version", "bad_mac", "no_mac", "unexpected_mac"}
    assert dec.pending <= 4 + 4096


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies=st.lists(st.dictionaries(st.text(max_size=8), json_values, max_size=5), min_size=1, max_size=4),
       pos=st.integers(0, 10**6), flip=st.integers(1, 255))
def test_fuzz_signed_frames_never_decode_to_something_else(bodies: list[dict], pos: int, flip: int) -> None:
    """One flipped byte in a signed stream: the decoder returns a prefix of the original
    messages and then either stops with a WireError or waits for bytes that never come."""
    stream = bytearray(b"".join(encode("x.y", "sender", b, secret=SECRET) for b in bodies))
    stream[pos % len(stream)] ^= flip
    dec = FrameDecoder(secret=SECRET)
    got: list[Message] = []
    try:
        got += dec.feed(bytes(stream))
        dec.eof()
    except WireError:
        pass
    else:  # pragma: no cover - a flipped byte can never leave every frame valid
        pytest.fail("a corrupted signed stream decoded without error")
    assert [m.body for m in got] == bodies[:len(got)]
    assert len(got) < len(bodies)


# ---------------------------------------------------------------------------------- real server
async def _send_raw(addr: str, data: bytes, close_write: bool = False) -> bytes:
    """Send bytes on a fresh connection; return what comes back before the server closes it."""
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        if close_write:
            writer.write_eof()
        return await asyncio.wait_for(reader.read(), 3.0)  # EOF = the server closed it
    finally:
        writer.close()


BAD_INPUTS = [
    ("malformed", lambda: signed_raw(b"\xc1\xc1 garbage")),
    ("oversized", lambda: struct.pack(">I", DEFAULT_MAX_FRAME + 1) + b"x" * 16),
    ("version", lambda: encode("g.ping", "x", {}, secret=SECRET, version=PROTOCOL_VERSION + 1)),
    ("bad_mac", lambda: encode("g.ping", "x", {}, secret=OTHER)),
    ("no_mac", lambda: encode("g.ping", "x", {})),
]


@pytest.fixture
async def server():
    srv = NodeServer(listen="127.0.0.1:0", secret=SECRET, spec=NodeSpec(replica_id="wire-test"))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(leave=False)


@pytest.mark.parametrize("kind,make", BAD_INPUTS, ids=[k for k, _ in BAD_INPUTS])
async def test_server_closes_counts_and_logs_each_bad_frame(server: NodeServer, kind: str, make,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="p2pft.net.driver")
    answer = await _send_raw(server.addr, make())
    assert answer == b""  # closed without a reply
    assert server.counters[f"bad_frame_{kind}"] == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "p2pft.net.driver"]
    assert any("closing connection" in line and kind in line for line in lines), lines
    rep = await admin_request(server.addr, "admin.members", secret=SECRET, timeout=3.0)
    assert rep["epoch"] >= 1 and rep["members"][0]["replica_id"] == "wire-test"


async def test_server_counts_truncated_stream(server: NodeServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="p2pft.net.driver")
    frame = encode("g.ping", "x", {"seq": 1}, secret=SECRET)
    await _send_raw(server.addr, frame[: len(frame) // 2], close_write=True)
    await asyncio.sleep(0.05)
    assert server.counters["bad_frame_truncated"] == 1
    assert any("truncated" in r.getMessage() for r in caplog.records)
    assert (await admin_request(server.addr, "admin.members", secret=SECRET))["epoch"] >= 1


async def test_server_without_secret_rejects_signed_frames(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="p2pft.net.driver")
    srv = NodeServer(listen="127.0.0.1:0")
    await srv.start()
    try:
        assert await _send_raw(srv.addr, encode("g.ping", "x", {}, secret=SECRET)) == b""
        assert srv.counters["bad_frame_unexpected_mac"] == 1
        assert any("unexpected_mac" in r.getMessage() for r in caplog.records)
        assert (await admin_request(srv.addr, "admin.members"))["epoch"] >= 1
    finally:
        await srv.stop(leave=False)


async def _exchange(addr: str, data: bytes) -> tuple[list[Message], bool]:
    """Send bytes; collect replies until the server closes the connection or answers an admin
    request. Returns (replies, closed_by_server)."""
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    dec = FrameDecoder(secret=SECRET)
    replies: list[Message] = []
    try:
        writer.write(data)
        await writer.drain()
        while True:
            chunk = await asyncio.wait_for(reader.read(1 << 16), 3.0)
            if not chunk:
                return replies, True
            replies += dec.feed(chunk)
            if any(m.type == "admin.reply" for m in replies):
                return replies, False
    finally:
        writer.close()


@pytest.mark.parametrize("body", [{"seq": "x", "to": "?", "from": 5}, {"t": 1}, {"view": 5, "leader": "a"},
                                  {"pb": "nonsense"}, {"e": float("inf"), "src": "q"}, {"hdr": [], "base": "x"}])
@pytest.mark.parametrize("mtype", ["g.ping", "g.pp", "v.view", "v.delta", "r.ae"])
async def test_server_drops_well_framed_nonsense(server: NodeServer, mtype: str, body: dict) -> None:
    """Valid frames whose content makes no sense: dropped (the connection closed and counted),
    never fatal; the node keeps serving on that connection or the next."""
    data = encode(mtype, "x", dict(body), secret=SECRET) + encode("admin.members", "x", {}, secret=SECRET)
    replies, closed = await _exchange(server.addr, data)
    if closed:
        assert server.counters["bad_message"] == 1
    else:
        assert replies[-1].body["epoch"] >= 1
    rep = await admin_request(server.addr, "admin.members", secret=SECRET, timeout=3.0)
    assert rep["epoch"] >= 1
    assert server.counters["tick_error"] == 0


async def test_garbage_after_good_frames_closes_only_that_connection(server: NodeServer) -> None:
    host, port = server.addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(encode("admin.members", "x", {}, secret=SECRET))
        await writer.drain()
        dec = FrameDecoder(secret=SECRET)
        replies: list[Message] = []
        while not replies:
            chunk = await asyncio.wait_for(reader.read(1 << 16), 3.0)
            assert chunk, "closed before answering a good request"
            replies += dec.feed(chunk)
        assert replies[0].type == "admin.reply"
        writer.write(b"\xff\xff\xff\xff")   # now garbage on the same connection
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 3.0) == b""
    finally:
        writer.close()
    assert server.counters["bad_frame_oversized"] == 1
    rep = await admin_request(server.addr, "admin.members", secret=SECRET)
    assert rep["members"][0]["replica_id"] == "wire-test"


@pytest.mark.parametrize("name", ["max_frame", "max_inbound", "idle_timeout", "drain_timeout", "replay_window"])
def test_connection_limits_name_a_bad_value(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ConnLimits(**{name: 0})
