"""The nccl backend: CuPy's NCCL binding (or libnccl through ctypes) for CUDA tensors, driven
through the device seam.

cupy is an optional extra, reached only through `device.device_api()`, so importing this module
never needs it. Built by ``DataServer.communicator(..., backend="nccl")``, rank 0 makes the unique
id of the (epoch, shard) and hands it to the other ranks over the data server
(``ncclid.StarLinks``), whose links then carry failures between ranks.

What NCCL and CuPy allow, and how this module keeps to it:

* Init can be cancelled only on a non-blocking communicator (``ncclCommInitRankConfig`` with
  ``blocking=0``, NCCL >= 2.14), which CuPy cannot make: the device seam makes one through ctypes
  on the libnccl CuPy loaded (`ncclapi`), the init thread polls ``ncclCommGetAsyncError`` and
  aborts it when the communicator fails or its init deadline passes. Where that is not possible
  (`DeviceApi.nccl_nonblocking` is None) CuPy's blocking init runs, and an init still blocked
  `release_timeout()` seconds after its deadline (a peer lost between "go" and its init: NCCL's
  bootstrap waits for it for ever) takes the process down (exit status 4) for its launcher to
  restart it. NCCL's bootstrap root (a thread of rank 0's, started by ncclGetUniqueId) cannot be
  cancelled at all: one stays per id whose ranks never all arrived.
* Peers are connected lazily since NCCL 2.22 (``NCCL_RUNTIME_CONNECT=1``), algorithm by
  algorithm (ring, tree, PAT, NVLS, NVLS-tree, CollNet), inside the first call that uses each,
  waiting for every peer. This module sets ``NCCL_RUNTIME_CONNECT=0`` at import (unless the user
  set it; NCCL reads it once per process, at its first init): init then connects everything.
  Where NCCL may have read its parameters before (another NCCL user initialised first), the
  init thread runs every collective the communicator uses once, and allreduces over a ladder of
  sizes up to `warm_max_bytes()`, so that the algorithms NCCL picks for gradient sizes connect
  within the bounded set-up. On a non-blocking communicator a connect left for later returns
  ``ncclInProgress`` and is polled with a timeout; only CuPy's blocking one blocks in the call.
* NCCL forbids concurrent calls on one communicator: every call (enqueue, async-error check)
  holds one lock per communicator. Abort is the exception NCCL designs for (see
  `release_bounded`): the handle is cleared under the state lock, so abort, close and the star
  watcher never wait for a call in progress.
* Calls on two communicators of one device are not to run at once, and an init's device work
  beside a spinning kernel may wait for it: a communicator's set-up (init, warm-up) starts only
  when no collective runs on its device, and holds the device's set-up turn until its init
  thread is gone; a collective that finds a set-up running waits for it a while, then makes it
  yield (aborts it: a communicator set up ahead is rebuilt when the attempt needs it).
* ncclCommAbort and ncclCommDestroy join NCCL's proxy thread, which waits for the node's other
  ranks (it hangs while one is stopped): they run on a thread of their own, watched
  (`release_bounded`); destroy only when no collective may be stuck (it waits for queued work).
* Collectives are enqueued on the caller's current stream (torch's, so they follow the kernels
  that produced the gradients and precede the optimizer's) and polled, so abort() and timeouts
  work. An event recorded just before the collective starts its clock: compute queued ahead of it
  (a slow first step) does not count against `timeout`. ncclCommGetAsyncError is polled too.
  Nothing in the path waits for the device on the host: the (tag, contribute, count, dtype) rows
  go through pinned host and device buffers of the communicator, copied asynchronously on the
  stream (a ``torch.tensor(..., device=cuda)`` copies from pageable memory, which makes the host
  wait for all the work queued on the stream, without bound and without abort).
* The (tag, contribute, count, dtype) of every rank is all-gathered and checked before the sum is
  enqueued: NCCL does not check counts, and a mismatch would hang or read out of bounds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator

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
#: bytes of the largest allreduce of the warm-up's ladder (where NCCL may connect lazily)
WARM_MAX_ENV = "P2PFT_NCCL_WARM_MAX_BYTES"
DEFAULT_WARM_MAX_BYTES = 64 << 20
#: seconds ncclCommAbort/ncclCommDestroy may take before the process is taken down (see `release_bounded`)
RELEASE_TIMEOUT_ENV = "P2PFT_NCCL_ABORT_TIMEOUT_S"
DEFAULT_RELEASE_TIMEOUT_S = 60.0
#: exit status of a process taken down because releasing (or a blocking init of) an NCCL communicator hung
EXIT_RELEASE_HUNG = 4
#: a collective waits this long for a set-up running on its device before making it yield
SETUP_YIELD_S = 2.0
#: a release waits this long for a call in progress to leave before aborting beside it
_ABORT_GRACE_S = 0.2
#: the set-up turn waits this long for the abort of a failed set-up before handing the device on
_SETUP_RELEASE_WAIT_S = 5.0
_NCCL_IN_PROGRESS = 7   # ncclResult_t ncclInProgress

# NCCL data type enum values (nccl.h; the same numbers as cupy.cuda.nccl.NCCL_*).
_NCCL_DTYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}
_NCCL_SUM = 0


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


# NCCL reads its parameters once per process, at its first communicator init (torch's or ours),
# not when libnccl is loaded (a CUDA torch loads it at import, so "loaded" says nothing). Set the
# connect mode here, at import, so that it holds for every NCCL communicator of the process
# (NCCL then connects peers inside init, which p2pft bounds). Only an NCCL user that may have
# initialised before this import (torch's NCCL process group) can have made NCCL read it earlier;
# then the warm-up connects instead.
NCCL_PARAMS_READ_BEFORE_P2PFT = _other_nccl_in_process()
os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")


def _eager_connect() -> bool:
    """Whether NCCL connects every algorithm inside init in this process: the connect mode is 0
    and was set before NCCL could have read its parameters."""
    return os.environ.get("NCCL_RUNTIME_CONNECT") == "0" and not NCCL_PARAMS_READ_BEFORE_P2PFT


def warm_max_bytes() -> int:
    """`$P2PFT_NCCL_WARM_MAX_BYTES`: the largest allreduce of the warm-up's ladder (default 64 MiB)."""
    raw = os.environ.get(WARM_MAX_ENV, "").strip()
    try:
        v = int(raw) if raw else DEFAULT_WARM_MAX_BYTES
    except ValueError:
        raise ValueError(f"${WARM_MAX_ENV} must be a number of bytes, got {raw!r}") from None
    return max(8, v)


def warm_ladder(max_bytes: int) -> list[int]:
    """Byte sizes of the warm-up's float32 allreduces where NCCL may connect lazily: every eighth
    power of two from 8 bytes, and `max_bytes`. NCCL picks an algorithm per size (tree, NVLS-tree,
    ring, NVLS, CollNet in turn as sizes grow): one allreduce per band connects each."""
    sizes = [1 << s for s in range(3, max_bytes.bit_length(), 3) if (1 << s) < max_bytes]
    return sizes + [max_bytes - max_bytes % 4 or 4]


class _DeviceTurn:
    """Who uses one device's NCCL now: collectives of ready communicators, or one communicator's
    set-up (init and warm-up), never both. NCCL: operations on independent communicators of one
    device are not to be issued in parallel, and communicators are used at different times; an
    init's allocations may also wait for a kernel spinning on a peer."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.collectives = 0
        self.setup: "NcclCommunicator | None" = None
        self.warned = False

    @contextlib.contextmanager
    def setting_up(self, comm: "NcclCommunicator", deadline: float, insist: bool) -> Iterator[None]:
        """Hold the device for `comm`'s set-up: once no collective runs and no other set-up does.
        A set-up that can be cancelled gives up when `comm` fails or `deadline` passes; one that
        cannot (`insist`: CuPy's blocking init, whose peers are already blocked in theirs and
        are released only when every rank has called it) takes the device at the deadline."""
        err: CommError | None = None
        with self.cv:
            while self.collectives or self.setup is not None:
                left = deadline - time.monotonic()
                if not insist and comm._failed is not None:
                    err = comm._failed
                    break
                if left <= 0:
                    if insist:
                        logger.warning("the set-up of %r runs beside other NCCL work on its device (blocking init)",
                                       comm)
                        break
                    err = CommTimeout("the device did not become free of other NCCL work for this communicator's "
                                      "set-up in time")
                    break
                self.cv.wait(min(left, 0.02))
            if err is None:
                self.setup = comm
        if err is not None:
            raise comm._fail(err)
        try:
            yield
        finally:
            with self.cv:
                if self.setup is comm:
                    self.setup = None
                self.cv.notify_all()

    def enter(self, comm: "NcclCommunicator", bound: float) -> None:
        """A collective of `comm` starts. A set-up running on the device gets `SETUP_YIELD_S`
        to finish; then one that can be cancelled is made to yield (it is aborted, and the
        collective waits for it to be gone, at most `bound` seconds in all), and one that cannot
        (CuPy's blocking init: failing it would strand its peers in theirs) is run beside."""
        t0 = time.monotonic()
        asked = False
        while True:
            with self.cv:
                holder = self.setup
                if holder is None or holder is comm:
                    self.collectives += 1
                    return
                waited = time.monotonic() - t0
                if waited > bound or (waited >= SETUP_YIELD_S and not holder.cancellable):
                    if not self.warned:
                        self.warned = True
                        logger.warning("an NCCL collective runs beside the set-up of %r (%s)", holder,
                                       "blocking init" if not holder.cancellable else "it did not yield in time")
                    self.collectives += 1
                    return
                if waited < SETUP_YIELD_S or asked:
                    self.cv.wait(0.02)
                    continue
            asked = True
            holder._fail(CommAborted("its set-up yielded to a collective of another communicator on the device "
                                     "(it is built again when needed)"))

    def leave(self) -> None:
        with self.cv:
            self.collectives -= 1
            self.cv.notify_all()


_turns: dict[int | None, _DeviceTurn] = {}
_turns_lock = threading.Lock()


def _device_turn(index: int | None) -> _DeviceTurn:
    with _turns_lock:
        t = _turns.get(index)
        if t is None:
            t = _turns[index] = _DeviceTurn()
        return t


class _MetaPool:
    """Pinned host slices for the check rows, from slabs allocated once per process: a pinned
    allocation synchronizes the device implicitly (later work on any stream waits for all
    earlier work, a stuck collective included), so it must not happen per communicator."""

    SLICE = 4096   # meta + rows of up to 127 ranks
    PER_SLAB = 16

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: list[Any] = []
        # given back while a copy or kernel may still use them: (host slice, last event, device
        # buffer kept alive with it, so that the caching allocator cannot hand it out meanwhile)
        self.parked: list[tuple[Any, Event, Any]] = []

    def take(self, api: DeviceApi, nbytes: int) -> Any:
        if nbytes > self.SLICE:
            return api.pinned(nbytes)
        with self.lock:
            self._reclaim()
            if self.free:
                return self.free.pop()
        slab = api.pinned(self.SLICE * self.PER_SLAB)
        slices = [slab[i * self.SLICE:(i + 1) * self.SLICE] for i in range(self.PER_SLAB)]
        with self.lock:
            self.free.extend(slices[1:])
        return slices[0]

    def give(self, buf: Any, last: Event | None, keep: Any = None) -> None:
        with self.lock:
            self._reclaim()
            if last is not None and not last.query():
                self.parked.append((buf, last, keep))
            elif int(buf.numel()) == self.SLICE:
                self.free.append(buf)

    def _reclaim(self) -> None:
        done = [b for b, e, _k in self.parked if e.query()]
        if done:
            self.parked = [(b, e, k) for b, e, k in self.parked if not e.query()]
            self.free.extend(b for b in done if int(b.numel()) == self.SLICE)


_META_POOL = _MetaPool()


class _MetaRows:
    """A communicator's (tag, contribute, count, dtype) row and every rank's, in pinned host and
    device memory (``[row | rows of ranks 0..world-1]`` as int64), copied asynchronously."""

    def __init__(self, api: DeviceApi, world: int, device: Any) -> None:
        import torch

        n = _META * (1 + world)
        self.n = n
        self.raw = _META_POOL.take(api, 8 * n)
        self.host = self.raw[:8 * n].view(torch.int64)
        self.dev = torch.empty(n, dtype=torch.int64, device=device)   # no kernel on the caller's stream
        self.last: Event | None = None   # the last copy from or into `host`

    @property
    def mine(self) -> int:
        return int(self.dev.data_ptr())

    @property
    def rows(self) -> int:
        return int(self.dev.data_ptr()) + 8 * _META

    def wait_free(self, alive: Callable[[], None], deadline: float) -> None:
        """The last copy that used the host buffer finished (it always has, unless an operation
        ended in an error; polled, never a host sync)."""
        ev = self.last
        while ev is not None and not ev.query():
            alive()
            if time.monotonic() > deadline:
                raise CommTimeout("the last copy of the NCCL check row did not finish")
            time.sleep(_POLL_S)

    def put(self, api: DeviceApi, values: list[int], stream: Stream) -> None:
        """This rank's row up to the device, after what `stream` has queued."""
        for i, v in enumerate(values):
            self.host[i] = int(v)
        api.copy_async(self.dev[:_META], self.host[:_META], stream)
        self.last = stream.record()

    def fetch(self, api: DeviceApi, stream: Stream, count: int, start: int = _META) -> None:
        """`count` values from the device buffer at `start` down to the host buffer's rows."""
        api.copy_async(self.host[_META:_META + count], self.dev[start:start + count], stream)
        self.last = stream.record()

    def release(self) -> None:
        _META_POOL.give(self.raw, self.last, keep=self.dev)


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
    """The release (or a blocking init) of a communicator hung: this process cannot use its device
    any more (stuck kernels or a stuck init thread), so it exits and its replica restarts."""
    logger.critical("%s has not returned after %g s (a peer process on this node stopped, or a peer was lost "
                    "during init?): taking this process down (exit status %d) so that the replica restarts; "
                    "set $%s to change the limit", what, limit, EXIT_RELEASE_HUNG, RELEASE_TIMEOUT_ENV)
    for h in logging.getLogger().handlers + logger.handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(EXIT_RELEASE_HUNG)


def release_bounded(comm: Any, how: str, what: str, limit: float | None = None,
                    on_hung: Callable[[str, float], None] = _take_down,
                    lock: threading.Lock | None = None) -> threading.Thread:
    """Run ``comm.abort()`` or ``comm.destroy()`` (`how`) on a thread of its own, watched.

    Real ncclCommAbort and ncclCommDestroy synchronize NCCL's streams and join its proxy
    thread, which waits for the other ranks on the node (NVIDIA/nccl#829, #863): with a peer
    process stopped (SIGSTOP, a debugger) they do not return. Called on the training thread
    they would block it. So nobody waits for them: the caller has already cleared the handle (no
    new call can reach the communicator), and a watchdog, like PyTorch's heartbeat monitor, takes
    the process down when the release is not done within `limit` seconds (`release_timeout()`
    when None; the communicator passes the value it read when it was built).

    `lock` is the communicator's call lock. The release first waits a short grace for a call in
    progress to leave (a call that returns soon must not race the free); a call still inside
    NCCL after it is blocked there (a lazy connect waiting for a lost peer, on a blocking
    communicator) and only an abort can end it: ncclCommAbort first raises the communicator's
    abort flag, which every host-side wait in NCCL polls (bootstrap, connect, proxy, group launch),
    and that is how such a call returns; PyTorch's watchdog aborts from its own thread while the
    training thread is in a call the same way. So the abort then runs beside it, and nothing else
    (abort, close, the star watcher) ever waits for the call lock."""
    limit = release_timeout() if limit is None else limit
    done = threading.Event()

    def run() -> None:
        got = lock.acquire(timeout=_ABORT_GRACE_S) if lock is not None else False
        try:
            getattr(comm, how)()
        except Exception:  # noqa: BLE001
            logger.exception("%s failed", what)
        finally:
            if got and lock is not None:
                lock.release()
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
        # Read once, here: a malformed value is one clear error before anything exists, never
        # one raised while a failing communicator is released (its handle already cleared).
        self._release_limit = release_timeout()
        self._warm_max = warm_max_bytes()
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
        self._lock = threading.Lock()          # this object's state: failed, closed, the handle
        self._nccl_lock = threading.Lock()     # every call into the NCCL communicator (NCCL forbids concurrent ones)
        self._turn = _device_turn(self._device)
        #: whether a set-up in progress ends when this communicator fails (all but CuPy's blocking init)
        self.cancellable = True
        self._failed: CommError | None = None
        self._comm: Any = None
        self._setup_comm: Any = None           # the communicator being set up, until published
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
        self._meta: _MetaRows | None = None
        self._meta_error: BaseException | None = None
        self._take_meta()
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

    def _take_meta(self) -> None:
        """The pinned and device buffers of the check rows, made on the caller's thread before
        anything else of this communicator is queued (the pool rarely allocates; see _MetaPool)."""
        try:
            api = device_api()
            if api.name == "cuda":
                import torch
                if not torch.cuda.is_available():
                    return
            self._meta = _MetaRows(api, self.world, self._torch_device(api))
        except Exception as e:  # noqa: BLE001 - no device here: the first operation reports it
            self._meta_error = e

    def _torch_device(self, api: DeviceApi) -> Any:
        import torch

        kind = api.accelerator_type
        return torch.device(kind, self._device) if kind != "cpu" and self._device is not None else torch.device(kind)

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _init(self) -> None:
        try:
            self._init_body()
        finally:
            self._init_done.set()
            self._give_back_meta()

    def _init_body(self) -> None:
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
                return
        except CommError as e:
            self._fail(e)
            return
        except BaseException as e:  # noqa: BLE001 - reported by the first operation
            self._init_error = e
            return
        self.unique_id = uid
        self.uid_known.set()
        deadline = time.monotonic() + self.connect_timeout + self.timeout
        try:
            nb = api.nccl_nonblocking()
            self.cancellable = nb is not None
            # The device's set-up turn is held until this thread is done with NCCL: a failed
            # set-up's abort (which ends its kernels and its init) included.
            with self._turn.setting_up(self, deadline, insist=nb is None):
                self._set_up(api, nb, uid, deadline, t0)
        except BaseException as e:  # noqa: BLE001 - reported by the first operation
            self._init_error = e
        finally:
            self.cancellable = True

    def _set_up(self, api: DeviceApi, nb: Any, uid: bytes, deadline: float, t0: float) -> None:
        """Init and warm-up, under the device's set-up turn. The communicator being set up is
        `_setup_comm` until it is published: whoever takes it from there (this thread when the
        set-up ends unpublished, `_fail` or `close` meanwhile) aborts it, before the turn is
        given back."""
        try:
            t_id = time.monotonic()
            os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")   # (set at import already, unless the user chose)
            api.use_device(self._device)
            comm = self._new_comm(api, nb, uid, deadline)
            self.cancellable = True   # the warm-up ends when this communicator fails
            t_init = time.monotonic()
            if self.world > 1 and not (_eager_connect() and _other_nccl_in_process()):
                self._raise_if_failed()
                self._warm_up(api, comm, deadline)   # else: connected by init, and no kernel beside another NCCL user
            with self._lock:
                if self._failed is None and self._setup_comm is comm:
                    self._comm, self._setup_comm = comm, None
                    t_end = time.monotonic()
                    logger.info("nccl communicator epoch=%d shard=%d rank=%d world=%d ready in %.3f s (id hand-off "
                                "%.3f s, init %.3f s, warm-up %.3f s)", self.epoch, self.shard, self.rank, self.world,
                                t_end - t0, t_id - t0, t_init - t_id, t_end - t_init)
        finally:
            with self._lock:
                left, self._setup_comm = self._setup_comm, None
            if left is not None:   # failed, aborted or closed while we were setting up
                self._released = release_bounded(left, "abort", self._what("ncclCommAbort"), self._release_limit,
                                                 lock=self._nccl_lock)
            released = self._released
            if released is not None:   # whoever aborted it: the device is handed on once it is gone
                released.join(_SETUP_RELEASE_WAIT_S)

    def _new_comm(self, api: DeviceApi, nb: Any, uid: bytes, deadline: float) -> Any:
        """A ready NCCL communicator: non-blocking init (`nb`) polled until done (aborted when this
        communicator fails or `deadline` passes), or CuPy's blocking init, watched."""
        if nb is not None:
            comm = nb.init(self.world, uid, self.rank)
            with self._lock:
                self._setup_comm = comm
            self._settle(comm, deadline, "ncclCommInitRankConfig")
            return comm
        returned = threading.Event()
        limit = self._release_limit
        if limit is not None:
            bound = max(0.0, deadline - time.monotonic()) + limit

            def watch() -> None:   # a lost peer leaves ncclCommInitRank blocked for ever: bounded here
                if not returned.wait(bound):
                    _take_down(self._what("ncclCommInitRank"), bound)
            threading.Thread(target=watch, daemon=True, name="p2pft-nccl-init-watchdog").start()
        try:
            comm = new_nccl_comm(api.nccl(), self.world, uid, self.rank)
        finally:
            returned.set()
        with self._lock:
            self._setup_comm = comm
        return comm

    def _lock_calls(self, what: str, deadline: float) -> None:
        """Take the call lock; a failure (whose abort may hold the lock) or `deadline` ends the wait."""
        while not self._nccl_lock.acquire(timeout=_ASYNC_CHECK_S):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise self._fail(CommTimeout(f"{what}: another call into the NCCL communicator did not return"))

    def _setup_call(self, comm: Any, fn: Callable[[Any], Any]) -> Any:
        """A call into the communicator being set up, under the call lock, while it is still ours
        (`_fail` or `close` may have taken it to abort it)."""
        self._lock_calls("a call into the NCCL communicator being set up", time.monotonic() + self.timeout)
        try:
            with self._lock:
                ours = self._setup_comm is comm
            if not ours:
                raise self._failed or CommAborted("communicator closed")
            return fn(comm)
        finally:
            self._nccl_lock.release()

    def _settle(self, comm: Any, deadline: float, what: str, locked: bool = False) -> None:
        """Poll a non-blocking communicator until its last call is no longer in progress; fail
        this communicator on an error, a failure seen meanwhile, or `deadline`. `locked`: the
        caller holds the call lock (a published communicator), else each poll takes it."""
        while True:
            st = comm.async_error() if locked else self._setup_call(comm, lambda c: c.async_error())
            if st == 0:
                return
            if st != _NCCL_IN_PROGRESS:
                raise self._fail(CommError(f"{what} failed: NCCL error {st}"))
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise self._fail(CommTimeout(f"{what} did not finish in time (a peer did not join or connect)"))
            time.sleep(_POLL_S * 4)

    def _identity(self, api: DeviceApi) -> str:
        """This rank's device identity, or "" when there is no device (init then reports it)."""
        try:
            return api.identity(self._device)
        except Exception:  # noqa: BLE001 - no CUDA here: nothing to compare
            return ""

    def _warm_up(self, api: DeviceApi, comm: Any, deadline: float) -> None:
        """Run every kind of collective the communicator uses once, on the device's warm-up
        stream, on the init thread, before it is published (its deadline bounds this): with
        ``NCCL_RUNTIME_CONNECT=0`` in effect NCCL connected everything at init and this only
        checks the sum; where NCCL read its parameters before p2pft set it (another NCCL user
        first, or the user's ``NCCL_RUNTIME_CONNECT=1``) NCCL connects each algorithm inside the
        first call that uses it, waiting for every peer: here, within the set-up, for the tag
        exchange, the broadcast and allreduces over a ladder of sizes (NCCL picks the algorithm
        per size). The sum is read back through the pinned row, never with a host sync."""
        import torch

        meta = self._meta
        if meta is None:
            raise CommError(f"no device buffers for the NCCL check rows: {self._meta_error!r}")
        dev = self._torch_device(api)
        one = meta.dev[:1]   # meta.dev is scratch until the first collective: no kernel on the caller's stream
        stream = api.own_stream(one, "warmup")
        meta.put(api, [1, 0, 0, 0], stream)
        i64, f32 = _NCCL_DTYPES["int64"], _NCCL_DTYPES["float32"]
        calls: list[Callable[[Any], None]] = [
            lambda c: c.allGather(meta.mine, meta.rows, _META, i64, stream.handle),   # the tag exchange
            lambda c: c.bcast(meta.mine, 1, i64, 0, stream.handle),                   # every rank holds 1
            lambda c: c.allReduce(meta.mine, meta.mine, 1, i64, _NCCL_SUM, stream.handle),
        ]
        ladder: list[Any] = []   # float32 zeros: NCCL's NVLS algorithms sum floats, not bytes
        if not _eager_connect():
            sizes = warm_ladder(self._warm_max)
            ladder.append(torch.empty(max(sizes) // 4, dtype=torch.float32, device=dev))
            api.zero_async(ladder[0], stream)
            ptr = int(ladder[0].data_ptr())

            def ladder_step(n: int) -> Callable[[Any], None]:
                return lambda c: c.allReduce(ptr, ptr, n // 4, f32, _NCCL_SUM, stream.handle)
            calls += [ladder_step(n) for n in sizes]
        for call in calls:   # one at a time: each connect waits for every peer's matching call
            self._setup_call(comm, call)
            if getattr(comm, "nonblocking", False):
                self._settle(comm, deadline, "an NCCL warm-up collective")
            self._wait_stream(stream, comm, deadline)
        meta.fetch(api, stream, 1, start=0)
        self._wait_stream(stream, comm, deadline)
        got = int(meta.host[_META])
        ladder.clear()
        if got != self.world:
            raise CommError(f"NCCL warm-up allreduce gave {got}, expected {self.world}")

    def _wait_stream(self, stream: Stream, comm: Any, deadline: float) -> None:
        checked = time.monotonic()
        while not stream.query():
            self._raise_if_failed()
            now = time.monotonic()
            if now > deadline:
                raise self._fail(CommTimeout("the NCCL warm-up did not finish in time (a peer did not join)"))
            if now - checked >= _ASYNC_CHECK_S:
                checked = now
                self._setup_call(comm, lambda c: c.check_async_error())
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
            # Once the handle is cleared no new call can reach the communicator; a call in
            # progress holds its own reference, and the abort handles it (release_bounded).
            comm, self._comm = self._comm or self._setup_comm, None
            self._setup_comm = None
        if tcp is not None:
            tcp.abort(str(err))
        if self._star is not None:  # tell the others first, then drop the links
            self._star.tell(err)
            self._star.close()
        if comm is not None:   # ncclCommAbort: unblocks kernels stuck on a dead peer
            self._released = release_bounded(comm, "abort", self._what("ncclCommAbort"), self._release_limit,
                                             lock=self._nccl_lock)
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

    def _call(self, what: str, fn: Callable[[Any], None], deadline: float | None = None) -> None:
        """One call into the NCCL communicator, under its call lock; a failure fails this
        communicator. On a non-blocking communicator a call that returned in progress (a lazy
        connect) is polled until done, at most until `deadline`: nothing blocks inside NCCL."""
        err: CommError | None = None
        self._lock_calls(what, deadline if deadline is not None else time.monotonic() + self.timeout)
        try:
            with self._lock:
                comm = self._comm if self._failed is None else None   # never onto a failed or closing one
                failed = self._failed
            if comm is None:
                err = failed or CommAborted("communicator closed")
            else:
                try:
                    fn(comm)
                    if deadline is not None and getattr(comm, "nonblocking", False):
                        self._settle(comm, deadline, what, locked=True)
                except CommError as e:
                    err = e
                except Exception as e:  # noqa: BLE001 - NcclError, CUDA errors
                    err = CommError(f"{what} failed: {e}")
        finally:
            self._nccl_lock.release()
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

    def _collective(self, stream: Stream, timeout: float, what: str, fn: Callable[[Any], None],
                    before: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> None:
        """Enqueue `before` (copies), the collective and `after` on `stream` and poll them to the end."""
        start = stream.record()
        self._unfinished = True
        if before is not None:
            before()
        self._call(what, fn, time.monotonic() + timeout)
        if after is not None:
            after()
        self._wait(start, stream.record(), timeout, what)
        self._unfinished = False

    def _exchange_rows(self, api: DeviceApi, stream: Stream, timeout: float, what: str,
                       values: list[int]) -> list[list[int]]:
        """All-gather this rank's check row: into the device buffer from the pinned one and back,
        asynchronously on `stream` (the host waits only by polling, never for the stream)."""
        m = self._meta
        if m is None:
            raise self._fail(CommError(f"no device buffers for the NCCL check rows: {self._meta_error!r}"))
        m.wait_free(self._raise_if_failed, time.monotonic() + timeout)
        n = _META * self.world
        i64 = _NCCL_DTYPES["int64"]
        self._collective(stream, timeout, what, lambda c: c.allGather(m.mine, m.rows, _META, i64, stream.handle),
                         before=lambda: m.put(api, values, stream), after=lambda: m.fetch(api, stream, n))
        flat = [int(v) for v in m.host[_META:_META + n].tolist()]
        return [flat[_META * i:_META * i + _META] for i in range(self.world)]

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
        self._begin(tmo)
        try:
            rows = self._exchange_rows(api, stream, tmo, "the NCCL tag exchange",
                                       [tag, 1 if contribute else 0, buf.count, buf.dtype])
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

    def _begin(self, timeout: float) -> None:
        """Count an operation in flight, atomically with the check that the communicator is
        neither failed nor closed: close() decides between destroy and abort from this count,
        so an operation must not start enqueueing after it looked (destroy would then wait for
        the kernel for ever). First the device's turn: no set-up of another communicator runs
        beside it (one running is made to yield)."""
        self._turn.enter(self, timeout)
        try:
            with self._lock:
                if self._failed is not None:
                    raise self._failed
                closed = self._peer_closed
                if closed is None:
                    self._inflight += 1
            if closed is not None:
                raise self._fail(closed)
        except BaseException:
            self._turn.leave()
            raise

    def _end(self) -> None:
        self._turn.leave()
        with self._lock:
            self._inflight -= 1
            closed = self._peer_closed if self._inflight == 0 else None
        self._give_back_meta()
        if closed is not None:
            self._fail(closed)

    def _give_back_meta(self) -> None:
        """Once closed, with no operation in flight and the set-up over: the check-row buffers go
        back to the pool (parked there until their last copy finished)."""
        with self._lock:
            meta = self._meta if self._closed and self._inflight == 0 and self._init_done.is_set() else None
            self._meta = None if meta is not None else self._meta
        if meta is not None:
            meta.release()

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
        self._begin(tmo)
        try:
            rows = self._exchange_rows(api, stream, tmo, "the NCCL broadcast check",
                                       [_BCAST_TAG, root, buf.count, buf.dtype])
            for r, (t, rt, n, d) in enumerate(rows):
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
        when a collective is stuck). Never waits for a call in progress (see release_bounded)."""
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
        with self._lock:
            comm, self._comm = self._comm, None
            setup, self._setup_comm = self._setup_comm, None
        if setup is not None:   # still being set up: its init or warm-up may wait for a peer
            self._released = release_bounded(setup, "abort", self._what("ncclCommAbort"), self._release_limit,
                                             lock=self._nccl_lock)
        if comm is not None:
            how = "destroy" if idle else "abort"
            self._released = release_bounded(comm, how, self._what(f"ncclComm{how.capitalize()}"),
                                             self._release_limit, lock=self._nccl_lock)
        self._give_back_meta()   # else the last operation, or the init thread, gives them back
        # The init thread may still be setting up (a peer never came): it sees the failure,
        # aborts its communicator, and gives the device's set-up turn back when it is gone.
        self._init_thread.join(0.1)
