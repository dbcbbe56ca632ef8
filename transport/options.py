"""Settings handed from the DataServer to the modules it drives, as plain frozen dataclasses.

The server keeps its knobs as public attributes (they may be changed between uses); it takes a
snapshot into one of these whenever it creates a communicator or starts a state stream, so the
ring and the stream code never look into the server itself.
"""

from __future__ import annotations

import ipaddress
import os

from dataclasses import dataclass
from typing import Callable

from .wire import split_addr

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_STATE_CHUNK_BYTES", "RING_BUFSIZE_ENV", "RING_ACK_TIMEOUT_S",
           "SHARED_CORES_BUFSIZE", "ChunkHook", "DonorLimits", "RingOptions", "checked_bufsize", "configured_bufsize",
           "ring_bufsize_for", "ring_bufsize_from_env"]

#: Ring chunk size: per-frame overhead is negligible above it, and a chunk still fits the
#: kernel's socket buffers so consecutive ring steps overlap.
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_STATE_CHUNK_BYTES = 4 << 20

#: Test hook of a donor: (chunk sequence number, payload) -> payload actually sent.
ChunkHook = Callable[[int, memoryview], "bytes | memoryview"]


@dataclass(frozen=True)
class RingOptions:
    """What every ring communicator of one process shares.

    `chunk_bytes` and `lanes` must be equal on all ranks of a communicator (checked in the
    handshake); the others are local.
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    lanes: int = 1
    #: SO_SNDBUF/SO_RCVBUF of this ring's sockets; None keeps kernel autotuning (see
    #: ring_bufsize_for).
    sock_bufsize: int | None = None
    #: Let the receiving thread write a frame itself when the socket has room (see docs).
    inline_send: bool = True
    #: Cluster secret for the handshake MAC; None: unauthenticated.
    secret: bytes | None = None
    #: Listen IP of this process's DataServer: the source of outgoing ring connections
    #: (see wire.source_address for when it is used).
    source_host: str | None = None
    #: Seconds the right neighbour's host may leave our data unacknowledged, with the kernel
    #: already retransmitting, before the op fails blaming it (wire.unacknowledged): a host gone
    #: without a reset is evidence long before the op timeout. None: only the op timeout.
    ack_timeout: float | None = None


@dataclass(frozen=True)
class DonorLimits:
    """Bounds of one state stream served by a donor."""

    #: Seconds without progress before a stream to a stalled joiner is dropped.
    timeout: float = 60.0
    #: bytes/s cap of this donor (None: unlimited); the joiner may ask for a lower one.
    rate_limit: float | None = None
    chunk_bytes: int = DEFAULT_STATE_CHUNK_BYTES
    chunk_hook: ChunkHook | None = None


#: Default RingOptions.ack_timeout (seconds): above Linux's minimum RTO (0.2 s), with room for
#: the first retransmission's acknowledgement; docs/control-plane.md, "Timing knobs".
RING_ACK_TIMEOUT_S = 0.3

RING_BUFSIZE_ENV = "P2PFT_RING_BUFSIZE"
#: Ring socket buffers on a host whose ring members outnumber its cores.
SHARED_CORES_BUFSIZE = 256 * 1024


def ring_bufsize_from_env() -> int | None:
    """$P2PFT_RING_BUFSIZE: None when unset or empty (chosen per ring, see ring_bufsize_for),
    0 for the kernel's autotuning always, else a fixed size in bytes."""
    raw = os.environ.get(RING_BUFSIZE_ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{RING_BUFSIZE_ENV}={raw!r}: expected a size in bytes, e.g. 262144, "
                         "or 0 for the kernel's autotuning") from None
    return checked_bufsize(n, RING_BUFSIZE_ENV)


def configured_bufsize(arg: int | None) -> int | None:
    """A DataServer's `sock_bufsize`: the argument if given, else $P2PFT_RING_BUFSIZE (None: each
    ring chooses, see ring_bufsize_for)."""
    return ring_bufsize_from_env() if arg is None else checked_bufsize(arg, "sock_bufsize")


def checked_bufsize(n: int, what: str) -> int:
    """A ring socket buffer size as given: 0 (the kernel's autotuning) or at least 4096 bytes."""
    if n != 0 and n < 4096:
        raise ValueError(f"{what}={n}: needs at least 4096 bytes (or 0: the kernel's autotuning)")
    return n


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def _same_host(a: str, b: str) -> bool:
    return a == b or (_is_loopback(a) and _is_loopback(b))


def ring_bufsize_for(peers: list[str], rank: int, configured: int | None, cores: int | None = None) -> int | None:
    """SO_SNDBUF/SO_RCVBUF of one ring's sockets (None: the kernel's autotuning).

    `configured` (the DataServer's `sock_bufsize` or $P2PFT_RING_BUFSIZE) wins: 0 is
    autotuning, a size is that size. Unset, the ring decides: small buffers (256 KiB) keep the
    bytes in flight in the CPU caches, which saves CPU per allreduce when ranks share cores
    (3 ranks on 2 cores, 64 MB, C loop: about 10% less than with autotuning), and costs
    throughput when each rank has a core or the ring crosses hosts, where the window must
    cover the path's bandwidth-delay product. So they are used when more members of this ring
    listen on this host than it has cores (`os.cpu_count()`, not this process's affinity: a
    rank pinned to a core of its own has one)."""
    if configured is not None:
        return configured or None
    here = split_addr(peers[rank])[0]
    local = sum(1 for p in peers if _same_host(split_addr(p)[0], here))
    return SHARED_CORES_BUFSIZE if local > (cores or os.cpu_count() or 1) else None
