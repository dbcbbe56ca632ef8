"""Start-up of a stand-in process (``tests/fakes`` first on ``PYTHONPATH``): the stand-in device is a
CUDA torch, and a CUDA torch loads libnccl when it is imported (libtorch_cuda links it), whether or
not NCCL is ever used. So here, once ``torch`` is imported, a file named ``libnccl.so.2`` is mapped
into the process, as the real library would be: code that asks /proc/self/maps whether libnccl is
loaded gets the answer a real process gives (yes), not the one no real CUDA process can give.
"""

from __future__ import annotations

import mmap
import os
import sys
import tempfile
from typing import Any

_MAPPED: list[mmap.mmap] = []
_SIZE = 4096


def _map_libnccl() -> None:
    folder = os.path.join(tempfile.gettempdir(), f"p2pft-standin-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "libnccl.so.2")
    if not os.path.exists(path) or os.path.getsize(path) < _SIZE:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(bytes(_SIZE))
        os.replace(tmp, path)
    with open(path, "rb") as f:
        _MAPPED.append(mmap.mmap(f.fileno(), _SIZE, prot=mmap.PROT_READ))


def _on_import(event: str, args: Any) -> None:
    if event == "import" and not _MAPPED and args and args[0] == "torch":
        try:
            _map_libnccl()
        except OSError:
            pass


sys.addaudithook(_on_import)
