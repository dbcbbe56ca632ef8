"""A fake ``cupy`` for tests without a GPU: just what p2pft's NCCL plane uses (see cuda/nccl.py).

Put ``tests/fakes`` first on ``PYTHONPATH``; p2pft's device seam then finds the matching CPU
device stand-in through `P2PFT_DEVICE_MODULE`. Never imported by the p2pft package itself.
"""

from . import cuda

P2PFT_DEVICE_MODULE = "fakedevice"
__version__ = "14.0.0-fake" if cuda.nccl.CUPY_MAJOR >= 14 else "13.6.0-fake"


class ndarray:  # noqa: N801 - cupy's name; no fake array is ever made
    """Placeholder so isinstance checks work; p2pft hands torch tensors to the stand-in."""


__all__ = ["P2PFT_DEVICE_MODULE", "cuda", "ndarray"]
