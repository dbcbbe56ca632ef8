"""The nccl backend: CuPy's NCCL binding for CUDA tensors.

cupy is an optional extra and is imported lazily, so importing this module never needs it.
Built by ``DataServer.communicator(..., backend="nccl")``, rank 0 makes the unique id of the
(epoch, shard) and hands it to the other ranks over the data server (``ncclid.StarLinks``),
whose links then carry failures between ranks. CuPy exposes only the blocking
ncclCommInitRank, so the id hand-off and the init run on a helper thread and the first
operation waits at most `timeout`; operations are enqueued on the caller's current CUDA stream
(torch's, so they follow the kernels that produced the gradients and precede the optimizer's)
and then polled (so abort() and timeouts work) instead of blocking in CUDA. A failed, aborted or
timed-out communicator is aborted with ncclCommAbort, which frees the GPU kernels.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Callable

from .backend import probe_nccl
from .base import Communicator
from .buffers import dtype_name
from .errors import CommAborted, CommError, CommTimeout, ProtocolMismatch
from .ncclid import KIND_NCCL_ID, StarLinks
from .options import RingOptions
from .wire import KIND_RING, ST_CLOSED, ST_MISMATCH, Hello

__all__ = ["NcclCommunicator", "nccl_available", "nccl_unique_id"]

logger = logging.getLogger(__name__)

UNIQUE_ID_BYTES = 128
_POLL_S = 0.0005

# NCCL data type enum values (nccl.h; the same numbers as cupy.cuda.nccl.NCCL_*).
_NCCL_DTYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}
_NCCL_SUM = 0


def nccl_available() -> bool:
    """True when cupy with NCCL support imports and at least one CUDA device is visible."""
    return probe_nccl().ok


def nccl_unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes) to hand to every rank of a new communicator."""
    from cupy.cuda import nccl

    uid = nccl.get_unique_id()  # bytes since CuPy 14, a tuple of C chars before
    return bytes(uid) if isinstance(uid, (bytes, bytearray)) else bytes((int(x) & 0xFF) for x in uid)


def _uid_tuple(uid: bytes) -> tuple[int, ...]:
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id must be {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
    return tuple(b - 256 if b > 127 else b for b in uid)  # cupy expects C chars


def _current_device() -> int | None:
    try:
        from cupy.cuda import runtime

        return int(runtime.getDevice())
    except Exception:  # noqa: BLE001 - no cupy / no CUDA: the first operation reports it
        return None


class _Device:
    """Pointer, element count, NCCL dtype and stream of a CUDA torch tensor or cupy array."""

    def __init__(self, tensor: Any) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(tensor, torch.Tensor):
            if tensor.device.type != "cuda":
                raise TypeError("the nccl backend needs CUDA tensors; use the tcp backend for CPU tensors")
            if not tensor.is_contiguous():
                raise ValueError("tensor must be contiguous")
            self.ptr = tensor.data_ptr()
            self.count = tensor.numel()
            name = dtype_name(tensor)
            self.stream = torch.cuda.current_stream(tensor.device).cuda_stream
            self.zero = tensor.zero_
            self.kind = "torch"
            self.device = tensor.device
        else:
            import cupy

            if not isinstance(tensor, cupy.ndarray):
                raise TypeError(f"expected a CUDA torch tensor or a cupy array, got {type(tensor).__name__}")
            if not tensor.flags.c_contiguous:
                raise ValueError("array must be C-contiguous")
            self.ptr = tensor.data.ptr
            self.count = tensor.size
            name = tensor.dtype.name
            self.stream = cupy.cuda.get_current_stream().ptr
            self.zero = lambda: tensor.fill(0)
            self.kind = "cupy"
            self.device = None
        if name not in _NCCL_DTYPES:
            raise TypeError(f"dtype {name} is not supported by NCCL")
        self.dtype = _NCCL_DTYPES[name]


class NcclCommunicator(Communicator):
    """NCCL communicator of one (epoch, shard).

    Either every rank passes the same 128-byte `uid`, or (`uid=None`, as the DataServer builds
    it) rank 0 makes one with `make_uid` and hands it to the others over `peers`' data servers
    within `connect_timeout`. `on_dead(comm)` runs once the communicator failed or closed.
    """

    hello_kind = KIND_NCCL_ID  # the DataServer routes id connections of this kind to it

    def __init__(self, epoch: int, shard: int, rank: int, world: int, uid: bytes | None = None, *,
                 timeout: float = 30.0, device: int | None = None, peers: list[str] | None = None,
                 options: RingOptions | None = None, connect_timeout: float = 5.0,
                 make_uid: Callable[[], bytes] | None = None,
                 on_dead: Callable[["NcclCommunicator"], None] | None = None) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for world {world}")
        if not timeout > 0 or not connect_timeout > 0:
            raise ValueError("timeout and connect_timeout must be > 0")
        if uid is not None:
            _uid_tuple(uid)  # validates the length
        elif world > 1 and (peers is None or len(peers) != world):
            raise ValueError("without a uid, the peers' data addresses are needed to hand one out")
        self.epoch = epoch
        self.shard = shard
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._uid = bytes(uid) if uid is not None else None
        self._make_uid = make_uid or nccl_unique_id
        self._on_dead = on_dead
        #: the unique id once known (set by the init thread before ncclCommInitRank)
        self.unique_id: bytes | None = self._uid
        self.uid_known = threading.Event()
        self._star = (StarLinks(epoch=epoch, shard=shard, rank=rank, peers=list(peers), options=options or RingOptions(),
                                on_error=self._fail) if uid is None and world > 1 and peers is not None else None)
        # NCCL binds the communicator to the calling thread's current CUDA device, which is
        # per thread: remember the caller's so the init thread can select it.
        self._device = device if device is not None else _current_device()
        self._lock = threading.Lock()
        self._failed: CommError | None = None
        self._comm: Any = None
        self._closed = False
        self._aborting = threading.Event()
        self._init_error: BaseException | None = None
        self._init_done = threading.Event()
        self._init_thread = threading.Thread(target=self._init, daemon=True,
                                             name=f"p2pft-nccl-init-e{epoch}s{shard}r{rank}")
        self._init_thread.start()

    def __repr__(self) -> str:
        return (f"NcclCommunicator(epoch={self.epoch}, shard={self.shard}, rank={self.rank}, "
                f"world={self.world}, failed={self._failed!r})")

    # ------------------------------------------------------------------ called by the DataServer
    def check_hello(self, h: Hello) -> int:
        if self._failed is not None or self._closed:
            return ST_CLOSED
        return self._star.check_hello(h) if self._star is not None else ST_MISMATCH

    def attach(self, h: Hello, sock: Any) -> None:
        if self._star is not None:
            self._star.attach(h, sock)
        else:
            sock.close()

    def reject_kind(self, h: Hello) -> None:
        """A peer connected with the other backend's handshake: the ranks disagree on the data plane."""
        other = "tcp" if h.kind == KIND_RING else f"kind-{h.kind}"
        self._fail(ProtocolMismatch(f"rank {h.src} uses the {other} data plane, this rank nccl "
                                    "(set the same data_plane on every replica)",
                                    peer_rank=h.src if h.src < self.world else None))

    # ------------------------------------------------------------------ init thread
    def _obtain_uid(self) -> bytes:
        if self._uid is not None:
            return self._uid
        deadline = time.monotonic() + self.connect_timeout
        if self.rank == 0:
            uid = self._make_uid()
            if len(uid) != UNIQUE_ID_BYTES:
                raise CommError(f"NCCL unique id of {len(uid)} bytes, expected {UNIQUE_ID_BYTES}")
            if self._star is not None:
                self._star.push(uid, deadline)
        else:
            assert self._star is not None
            uid = self._star.receive(deadline, deadline + self.connect_timeout)
        if self._star is not None:
            self._star.watch()
        return uid

    def _init(self) -> None:
        try:
            uid = self._obtain_uid()
        except CommError as e:
            self._fail(e)
            self._init_done.set()
            return
        except BaseException as e:  # noqa: BLE001 - reported by the first operation
            self._init_error = e
            self._init_done.set()
            return
        self.unique_id = uid
        self.uid_known.set()
        try:
            import cupy
            from cupy.cuda import nccl

            if self._device is not None:
                cupy.cuda.Device(self._device).use()
            try:
                comm = nccl.NcclCommunicator(self.world, uid, self.rank)   # CuPy >= 14: bytes
            except TypeError:
                comm = nccl.NcclCommunicator(self.world, _uid_tuple(uid), self.rank)
            with self._lock:
                if self._failed is None:
                    self._comm = comm
                    comm = None
            if comm is not None:  # aborted while we were initialising
                comm.abort()
        except BaseException as e:  # noqa: BLE001 - reported by the first operation
            self._init_error = e
        finally:
            self._init_done.set()

    @property
    def failed(self) -> CommError | None:
        return self._failed

    def _fail(self, err: CommError) -> CommError:
        with self._lock:
            if self._failed is not None:
                return self._failed
            self._failed = err
            comm, self._comm = self._comm, None
        self._aborting.set()
        if self._star is not None:  # tell the others first, then drop the links
            self._star.tell(err)
            self._star.close()
        if comm is not None:
            try:
                comm.abort()  # ncclCommAbort: unblocks kernels stuck on a dead peer
            except Exception:  # noqa: BLE001
                logger.exception("ncclCommAbort failed")
        level = logging.INFO if isinstance(err, CommAborted) else logging.WARNING
        logger.log(level, "nccl communicator epoch=%d shard=%d rank=%d failed: %s", self.epoch, self.shard,
                   self.rank, err)
        if self._on_dead is not None:
            self._on_dead(self)
        return err

    def _ready(self, deadline: float) -> Any:
        while not self._init_done.wait(_POLL_S * 20):
            if self._failed is not None:
                raise self._failed
            if time.monotonic() > deadline:
                raise self._fail(CommTimeout(f"ncclCommInitRank did not finish within {self.timeout:g} s "
                                             "(a peer did not join)"))
        if self._init_error is not None:
            raise self._fail(CommError(f"ncclCommInitRank failed: {self._init_error!r}"))
        if self._failed is not None:
            raise self._failed
        return self._comm

    def _wait(self, stream: int, deadline: float, what: str) -> None:
        """Poll the stream until the enqueued collective finished, NCCL reports an error, abort or timeout."""
        from cupy.cuda import runtime

        comm = self._comm
        while True:
            if self._failed is not None:
                raise self._failed
            status = runtime.streamQuery(stream)
            if status == 0:  # cudaSuccess
                return
            if status != 600:  # cudaErrorNotReady
                raise self._fail(CommError(f"CUDA error {status} during {what}"))
            try:
                comm.check_async_error()
            except Exception as e:  # noqa: BLE001
                raise self._fail(CommError(f"NCCL error during {what}: {e}")) from None
            if time.monotonic() > deadline:
                raise self._fail(CommTimeout(f"{what} made no progress within the timeout"))
            time.sleep(_POLL_S)

    def allreduce(self, tensor: Any, *, contribute: bool = True, tag: int = 0, timeout: float | None = None) -> int:
        """Enqueue, on the tensor's current stream and without a host sync in between: an
        allGather of (tag, contribute) of every rank, the zeroing of a joiner's buffer, the sum.
        Then poll until the stream has finished them (the only wait: abort and timeouts work),
        and check the tags; a mismatch fails the communicator naming a mismatching rank."""
        dev = _Device(tensor)  # TypeError for a CPU tensor before cupy is needed
        import cupy

        tag = int(tag)
        if not -(1 << 63) <= tag < (1 << 63):
            raise ValueError(f"tag {tag} does not fit in 64 bits")
        tmo = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + tmo
        if self._failed is not None:
            raise self._failed
        comm = self._ready(deadline)
        device = dev.device.index if dev.device is not None else cupy.cuda.Device().id
        # cupy's copies and allocations on the same device and stream as the collective.
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(dev.stream):
            send = cupy.asarray([tag, 1 if contribute else 0], dtype=cupy.int64)
            recv = cupy.empty(2 * self.world, dtype=cupy.int64)
            try:
                comm.allGather(send.data.ptr, recv.data.ptr, 2, _NCCL_DTYPES["int64"], dev.stream)
                if not contribute:
                    dev.zero()
                comm.allReduce(dev.ptr, dev.ptr, dev.count, dev.dtype, _NCCL_SUM, dev.stream)
            except Exception as e:  # noqa: BLE001
                raise self._fail(CommError(f"ncclAllReduce failed: {e}")) from None
            self._wait(dev.stream, deadline, "allreduce")
            flat = recv.get().tolist()  # the stream is idle: no wait
        rows = [flat[2 * i:2 * i + 2] for i in range(self.world)]
        for r, (t, _c) in enumerate(rows):
            if t != tag:
                raise self._fail(ProtocolMismatch(f"tag mismatch: rank {r} has tag {t}, this rank {tag}",
                                                  peer_rank=r, peer_addr=self._peer_addr(r)))
        return sum(c for _t, c in rows)

    def _peer_addr(self, r: int) -> str | None:
        return self._star.peers[r] if self._star is not None else None

    def broadcast(self, tensor: Any, root: int, *, timeout: float | None = None) -> None:
        if not 0 <= root < self.world:
            raise ValueError(f"root {root} out of range for world {self.world}")
        dev = _Device(tensor)
        tmo = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + tmo
        if self._failed is not None:
            raise self._failed
        comm = self._ready(deadline)
        try:
            comm.bcast(dev.ptr, dev.count, dev.dtype, root, dev.stream)
        except Exception as e:  # noqa: BLE001
            raise self._fail(CommError(f"ncclBcast failed: {e}")) from None
        self._wait(dev.stream, deadline, "broadcast")

    def abort(self, reason: str) -> None:
        self._fail(CommAborted(f"aborted: {reason}"))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            comm = self._comm if self._failed is None else None
            first = self._failed is None
            if first:
                self._failed = CommAborted("communicator closed")
            self._comm = None
        if self._star is not None:
            if first:
                self._star.tell(CommAborted("closed its communicator"))
            self._star.close()
        if self._on_dead is not None:
            self._on_dead(self)
        if comm is not None:
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001
                logger.exception("ncclCommDestroy failed")
        self._aborting.set()
        # The init thread may still be inside ncclCommInitRank (a peer never came): it is a
        # daemon thread and aborts the communicator itself if init ever returns.
        self._init_thread.join(0.1)
