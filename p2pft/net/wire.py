"""Control-plane wire codec: length-prefixed msgpack frames, optionally HMAC-SHA256 signed.

Frame layout (all integers big-endian)::

    u32 length | u8 flags | [32-byte HMAC-SHA256 if flags & 1] | msgpack payload

``length`` counts everything after itself. The payload is a msgpack map
``{"v": protocol version, "t": message type, "s": sender node id, "b": body,
"q": sender's send sequence number, "w": send wall time}``.
The HMAC covers the flags byte and the payload, so ``q`` and ``w`` cannot be altered: a
``ReplayGuard`` on the receiving side rejects a captured frame sent again (same or older
sequence number of that sender) or sent later than its acceptance window. The decoder is
sans-IO: feed it bytes, get messages or a ``WireError`` that says why the stream must be closed.
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

PROTOCOL_VERSION = 2   # 2: frames carry a send sequence number and a send time (replay protection)
DEFAULT_MAX_FRAME = 4 * 1024 * 1024
FLAG_MAC = 0x01
_HDR = struct.Struct(">IB")
MAC_LEN = 32


class WireError(Exception):
    """A frame that cannot be accepted; the connection that carried it must be closed."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        # counter key: malformed, oversized, truncated, bad_mac, no_mac, unexpected_mac, version, replay, stale
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class Message:
    """One decoded control-plane message."""

    type: str
    sender: str
    body: dict[str, Any]
    version: int = PROTOCOL_VERSION
    seq: int = field(default=0, compare=False)       # sender's send sequence number
    ts: float = field(default=0.0, compare=False)    # sender's wall clock when it encoded the frame


# One counter per process: every frame a process encodes, whatever its node id or destination,
# gets the next number, so each sender's numbers strictly increase in encoding order.
_SEND_SEQ = itertools.count(1)


def load_secret(path: str | None = None, env: str = "P2PFT_SECRET") -> bytes | None:
    """Read the cluster secret from a file (stripped) or the environment; None if neither is set.

    Raises ``ValueError`` with a one-line reason when the file is unreadable or empty, so the CLI
    can print it and exit instead of silently running unauthenticated.
    """
    if path:
        try:
            with open(path, "rb") as fh:
                data = fh.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read secret file {path!r}: {exc.strerror or exc}") from None
        if not data:
            raise ValueError(f"secret file {path!r} is empty")
        return data
    value = os.environ.get(env)
    if value:
        return value.encode()
    return None


def encode(msg_type: str, sender: str, body: dict[str, Any], *, secret: bytes | None = None,
           version: int = PROTOCOL_VERSION, max_frame: int = DEFAULT_MAX_FRAME, seq: int | None = None,
           ts: float | None = None) -> bytes:
    """Encode one frame, stamped with the next send sequence number of this process and the wall
    time (both overridable for tests). Raises ``WireError('oversized')`` rather than emit a frame
    peers would drop."""
    payload = msgpack.packb({"v": version, "t": msg_type, "s": sender, "b": body,
                             "q": next(_SEND_SEQ) if seq is None else seq,
                             "w": time.time() if ts is None else ts}, use_bin_type=True)
    flags = FLAG_MAC if secret else 0
    mac = hmac.new(secret, bytes([flags]) + payload, hashlib.sha256).digest() if secret else b""
    length = 1 + len(mac) + len(payload)
    if length > max_frame:
        raise WireError("oversized", f"frame of {length} bytes exceeds limit {max_frame}")
    return _HDR.pack(length, flags) + mac + payload


class FrameDecoder:
    """Incremental decoder for one byte stream (one TCP connection)."""

    def __init__(self, *, secret: bytes | None = None, max_frame: int = DEFAULT_MAX_FRAME,
                 version: int = PROTOCOL_VERSION, guard: "ReplayGuard | None" = None) -> None:
        self._buf = bytearray()
        self._secret = secret
        self._max = max_frame
        self._version = version
        self._guard = guard

    def feed(self, data: bytes) -> list[Message]:
        """Append bytes; return every complete message. Raises WireError on the first bad frame."""
        self._buf += data
        out: list[Message] = []
        while True:
            if len(self._buf) < 4:
                return out
            (length,) = struct.unpack_from(">I", self._buf, 0)
            if length > self._max:
                raise WireError("oversized", f"frame length {length} exceeds limit {self._max}")
            if length < 1:
                raise WireError("malformed", "empty frame")
            if len(self._buf) < 4 + length:
                return out
            frame = bytes(self._buf[4:4 + length])
            del self._buf[:4 + length]
            out.append(self._decode_frame(frame))

    def eof(self) -> None:
        """The stream ended. Raises ``WireError('truncated')`` if it ended inside a frame."""
        if self._buf:
            raise WireError("truncated", f"connection closed {len(self._buf)} bytes into a frame")

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held (bounded by the frame limit)."""
        return len(self._buf)

    def _decode_frame(self, frame: bytes) -> Message:
        flags = frame[0]
        if flags & ~FLAG_MAC:
            raise WireError("malformed", f"unknown flags 0x{flags:02x}")
        rest = frame[1:]
        if flags & FLAG_MAC:
            if not self._secret:
                raise WireError("unexpected_mac", "peer signs its frames but this node has no cluster secret")
            if len(rest) < MAC_LEN:
                raise WireError("malformed", "frame shorter than its MAC")
            mac, payload = rest[:MAC_LEN], rest[MAC_LEN:]
            want = hmac.new(self._secret, bytes([flags]) + payload, hashlib.sha256).digest()
            if not hmac.compare_digest(mac, want):
                raise WireError("bad_mac", "HMAC mismatch (wrong cluster secret?)")
        else:
            if self._secret:
                raise WireError("no_mac", "unauthenticated frame (peer has no cluster secret)")
            payload = rest
        try:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several exception types on garbage
            raise WireError("malformed", f"undecodable msgpack ({type(exc).__name__})") from None
        if not isinstance(obj, dict):
            raise WireError("malformed", "payload is not a map")
        version = obj.get("v")
        if type(version) is not int or version != self._version:  # True == 1 in Python: be exact
            raise WireError("version", f"protocol version {version!r}, this node speaks {self._version}")
        mtype, sender, body = obj.get("t"), obj.get("s"), obj.get("b")
        if not isinstance(mtype, str) or not isinstance(sender, str) or not isinstance(body, dict):
            raise WireError("malformed", "missing or mistyped t/s/b fields")
        seq, ts = obj.get("q"), obj.get("w")
        if type(seq) is not int or not 0 <= seq < 1 << 63 or type(ts) not in (int, float) or ts != ts:
            raise WireError("malformed", "missing or mistyped q/w fields")
        if self._guard is not None:  # after the MAC check: only authentic frames update the table
            self._guard.check(sender, seq, float(ts))
        return Message(mtype, sender, body, version, seq, float(ts))


class ReplayGuard:
    """Rejects control frames that were already accepted, or that are outside the time window.

    Per sender node id it keeps the highest sequence number accepted and a bitmap of the
    ``reorder`` numbers below it (IPsec-style anti-replay window), so frames of one sender that
    arrive slightly out of order on two connections (a reconnect, two spellings of one address)
    are still accepted once each. A frame is rejected as

    - ``stale``: its send time is more than ``window`` seconds away from this node's clock (this
      assumes peers' wall clocks agree to well within the window, e.g. NTP), or it comes from a
      sender not in the table and is not newer than ``floor`` (this process's start minus
      ``start_slack``, raised to the newest frame of any entry evicted early);
    - ``replay``: its sequence number was seen, or is more than ``reorder`` below the highest.

    The table is an LRU bounded by ``max_senders``; an entry whose newest frame is older than the
    window is dropped (any replay of its frames is stale by then), and an entry evicted early
    raises ``floor`` so that its frames still cannot come back as an unknown sender's.
    """

    def __init__(self, *, window: float = 30.0, max_senders: int = 16384, reorder: int = 4096,
                 start_slack: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        self.window = float(window)
        self.max_senders = int(max_senders)
        self.reorder = int(reorder)
        self.clock = clock
        self.floor = clock() - start_slack
        self._mask = (1 << self.reorder) - 1
        self._table: OrderedDict[str, list[Any]] = OrderedDict()   # sender -> [highest, bitmap, newest ts]
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._table)

    def check(self, sender: str, seq: int, ts: float) -> None:
        """Accept (and remember) one authentic frame, or raise ``WireError('replay'|'stale')``."""
        now = self.clock()
        if abs(now - ts) > self.window:
            raise WireError("stale", f"frame from {sender} sent {now - ts:+.1f} s from now, outside the "
                            f"{self.window:g} s window (clocks apart, or a replayed frame)")
        table = self._table
        while table:  # drop entries whose frames are all outside the window by now
            head = next(iter(table.values()))
            if now - head[2] <= self.window:
                break
            table.popitem(last=False)
        entry = table.get(sender)
        if entry is None:
            if ts <= self.floor:
                raise WireError("stale", f"frame from {sender}, unknown here, is older than this node's "
                                f"replay table ({self.floor - ts:.1f} s before its floor)")
            table[sender] = [seq, 1, ts]
            while len(table) > self.max_senders:
                _, old = table.popitem(last=False)
                self.floor = max(self.floor, old[2])
                self.evicted += 1
            return
        high, bits = entry[0], entry[1]
        if seq > high:
            entry[0] = seq
            gap = seq - high
            entry[1] = ((bits << gap) | 1) & self._mask if gap < self.reorder else 1
        else:
            back = high - seq
            if back >= self.reorder or (bits >> back) & 1:
                raise WireError("replay", f"frame {seq} from {sender} was already accepted or is too old "
                                f"(highest seen {high})")
            entry[1] = bits | (1 << back)
        entry[2] = max(entry[2], ts)
        table.move_to_end(sender)
