"""Non-blocking NCCL communicators through ctypes, on the libnccl CuPy loaded.

CuPy's ``NcclConfig`` offers no ``blocking`` field, so CuPy's ``NcclCommunicator`` always
initialises in blocking mode: ncclCommInitRank does not return until every rank reached NCCL's
bootstrap, and there is no handle to abort it with meanwhile. A peer lost between the id
hand-off and its init leaves the init thread (and its communicator) blocked for the life of the
process. ``ncclCommInitRankConfig`` with ``config.blocking = 0`` (NCCL >= 2.14) returns at once
with ``ncclInProgress`` and a handle; ``ncclCommGetAsyncError`` says when init finished, and
``ncclCommAbort`` cancels it. On such a communicator every call may return ``ncclInProgress``
(a lazy connect inside a collective, for one), and no further call but the async-error check
and abort may be made until the state is ``ncclSuccess``: `NonBlockingComm` returns, and the
caller polls (`async_error`).

`NonBlockingComm` offers the calls of CuPy's ``NcclCommunicator`` that p2pft makes (same names
and arguments), so the NCCL plane drives either. Nothing here is imported unless CUDA is used.
Layouts are from nccl.h: ``ncclUniqueId`` (128 bytes, by value) and the ``ncclConfig_t``
prefix of NCCL 2.17 (NCCL copies ``config.size`` bytes and leaves later fields at their
defaults, so an older or newer library reads it the same).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

__all__ = ["NCCL_IN_PROGRESS", "NCCL_SUCCESS", "NcclApiError", "NcclLib", "NonBlockingComm", "load_libnccl",
           "mapped_library"]

logger = logging.getLogger(__name__)

NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7
_API_MAGIC = 0xCAFEBEEF
_UNDEF_INT = -(1 << 31)
_CONFIG_VERSION = 21700          # NCCL_VERSION(2, 17, 0): the layout below
_MIN_VERSION = 21400             # config.blocking exists since NCCL 2.14
_UID_BYTES = 128


class NcclApiError(RuntimeError):
    """An NCCL call returned an error (`status` is its ncclResult_t)."""

    def __init__(self, status: int, what: str, detail: str = "") -> None:
        self.status = status
        super().__init__(f"{what}: ncclResult {status}" + (f" ({detail})" if detail else ""))


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_ubyte * _UID_BYTES)]


class _Config(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p)]


def _config_nonblocking() -> _Config:
    c = _Config()
    c.size = ctypes.sizeof(_Config)
    c.magic = _API_MAGIC
    c.version = _CONFIG_VERSION
    c.blocking = 0
    c.cgaClusterSize = c.minCTAs = c.maxCTAs = _UNDEF_INT
    c.netName = None
    return c


class NcclLib:
    """The functions of one loaded libnccl that p2pft calls."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)   # the library already loaded by CuPy: dlopen hands back that one
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self.lib = lib
        ver = ctypes.c_int(0)
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        if lib.ncclGetVersion(ctypes.byref(ver)) != NCCL_SUCCESS:
            raise OSError(f"ncclGetVersion failed in {path}")
        self.version = int(ver.value)
        lib.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(vp), i, _UniqueId, i, ctypes.POINTER(_Config)]
        lib.ncclCommGetAsyncError.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
        lib.ncclCommAbort.argtypes = [vp]
        lib.ncclCommDestroy.argtypes = [vp]
        lib.ncclAllReduce.argtypes = [vp, vp, sz, i, i, vp, vp]
        lib.ncclAllGather.argtypes = [vp, vp, sz, i, vp, vp]
        lib.ncclBcast.argtypes = [vp, sz, i, i, vp, vp]
        lib.ncclGetErrorString.argtypes = [i]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        for fn in (lib.ncclCommInitRankConfig, lib.ncclCommGetAsyncError, lib.ncclCommAbort, lib.ncclCommDestroy,
                   lib.ncclAllReduce, lib.ncclAllGather, lib.ncclBcast):
            fn.restype = ctypes.c_int

    def error_string(self, status: int) -> str:
        try:
            raw = self.lib.ncclGetErrorString(int(status))
            return raw.decode("utf-8", "replace") if raw else ""
        except Exception:  # noqa: BLE001 - only used in messages
            return ""

    def init(self, world: int, uid: bytes, rank: int) -> "NonBlockingComm":
        """ncclCommInitRankConfig(blocking=0) on the calling thread's current CUDA device: returns
        at once; the communicator is ready once `async_error()` is no longer ncclInProgress."""
        if len(uid) != _UID_BYTES:
            raise ValueError(f"NCCL unique id must be {_UID_BYTES} bytes, got {len(uid)}")
        handle = ctypes.c_void_p()
        cid = _UniqueId()
        ctypes.memmove(ctypes.addressof(cid), uid, _UID_BYTES)
        cfg = _config_nonblocking()
        st = self.lib.ncclCommInitRankConfig(ctypes.byref(handle), int(world), cid, int(rank), ctypes.byref(cfg))
        if st not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            if handle.value:   # NCCL sets the handle only when it owns resources to free
                self.lib.ncclCommAbort(handle)
            raise NcclApiError(st, "ncclCommInitRankConfig", self.error_string(st))
        if not handle.value:
            raise NcclApiError(st, "ncclCommInitRankConfig", "no communicator returned")
        return NonBlockingComm(self, int(handle.value))


class NonBlockingComm:
    """One non-blocking ncclComm_t, with the CuPy ``NcclCommunicator`` calls p2pft makes.

    Enqueues raise on an error and return on ``ncclSuccess`` or ``ncclInProgress``; the caller
    polls `async_error()` until it is no longer ``ncclInProgress`` before the next call. Nothing
    is released when the object is collected (CuPy's communicator runs a blocking
    ncclCommDestroy there): `abort` or `destroy` is always called explicitly."""

    nonblocking = True

    def __init__(self, lib: NcclLib, handle: int) -> None:
        self._lib = lib
        self._handle = handle
        self._lock = threading.Lock()   # guards the handle only, never held across an NCCL call

    @property
    def comm(self) -> int:
        return self._handle

    def _h(self, what: str) -> ctypes.c_void_p:
        h = self._handle
        if not h:
            raise NcclApiError(4, what, "the communicator was released")   # ncclInvalidArgument
        return ctypes.c_void_p(h)

    def _check(self, st: int, what: str) -> None:
        if st not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise NcclApiError(st, what, self._lib.error_string(st))

    def async_error(self) -> int:
        """ncclCommGetAsyncError: ncclSuccess, ncclInProgress, or the error."""
        state = ctypes.c_int(0)
        st = self._lib.lib.ncclCommGetAsyncError(self._h("ncclCommGetAsyncError"), ctypes.byref(state))
        if st != NCCL_SUCCESS:
            raise NcclApiError(st, "ncclCommGetAsyncError", self._lib.error_string(st))
        return int(state.value)

    def check_async_error(self) -> None:
        st = self.async_error()
        if st not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise NcclApiError(st, "asynchronous NCCL error", self._lib.error_string(st))

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,  # noqa: N802
                  stream: int) -> None:
        self._check(self._lib.lib.ncclAllReduce(ctypes.c_void_p(sendbuf), ctypes.c_void_p(recvbuf), count, datatype,
                                                op, self._h("ncclAllReduce"), ctypes.c_void_p(stream)),
                    "ncclAllReduce")

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:  # noqa: N802
        self._check(self._lib.lib.ncclAllGather(ctypes.c_void_p(sendbuf), ctypes.c_void_p(recvbuf), count, datatype,
                                                self._h("ncclAllGather"), ctypes.c_void_p(stream)),
                    "ncclAllGather")

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self._check(self._lib.lib.ncclBcast(ctypes.c_void_p(buff), count, datatype, root, self._h("ncclBcast"),
                                            ctypes.c_void_p(stream)), "ncclBcast")

    def _release(self, fn: Any, what: str) -> None:
        with self._lock:
            h, self._handle = self._handle, 0
        if h:
            self._check(fn(ctypes.c_void_p(h)), what)   # ncclInProgress: NCCL finishes freeing on its own threads

    def abort(self) -> None:
        self._release(self._lib.lib.ncclCommAbort, "ncclCommAbort")

    def destroy(self) -> None:
        self._release(self._lib.lib.ncclCommDestroy, "ncclCommDestroy")


def mapped_library(name: str) -> str | None:
    """Path of the first shared object whose file name starts with `name` mapped into this process."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if os.path.basename(path).startswith(name):
                    return path
    except OSError:
        pass
    return None


def load_libnccl() -> NcclLib | None:
    """The libnccl of this process (the one CuPy's NCCL binding loaded), or None when there is
    none reachable, or it is older than 2.14 (no non-blocking communicators)."""
    path = mapped_library("libnccl.so")
    if path is None:
        try:
            from cupy.cuda import nccl  # noqa: F401 - loads libnccl

            path = mapped_library("libnccl.so")
        except Exception:  # noqa: BLE001 - no CuPy NCCL: nothing to drive
            return None
    if path is None or not os.path.exists(path):
        return None
    try:
        lib = NcclLib(path)
    except (OSError, AttributeError) as e:
        logger.warning("cannot drive %s through ctypes (%s): NCCL init is blocking", path, e)
        return None
    if lib.version < _MIN_VERSION:
        logger.warning("NCCL %d has no non-blocking communicators: NCCL init is blocking", lib.version)
        return None
    return lib
