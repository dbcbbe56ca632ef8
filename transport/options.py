"""Settings handed from the DataServer to the modules it drives, as plain frozen dataclasses.

The server keeps its knobs as public attributes (they may be changed between uses); it takes a
snapshot into one of these whenever it creates a communicator or starts a state stream, so the
ring and the stream code never look into the server itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_STATE_CHUNK_BYTES", "ChunkHook", "DonorLimits", "RingOptions"]

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
    #: SO_SNDBUF/SO_RCVBUF of ring sockets; None keeps kernel autotuning.
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
