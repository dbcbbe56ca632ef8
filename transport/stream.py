"""State streaming: a joiner pulls a snapshot (metadata + CPU tensors) from a donor's DataServer.

Wire (after the KIND_STATE handshake): the joiner sends one length-prefixed msgpack request; the
donor answers with a length-prefixed msgpack header (ok/error, meta, tensor index) and then every
tensor's bytes in order, in chunks of at most `state_chunk_bytes`, each preceded by a chunk header
(magic, tensor index, byte offset, length, crc32). Payloads go from the donor's tensors straight
to the socket and from the socket straight into the joiner's freshly allocated tensors, so the
extra memory on either side is a few headers, whatever the snapshot size.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import msgpack

from .buffers import DTYPE_CODES, as_flat_buffer, dtype_name, host_empty
from .devcopy import DeviceSink, DeviceSource, PinnedPair, is_device_tensor, iter_chunks
from .errors import CommError, CommTimeout, PeerFailed, ProtocolMismatch
from .options import DonorLimits
from .sockutil import close_quietly
from .wire import (
    ACK_LEN, KIND_STATE, ST_BUSY, ST_NO_STATE, ST_OK, STATUS_TEXT, pack_hello, parse_ack, recv_exact,
    send_all, source_address, split_addr, tune_socket,
)

if TYPE_CHECKING:
    import torch

    from .device import Event

__all__ = ["StateSnapshot", "fetch_state", "serve_state_connection"]

logger = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
CHUNK_MAGIC = b"P2FS"
CHUNK = struct.Struct("<4sIQII")  # magic, tensor index, byte offset, length, crc32
MAX_HEADER = 64 << 20             # msgpack request / index size limit
_RATE_KEY = "_p2pft_rate_limit"


@dataclass
class StateSnapshot:
    """What a donor hands a joiner: small msgpack-able metadata and CPU tensors copied at a step boundary."""

    meta: dict
    tensors: dict[str, "torch.Tensor"] = field(default_factory=dict)
    #: device tensors: an event (device seam) recorded after they were written; None: the providing thread's stream
    ready: Any = None


def _send_msg(sock: socket.socket, obj: Any) -> None:
    body = msgpack.packb(obj)
    send_all(sock, (_LEN.pack(len(body)), body))


def _recv_msg(sock: socket.socket) -> Any:
    hb = bytearray(_LEN.size)
    recv_exact(sock, memoryview(hb))
    (n,) = _LEN.unpack(hb)
    if n > MAX_HEADER:
        raise ProtocolMismatch(f"state stream header of {n} bytes exceeds {MAX_HEADER}")
    body = bytearray(n)
    recv_exact(sock, memoryview(body))
    return msgpack.unpackb(bytes(body), strict_map_key=False)


class _Pacer:
    """Sleeps just enough to keep the average rate under `rate` bytes/s (None: no cap)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.t0 = time.monotonic()
        self.sent = 0

    def account(self, nbytes: int) -> None:
        if not self.rate:
            return
        self.sent += nbytes
        ahead = self.sent / self.rate - (time.monotonic() - self.t0)
        if ahead > 0:
            time.sleep(min(ahead, 1.0))


# ---------------------------------------------------------------------------- donor side
def serve_state_connection(sock: socket.socket, provider: Callable[[dict], StateSnapshot | None],
                           limits: DonorLimits) -> None:
    """Answer one joiner on `sock` (runs on a DataServer donor thread)."""
    sock.settimeout(limits.timeout)
    request = _recv_msg(sock)
    if not isinstance(request, dict):
        _send_msg(sock, {"ok": False, "error": "request must be a map"})
        return
    rates = [r for r in (limits.rate_limit, request.pop(_RATE_KEY, None)) if r]
    try:
        snap = provider(request)
    except Exception as e:  # noqa: BLE001 - reported to the joiner, logged here
        logger.exception("state provider failed")
        _send_msg(sock, {"ok": False, "error": f"provider failed: {e!r}"})
        return
    if snap is None:
        _send_msg(sock, {"ok": False, "error": "donor has no snapshot for this request"})
        return
    names = list(snap.tensors)
    bufs: list[Any] = []
    index = []
    pairs: dict[Any, PinnedPair] = {}   # device tensors: two pinned chunks per device, not a host copy
    chunk = limits.chunk_bytes
    for name in names:
        t = snap.tensors[name]
        if not t.is_contiguous():
            t = t.contiguous()
        if is_device_tensor(t):
            dname = dtype_name(t)
            if dname not in DTYPE_CODES:
                raise TypeError(f"unsupported dtype {dname} for tensor {name!r}")
            pair = pairs.get(t.device) or pairs.setdefault(t.device, PinnedPair(chunk, t.device, snap.ready))
            src: Any = DeviceSource(t, pair)
            index.append([name, dname, list(t.shape), src.nbytes])
        else:
            src = as_flat_buffer(t, reducible=False)
            index.append([name, src.dtype_name, list(t.shape), src.nbytes])
        bufs.append(src)
    _send_msg(sock, {"ok": True, "meta": snap.meta, "tensors": index, "chunk": chunk})
    pacer = _Pacer(min(rates) if rates else None)
    hook = limits.chunk_hook
    seq = 0
    for ti, b in enumerate(bufs):
        for off, payload in iter_chunks(b, chunk):
            crc = zlib.crc32(payload)
            if hook is not None:
                payload = memoryview(hook(seq, payload))
            send_all(sock, (CHUNK.pack(CHUNK_MAGIC, ti, off, len(payload), crc), payload))
            pacer.account(len(payload))
            seq += 1
    sock.settimeout(5.0)
    try:  # wait for the joiner's close so it has the last bytes before our close can reset them
        sock.recv(1)
    except OSError:
        pass
    if pairs:
        logger.info("state stream staged device tensors through %d bytes of pinned memory",
                    sum(p.nbytes for p in pairs.values()))
        for p in pairs.values():
            p.release()
    logger.info("served state snapshot: %d tensors, %d bytes", len(bufs), sum(b.nbytes for b in bufs))


# ---------------------------------------------------------------------------- joiner side
def fetch_state(addr: str, request: dict, *, secret: bytes | None = None, timeout: float = 60.0,
                rate_limit_bytes_per_s: float | None = None,
                into: "Mapping[str, torch.Tensor] | None" = None, source_host: str | None = None,
                after: "Event | None" = None) -> StateSnapshot:
    """Pull a snapshot from the donor at `addr`; every chunk is crc32-checked.

    `timeout` bounds connecting and each wait for data (no progress). `into` optionally maps
    names to existing contiguous tensors (e.g. the model's own parameters) that receive the
    bytes in place when name, dtype and shape match; the snapshot then returns those tensors.
    CUDA `into` tensors are filled through two pinned chunk buffers (their size is returned in
    ``meta["_staging_bytes"]``), never through a full host copy.
    Raises PeerFailed if the donor goes away, CommTimeout if it stalls, ProtocolMismatch on
    corruption or a bad handshake, CommError if the donor has nothing to give.
    Copies into CUDA `into` tensors run on a stream of their own that first waits for `after`,
    an event the caller records (`device.written_event`) on the stream that last used those
    tensors; without it, for the calling thread's current stream, which on a fetch thread is the
    default stream: behind whatever is queued there (a collective stuck until this very joiner
    joins it), and not after a side stream that training writes on.
    The connection's source IP is `source_host` (a replica passes its data server's, so that
    peers see the address they know it by; see wire.source_address for when it is used).
    """
    import torch

    if not isinstance(request, dict):
        raise TypeError("request must be a dict")
    host, port = split_addr(addr)
    req = dict(request)
    if rate_limit_bytes_per_s:
        req[_RATE_KEY] = float(rate_limit_bytes_per_s)
    try:
        sock = socket.create_connection((host, port), timeout=timeout,
                                        source_address=source_address(source_host, host))
    except ConnectionRefusedError as e:
        raise PeerFailed(f"state donor refused the connection: {e}", peer_addr=addr) from None
    except OSError as e:
        raise CommTimeout(f"cannot reach state donor: {e!r}", peer_addr=addr) from None
    try:
        tune_socket(sock, None)
        hello = pack_hello(secret, KIND_STATE, 0, 0, 0, 0, 0)
        sock.sendall(hello)
        ack = bytearray(ACK_LEN)
        recv_exact(sock, memoryview(ack))
        status = parse_ack(secret, hello, bytes(ack))
        if status != ST_OK:
            cls = CommError if status in (ST_BUSY, ST_NO_STATE) else ProtocolMismatch
            raise cls(f"state donor rejected the request: {STATUS_TEXT.get(status, status)}", peer_addr=addr)
        _send_msg(sock, req)
        head = _recv_msg(sock)
        if not head.get("ok"):
            raise CommError(f"state donor: {head.get('error')}", peer_addr=addr)
        tensors: dict[str, Any] = {}
        bufs: list[Any] = []
        fresh = []
        pairs: dict[Any, PinnedPair] = {}
        chunk = int(head["chunk"])
        for name, dtype, shape, nbytes in head["tensors"]:
            dt = getattr(torch, dtype, None)
            if not isinstance(dt, torch.dtype) or dtype not in DTYPE_CODES:
                raise ProtocolMismatch(f"unknown dtype {dtype!r} for tensor {name!r}", peer_addr=addr)
            t = into.get(name) if into is not None else None
            if t is not None and t.dtype == dt and list(t.shape) == list(shape) and t.is_contiguous():
                fresh.append(False)
            else:
                t = host_empty(torch, dtype, shape)
                fresh.append(True)
            if not fresh[-1] and is_device_tensor(t):   # a fresh tensor is host memory (host_empty)
                pair = pairs.get(t.device) or pairs.setdefault(t.device, PinnedPair(chunk, t.device, after))
                b: Any = DeviceSink(t, pair)
            else:
                b = as_flat_buffer(t, reducible=False)
            if b.nbytes != nbytes:
                raise ProtocolMismatch(f"tensor {name!r}: {nbytes} bytes announced, shape gives {b.nbytes}",
                                       peer_addr=addr)
            tensors[name] = t
            bufs.append(b)
        hb = bytearray(CHUNK.size)
        hv = memoryview(hb)
        pacer = _Pacer(rate_limit_bytes_per_s)
        for ti, b in enumerate(bufs):
            for off in range(0, b.nbytes, chunk):
                n = min(chunk, b.nbytes - off)
                recv_exact(sock, hv)
                magic, got_ti, got_off, got_n, crc = CHUNK.unpack(hb)
                if magic != CHUNK_MAGIC or got_ti != ti or got_off != off or got_n != n:
                    raise ProtocolMismatch(f"state stream out of sync at tensor {ti} offset {off}", peer_addr=addr)
                sink = b if isinstance(b, DeviceSink) else None
                if fresh[ti]:
                    b.zero(off, n)  # take the page faults here, not inside recv with the socket locked
                view = sink.buffer(n) if sink is not None else b.mv[off:off + n]
                recv_exact(sock, view)
                if zlib.crc32(view) != crc:
                    raise ProtocolMismatch(
                        f"corrupted state chunk: tensor {head['tensors'][ti][0]!r} bytes {off}..{off + n} "
                        f"fail the crc32 check", peer_addr=addr)
                if sink is not None:
                    sink.commit(off, n)
                pacer.account(n)
        meta = head.get("meta") or {}
        if pairs:
            for pair in pairs.values():
                pair.finish()  # every chunk is on the device before the snapshot is used
                pair.release()
            meta["_staging_bytes"] = sum(p.nbytes for p in pairs.values())
        return StateSnapshot(meta=meta, tensors=tensors)
    except (socket.timeout, TimeoutError):
        raise CommTimeout(f"state donor sent nothing for {timeout:g} s", peer_addr=addr) from None
    except EOFError:
        raise PeerFailed("state donor closed the stream early", peer_addr=addr) from None
    except ConnectionError as e:
        raise PeerFailed(f"state stream failed: {e!r}", peer_addr=addr) from None
    finally:
        close_quietly(sock)
