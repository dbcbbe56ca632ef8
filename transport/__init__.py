"""p2pft data plane: communicators (allreduce, broadcast, abort) and state streaming.

Knows nothing of membership: it is handed an epoch, a shard index, a rank and the ordered peer
data addresses. torch is imported lazily, only by functions that need it.
"""

from .base import Communicator
from .errors import CommAborted, CommError, CommTimeout, PeerFailed, ProtocolMismatch, SharedDevice
from .nccl import NcclCommunicator, nccl_available, nccl_unique_id
from .server import DataServer
from .stream import StateSnapshot, fetch_state
from .tcp import DEFAULT_CHUNK_BYTES, TcpCommunicator

__all__ = [
    "CommAborted", "CommError", "CommTimeout", "Communicator", "DataServer", "DEFAULT_CHUNK_BYTES",
    "NcclCommunicator", "PeerFailed", "ProtocolMismatch", "SharedDevice", "StateSnapshot", "TcpCommunicator",
    "fetch_state", "nccl_available", "nccl_unique_id",
]
