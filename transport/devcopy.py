"""Device (CUDA) tensors in state streams, through two pinned chunk buffers instead of a host copy.

Donor: chunk k+1 of a tensor is copied device -> pinned host on a side stream while chunk k is
being sent (``iter_chunks``). Joiner: a chunk is received into a pinned buffer, checked, and
copied host -> device on a side stream while the next chunk is received (``DeviceSink``). Either
side holds two chunk-sized pinned buffers for the whole stream (``PinnedPair.nbytes``), whatever
the snapshot size. The side stream first waits for the current stream, so a donor reads the
state as of the step boundary at which it was handed over; a joiner synchronises the side stream
once at the end, before the snapshot is used.

torch is only used when a device tensor is seen (it is then already imported). A pair on the
CPU device does the same with plain memory and synchronous copies (how the tests check the chunk
logic without a GPU).
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

__all__ = ["DeviceSink", "DeviceSource", "PinnedPair", "is_device_tensor", "iter_chunks"]


def is_device_tensor(t: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor) and t.device.type != "cpu"


class PinnedPair:
    """Two pinned host buffers of `chunk` bytes and a copy stream, shared by a stream's tensors."""

    def __init__(self, chunk: int, device: Any) -> None:
        import torch

        self.torch = torch
        self.chunk = chunk
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.slots = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.events: list[Any] = [None, None]   # last copy that used each slot

    @property
    def nbytes(self) -> int:
        return 2 * self.chunk

    def free(self, i: int) -> None:
        """Wait until the last copy from or into slot i finished."""
        if self.events[i] is not None:
            self.events[i].synchronize()
            self.events[i] = None

    def copy(self, i: int, dst: Any, src: Any) -> None:
        if self.stream is None:
            dst.copy_(src)
            return
        with self.torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            ev = self.torch.cuda.Event()
            ev.record(self.stream)
        self.events[i] = ev

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


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
