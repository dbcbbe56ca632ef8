"""Fake ``cupy.cuda``: the NCCL binding, the runtime calls p2pft makes, and `Device`."""

from __future__ import annotations

from typing import Any

from . import nccl, runtime


class Device:
    """cupy.cuda.Device: the stand-in has one device per process (index 0)."""

    def __init__(self, device: int | None = None) -> None:
        self.id = 0 if device is None else int(device)

    def use(self) -> None:
        pass

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


__all__ = ["Device", "nccl", "runtime"]
