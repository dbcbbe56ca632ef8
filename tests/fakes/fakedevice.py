"""A CPU stand-in for a CUDA device, behind p2pft's device seam (`p2pft.transport.device`).

"Device memory" is host memory (CPU torch tensors). What makes it a device is the ordering:

* every stream is a queue run by a worker thread of its own; work queued on it (copies, zeroing,
  NCCL kernels, `slow_kernel`) runs later, in order, and is visible only through events;
* copies are a deferred copy engine: each waits a random 0-3 ms before it copies, and reads its
  source when it runs, not when it was queued, so a missing wait between streams corrupts data
  instead of passing by accident;
* a pinned allocation that torch's caching host allocator cannot serve from freed blocks calls
  cudaHostAlloc, which synchronizes implicitly: work issued after it, on any stream, runs only
  after all work issued before it;
* the default stream stands for the compute stream: torch ops run on the host at once, so a
  `wait(event)` on it blocks the host thread (the host is that stream) as well as queueing the
  wait for later kernels on it;
* a host-to-device copy from pageable memory synchronizes the host with the stream, as CUDA's
  does: ``torch.tensor(data, device=<the device>)`` returns only once everything queued on the
  calling thread's current stream has finished;
* `new_stream` is ``torch.cuda.Stream()``: one of 32 pooled streams per device, handed out round
  robin, so a "new" stream is, sooner or later, one another caller (the training loop) has too;
  `own_stream` is a raw non-blocking stream made once per device and role (CuPy's
  ``Stream(non_blocking=True)`` under ``torch.cuda.ExternalStream``), never one of the pool's;
* `nccl_nonblocking` is the libnccl reached through ctypes (``cupy.cuda.nccl.LIB``), unless
  ``$FAKE_NCCL_NONBLOCKING=0``: a process where only CuPy's blocking init is possible.

The device's identity is ``fake:<host>:<index>`` with the index from ``$P2PFT_FAKE_GPU``
(default: one device per process), so two processes given the same index share a "GPU".
Selected by p2pft through the ``P2PFT_DEVICE_MODULE`` attribute of the fake ``cupy`` package.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import random
import socket
import threading
import time
import weakref
from typing import Any, Callable, Iterator

import torch

MAX_COPY_DELAY_S = float(os.environ.get("P2PFT_FAKE_COPY_DELAY_S", "0.003"))
_QUEUE_CAP = 100_000


class FakeEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def wait_for(self, timeout: float) -> bool:
        return self._done.wait(timeout)


class _Queue:
    """A stream's queue and its worker's state (the worker holds this, not the stream, so a stream
    nobody references any more is collected and its worker exits)."""

    def __init__(self) -> None:
        self.q: queue.Queue[Callable[[], None] | None] = queue.Queue(_QUEUE_CAP)
        self.pending = 0
        self.cv = threading.Condition()

    def run(self) -> None:
        while True:
            fn = self.q.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - a failing kernel is a device error, kept
                ERRORS.append(e)
            finally:
                with self.cv:
                    self.pending -= 1
                    self.cv.notify_all()


class FakeStream:
    """A queue of work run in order by a worker thread."""

    _ids = itertools.count(1)

    def __init__(self, default: bool = False) -> None:
        self.handle = next(self._ids)
        self.default = default
        self._w = _Queue()
        STREAMS[self.handle] = self
        threading.Thread(target=self._w.run, daemon=True, name=f"fake-stream-{self.handle}").start()

    def __del__(self) -> None:
        try:
            self._w.q.put_nowait(None)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def enqueue(self, fn: Callable[[], None]) -> None:
        before = _barrier()
        if before:   # issued after a pinned allocation: runs after everything issued before it
            inner = fn

            def fn() -> None:
                for ev in before:
                    ev.synchronize()
                inner()
        with self._w.cv:
            self._w.pending += 1
        self._w.q.put(fn, timeout=60)

    def record(self) -> FakeEvent:
        ev = FakeEvent()
        self.enqueue(ev._done.set)
        return ev

    def wait(self, event: Any) -> None:
        self.enqueue(event.synchronize)
        if self.default:
            event.synchronize()   # the host thread is the compute stream

    def query(self) -> bool:
        with self._w.cv:
            return self._w.pending == 0

    def synchronize(self) -> None:
        with self._w.cv:
            while self._w.pending:
                self._w.cv.wait(0.05)


STREAMS: "weakref.WeakValueDictionary[int, FakeStream]" = weakref.WeakValueDictionary()   # by NCCL handle
ERRORS: list[BaseException] = []
_BARRIER: list[FakeEvent] = []   # work issued before the last pinned allocation, not all finished yet
_barrier_lock = threading.Lock()


def _barrier() -> list[FakeEvent]:
    with _barrier_lock:
        _BARRIER[:] = [e for e in _BARRIER if not e.query()]
        return list(_BARRIER)


_free_pinned: dict[int, int] = {}   # size class -> freed pinned blocks torch's allocator would reuse


def _pinned_freed(cls: int) -> None:
    with _barrier_lock:
        _free_pinned[cls] = _free_pinned.get(cls, 0) + 1


def _implicit_sync() -> None:
    """CUDA's implicit synchronization (programming guide): commands issued after a page-locked
    host allocation do not run until every command issued before it, on any stream, finished."""
    with _barrier_lock:
        streams = list(STREAMS.values())
    events = [s.record() for s in streams]
    with _barrier_lock:
        _BARRIER.extend(events)


#: torch's stream pool: streams per device that torch.cuda.Stream() hands out, round robin
POOL_SIZE = 32
#: the roles of p2pft's own streams (p2pft.transport.device.OWN_STREAM_ROLES)
OWN_STREAM_ROLES = ("warmup", "side", "staging", "copy", "join")


class FakeDevice:
    """The stand-in's DeviceApi (see p2pft.transport.device)."""

    name = "fake"
    accelerator_type = "cpu"

    def __init__(self) -> None:
        self._default: FakeStream | None = None
        self._current = threading.local()   # like torch's: the current stream and device are per thread
        self._placed: dict[int, int] = {}      # data_ptr -> device index, for tensors `place`d elsewhere than 0
        self._lock = threading.Lock()
        self._pool: dict[int, list[FakeStream]] = {}
        self._pool_next: dict[int, int] = {}
        self._own: dict[tuple[int, str], FakeStream] = {}

    def probe(self) -> tuple[bool, bool, int, str]:
        return True, True, 1, "fake device"

    def nccl(self) -> Any:
        from cupy.cuda import nccl

        return nccl

    def is_device_tensor(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == "cpu"

    def current_device(self) -> int | None:
        return getattr(self._current, "device", 0)

    def use_device(self, index: int | None) -> None:
        """Per thread, like cudaSetDevice."""
        if index is not None:
            self._current.device = int(index)

    def device_index(self, t: Any) -> int | None:
        return self._placed.get(int(t.data_ptr()), 0)

    def place(self, t: Any, index: int) -> Any:
        """Test hook: count tensor `t` as memory of device `index` (default: device 0)."""
        self._placed[int(t.data_ptr())] = int(index)
        return t

    def identity(self, index: int | None = None) -> str:
        return f"fake:{socket.gethostname()}:{os.environ.get('P2PFT_FAKE_GPU') or f'pid{os.getpid()}'}"

    def default_stream(self) -> FakeStream:
        with self._lock:
            if self._default is None:
                self._default = FakeStream(default=True)
            return self._default

    def current_stream(self, t: Any = None) -> FakeStream:
        return getattr(self._current, "stream", None) or self.default_stream()

    def set_current_stream(self, stream: FakeStream | None) -> None:
        """This thread trains on a side stream (None: the default one), as torch.cuda.set_stream
        would: then a wait on the current stream no longer blocks the host."""
        self._current.stream = stream

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        """This thread's current stream is `stream` inside the block (torch.cuda.stream's role)."""
        before = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield stream
        finally:
            self._current.stream = before

    def new_stream(self, t: Any = None) -> FakeStream:
        """torch.cuda.Stream(): the next of the device's 32 pooled streams (made lazily, kept)."""
        index = (self.device_index(t) if t is not None else self.current_device()) or 0
        with self._lock:
            pool = self._pool.setdefault(index, [])
            i = self._pool_next.get(index, 0)
            self._pool_next[index] = (i + 1) % POOL_SIZE
            if i == len(pool):
                pool.append(FakeStream())
            return pool[i]

    def own_stream(self, t: Any, role: str) -> FakeStream:
        """A raw non-blocking stream of `role` on `t`'s device, made once (never a pooled one)."""
        if role not in OWN_STREAM_ROLES:
            raise ValueError(f"unknown stream role {role!r}")
        key = (self.device_index(t) or 0, role)
        with self._lock:
            s = self._own.get(key)
            if s is None:
                s = self._own[key] = FakeStream()
            return s

    def nccl_nonblocking(self) -> Any:
        if os.environ.get("FAKE_NCCL_NONBLOCKING", "1") == "0":
            return None
        from cupy.cuda import nccl

        return nccl.LIB

    def pinned(self, nbytes: int) -> Any:
        """A page-locked buffer, as torch's caching host allocator gives it: a freed block of the
        same size class is reused; otherwise cudaHostAlloc runs, which synchronizes implicitly
        (later work on any stream waits for all earlier work, a stuck collective included)."""
        cls = 1 << max(0, (nbytes - 1).bit_length())
        with _barrier_lock:
            hit = _free_pinned.get(cls, 0) > 0
            if hit:
                _free_pinned[cls] -= 1
        if not hit:
            _implicit_sync()
        t = torch.empty(nbytes, dtype=torch.uint8)
        weakref.finalize(t, _pinned_freed, cls)
        return t

    def copy_async(self, dst: Any, src: Any, stream: Any) -> None:
        delay = random.uniform(0, MAX_COPY_DELAY_S)

        def run() -> None:
            time.sleep(delay)
            dst.copy_(src)
        stream.enqueue(run)

    def zero_async(self, t: Any, stream: Any) -> None:
        stream.enqueue(t.zero_)

    # ------------------------------------------------------------------ test hooks
    def slow_kernel(self, seconds: float, stream: Any = None) -> None:
        """Queue `seconds` of "compute" on a stream (default: the compute stream) without
        blocking the host, as a long first step's kernels would be."""
        (stream or self.default_stream()).enqueue(lambda: time.sleep(seconds))


DEVICE = FakeDevice()

_torch_tensor = torch.tensor


def _tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """torch.tensor: with a device of the stand-in's, a copy from pageable host memory, after
    which the host has waited for the current stream (cudaMemcpy's implicit synchronization)."""
    t = _torch_tensor(data, *args, **kwargs)
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == FakeDevice.accelerator_type:
        DEVICE.current_stream().synchronize()
    return t


torch.tensor = _tensor  # type: ignore[assignment]
