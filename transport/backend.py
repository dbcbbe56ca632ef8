"""Which backend a communicator uses: NCCL for CUDA tensors when it can work, the TCP ring otherwise.

The choice is made once, at start-up, from the requested data plane (``auto``, ``nccl`` or
``tcp``; argument, else the ``P2PFT_DATA_PLANE`` environment variable, else ``auto``) and the
device of the step buffer. ``auto`` takes NCCL when the buffer is on a CUDA device and CuPy with
NCCL imports and sees a device (`Backend.NCCL_AUTO`: a communicator whose ranks turn out to share
one device, which NCCL refuses, uses the TCP ring instead; the ranks learn it from the device
identities they exchange when the NCCL id is handed out); ``nccl`` where that cannot work is one
``DataPlaneError`` before anything is bound. Every rank of a communicator must end up with the same backend: a
mismatch is refused at connection time (``ProtocolMismatch``), not silently mixed.

Imports neither torch nor cupy at module level.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

__all__ = ["ENV_DATA_PLANE", "Backend", "DataPlane", "DataPlaneError", "NcclSupport", "check_data_plane",
           "choose_backend", "data_plane_from", "probe_nccl"]

ENV_DATA_PLANE = "P2PFT_DATA_PLANE"


class DataPlane(str, enum.Enum):
    """What the user asked for."""

    AUTO = "auto"
    NCCL = "nccl"
    TCP = "tcp"


class Backend(str, enum.Enum):
    """What a communicator is built with."""

    TCP = "tcp"
    NCCL = "nccl"
    #: NCCL, except for a communicator whose ranks share a device: the TCP ring (what auto picks)
    NCCL_AUTO = "nccl-auto"

    @property
    def nccl(self) -> bool:
        return self is not Backend.TCP


class DataPlaneError(ValueError):
    """The requested data plane cannot work here (raised at start-up, before any side effect)."""


@dataclass(frozen=True)
class NcclSupport:
    """What a probe found: CuPy importable, its NCCL binding usable, CUDA devices visible."""

    cupy: bool
    nccl: bool
    devices: int
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.cupy and self.nccl and self.devices > 0

    def why_not(self) -> str:
        if not self.cupy:
            return f"CuPy is not importable ({self.detail}); install p2pft[cuda12]"
        if not self.nccl:
            return f"CuPy has no usable NCCL ({self.detail}); install nvidia-nccl-cu12"
        if self.devices <= 0:
            return f"no CUDA device is visible ({self.detail})" if self.detail else "no CUDA device is visible"
        return "NCCL is available"


def probe_nccl() -> NcclSupport:
    """Look for CuPy, its NCCL binding and a device, for real, through the device seam (no
    caching: cheap after the first import, and a test may change the environment)."""
    from .device import device_api

    return NcclSupport(*device_api().probe())


def _accelerator() -> str:
    """The torch device type NCCL works on: 'cuda', or the device stand-in's."""
    from .device import device_api

    return device_api().accelerator_type


def data_plane_from(value: "str | DataPlane | None" = None) -> DataPlane:
    """The requested data plane: `value`, else $P2PFT_DATA_PLANE, else auto; one clear error otherwise."""
    if value is None:
        value = os.environ.get(ENV_DATA_PLANE) or DataPlane.AUTO.value
        where = f" (from ${ENV_DATA_PLANE})" if os.environ.get(ENV_DATA_PLANE) else ""
    else:
        where = ""
    if isinstance(value, DataPlane):
        return value
    try:
        return DataPlane(str(value).strip().lower())
    except ValueError:
        choices = ", ".join(repr(p.value) for p in DataPlane)
        raise DataPlaneError(f"unknown data plane {value!r}{where}; choose one of {choices}") from None


def check_data_plane(plane: DataPlane, support: NcclSupport | None = None) -> None:
    """Start-up check that needs no tensor: an explicit 'nccl' needs CuPy, NCCL and a device."""
    if plane is DataPlane.NCCL:
        support = support if support is not None else probe_nccl()
        if not support.ok:
            raise DataPlaneError(f"data_plane='nccl' cannot work here: {support.why_not()}; "
                                 "use data_plane='tcp' (or 'auto')")


def choose_backend(plane: DataPlane, device_type: str, support: NcclSupport | None = None) -> Backend:
    """The backend of every communicator of a step buffer on `device_type` ('cpu', 'cuda', ...)."""
    if plane is DataPlane.TCP:
        return Backend.TCP
    accel = _accelerator()
    if plane is DataPlane.NCCL:
        if device_type != accel:
            raise DataPlaneError(f"data_plane='nccl' needs the step buffer on a CUDA device, it is on "
                                 f"{device_type!r} (CPU tensors go over data_plane='tcp')")
        check_data_plane(plane, support)
        return Backend.NCCL
    if device_type != accel:
        return Backend.TCP
    support = support if support is not None else probe_nccl()
    return Backend.NCCL_AUTO if support.ok else Backend.TCP
