"""CUDA tensors over the TCP ring: pinned host staging, pipelined in pieces.

A CUDA tensor is reduced in pieces of `piece_bytes` (8 MiB): while piece k goes around the ring
from pinned host memory, piece k+1 is already being copied device -> host on a copy stream, and
piece k's sum is copied host -> device as soon as its ring operation returns. Two pinned slots
(double buffering) bound the extra memory to 2 x `piece_bytes` per communicator, whatever the
tensor size. Every piece is one ordinary ring operation (all ranks cut the tensor the same way,
from its size alone), so the ring code and its failure semantics are unchanged; a failed piece
fails the communicator and the tensor's content is undefined, as with CPU tensors.

Stream order: the copy stream first waits for the caller's current stream (the gradients are
finished), and at the end the caller's stream waits for the copy stream (the optimizer sees the
finished sum); the host waits only for each piece's own device -> host copy, which it needs
before sending it.

The schedule (`run_pieces`) only drives a `Stager`; `HostStager` does the same copies between
CPU tensors, which is how the tests run the exact schedule over real sockets without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .device import DeviceApi, Event, Stream, device_api
from .tcp import TcpCommunicator
from .wire import KIND_RING, Hello
from .errors import ProtocolMismatch

__all__ = ["DEFAULT_PIECE_BYTES", "DeviceStager", "StageCache", "HostStager", "Piece", "StagingTcpCommunicator",
           "plan_pieces", "run_pieces"]

DEFAULT_PIECE_BYTES = 8 << 20
_SLOTS = 2


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flat tensor, the index-th piece."""

    index: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_pieces(numel: int, itemsize: int, piece_bytes: int) -> list[Piece]:
    """Element-aligned pieces of at most `piece_bytes`; an empty tensor is one empty piece (so
    every rank still runs one operation and returns the contributor count)."""
    per = max(1, piece_bytes // itemsize)
    if numel == 0:
        return [Piece(0, 0, 0)]
    return [Piece(i, a, min(a + per, numel)) for i, a in enumerate(range(0, numel, per))]


class Stager(Protocol):
    """The copies between the device tensor and the host slots (see run_pieces)."""

    def slot(self, i: int, n: int) -> Any: ...
    def down(self, p: Piece, i: int) -> None: ...
    def wait_down(self, p: Piece) -> None: ...
    def reuse(self, i: int) -> None: ...
    def up(self, p: Piece, i: int) -> None: ...
    def finish(self) -> None: ...


def run_pieces(pieces: list[Piece], stager: Stager, op: Callable[[Any], Any], *, copy_down: bool,
               copy_up: bool) -> Any:
    """Run `op(host slot view)` on every piece in order, copies overlapped; returns the last result.

    Slot i%2 serves piece i. A copy down into a slot is enqueued after the copy up that last
    read it (same copy stream), and the host writes a slot only after its copy down finished
    (or, with no copy down, after the last copy up from it finished).
    """
    result = None
    if copy_down:
        stager.down(pieces[0], 0)
    try:
        for k, p in enumerate(pieces):
            if copy_down and k + 1 < len(pieces):
                stager.down(pieces[k + 1], (k + 1) % _SLOTS)  # overlaps this piece's ring operation
            if copy_down:
                stager.wait_down(p)
            else:
                stager.reuse(k % _SLOTS)
            result = op(stager.slot(k % _SLOTS, p.numel))
            if copy_up:
                stager.up(p, k % _SLOTS)
    finally:
        stager.finish()   # also after a failed piece: a retry must not race the uploads still queued
    return result


class HostStager:
    """Stager between a CPU tensor and two CPU slots, synchronous; `log` records the schedule."""

    def __init__(self, tensor: Any, piece_bytes: int) -> None:
        import torch

        self.flat = tensor.view(-1)
        per = max(1, piece_bytes // tensor.element_size())
        self.slots = [torch.empty(per, dtype=tensor.dtype) for _ in range(_SLOTS)]
        self.log: list[tuple[str, int, int]] = []

    def slot(self, i: int, n: int) -> Any:
        return self.slots[i][:n]

    def down(self, p: Piece, i: int) -> None:
        self.log.append(("down", p.index, i))
        self.slots[i][:p.numel].copy_(self.flat[p.start:p.stop])

    def wait_down(self, p: Piece) -> None:
        self.log.append(("wait", p.index, -1))

    def reuse(self, i: int) -> None:
        self.log.append(("reuse", -1, i))

    def up(self, p: Piece, i: int) -> None:
        self.log.append(("up", p.index, i))
        self.flat[p.start:p.stop].copy_(self.slots[i][:p.numel])

    def finish(self) -> None:
        self.log.append(("finish", -1, -1))


@dataclass
class StageCache:
    """What staging keeps per communicator and device: the pinned slots, the copy stream and the
    last upload from each slot, so a call that starts by receiving into a slot waits for the
    previous call's upload from it."""

    device: Any
    slots: list[Any]
    stream: Stream
    up: list[Event | None]


class DeviceStager:
    """Stager between a device tensor and two pinned host slots, on a side copy stream (device seam)."""

    def __init__(self, api: DeviceApi, tensor: Any, cache: StageCache) -> None:
        self.api = api
        self.flat = tensor.view(-1)
        self.itemsize = tensor.element_size()
        self.dtype = tensor.dtype
        self.cache = cache
        self.compute = api.current_stream(tensor)
        self.copy = cache.stream
        self.copy.wait(self.compute.record())   # read the gradients only once they are finished
        self._down: dict[int, Event] = {}

    def slot(self, i: int, n: int) -> Any:
        return self.cache.slots[i][:n * self.itemsize].view(self.dtype)

    def down(self, p: Piece, i: int) -> None:
        self.api.copy_async(self.slot(i, p.numel), self.flat[p.start:p.stop], self.copy)
        self._down[p.index] = self.copy.record()

    def wait_down(self, p: Piece) -> None:
        self._down.pop(p.index).synchronize()

    def reuse(self, i: int) -> None:
        ev = self.cache.up[i]
        if ev is not None:
            ev.synchronize()
            self.cache.up[i] = None

    def up(self, p: Piece, i: int) -> None:
        self.api.copy_async(self.flat[p.start:p.stop], self.slot(i, p.numel), self.copy)
        self.cache.up[i] = self.copy.record()

    def finish(self) -> None:
        self.compute.wait(self.copy.record())     # the caller's next kernels see the sum


def _is_device_tensor(t: Any) -> bool:
    return device_api().is_device_tensor(t)


class StagingTcpCommunicator(TcpCommunicator):
    """The TCP ring communicator, taking CUDA tensors too (through pinned staging, see above).

    CPU tensors and numpy arrays take the ring's zero-copy path unchanged.
    """

    hello_kind = KIND_RING

    def __init__(self, *args: Any, piece_bytes: int = DEFAULT_PIECE_BYTES, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if piece_bytes < 64:
            raise ValueError(f"piece_bytes must be >= 64, got {piece_bytes}")
        self.piece_bytes = int(piece_bytes)
        self._stage: StageCache | None = None

    def allreduce(self, tensor: Any, *, contribute: bool = True, tag: int = 0,
                  timeout: float | None = None) -> int:
        if not _is_device_tensor(tensor):
            return super().allreduce(tensor, contribute=contribute, tag=tag, timeout=timeout)
        return self.staged_allreduce(tensor, contribute=contribute, tag=tag, timeout=timeout)

    def broadcast(self, tensor: Any, root: int, *, timeout: float | None = None) -> None:
        if not _is_device_tensor(tensor):
            return super().broadcast(tensor, root, timeout=timeout)
        return self.staged_broadcast(tensor, root, timeout=timeout)

    def staged_allreduce(self, tensor: Any, *, contribute: bool = True, tag: int = 0,
                         timeout: float | None = None, stager: Stager | None = None) -> int:
        """Allreduce `tensor` piece by piece through host slots (CUDA: pinned; `stager` for tests)."""
        self._check(tensor)
        if self.world == 1:
            if not contribute:
                tensor.zero_()
            return super().allreduce(tensor.new_empty(0, device="cpu"), contribute=contribute, tag=tag,
                                     timeout=timeout)
        pieces = plan_pieces(tensor.numel(), tensor.element_size(), self.piece_bytes)
        stager = stager if stager is not None else self._cuda_stager(tensor)
        op: Callable[[Any], int] = lambda host: TcpCommunicator.allreduce(  # noqa: E731
            self, host, contribute=contribute, tag=tag, timeout=timeout)
        return run_pieces(pieces, stager, op, copy_down=bool(contribute), copy_up=True)

    def staged_broadcast(self, tensor: Any, root: int, *, timeout: float | None = None,
                         stager: Stager | None = None) -> None:
        self._check(tensor)
        if not 0 <= root < self.world:
            raise ValueError(f"root {root} out of range for world {self.world}")
        if self.world == 1:
            return super().broadcast(tensor.new_empty(0, device="cpu"), root, timeout=timeout)
        pieces = plan_pieces(tensor.numel(), tensor.element_size(), self.piece_bytes)
        stager = stager if stager is not None else self._cuda_stager(tensor)
        run_pieces(pieces, stager, lambda host: TcpCommunicator.broadcast(self, host, root, timeout=timeout),
                   copy_down=self.rank == root, copy_up=self.rank != root)

    def reject_kind(self, h: Hello) -> None:
        """A peer connected with the NCCL id handshake: the ranks disagree on the data plane."""
        self._fail(ProtocolMismatch(f"rank {h.src} uses the nccl data plane, this rank tcp "
                                    "(set the same data_plane on every replica)",
                                    peer_rank=h.src if h.src < self.world else None))

    def close(self) -> None:
        super().close()
        self._stage = None  # torch's pinned allocator keeps blocks until their copies finished

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _check(tensor: Any) -> None:
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous")

    def _cuda_stager(self, tensor: Any) -> DeviceStager:
        """Pinned slots and upload events, made once per communicator and device; the copies run on the
        device's own staging stream (raw, made once: never the caller's stream)."""
        api = device_api()
        cache = self._stage
        if cache is None or cache.device != tensor.device:
            cache = StageCache(tensor.device, [api.pinned(self.piece_bytes) for _ in range(_SLOTS)],
                               api.own_stream(tensor, "staging"), [None] * _SLOTS)
            self._stage = cache
        return DeviceStager(api, tensor, cache)
