"""The nccl backend: CuPy's NCCL binding for CUDA tensors.

cupy is an optional extra and is imported lazily, so importing this module never needs it.
CuPy exposes only the blocking ncclCommInitRank, so the communicator is initialised on a helper
thread and the caller waits at most `timeout`; operations are enqueued on the caller's current
CUDA stream and then polled (so abort() and timeouts work) instead of blocking in CUDA.
A failed or timed-out communicator is aborted with ncclCommAbort, which frees the GPU kernels.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from .base import Communicator
from .errors import CommAborted, CommError, CommTimeout, ProtocolMismatch

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
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - ImportError, or a broken CUDA install
        return False
    try:
        return bool(getattr(nccl, "available", True)) and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


def nccl_unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes) to hand to every rank of a new communicator."""
    from cupy.cuda import nccl

    return bytes((int(x) & 0xFF) for x in nccl.get_unique_id())


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
            name = str(tensor.dtype).removeprefix("torch.")
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
    """NCCL communicator of one (epoch, shard); every rank passes the same `uid`."""

    def __init__(self, epoch: int, shard: int, rank: int, world: int, uid: bytes, *, timeout: float = 30.0,
                 device: int | None = None) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for world {world}")
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        self.epoch = epoch
        self.shard = shard
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self._uid = _uid_tuple(uid)
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

    def _init(self) -> None:
        try:
            import cupy
            from cupy.cuda import nccl

            if self._device is not None:
                cupy.cuda.Device(self._device).use()
            comm = nccl.NcclCommunicator(self.world, self._uid, self.rank)
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
        if comm is not None:
            try:
                comm.abort()  # ncclCommAbort: unblocks kernels stuck on a dead peer
            except Exception:  # noqa: BLE001
                logger.exception("ncclCommAbort failed")
        logger.warning("nccl communicator epoch=%d shard=%d rank=%d failed: %s", self.epoch, self.shard, self.rank, err)
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

    def _exchange_small(self, comm: Any, values: list[int], stream: int, deadline: float, dev: _Device) -> list[list[int]]:
        """allGather a few int64 per rank (tags, contribution flags) so every rank can name a mismatching peer."""
        import cupy

        device = dev.device.index if dev.device is not None else cupy.cuda.Device().id
        # Same device and same stream as the tensor, so the copies are ordered with the collective.
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream):
            send = cupy.asarray(values, dtype=cupy.int64)
            recv = cupy.empty(len(values) * self.world, dtype=cupy.int64)
            comm.allGather(send.data.ptr, recv.data.ptr, len(values), _NCCL_DTYPES["int64"], stream)
            self._wait(stream, deadline, "tag exchange")
            flat = recv.get().tolist()
        k = len(values)
        return [flat[i * k:(i + 1) * k] for i in range(self.world)]

    def allreduce(self, tensor: Any, *, contribute: bool = True, tag: int = 0, timeout: float | None = None) -> int:
        dev = _Device(tensor)
        tmo = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + tmo
        if self._failed is not None:
            raise self._failed
        comm = self._ready(deadline)
        rows = self._exchange_small(comm, [int(tag), 1 if contribute else 0], dev.stream, deadline, dev)
        for r, (t, _c) in enumerate(rows):
            if t != int(tag):
                raise self._fail(ProtocolMismatch(f"tag mismatch: rank {r} has tag {t}, this rank {tag}", peer_rank=r))
        if not contribute:
            dev.zero()
        try:
            comm.allReduce(dev.ptr, dev.ptr, dev.count, dev.dtype, _NCCL_SUM, dev.stream)
        except Exception as e:  # noqa: BLE001
            raise self._fail(CommError(f"ncclAllReduce failed: {e}")) from None
        self._wait(dev.stream, deadline, "allreduce")
        return sum(c for _t, c in rows)

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
            if self._failed is None:
                self._failed = CommAborted("communicator closed")
            self._comm = None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001
                logger.exception("ncclCommDestroy failed")
        self._aborting.set()
        # The init thread may still be inside ncclCommInitRank (a peer never came): it is a
        # daemon thread and aborts the communicator itself if init ever returns.
        self._init_thread.join(0.1)
