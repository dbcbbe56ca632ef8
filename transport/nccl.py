"""The nccl backend: CuPy's NCCL binding for CUDA tensors, driven through the device seam.

cupy is an optional extra, reached only through `device.device_api()`, so importing this module
never needs it. Built by ``DataServer.communicator(..., backend="nccl")``, rank 0 makes the unique
id of the (epoch, shard) and hands it to the other ranks over the data server
(``ncclid.StarLinks``), whose links then carry failures between ranks.

What NCCL and CuPy allow, and how this module keeps to it:

* ncclCommInitRank blocks (CuPy offers no non-blocking init): the id hand-off and the init run
  on a helper thread, and the first operation waits at most `timeout`. Since NCCL 2.22 peers are
  connected lazily (``NCCL_RUNTIME_CONNECT=1``), algorithm by algorithm, inside the first host
  call that uses each, waiting for every peer: so this module sets ``NCCL_RUNTIME_CONNECT=0`` at
  import (unless the user set it; NCCL reads it once per process, at its first init), and the
  helper thread runs every kind of collective the communicator uses once before it is handed
  out, which connects them within the bounded init where NCCL read its parameters earlier.
* NCCL forbids concurrent calls on one communicator, and CuPy's ``abort()`` clears its handle only
  after ncclCommAbort returned: every call into the communicator (enqueue, async-error check)
  holds one lock per communicator, and the handle is cleared under it before abort or destroy.
* ncclCommAbort and ncclCommDestroy join NCCL's proxy thread, which waits for the node's other
  ranks (it hangs while one is stopped): they run on a thread of their own, watched
  (`release_bounded`); destroy only when no collective may be stuck (it waits for queued work).
* Collectives are enqueued on the caller's current stream (torch's, so they follow the kernels
  that produced the gradients and precede the optimizer's) and polled, so abort() and timeouts
  work. An event recorded just before the collective starts its clock: compute queued ahead of it
  (a slow first step) does not count against `timeout`. ncclCommGetAsyncError is polled too.
* The (tag, contribute, count, dtype) of every rank is all-gathered and checked before the sum is
  enqueued: NCCL does not check counts, and a mismatch would hang or read out of bounds.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Callable

from .backend import probe_nccl
from .base import Communicator
from .buffers import dtype_name
from .device import DeviceApi, Event, Stream, device_api
from .errors import CommAborted, CommError, CommTimeout, ProtocolMismatch
from .ncclid import KIND_NCCL_ID, StarLinks
from .options import RingOptions
from .wire import KIND_RING, ST_CLOSED, ST_MISMATCH, Hello

__all__ = ["NcclCommunicator", "nccl_available", "nccl_unique_id"]

logger = logging.getLogger(__name__)

UNIQUE_ID_BYTES = 128
_POLL_S = 0.0005
#: ncclCommGetAsyncError is asked at most this often while a collective is polled: it takes the
#: communicator's lock, and a dead peer is also seen through the star links and the timeout
_ASYNC_CHECK_S = 0.01
#: compute queued ahead of a collective may delay its start by this many timeouts before it counts as stuck
_START_FACTOR = 10.0
#: shard number of the TCP ring used instead when the ranks share a device (u32 on the wire)
FALLBACK_SHARD = 1 << 31
_META = 4   # tag, contribute, count, dtype: what every rank all-gathers before the sum
_BCAST_TAG = -(1 << 62)   # first word of a broadcast's check row (an allreduce on another rank sees a tag mismatch)
#: what a rank that closes its communicator tells the others (ncclid links), and how long an
#: operation in flight then has to complete (it may be the last one the closing rank finished)
_CLOSED_REASON = "closed its communicator"
_CLOSE_GRACE_S = 2.0
#: bytes of the warm-up's large allreduce: large enough for NCCL's ring algorithm, where small ones take the tree
WARM_RING_BYTES = 4 << 20
#: seconds ncclCommAbort/ncclCommDestroy may take before the process is taken down (see `release_bounded`)
RELEASE_TIMEOUT_ENV = "P2PFT_NCCL_ABORT_TIMEOUT_S"
DEFAULT_RELEASE_TIMEOUT_S = 60.0
#: exit status of a process taken down because releasing an NCCL communicator hung
EXIT_RELEASE_HUNG = 4

# NCCL data type enum values (nccl.h; the same numbers as cupy.cuda.nccl.NCCL_*).
_NCCL_DTYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}
_NCCL_SUM = 0


def _nccl_mapped() -> bool:
    """Whether a libnccl is already loaded in this process (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            return "libnccl" in f.read()
    except OSError:
        return False


# NCCL reads its parameters once per process, at its first init (param.h), torch's or ours: set
# the connect mode here, at import, so that it holds for every NCCL communicator of the process
# (NCCL then connects peers inside ncclCommInitRank, which p2pft runs on a bounded helper thread).
# Where NCCL was loaded before p2pft (torch's NCCL group first), the warm-up connects instead.
NCCL_LOADED_BEFORE_P2PFT = _nccl_mapped()
os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")


def _eager_connect() -> bool:
    """Whether NCCL connects every algorithm inside init in this process: the connect mode is 0
    and was set before NCCL could have read its parameters."""
    return os.environ.get("NCCL_RUNTIME_CONNECT") == "0" and not NCCL_LOADED_BEFORE_P2PFT


def _other_nccl_in_process() -> bool:
    """Whether torch.distributed runs an NCCL process group in this process (HSDP's FSDP group).
    NCCL's docs call kernels of two communicators on one device unsafe unless ordered: a warm-up
    collective of a communicator set up ahead would run beside that group's collectives."""
    torch = sys.modules.get("torch")
    try:
        dist = torch.distributed  # type: ignore[union-attr]
        return bool(dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower())
    except Exception:  # noqa: BLE001 - no torch, no distributed: no other NCCL user we know of
        return False


def nccl_available() -> bool:
    """True when cupy with NCCL support imports and at least one CUDA device is visible."""
    return probe_nccl().ok


def nccl_unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes) to hand to every rank of a new communicator."""
    uid = device_api().nccl().get_unique_id()  # bytes since CuPy 14, a tuple of C chars before
    return bytes(uid) if isinstance(uid, (bytes, bytearray)) else bytes((int(x) & 0xFF) for x in uid)


def _check_uid(uid: bytes) -> None:
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id must be {UNIQUE_ID_BYTES} bytes, got {len(uid)}")


def new_nccl_comm(nccl: Any, world: int, uid: bytes, rank: int) -> Any:
    """ncclCommInitRank through CuPy 14 (the id as bytes) or CuPy 13 (a tuple of C chars, whose
    signedness is the platform's: signed on x86_64, unsigned on aarch64). CuPy converts the id
    before it calls NCCL, so a TypeError or OverflowError means NCCL was not called yet."""
    try:
        return nccl.NcclCommunicator(world, uid, rank)
    except TypeError:
        pass
    try:
        return nccl.NcclCommunicator(world, tuple(b - 256 if b > 127 else b for b in uid), rank)
    except OverflowError:   # unsigned char
        return nccl.NcclCommunicator(world, tuple(uid), rank)


def release_timeout() -> float | None:
    """`$P2PFT_NCCL_ABORT_TIMEOUT_S` (default 60; 0 or "off": never take the process down)."""
    raw = os.environ.get(RELEASE_TIMEOUT_ENV, "").strip().lower()
    if raw in ("", "default"):
        return DEFAULT_RELEASE_TIMEOUT_S
    if raw in ("0", "off", "none"):
        return None
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"${RELEASE_TIMEOUT_ENV} must be a number of seconds or 'off', got {raw!r}") from None
    if not v > 0:
        raise ValueError(f"${RELEASE_TIMEOUT_ENV} must be > 0 (or 'off'), got {raw!r}")
    return v


def _take_down(what: str, limit: float) -> None:
    """The release of a communicator hung: this process cannot use its device any more (the
    stuck kernels are still queued on its streams), so it exits and its replica restarts."""
    logger.critical("%s has not returned after %g s (a peer process on this node stopped?): taking this "
                    "process down (exit status %d) so that the replica restarts; set $%s to change the limit",
                    what, limit, EXIT_RELEASE_HUNG, RELEASE_TIMEOUT_ENV)
    for h in logging.getLogger().handlers + logger.handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(EXIT_RELEASE_HUNG)


def release_bounded(comm: Any, how: str, what: str, limit: float | None = None,
                    on_hung: Callable[[str, float], None] = _take_down) -> threading.Thread:
    """Run ``comm.abort()`` or ``comm.destroy()`` (`how`) on a thread of its own, watched.

    Real ncclCommAbort and ncclCommDestroy synchronize NCCL's streams and join its proxy
    thread, which waits for the other ranks on the node (NVIDIA/nccl#829, #863): with a peer
    process stopped (SIGSTOP, a debugger) they do not return. Called on the training thread
    they would block it, holding the communicator's lock. So nobody waits for them: the caller
    has already cleared the handle (no other call can reach the communicator), and a watchdog,
    like PyTorch's heartbeat monitor, takes the process down when the release is not done
    within `limit` seconds (`release_timeout()` when None)."""
    limit = release_timeout() if limit is None else limit
    done = threading.Event()

    def run() -> None:
        try:
            getattr(comm, how)()
        except Exception:  # noqa: BLE001
            logger.exception("%s failed", what)
        finally:
            done.set()
    th = threading.Thread(target=run, daemon=True, name="p2pft-nccl-release")
    th.start()
    if limit is not None:
        def watch() -> None:
            if not done.wait(limit):
                on_hung(what, limit)
        threading.Thread(target=watch, daemon=True, name="p2pft-nccl-release-watchdog").start()
    return th


class _Buffer:
    """Pointer, element count, NCCL dtype and device of a device tensor (validated, nothing sent)."""

    def __init__(self, api: DeviceApi, tensor: Any) -> None:
        if not api.is_device_tensor(tensor):
            raise TypeError(f"the nccl backend needs {api.accelerator_type.upper()} tensors, got "
                            f"{type(tensor).__name__} on {getattr(tensor, 'device', '?')}; use the tcp backend "
                            "for host tensors")
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous")
        name = dtype_name(tensor)
        if name not in _NCCL_DTYPES:
            raise TypeError(f"dtype {name} is not supported by NCCL")
        self.tensor = tensor
        self.ptr = int(tensor.data_ptr())
        self.count = int(tensor.numel())
        self.dtype = _NCCL_DTYPES[name]
        self.index = api.device_index(tensor)


def _caller_device() -> int | None:
    try:
        return device_api().current_device()
    except Exception:  # noqa: BLE001 - no device backend: the first operation reports it
        return None


def _int64(values: list[int], like: Any) -> Any:
    import torch

    return torch.tensor(values, dtype=torch.int64, device=like.device)


class NcclCommunicator(Communicator):
    """NCCL communicator of one (epoch, shard).

    Either every rank passes the same 128-byte `uid`, or (`uid=None`, as the DataServer builds
    it) rank 0 makes one with `make_uid` and hands it to the others over `peers`' data servers
    within `connect_timeout`. `on_dead(comm)` runs once the communicator failed or closed.
    With `fallback` (data plane ``auto``: the DataServer's ``communicator``), ranks that turn out
    to share a device use the TCP ring it builds for (epoch, shard + FALLBACK_SHARD) instead;
    without it that is `SharedDevice`.
    """

    hello_kind = KIND_NCCL_ID  # the DataServer routes id connections of this kind to it

    def __init__(self, epoch: int, shard: int, rank: int, world: int, uid: bytes | None = None, *,
                 timeout: float = 30.0, device: int | None = None, peers: list[str] | None = None,
                 options: RingOptions | None = None, connect_timeout: float = 5.0,
                 make_uid: Callable[[], bytes] | None = None,
                 on_dead: Callable[["NcclCommunicator"], None] | None = None,
                 fallback: Callable[..., Communicator] | None = None) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for world {world}")
        if not timeout > 0 or not connect_timeout > 0:
            raise ValueError("timeout and connect_timeout must be > 0")
        if uid is not None:
            _check_uid(uid)
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
        self._fallback = fallback
        #: the TCP ring used instead of NCCL when the ranks share a device (data plane auto)
        self.tcp: Communicator | None = None
        #: the unique id once known (set by the init thread before ncclCommInitRank)
        self.unique_id: bytes | None = self._uid
        self.uid_known = threading.Event()
        star = uid is None and world > 1 and peers is not None
        self._star = (StarLinks(epoch=epoch, shard=shard, rank=rank, peers=list(peers or ()),
                                options=options or RingOptions(), on_error=self._on_star_error) if star else None)
        self._api: DeviceApi | None = None
        # NCCL binds the communicator to the calling thread's current CUDA device, which is
        # per thread: remember the caller's so the init thread can select it.
        self._device = device if device is not None else _caller_device()
        self._lock = threading.Lock()          # this object's state: failed, closed
        self._nccl_lock = threading.Lock()     # every call into the NCCL communicator (NCCL forbids concurrent ones)
        self._failed: CommError | None = None
        self._comm: Any = None
        self._closed = False
        self._inflight = 0                     # operations between their first enqueue and their end
        # Work queued on the device that was not seen to finish: an operation that ended in an
        # error (a failure seen first by another thread, a timeout) leaves its kernel queued, and
        # possibly stuck, after the host call returned. Only abort releases the communicator then.
        self._unfinished = False
        self._init_error: BaseException | None = None
        self._released: threading.Thread | None = None   # the thread running abort/destroy, once started
        self._peer_closed: CommError | None = None   # a peer closed: fail once the operations in flight ended
        self._peer_closed_at = 0.0
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
    def _obtain_uid(self, identity: str) -> tuple[bytes, bool]:
        """The unique id, and whether rank 0 said to use the TCP ring instead (shared device).
        Rank 0 makes the id only once every rank answered (see ncclid): an id starts NCCL's
        bootstrap root, which lives until every rank has reached it."""
        if self._uid is not None:
            return self._uid, False
        deadline = time.monotonic() + self.connect_timeout
        got: bytes | None
        if self._star is None:
            got = self._make_uid()
            if len(got) != UNIQUE_ID_BYTES:
                raise CommError(f"NCCL unique id of {len(got)} bytes, expected {UNIQUE_ID_BYTES}")
        elif self.rank == 0:
            got = self._star.push(self._make_uid, deadline, identity, fallback=self._fallback is not None)
        else:
            got = self._star.receive(deadline, deadline + self.connect_timeout, identity)
        if self._star is not None and got is None:
            # The TCP ring carries failures from here (a rank closing its ring after its last
            # allreduce must not abort a peer still finishing that allreduce).
            self._star.close()
        elif self._star is not None:
            self._star.watch()
        return (got, False) if got is not None else (b"", True)

    def _init(self) -> None:
        t0 = time.monotonic()
        try:
            api = self._api = device_api()
            uid, use_tcp = self._obtain_uid(self._identity(api) if self._star is not None else "")
            if use_tcp:
                if self._fallback is None:
                    raise CommError("rank 0 chose the TCP ring (shared device) but this rank has no fallback "
                                    "(set the same data_plane on every replica)")
                with self._lock:
                    if self._failed is None:
                        self.tcp = self._fallback(self.epoch, self.shard + FALLBACK_SHARD, self.rank,
                                                  list(self._star.peers) if self._star else [],
                                                  timeout=self.timeout, connect_timeout=self.connect_timeout)
                self._init_done.set()
                return
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
        comm = None
        try:
            t_id = time.monotonic()
            os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")   # (set at import already, unless the user chose)
            api.use_device(self._device)
            nccl = api.nccl()
            comm = new_nccl_comm(nccl, self.world, uid, self.rank)
            t_init = time.monotonic()
            if self.world > 1 and not (_eager_connect() and _other_nccl_in_process()):
                self._connect(api, comm)   # else: connected by init, and no kernel beside another NCCL user
            with self._lock:
                if self._failed is None:
                    with self._nccl_lock:
                        self._comm = comm
                    comm = None
                    t_end = time.monotonic()
                    logger.info("nccl communicator epoch=%d shard=%d rank=%d world=%d ready in %.3f s (id hand-off "
                                "%.3f s, ncclCommInitRank %.3f s, connect %.3f s)", self.epoch, self.shard,
                                self.rank, self.world, t_end - t0, t_id - t0, t_init - t_id, t_end - t_init)
        except BaseException as e:  # noqa: BLE001 - reported by the first operation
            self._init_error = e
        finally:
            if comm is not None:  # failed, aborted or closed while we were initialising: ours alone
                self._released = release_bounded(comm, "abort", self._what("ncclCommAbort"))
            self._init_done.set()

    def _identity(self, api: DeviceApi) -> str:
        """This rank's device identity, or "" when there is no device (init then reports it)."""
        try:
            return api.identity(self._device)
        except Exception:  # noqa: BLE001 - no CUDA here: nothing to compare
            return ""

    def _connect(self, api: DeviceApi, comm: Any) -> None:
        """Run every kind of collective the communicator uses once, on a stream of its own, on the
        init thread, before it is published (the caller's wait for init bounds this): with
        ``NCCL_RUNTIME_CONNECT=0`` in effect NCCL connected everything at init and this only
        checks the sum; where NCCL read its parameters before p2pft set it (torch's NCCL first
        in the process, or the user's ``NCCL_RUNTIME_CONNECT=1``) NCCL connects each algorithm
        inside the first host call that uses it, waiting for every peer with no timeout: here,
        not on the training thread under the communicator's lock. The result is copied to the host
        on that stream, not read with ``.item()`` on the default stream (which would wait behind
        the caller's compute)."""
        import torch

        kind = api.accelerator_type
        dev = torch.device(kind, self._device) if kind != "cpu" and self._device is not None else torch.device(kind)
        # No kernel on the caller's stream: empty tensors, filled on the warm-up stream.
        one = torch.empty(1, dtype=torch.int64, device=dev)
        meta = torch.empty(_META, dtype=torch.int64, device=dev)
        rows = torch.empty(_META * self.world, dtype=torch.int64, device=dev)
        big = torch.empty(WARM_RING_BYTES, dtype=torch.uint8, device=dev)
        stream = api.new_stream(one)
        api.copy_async(one, torch.ones(1, dtype=torch.int64), stream)
        for t in (meta, big):
            api.zero_async(t, stream)
        i64, u8 = _NCCL_DTYPES["int64"], _NCCL_DTYPES["uint8"]
        calls: list[Callable[[], None]] = [
            lambda: comm.allGather(meta.data_ptr(), rows.data_ptr(), _META, i64, stream.handle),   # the tag exchange
            lambda: comm.allReduce(big.data_ptr(), big.data_ptr(), WARM_RING_BYTES, u8, _NCCL_SUM, stream.handle),
            lambda: comm.bcast(one.data_ptr(), 1, i64, 0, stream.handle),   # every rank holds 1
            lambda: comm.allReduce(one.data_ptr(), one.data_ptr(), 1, i64, _NCCL_SUM, stream.handle),
        ]
        for call in calls:   # one at a time: each connect waits for every peer's matching call
            call()
            self._wait_stream(stream, comm)
        host = torch.empty(1, dtype=torch.int64)   # pageable: a first pinned allocation may synchronize the device
        api.copy_async(host, one, stream)
        self._wait_stream(stream, comm)
        got = int(host[0])
        if got != self.world:
            raise CommError(f"NCCL warm-up allreduce gave {got}, expected {self.world}")

    def _wait_stream(self, stream: Stream, comm: Any) -> None:
        checked = time.monotonic()
        while not stream.query():
            if self._failed is not None:
                raise self._failed
            if time.monotonic() - checked >= _ASYNC_CHECK_S:
                checked = time.monotonic()
                comm.check_async_error()
            time.sleep(_POLL_S * 4)

    def wait_init(self, timeout: float) -> bool:
        """Whether init (id hand-off, ncclCommInitRank, connect) finished within `timeout`."""
        return self._init_done.wait(timeout)

    @property
    def failed(self) -> CommError | None:
        tcp = self.tcp
        return self._failed or (tcp.failed if tcp is not None else None)

    def _fail(self, err: CommError) -> CommError:
        with self._lock:
            if self._failed is not None:
                return self._failed
            self._failed = err
            tcp = self.tcp
        if tcp is not None:
            tcp.abort(str(err))
        if self._star is not None:  # tell the others first, then drop the links
            self._star.tell(err)
            self._star.close()
        with self._nccl_lock:   # once the handle is cleared no other call can reach the communicator
            comm, self._comm = self._comm, None
        if comm is not None:   # ncclCommAbort: unblocks kernels stuck on a dead peer
            self._released = release_bounded(comm, "abort", self._what("ncclCommAbort"))
        level = logging.INFO if isinstance(err, CommAborted) else logging.WARNING
        logger.log(level, "nccl communicator epoch=%d shard=%d rank=%d failed: %s", self.epoch, self.shard,
                   self.rank, err)
        if self._on_dead is not None:
            self._on_dead(self)
        return err

    def _on_star_error(self, err: CommError) -> None:
        """A verdict from the id links. A peer that closed its communicator has finished every
        collective it entered: one this rank is still in may be that last one, and completes;
        it is failed only once the operations in flight ended, or after a short grace."""
        if isinstance(err, CommAborted) and err.peer_rank is not None and _CLOSED_REASON in err.reason:
            with self._lock:
                if self._inflight > 0 and self._failed is None:
                    if self._peer_closed is None:
                        self._peer_closed, self._peer_closed_at = err, time.monotonic()
                    return
        self._fail(err)

    def _call(self, what: str, fn: Callable[[Any], None]) -> None:
        """One call into the NCCL communicator, under its lock; a failure fails this communicator."""
        err: CommError | None = None
        with self._nccl_lock:
            comm = self._comm
            if comm is None or self._failed is not None:   # never enqueue onto a failed or closing one
                err = self._failed or CommAborted("communicator closed")
            else:
                try:
                    fn(comm)
                except Exception as e:  # noqa: BLE001 - NcclError, CUDA errors
                    err = CommError(f"{what} failed: {e}")
        if err is not None:
            raise self._fail(err)

    def _ready(self, deadline: float) -> None:
        while not self._init_done.wait(_POLL_S * 20):
            if self._failed is not None:
                raise self._failed
            if time.monotonic() > deadline:
                raise self._fail(CommTimeout(f"NCCL init did not finish within {self.timeout:g} s "
                                             "(a peer did not join or connect)"))
        if self._init_error is not None:
            raise self._fail(CommError(f"NCCL init failed: {self._init_error!r}"))
        if self._failed is not None:
            raise self._failed

    def _wait(self, start: Event, end: Event, timeout: float, what: str) -> None:
        """Poll until `end` (the collective and what precedes it on the stream) completed, NCCL
        reports an error, abort, or the collective made no progress for `timeout` from `start`."""
        t0 = checked = time.monotonic()
        started: float | None = None
        while True:
            if end.query():   # finished everywhere it had to: a failure noticed meanwhile is for later ops
                return
            if self._failed is not None:
                raise self._failed
            now = time.monotonic()
            if started is None:
                if start.query():
                    started = now
                elif now - t0 > _START_FACTOR * timeout:
                    raise self._fail(CommTimeout(f"the work queued before {what} did not finish within "
                                                 f"{_START_FACTOR * timeout:g} s"))
            if now - checked >= _ASYNC_CHECK_S:
                checked = now
                self._call(what, lambda c: c.check_async_error())
            if started is not None and now - started > timeout:
                raise self._fail(CommTimeout(f"{what} made no progress within {timeout:g} s"))
            closed = self._peer_closed
            if closed is not None and now - self._peer_closed_at > min(timeout, _CLOSE_GRACE_S):
                raise self._fail(closed)   # not the collective the peer finished before closing
            time.sleep(_POLL_S)

    def _collective(self, stream: Stream, timeout: float, what: str, fn: Callable[[Any], None]) -> None:
        start = stream.record()
        self._unfinished = True
        self._call(what, fn)
        self._wait(start, stream.record(), timeout, what)
        self._unfinished = False

    def allreduce(self, tensor: Any, *, contribute: bool = True, tag: int = 0, timeout: float | None = None) -> int:
        """All-gather (tag, contribute, count, dtype) of every rank and check them; then, unless a
        rank disagrees, zero a joiner's buffer and sum, on the tensor's current stream. Each
        collective is polled (abort, async errors and timeouts work)."""
        api = device_api()
        buf = _Buffer(api, tensor)  # TypeError for a host tensor before anything is enqueued
        self._check_device(buf)
        tag = int(tag)
        if not -(1 << 63) <= tag < (1 << 63):
            raise ValueError(f"tag {tag} does not fit in 64 bits")
        tmo = self.timeout if timeout is None else float(timeout)
        if self._failed is not None:
            raise self._failed
        self._ready(time.monotonic() + tmo)
        if self.tcp is not None:
            return self.tcp.allreduce(tensor, contribute=contribute, tag=tag, timeout=timeout)
        stream = api.current_stream(tensor)
        meta = _int64([tag, 1 if contribute else 0, buf.count, buf.dtype], tensor)
        rows_t = _int64([0] * (_META * self.world), tensor)
        self._begin()
        try:
            self._collective(stream, tmo, "the NCCL tag exchange", lambda c: c.allGather(
                meta.data_ptr(), rows_t.data_ptr(), _META, _NCCL_DTYPES["int64"], stream.handle))
            flat = rows_t.tolist()
            rows = [flat[_META * i:_META * i + _META] for i in range(self.world)]
            self._check_rows(rows, tag, buf)
            if not contribute:
                api.zero_async(tensor, stream)
            self._collective(stream, tmo, "allreduce", lambda c: c.allReduce(
                buf.ptr, buf.ptr, buf.count, buf.dtype, _NCCL_SUM, stream.handle))
        finally:
            self._end()
        return sum(r[1] for r in rows)

    def _check_device(self, buf: _Buffer) -> None:
        """NCCL reads the buffer through the communicator's device: memory of another device is
        an illegal access (or silently another GPU's data over peer access)."""
        if self._device is not None and buf.index is not None and buf.index != self._device:
            raise ValueError(f"the tensor is on device {buf.index}, this NCCL communicator on device "
                             f"{self._device} (build the communicator on the tensor's device)")

    def _begin(self) -> None:
        """Count an operation in flight, atomically with the check that the communicator is
        neither failed nor closed: close() decides between destroy and abort from this count,
        so an operation must not start enqueueing after it looked (destroy would then wait for
        the kernel for ever)."""
        with self._lock:
            if self._failed is not None:
                raise self._failed
            closed = self._peer_closed
            if closed is None:
                self._inflight += 1
        if closed is not None:
            raise self._fail(closed)

    def _end(self) -> None:
        with self._lock:
            self._inflight -= 1
            closed = self._peer_closed if self._inflight == 0 else None
        if closed is not None:
            self._fail(closed)

    def _check_rows(self, rows: list[list[int]], tag: int, buf: _Buffer) -> None:
        for r, (t, _c, n, d) in enumerate(rows):
            if t != tag:
                raise self._fail(ProtocolMismatch(f"tag mismatch: rank {r} has tag {t}, this rank {tag}",
                                                  peer_rank=r, peer_addr=self._peer_addr(r)))
            if (n, d) != (buf.count, buf.dtype):
                raise self._fail(ProtocolMismatch(
                    f"size mismatch: rank {r} reduces {n} elements of NCCL type {d}, this rank {buf.count} "
                    f"of type {buf.dtype}", peer_rank=r, peer_addr=self._peer_addr(r)))

    def _peer_addr(self, r: int) -> str | None:
        return self._star.peers[r] if self._star is not None else None

    def broadcast(self, tensor: Any, root: int, *, timeout: float | None = None) -> None:
        """All-gather (root, count, dtype) of every rank and check them (NCCL does not: a
        mismatch hangs or writes out of bounds), then broadcast on the tensor's current stream."""
        if not 0 <= root < self.world:
            raise ValueError(f"root {root} out of range for world {self.world}")
        api = device_api()
        buf = _Buffer(api, tensor)
        self._check_device(buf)
        tmo = self.timeout if timeout is None else float(timeout)
        if self._failed is not None:
            raise self._failed
        self._ready(time.monotonic() + tmo)
        if self.tcp is not None:
            return self.tcp.broadcast(tensor, root, timeout=timeout)
        stream = api.current_stream(tensor)
        meta = _int64([_BCAST_TAG, root, buf.count, buf.dtype], tensor)
        rows_t = _int64([0] * (_META * self.world), tensor)
        self._begin()
        try:
            self._collective(stream, tmo, "the NCCL broadcast check", lambda c: c.allGather(
                meta.data_ptr(), rows_t.data_ptr(), _META, _NCCL_DTYPES["int64"], stream.handle))
            flat = rows_t.tolist()
            for r in range(self.world):
                t, rt, n, d = flat[_META * r:_META * r + _META]
                if t != _BCAST_TAG or rt != root or (n, d) != (buf.count, buf.dtype):
                    raise self._fail(ProtocolMismatch(
                        f"broadcast mismatch: rank {r} has root {rt}, {n} elements of NCCL type {d} "
                        f"(tag {t}); this rank root {root}, {buf.count} of type {buf.dtype}",
                        peer_rank=r, peer_addr=self._peer_addr(r)))
            self._collective(stream, tmo, "broadcast", lambda c: c.bcast(
                buf.ptr, buf.count, buf.dtype, root, stream.handle))
        finally:
            self._end()

    def abort(self, reason: str) -> None:
        self._fail(CommAborted(f"aborted: {reason}"))

    def _what(self, call: str) -> str:
        return f"{call} of the NCCL communicator epoch={self.epoch} shard={self.shard} rank={self.rank}"

    def wait_released(self, timeout: float) -> bool:
        """Whether the NCCL communicator's abort or destroy (if one was started) has returned."""
        th = self._released
        if th is None:
            return True
        th.join(timeout)
        return not th.is_alive()

    def close(self) -> None:
        """Release the communicator: ncclCommDestroy when it never failed and every collective
        was seen to finish, else ncclCommAbort (destroy waits for queued work, which never ends
        when a collective is stuck; a failure another thread recorded may not have aborted yet,
        and its abort would then wait for our destroy, holding the same lock: a deadlock)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            first = self._failed is None
            if first:
                self._failed = CommAborted("communicator closed")
            idle = first and self._inflight == 0 and not self._unfinished
            tcp = self.tcp
        if tcp is not None:
            tcp.close()
        if self._star is not None:
            if first:
                self._star.tell(CommAborted(_CLOSED_REASON))
            self._star.close()
        if self._on_dead is not None and first:
            self._on_dead(self)
        with self._nccl_lock:
            comm, self._comm = self._comm, None
        if comm is not None:
            how = "destroy" if idle else "abort"
            self._released = release_bounded(comm, how, self._what(f"ncclComm{how.capitalize()}"))
        # The init thread may still be inside ncclCommInitRank (a peer never came): it is a
        # daemon thread and aborts the communicator itself if init ever returns.
        self._init_thread.join(0.1)
