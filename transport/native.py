"""The optional C allreduce loop (`_ringloop`): whether it is used, and plans packed for it.

The C loop runs the same schedule and speaks the same wire as the Python loop in receiver.py;
ranks using either interoperate. It adds float32, float64, int32 and int64 (float16 and
bfloat16 take the Python loop). Without a C compiler at install time the extension is absent
and every op takes the Python loop. P2PFT_NATIVE_RING=0 turns it off (for comparison).
"""

from __future__ import annotations

import importlib
import os
import sys
from array import array
from types import ModuleType

from .buffers import DTYPE_CODES
from .ring import LanePlan

__all__ = ["NATIVE_ENV", "NATIVE_DTYPES", "Status", "native_loop", "packed_plan"]

NATIVE_ENV = "P2PFT_NATIVE_RING"
#: dtype codes the C loop adds
NATIVE_DTYPES = frozenset(DTYPE_CODES[n] for n in ("float32", "float64", "int32", "int64"))


class Status:
    """Return statuses of `_ringloop.allreduce_lane` (the same numbers as in ringloop/ringloop.h)."""

    OK = 0
    RECV_TIMEOUT = 1
    SEND_TIMEOUT = 2
    EOF = 3
    RECV_ERROR = 4
    SEND_ERROR = 5
    BAD_PREFIX = 6
    BAD_SUFFIX = 7
    COUNT_MISMATCH = 8
    INTERRUPTED = 9  # a signal handler raised; the exception is returned in the header slot
    FAILED = 10  # the communicator failed elsewhere (another lane, abort) while this lane ran
    NO_THREAD = 11  # the loop could not start its sender thread (errno in the err slot)
    RIGHT_SILENT = 12  # the right neighbour's host acknowledged nothing for the ack timeout


def _load() -> ModuleType | None:
    if sys.byteorder != "little":  # the C loop writes the "<" frame structs natively
        return None
    try:   # the C extension, by name: `from . import` would go through this package's __init__
        return importlib.import_module(f"{__package__}._ringloop")
    except ImportError:
        return None


_MODULE = _load()


def native_loop() -> ModuleType | None:
    """The C module when it is built and not turned off by $P2PFT_NATIVE_RING=0 (read per call,
    so a test or benchmark can compare both loops in one process)."""
    if _MODULE is None or os.environ.get(NATIVE_ENV, "").strip() == "0":
        return None
    return _MODULE


def packed_plan(plan: LanePlan) -> tuple[array, array]:
    """The plan as the C loop reads it: sends as (step, chunk, off, nbytes) and receives as
    (step, chunk, off, nbytes, reduce, next send) int64 rows; cached on the plan."""
    if plan.packed is None:
        sends = array("q")
        for f in plan.sends:
            sends.extend((f.step, f.chunk, f.off, f.nbytes))
        recvs = array("q")
        for f, reduce, nxt in plan.recvs:
            recvs.extend((f.step, f.chunk, f.off, f.nbytes, int(reduce), nxt))
        plan.packed = (sends, recvs)
    return plan.packed
