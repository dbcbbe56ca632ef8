"""Device (CUDA) tensors in state streams, through two pinned chunk buffers instead of a host copy.

Donor: chunk k+1 of a tensor is copied device -> pinned host on a side stream while chunk k is
being sent (``iter_chunks``). Joiner: a chunk is received into a pinned buffer, checked, and
copied host -> device on a side stream while the next chunk is received (``DeviceSink``). Either
side holds two chunk-sized pinned buffers for the whole stream (``PinnedPair.nbytes``), whatever
the snapshot size. The side stream first waits for the current stream, so a donor reads the
state as of the step boundary at which it was handed over; a joiner synchronises the side stream
once at the end, before the snapshot is used.

Streams, events, pinned memory and copies go through the device seam (`device.py`), so the CPU
stand-in of the tests runs this code with deferred copies. A pair on a device that is not the
seam's (the CPU, without the stand-in) does the same with plain memory and synchronous copies.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

from .device import Event, Stream, device_api

__all__ = ["DeviceSink", "DeviceSource", "PinnedPair", "give_pinned", "is_device_tensor", "iter_chunks",
           "prime_pinned", "take_pinned"]


def is_device_tensor(t: Any) -> bool:
    return device_api().is_device_tensor(t)


#: pinned buffers kept per size for reuse; allocating one synchronizes the device implicitly
POOL_CAP = 8
_pool: dict[int, list[Any]] = {}
_pool_lock = threading.Lock()


def take_pinned(api: Any, nbytes: int) -> Any:
    """A pinned host buffer of `nbytes`: one kept from earlier, else a new one."""
    with _pool_lock:
        free = _pool.get(nbytes)
        if free:
            return free.pop()
    return api.pinned(nbytes)


def give_pinned(buf: Any) -> None:
    """Keep `buf` (no copy may still use it) for the next `take_pinned` of its size."""
    with _pool_lock:
        free = _pool.setdefault(int(buf.numel()), [])
        if len(free) < POOL_CAP:
            free.append(buf)


def prime_pinned(nbytes: int, count: int) -> int:
    """Allocate pinned buffers ahead, while nothing is queued that could be stuck.

    A page-locked allocation synchronizes implicitly (CUDA programming guide, "Implicit
    Synchronization"): commands issued after it, on any stream, wait for every command issued
    before it. A donor that allocated its staging buffers while a collective was stuck on its
    compute stream (waiting for the very joiner it serves) waited for that collective. Returns
    the buffers of that size now kept; 0 where there is no device."""
    try:
        api = device_api()
        if api.name == "cuda":
            import torch
            if not torch.cuda.is_available():
                return 0
        with _pool_lock:
            have = len(_pool.get(nbytes, []))
        for _ in range(max(0, min(count, POOL_CAP) - have)):
            give_pinned(api.pinned(nbytes))
    except Exception:  # noqa: BLE001 - no device backend here: nothing to prime
        return 0
    with _pool_lock:
        return len(_pool.get(nbytes, []))


class PinnedPair:
    """Two pinned host buffers of `chunk` bytes and the device's own copy stream (raw, made once:
    never the training stream), shared by a stream's tensors.

    The copy stream first waits for `after` (an event of the device seam recorded once the
    tensors were written, e.g. `StateSnapshot.ready`), else for the current stream of the thread
    that builds the pair: a donor thread's current stream is the default one, not necessarily
    the stream the training thread wrote the state on.
    """

    def __init__(self, chunk: int, device: Any, after: Event | None = None) -> None:
        import torch

        self.torch = torch
        self.chunk = chunk
        self.device = torch.device(device)
        api = device_api()
        probe = torch.empty(0, device=self.device)
        self.api = api if api.is_device_tensor(probe) else None
        if self.api is not None:
            self.slots = [take_pinned(self.api, chunk) for _ in range(2)]
            self.stream: Stream | None = self.api.own_stream(probe, "copy")
            self.stream.wait(after if after is not None else self.api.current_stream(probe).record())
        else:
            self.slots = [torch.empty(chunk, dtype=torch.uint8) for _ in range(2)]
            self.stream = None
        self.events: list[Event | None] = [None, None]   # last copy that used each slot
        self._last: Event | None = None   # this pair's last copy (the stream is shared: not its end)

    @property
    def nbytes(self) -> int:
        return 2 * self.chunk

    def free(self, i: int) -> None:
        """Wait until the last copy from or into slot i finished."""
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()
            self.events[i] = None

    def copy(self, i: int, dst: Any, src: Any) -> None:
        if self.stream is None or self.api is None:
            dst.copy_(src)
            return
        self.api.copy_async(dst, src, self.stream)
        self.events[i] = self._last = self.stream.record()

    def finish(self) -> None:
        if self._last is not None:
            self._last.synchronize()

    def release(self) -> None:
        """Give the slots back for reuse, if no copy still uses them (else they are dropped)."""
        if self.api is None or self.stream is None or not self.slots or (self._last is not None
                                                                          and not self._last.query()):
            return
        for b in self.slots:
            give_pinned(b)
        self.slots = []


class DeviceSource:
    """A contiguous device tensor the donor sends, as bytes."""

    def __init__(self, tensor: Any, pair: PinnedPair) -> None:
        self.bytes = tensor.detach().reshape(-1).view(pair.torch.uint8)
        self.nbytes = int(self.bytes.numel())
        self.pair = pair


def iter_chunks(src: Any, chunk: int) -> Iterator[tuple[int, memoryview]]:
    """(byte offset, payload) of every chunk of a FlatBuffer or a DeviceSource, in order."""
    if not isinstance(src, DeviceSource):
        for off in range(0, src.nbytes, chunk):
            yield off, src.mv[off:off + chunk]
        return
    pair = src.pair
    offs = list(range(0, src.nbytes, chunk))

    def enqueue(k: int) -> None:
        off = offs[k]
        n = min(chunk, src.nbytes - off)
        pair.free(k % 2)  # the host finished sending from it: send_all is synchronous
        pair.copy(k % 2, pair.slots[k % 2][:n], src.bytes[off:off + n])

    if offs:
        enqueue(0)
    for k, off in enumerate(offs):
        if k + 1 < len(offs):
            enqueue(k + 1)    # overlaps sending chunk k
        pair.free(k % 2)
        n = min(chunk, src.nbytes - off)
        yield off, memoryview(pair.slots[k % 2][:n].numpy())


class DeviceSink:
    """A contiguous device tensor the joiner receives into, chunk by chunk through the pair."""

    def __init__(self, tensor: Any, pair: PinnedPair) -> None:
        self.bytes = tensor.detach().reshape(-1).view(pair.torch.uint8)
        self.nbytes = int(self.bytes.numel())
        self.pair = pair
        self._k = 0

    def buffer(self, n: int) -> memoryview:
        """A pinned buffer for the next chunk of n bytes (free of any copy still reading it)."""
        i = self._k % 2
        self.pair.free(i)
        return memoryview(self.pair.slots[i][:n].numpy())

    def commit(self, off: int, n: int) -> None:
        """The chunk just received (and checked) goes up to the device at `off`."""
        i = self._k % 2
        self.pair.copy(i, self.bytes[off:off + n], self.pair.slots[i][:n])
        self._k += 1
