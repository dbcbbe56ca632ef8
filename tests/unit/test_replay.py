"""Replay protection: control frames (sequence + send time under the HMAC) and data-port
handshakes (send time + nonce), in isolation and against real servers."""
from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from p2pft.core.meta import NodeSpec
from p2pft.net.admin import admin_request
from p2pft.net.driver import NodeServer
from p2pft.net.wire import FrameDecoder, ReplayGuard, WireError, encode

SECRET = b"cluster-secret"


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def reject(guard: ReplayGuard, sender: str, seq: int, ts: float) -> str:
    with pytest.raises(WireError) as info:
        guard.check(sender, seq, ts)
    return info.value.kind


# ---------------------------------------------------------------------------------- the guard
def test_each_sequence_number_is_accepted_once() -> None:
    clock = Clock()
    g = ReplayGuard(window=30, clock=clock, reorder=64)
    for q in (5, 6, 9):
        g.check("a", q, clock.t)
    assert reject(g, "a", 9, clock.t) == "replay"
    assert reject(g, "a", 6, clock.t) == "replay"
    g.check("a", 7, clock.t)                      # late but never seen: accepted (reordered)
    assert reject(g, "a", 7, clock.t) == "replay"
    g.check("a", 200, clock.t)
    assert reject(g, "a", 200 - 64, clock.t) == "replay"   # below the reorder window: cannot tell
    g.check("b", 1, clock.t)                      # senders are independent
    g.check("a", 1 << 62, clock.t)                # a huge jump costs nothing
    assert reject(g, "a", 1 << 62, clock.t) == "replay"


def test_frames_outside_the_time_window_are_stale() -> None:
    clock = Clock()
    g = ReplayGuard(window=30, clock=clock)
    assert reject(g, "a", 1, clock.t - 31) == "stale"
    assert reject(g, "a", 2, clock.t + 31) == "stale"
    g.check("a", 3, clock.t + 29)
    # An unknown sender's frame from before this process started (minus the slack) is stale:
    # a receiver that restarted has an empty table, but captured frames are older than it.
    assert reject(g, "c", 1, clock.t - 2) == "stale"


def test_entries_expire_and_eviction_raises_the_floor() -> None:
    clock = Clock()
    g = ReplayGuard(window=10, clock=clock, max_senders=3, start_slack=0)
    clock.t += 1
    for i, s in enumerate("abc"):
        g.check(s, 1, clock.t + i * 0.1)
    g.check("d", 1, clock.t + 0.5)                # evicts "a" early (table full)
    assert g.evicted == 1 and len(g) == 3
    assert reject(g, "a", 1, clock.t) == "stale"  # a's frames are at or below the floor now
    clock.t += 20                                  # everything ages out of the window
    g.check("e", 1, clock.t)
    assert len(g) == 1


def test_decoder_checks_only_authentic_frames() -> None:
    g = ReplayGuard()
    frame = encode("g.ping", "n.1", {"seq": 1}, secret=SECRET)
    assert FrameDecoder(secret=SECRET, guard=g).feed(frame)[0].body == {"seq": 1}
    with pytest.raises(WireError) as info:
        FrameDecoder(secret=SECRET, guard=g).feed(frame)      # the same bytes on a new connection
    assert info.value.kind == "replay"
    # A forged frame with a huge sequence number fails its MAC before it can poison the table.
    forged = encode("g.ping", "n.1", {}, secret=b"wrong", seq=1 << 60)
    with pytest.raises(WireError) as info:
        FrameDecoder(secret=SECRET, guard=g).feed(forged)
    assert info.value.kind == "bad_mac"
    FrameDecoder(secret=SECRET, guard=g).feed(encode("g.ping", "n.1", {}, secret=SECRET))


# ---------------------------------------------------------------------------------- real node
async def _recording_relay(target: str, record: bytearray) -> tuple[asyncio.base_events.Server, str]:
    """A relay that records what clients send (a wire tap)."""
    host, port = target.rsplit(":", 1)

    async def on_conn(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        tr, tw = await asyncio.open_connection(host, int(port))

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, rec: bool) -> None:
            try:
                while data := await r.read(65536):
                    if rec:
                        record.extend(data)
                    w.write(data)
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pump(cr, tw, True), pump(tr, cw, False))

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return srv, f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"


async def _send(addr: str, data: bytes) -> bytes:
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 3.0)
    finally:
        writer.close()


async def test_a_frame_recorded_on_the_wire_and_replayed_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="p2pft.net.driver")
    b = NodeServer(listen="127.0.0.1:0", secret=SECRET, spec=NodeSpec(replica_id="b"))
    await b.start()
    record = bytearray()
    relay, tap = await _recording_relay(b.addr, record)
    a = NodeServer(listen="127.0.0.1:0", secret=SECRET, spec=NodeSpec(replica_id="a"), seeds=[tap])
    await a.start()
    try:
        deadline = time.monotonic() + 10
        while len(record) < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        length = int.from_bytes(record[:4], "big")
        frame = bytes(record[:4 + length])                   # a's first real frame, as b got it
        msg = FrameDecoder(secret=SECRET).feed(frame)[0]
        assert msg.sender == a.node.id
        before = b.counters["bad_frame_replay"]
        assert await _send(b.addr, frame) == b""              # replayed on a new connection: closed
        assert b.counters["bad_frame_replay"] == before + 1
        assert any("replay" in r.getMessage() and a.node.id in r.getMessage() for r in caplog.records)
        rep = await admin_request(b.addr, "admin.members", secret=SECRET)
        assert rep["epoch"] >= 1
        stats = await admin_request(b.addr, "admin.stats", secret=SECRET)
        assert stats["counters"]["bad_frame_replay"] >= 1
        # A fresh frame stamped long ago (a capture replayed later) is stale.
        old = encode("g.ping", "someone.1", {}, secret=SECRET, ts=time.time() - 3600)
        assert await _send(b.addr, old) == b""
        assert b.counters["bad_frame_stale"] == 1
    finally:
        await a.stop(leave=False)
        await b.stop(leave=False)
        relay.close()


# ---------------------------------------------------------------------------------- data port
def test_data_handshake_replay_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    from p2pft.transport import DataServer
    from p2pft.transport.stream import StateSnapshot, fetch_state
    from p2pft.transport.wire import (ACK_LEN, KIND_STATE, ST_OK, ST_REPLAY, HelloGuard, pack_hello, parse_ack,
                                      parse_hello, recv_exact)

    g = HelloGuard(window=30)
    raw = pack_hello(SECRET, KIND_STATE, 0, 0, 0, 0, 0)
    h = parse_hello(SECRET, raw)[1]
    assert h is not None and abs(h.ts - time.time()) < 5
    assert g.check(h) is None
    assert "nonce" in (g.check(h) or "")
    assert "window" in (g.check(h, now=h.ts + 60) or "")

    caplog.set_level(logging.WARNING, logger="p2pft.transport.server")
    srv = DataServer("127.0.0.1", 0, secret=SECRET)
    srv.serve_state(lambda req: StateSnapshot(meta={"secret_state": 42}))
    host, port = srv._host, srv._port
    try:
        def handshake(hello: bytes) -> int:
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(hello)
                ack = bytearray(ACK_LEN)
                recv_exact(s, memoryview(ack))
                return parse_ack(SECRET, hello, bytes(ack))

        captured = pack_hello(SECRET, KIND_STATE, 0, 0, 0, 0, 0)
        assert handshake(captured) == ST_OK
        assert handshake(captured) == ST_REPLAY              # the same bytes again: refused
        assert srv.counters["hello_replay"] == 1
        assert any("handshake" in r.getMessage() and "replay" in r.getMessage() for r in caplog.records)
        assert fetch_state(srv.addr, {}, secret=SECRET, timeout=5).meta == {"secret_state": 42}
    finally:
        srv.close()
