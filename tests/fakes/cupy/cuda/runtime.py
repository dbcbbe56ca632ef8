"""Fake ``cupy.cuda.runtime``: the device count and stream queries, over the stand-in's streams."""

from __future__ import annotations

import fakedevice

cudaSuccess = 0
cudaErrorNotReady = 600


def getDeviceCount() -> int:  # noqa: N802 - CuPy's name
    return 1


def getDevice() -> int:  # noqa: N802
    return 0


def streamQuery(stream: int) -> int:  # noqa: N802
    s = fakedevice.STREAMS[stream]
    return cudaSuccess if s.query() else cudaErrorNotReady
