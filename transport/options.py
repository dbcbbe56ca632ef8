"""Settings handed from the DataServer to the modules it drives, as plain frozen dataclasses.

The server keeps its knobs as public attributes (they may be changed between uses); it takes a
snapshot into one of these whenever it creates a communicator or starts a state stream, so the
ring and the stream code never look into the server itself.
"""

from __future__ import annotations

import os

from dataclasses import dataclass
from typing import Callable

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_STATE_CHUNK_BYTES", "RING_BUFSIZE_ENV", "ChunkHook", "DonorLimits",
           "RingOptions", "ring_bufsize_from_env"]

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
    #: SO_SNDBUF/SO_RCVBUF of ring sockets; None keeps kernel autotuning (see
    #: ring_bufsize_from_env).
    sock_bufsize: int | None = None
    #: Let the receiving thread write a frame itself when the socket has room (see docs).
    inline_send: bool = True
    #: Cluster secret for the handshake MAC; None: unauthenticated.
    secret: bytes | None = None
    #: Listen IP of this process's DataServer: the source of outgoing ring connections
    #: (see wire.source_address for when it is used).
    source_host: str | None = None


@dataclass(frozen=True)
class DonorLimits:
    """Bounds of one state stream served by a donor."""

    #: Seconds without progress before a stream to a stalled joiner is dropped.
    timeout: float = 60.0
    #: bytes/s cap of this donor (None: unlimited); the joiner may ask for a lower one.
    rate_limit: float | None = None
    chunk_bytes: int = DEFAULT_STATE_CHUNK_BYTES
    chunk_hook: ChunkHook | None = None


RING_BUFSIZE_ENV = "P2PFT_RING_BUFSIZE"


def ring_bufsize_from_env() -> int | None:
    """$P2PFT_RING_BUFSIZE in bytes (None when unset or empty: kernel autotuning).

    Small ring socket buffers (256 KiB) keep the bytes in flight in the CPU caches: less CPU
    per allreduce when ranks share cores (3 ranks on 2 cores, 64 MB, C loop: 34-35 ms against
    37-38 with autotuning and Gloo's 39),
    less throughput when each rank has a core and across hosts, where the window must cover the
    path's bandwidth-delay product. Hence a setting for oversubscribed hosts, not the default."""
    raw = os.environ.get(RING_BUFSIZE_ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{RING_BUFSIZE_ENV}={raw!r}: expected a size in bytes, e.g. 262144") from None
    if n < 4096:
        raise ValueError(f"{RING_BUFSIZE_ENV}={n}: needs at least 4096 bytes")
    return n
