"""The device seam: everything the NCCL plane and the CUDA staging ask of the accelerator.

Current stream, side streams, events, pinned host buffers, asynchronous copies, the NCCL module
and the device's identity go through one small interface, `DeviceApi`, so that the code that
orders copies and collectives on a GPU is the code the tests run without one. Two
implementations: `CudaDevice` (torch + CuPy, imported lazily) and a CPU stand-in that lives with
the tests. The stand-in is never imported by path: a process selects it by naming its module in
``$P2PFT_DEVICE_MODULE``, or by having a ``cupy`` package first on ``sys.path`` whose
``P2PFT_DEVICE_MODULE`` attribute names it (the fake ``cupy`` of ``tests/fakes`` does).

Streams and events are wrapped (`Stream`, `Event`) so that both implementations hand the same
small surface to the transport; the NCCL module gets the raw stream handle (`Stream.handle`).

The transport's own device work (a communicator's warm-up, a helper thread's collectives,
staging copies, state copies) runs on streams that are really its own: one raw non-blocking
stream per device and role (`OWN_STREAM_ROLES`), made once and reused (`DeviceApi.own_stream`).
``torch.cuda.Stream()`` is not used: it hands out one of 32 pooled streams per device, round
robin, so in a long run two "new" streams, or a new one and the training stream, are the same
stream, and a state copy could queue behind a collective stuck on the very peer it serves.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import sys
import threading
from typing import Any, Iterable, Iterator, Protocol

__all__ = ["ENV_DEVICE_MODULE", "OWN_STREAM_ROLES", "CudaDevice", "DeviceApi", "Event", "SideStream", "Stream",
           "device_api", "joined_event", "reset_device_api", "written_event"]

ENV_DEVICE_MODULE = "P2PFT_DEVICE_MODULE"
#: what each of the transport's own streams (one per device and role) carries; distinct roles
#: never share a stream: collectives (warmup, side) must not hold up copies (staging, copy, join)
OWN_STREAM_ROLES = ("warmup", "side", "staging", "copy", "join")

logger = logging.getLogger(__name__)


class Event(Protocol):
    """A point in a stream's queue."""

    def query(self) -> bool: ...          # True once the work queued before it has finished
    def synchronize(self) -> None: ...    # block the host until then


class Stream(Protocol):
    """An ordered queue of device work."""

    handle: int                           # the raw handle NCCL calls take (cudaStream_t)

    def record(self) -> Event: ...        # an event at the current end of the queue
    def wait(self, event: Event) -> None: ...   # later work on this stream runs after `event`
    def query(self) -> bool: ...          # True when all queued work has finished
    def synchronize(self) -> None: ...


class DeviceApi(Protocol):
    """What the transport needs of a device backend."""

    name: str
    accelerator_type: str     # the torch device type whose tensors this backend treats as device memory

    def probe(self) -> tuple[bool, bool, int, str]: ...     # (cupy, nccl, devices, detail)
    def nccl(self) -> Any: ...                               # the cupy.cuda.nccl module (or its stand-in)
    def is_device_tensor(self, t: Any) -> bool: ...
    def current_device(self) -> int | None: ...
    def use_device(self, index: int | None) -> None: ...     # on this thread (NCCL binds to it)
    def device_index(self, t: Any) -> int | None: ...
    def identity(self, index: int | None) -> str: ...         # PCI bus id / UUID: equal iff the same physical device
    def current_stream(self, t: Any) -> Stream: ...         # the stream the caller's kernels on `t` run on
    # the transport's raw non-blocking stream of `role` on `t`'s device (made once per device and role)
    def own_stream(self, t: Any, role: str) -> Stream: ...
    # ncclCommInitRankConfig(blocking=0) and the calls of a non-blocking communicator, or None
    def nccl_nonblocking(self) -> Any | None: ...
    def pinned(self, nbytes: int) -> Any: ...                # a uint8 host tensor the copy engine can read/write
    def copy_async(self, dst: Any, src: Any, stream: Stream) -> None: ...
    def zero_async(self, t: Any, stream: Stream) -> None: ...
    # the current stream of this thread
    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager[Any]: ...


class _CudaEvent:
    def __init__(self, torch: Any, raw: Any) -> None:
        self.torch = torch
        self.raw = raw

    def query(self) -> bool:
        return bool(self.raw.query())

    def synchronize(self) -> None:
        self.raw.synchronize()


class _CudaStream:
    def __init__(self, torch: Any, raw: Any, keep: Any = None) -> None:
        self.torch = torch
        self.raw = raw
        self.handle = int(raw.cuda_stream)
        self.keep = keep   # the owner of a raw stream (CuPy's Stream destroys it when collected)

    def record(self) -> Event:
        ev = self.torch.cuda.Event()
        ev.record(self.raw)
        return _CudaEvent(self.torch, ev)

    def wait(self, event: Event) -> None:
        assert isinstance(event, _CudaEvent)
        self.raw.wait_event(event.raw)

    def query(self) -> bool:
        return bool(self.raw.query())

    def synchronize(self) -> None:
        self.raw.synchronize()


def _cudart_stream(index: int) -> int:
    """cudaStreamCreateWithFlags(cudaStreamNonBlocking) through the libcudart torch loaded; 0 if
    that is not possible (torch linked the runtime statically, or no CUDA)."""
    from .ncclapi import mapped_library

    path = mapped_library("libcudart.so")
    if path is None:
        return 0
    try:
        lib = ctypes.CDLL(path)
        handle = ctypes.c_void_p()
        if lib.cudaSetDevice(ctypes.c_int(index)) != 0:
            return 0
        if lib.cudaStreamCreateWithFlags(ctypes.byref(handle), ctypes.c_uint(1)) != 0:   # 1: non-blocking
            return 0
        return int(handle.value or 0)
    except (OSError, AttributeError):
        return 0


class CudaDevice:
    """CUDA through torch (streams, events, copies) and CuPy (the NCCL binding)."""

    name = "cuda"
    accelerator_type = "cuda"

    def __init__(self) -> None:
        self._own: dict[tuple[int, str], _CudaStream] = {}
        self._own_lock = threading.Lock()
        self._nb: Any = None
        self._nb_loaded = False

    def probe(self) -> tuple[bool, bool, int, str]:
        try:
            import cupy
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken CUDA install
            return False, False, 0, f"{type(e).__name__}: {e}"[:200]
        try:
            from cupy.cuda import nccl
            if not getattr(nccl, "available", True):
                return True, False, 0, "cupy.cuda.nccl.available is False"
        except Exception as e:  # noqa: BLE001
            return True, False, 0, f"{type(e).__name__}: {e}"[:200]
        try:
            n = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as e:  # noqa: BLE001 - no driver, driver too old, no device
            return True, True, 0, f"{type(e).__name__}: {e}"[:200]
        return True, True, n, "" if n else "getDeviceCount() is 0"

    def nccl(self) -> Any:
        from cupy.cuda import nccl

        return nccl

    def is_device_tensor(self, t: Any) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(t, torch.Tensor) and t.device.type == "cuda"

    def current_device(self) -> int | None:
        torch = sys.modules.get("torch")
        try:
            if torch is not None and torch.cuda.is_available():
                return int(torch.cuda.current_device())
            from cupy.cuda import runtime

            return int(runtime.getDevice())
        except Exception:  # noqa: BLE001 - no CUDA: the first operation reports it
            return None

    def use_device(self, index: int | None) -> None:
        if index is None:
            return
        import torch

        torch.cuda.set_device(index)
        try:
            import cupy

            cupy.cuda.Device(index).use()
        except ImportError:
            pass

    def device_index(self, t: Any) -> int | None:
        return t.device.index if t.device.index is not None else self.current_device()

    def identity(self, index: int | None) -> str:
        import torch

        i = self.current_device() if index is None else index
        props = torch.cuda.get_device_properties(i)
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            return f"GPU-{uuid}"
        bus = f"{getattr(props, 'pci_domain_id', 0):04x}:{getattr(props, 'pci_bus_id', 0):02x}:" \
              f"{getattr(props, 'pci_device_id', 0):02x}"
        return f"pci-{bus}"

    def current_stream(self, t: Any) -> Stream:
        import torch

        return _CudaStream(torch, torch.cuda.current_stream(t.device))

    def own_stream(self, t: Any, role: str) -> Stream:
        if role not in OWN_STREAM_ROLES:
            raise ValueError(f"unknown stream role {role!r}")
        index = self.device_index(t)
        if index is None:
            raise RuntimeError("no CUDA device")
        with self._own_lock:
            s = self._own.get((index, role))
            if s is None:
                s = self._own[(index, role)] = self._raw_stream(index)
            return s

    def _raw_stream(self, index: int) -> _CudaStream:
        """A stream created for us alone (never one of torch's pooled streams), non-blocking: it
        does not wait for the legacy default stream's work, only for the events it is told to."""
        import torch

        dev = torch.device("cuda", index)
        try:
            import cupy

            with cupy.cuda.Device(index):
                keep = cupy.cuda.Stream(non_blocking=True)
            return _CudaStream(torch, torch.cuda.ExternalStream(int(keep.ptr), device=dev), keep)
        except ImportError:
            pass
        with torch.cuda.device(index):
            ptr = _cudart_stream(index)
        if ptr:   # never destroyed: one per device and role for the life of the process
            return _CudaStream(torch, torch.cuda.ExternalStream(ptr, device=dev))
        logger.warning("neither CuPy nor torch's libcudart can make a raw stream: using one of torch's pooled "
                       "streams, which another torch.cuda.Stream() may share")
        return _CudaStream(torch, torch.cuda.Stream(dev))

    def nccl_nonblocking(self) -> Any | None:
        """The libnccl CuPy loaded, through ctypes (CuPy offers no non-blocking init); None when it
        cannot be reached or is older than NCCL 2.14."""
        with self._own_lock:
            if not self._nb_loaded:
                from .ncclapi import load_libnccl

                self._nb, self._nb_loaded = load_libnccl(), True
            return self._nb

    def pinned(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy_async(self, dst: Any, src: Any, stream: Stream) -> None:
        import torch

        assert isinstance(stream, _CudaStream)
        with torch.cuda.stream(stream.raw):
            dst.copy_(src, non_blocking=True)

    def zero_async(self, t: Any, stream: Stream) -> None:
        import torch

        assert isinstance(stream, _CudaStream)
        with torch.cuda.stream(stream.raw):
            t.zero_()

    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager[Any]:
        import torch

        assert isinstance(stream, _CudaStream)
        return torch.cuda.stream(stream.raw)


_lock = threading.Lock()
_api: DeviceApi | None = None


def _stand_in_module() -> str | None:
    name = os.environ.get(ENV_DEVICE_MODULE)
    if name:
        return name
    try:
        import cupy
    except Exception:  # noqa: BLE001 - no cupy at all: CUDA (which then reports what is missing)
        return None
    return getattr(cupy, "P2PFT_DEVICE_MODULE", None)


def device_api() -> DeviceApi:
    """The process's device backend, chosen once (see the module docstring)."""
    global _api
    with _lock:
        if _api is None:
            name = _stand_in_module()
            _api = importlib.import_module(name).DEVICE if name else CudaDevice()
        return _api


def reset_device_api() -> None:
    """Choose again at the next call (tests that change the environment)."""
    global _api
    with _lock:
        _api = None


def joined_event(t: Any, events: Iterable[Event | None]) -> Event | None:
    """One event that follows every one of `events`, recorded on our own ``join`` stream of `t`'s
    device (no stream of the caller's is made to wait). None for a host tensor or no events."""
    api = device_api()
    evs = [e for e in events if e is not None]
    if not evs or not api.is_device_tensor(t):
        return None
    if len(evs) == 1:
        return evs[0]
    s = api.own_stream(t, "join")
    for e in evs:
        s.wait(e)
    return s.record()


def written_event(t: Any) -> Event | None:
    """An event on `t`'s current stream, recorded now: later readers on other streams (a donor's
    copy stream) wait for exactly the work that wrote `t`, not for kernels queued after it, such
    as a collective that is stuck until the very peer that reads `t` joins it. None for a host
    tensor."""
    api = device_api()
    return api.current_stream(t).record() if api.is_device_tensor(t) else None


class SideStream:
    """A stream of its own for device work a helper thread enqueues for its owner, e.g. DiLoCo's
    sync thread reducing a pseudo-gradient while inner steps go on.

    A new thread's current stream is the default one: collectives it enqueues there serialize
    with training (the legacy default stream waits for every other stream) or, when training runs
    on a side stream, do not wait for the kernels that wrote their input. Inside `use(after)` the
    thread's current stream is this one, started after `after` (the event the owner recorded once
    the input was written, `written_event`); `join(t)` makes the owner's stream of `t` wait for
    what was enqueued inside `use`, without blocking the host. For a host tensor both do nothing.
    """

    def __init__(self, like: Any) -> None:
        self.api = device_api()
        self.stream: Stream | None = self.api.own_stream(like, "side") if self.api.is_device_tensor(like) else None
        self._done: Event | None = None

    @contextlib.contextmanager
    def use(self, after: Event | None = None) -> Iterator[Stream | None]:
        if self.stream is None:
            yield None
            return
        if after is not None:
            self.stream.wait(after)
        try:
            with self.api.use_stream(self.stream):
                yield self.stream
        finally:
            self._done = self.stream.record()

    def join(self, t: Any) -> None:
        """The current stream of `t` (the calling thread's) waits for the work done inside `use`."""
        done = self._done
        if done is not None and self.api.is_device_tensor(t):
            self.api.current_stream(t).wait(done)
