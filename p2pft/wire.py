"""Control-plane wire codec: length-prefixed msgpack frames, optionally HMAC-SHA256 signed.

Frame layout (all integers big-endian)::

    u32 length | u8 flags | [32-byte HMAC-SHA256 if flags & 1] | msgpack payload

``length`` counts everything after itself. The payload is a msgpack map
``{"v": protocol version, "t": message type, "s": sender node id, "b": body}``.
The HMAC covers the flags byte and the payload. The decoder is sans-IO: feed it bytes, get
messages or a ``WireError`` that says why the stream must be closed.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME = 4 * 1024 * 1024
FLAG_MAC = 0x01
_HDR = struct.Struct(">IB")
MAC_LEN = 32


class WireError(Exception):
    """A frame that cannot be accepted; the connection that carried it must be closed."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind  # counter key: malformed, oversized, truncated, bad_mac, no_mac, unexpected_mac, version
        self.detail = detail


@dataclass(frozen=True)
class Message:
    """One decoded control-plane message."""

    type: str
    sender: str
    body: dict[str, Any]
    version: int = PROTOCOL_VERSION


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
           version: int = PROTOCOL_VERSION, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Encode one frame. Raises ``WireError('oversized')`` rather than emit a frame peers would drop."""
    payload = msgpack.packb({"v": version, "t": msg_type, "s": sender, "b": body}, use_bin_type=True)
    flags = FLAG_MAC if secret else 0
    mac = hmac.new(secret, bytes([flags]) + payload, hashlib.sha256).digest() if secret else b""
    length = 1 + len(mac) + len(payload)
    if length > max_frame:
        raise WireError("oversized", f"frame of {length} bytes exceeds limit {max_frame}")
    return _HDR.pack(length, flags) + mac + payload


class FrameDecoder:
    """Incremental decoder for one byte stream (one TCP connection)."""

    def __init__(self, *, secret: bytes | None = None, max_frame: int = DEFAULT_MAX_FRAME,
                 version: int = PROTOCOL_VERSION) -> None:
        self._buf = bytearray()
        self._secret = secret
        self._max = max_frame
        self._version = version

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
        return Message(mtype, sender, body, version)
