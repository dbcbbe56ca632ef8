"""A fake ``cupy.cuda.nccl`` over host memory and loopback sockets, between real processes.

It keeps the API of CuPy's binding (``cupy_backends/cuda/libs/nccl.pyx``), that of the
non-blocking libnccl calls p2pft makes through ctypes (`LIB`, see ``transport/ncclapi.py``), and
the behaviour of NCCL that p2pft's failure handling depends on:

* ``get_unique_id()`` starts a bootstrap root in the calling process (as ncclGetUniqueId does),
  a thread and a listening socket that stay until every rank of the id reached it (never, for an
  id whose init does not run: nothing can cancel it), and returns its address in 128 bytes:
  ``bytes`` as CuPy 14 does, or, with ``$FAKE_CUPY_VERSION=13``, a tuple of C ``char`` values
  whose signedness is the platform's (signed on x86_64, unsigned on aarch64; ``$FAKE_CHAR_SIGNED``
  overrides). CuPy 13's ``NcclCommunicator`` takes only such a tuple (``TypeError`` for bytes)
  and converts each item to a C char (``OverflowError`` out of range); CuPy 14's takes only
  ``bytes`` and a config, whose only field is ``split_share`` (no ``blocking``).
* ``NcclCommunicator(ndev, commId, rank)`` (CuPy's, blocking) does not return until all ``ndev``
  ranks reached the root, with no timeout and nothing that can cancel it. ``LIB.init`` (the
  non-blocking ncclCommInitRankConfig) returns at once; ``async_error()`` is ncclInProgress
  until the rendezvous and connect finished, and ``abort()`` cancels them. Two ranks on one
  device fail all of them with ``ncclInvalidUsage`` ("Duplicate GPU detected"; unless
  ``$NCCL_HOSTID`` differs: NCCL then takes them for two hosts).
* Six algorithms (ring, tree, PAT, NVLS, NVLS-tree, CollNet; CollNet only with
  ``NCCL_COLLNET_ENABLE=1``), picked per operation and size (`algorithm`). With
  ``NCCL_RUNTIME_CONNECT`` unset or 1 (NCCL >= 2.22) peers are connected algorithm by algorithm
  (enqueue.cc): the first collective that uses an algorithm connects it *inside the host call*,
  waiting for every peer (on a non-blocking communicator the call returns ncclInProgress and
  the connect goes on in the background); with 0, every algorithm inside init. Like NCCL's
  parameters, the variable is read once per process, at the first init.
* Collectives are kernels queued on the caller's stream (the stand-in's streams). A peer's death
  leaves the kernel stuck, as a kernel spinning on a dead peer is, until ``abort()``; over the
  network (``NCCL_P2P_DISABLE=1`` and ``NCCL_SHM_DISABLE=1``, or ``NCCL_HOSTID`` set) it also sets
  the communicator's async error (``check_async_error`` raises it), over P2P/SHM (the default
  between the stand-in's processes, all on one host) nothing reports it. Mismatched element counts
  across ranks hang the same way (NCCL does not check them).
* ``abort()`` wakes stuck kernels and blocked host calls and sets the handle to 0; later calls
  raise ``ncclInvalidArgument``. ``destroy()`` waits for the queued kernels first (it never
  returns while one is stuck). Both then wait, as NCCL's proxy thread does, for every other rank
  of the same host (same ``NCCL_HOSTID``) whose process is stopped (SIGSTOP) to run again. CuPy's
  communicator runs that blocking ``destroy()`` when it is collected without a release
  (``__dealloc__``), on whatever thread drops it.
* A guard records every call made while another call on the same communicator is in progress
  (``abort`` takes 50 ms and ``check_async_error`` 5 ms: race windows widened so that
  unsynchronised calls do overlap), or after abort/destroy, or, on a non-blocking communicator,
  before the previous call completed, in `VIOLATIONS` (and in the file ``$FAKE_NCCL_VIOLATIONS``):
  NCCL forbids all of them (a use after free in the real library). The one exception is
  NCCL's own: ``abort`` beside a call that is blocked waiting for peers (abort is what ends it).
* `TIMELINE` records (time, communicator number, event): init begin/end, each enqueue, each
  lazy connect, each kernel's queueing, begin and end, so tests can check what ran beside what.
"""

from __future__ import annotations

import os
import platform
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

import torch

import fakedevice

CUPY_MAJOR = int(os.environ.get("FAKE_CUPY_VERSION", "14"))   # at import; _major() reads it again per call


def _major() -> int:
    return int(os.environ.get("FAKE_CUPY_VERSION", "14"))


NCCL_UNIQUE_ID_BYTES = 128
available = True

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM = 0
_TORCH = {0: torch.int8, 1: torch.uint8, 2: torch.int32, 4: torch.int64, 6: torch.float16, 7: torch.float32,
          8: torch.float64, 9: torch.bfloat16}

ncclSuccess, ncclUnhandledCudaError, ncclSystemError, ncclInternalError = 0, 1, 2, 3
ncclInvalidArgument, ncclInvalidUsage, ncclRemoteError, ncclInProgress = 4, 5, 6, 7
_NAMES = {1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR", 2: "NCCL_ERROR_SYSTEM_ERROR", 3: "NCCL_ERROR_INTERNAL_ERROR",
          4: "NCCL_ERROR_INVALID_ARGUMENT", 5: "NCCL_ERROR_INVALID_USAGE", 6: "NCCL_ERROR_REMOTE_ERROR"}

ABORT_S = 0.05
CHECK_S = 0.005   # check_async_error and abort take this long, so races between threads show
_MAGIC = b"FAKENCCL"
_SLICE = 0.05
_HDR = struct.Struct("<4sBqqqiq")   # magic, op, seq, count, dtype/root, rank, payload bytes
_OP_AR, _OP_AG, _OP_BC = 1, 2, 3

VIOLATIONS: list[str] = []
_vlock = threading.Lock()
TIMELINE: list[tuple[float, int, str]] = []


def _note(no: int, what: str) -> None:
    TIMELINE.append((time.monotonic(), no, what))


class NcclError(RuntimeError):
    """cupy_backends.cuda.libs.nccl.NcclError."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        super().__init__(f"{_NAMES.get(status, status)}: {detail or 'see NCCL_DEBUG=WARN'}")


def _violation(text: str) -> None:
    with _vlock:
        VIOLATIONS.append(text)
        path = os.environ.get("FAKE_NCCL_VIOLATIONS")
        if path:
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {text}\n")


def _char_signed() -> bool:
    env = os.environ.get("FAKE_CHAR_SIGNED")
    if env is not None:
        return env == "1"
    return platform.machine() not in ("aarch64", "arm64", "ppc64le", "s390x")


def _to_char(v: Any, signed: bool) -> int:
    v = int(v)
    lo, hi = (-128, 127) if signed else (0, 255)
    if v < lo:
        raise OverflowError(f"can't convert negative value to {'char' if signed else 'unsigned char'}")
    if v > hi:
        raise OverflowError("value too large to convert to char")
    return v & 0xFF


# ---------------------------------------------------------------------------------- bootstrap root
def _serve_root(listener: socket.socket) -> None:
    """Collect every rank's (rank, nranks, device identity, data address); answer all at once.

    Like NCCL's bootstrap root it never gives up: until every rank of the id has reached it, this
    thread and its listening socket stay, for the life of the process (`live_roots()` counts them).
    """
    conns: dict[int, tuple[socket.socket, str, str]] = {}
    nranks = None
    try:
        while nranks is None or len(conns) < nranks:
            c, _ = listener.accept()
            c.settimeout(None)
            rank, n, ident, addr = _recv_obj(c).split("|")
            nranks = int(n)
            conns[int(rank)] = (c, ident, addr)
    except (OSError, EOFError, ValueError):
        return
    finally:
        listener.close()
        with _roots_lock:
            _roots.discard(threading.current_thread())
    idents = [conns[r][1] for r in range(nranks)]
    dup = len(set(idents)) != len(idents)
    table = "DUP" if dup else "|".join(f"{conns[r][2]}#{conns[r][1].split('/')[0]}" for r in range(nranks))
    for c, _i, _a in conns.values():
        try:
            _send_obj(c, table)
        except OSError:
            pass
        c.close()


_roots: set[threading.Thread] = set()
_roots_lock = threading.Lock()


def live_roots() -> int:
    """Bootstrap roots of this process still waiting for their ranks (a test hook)."""
    with _roots_lock:
        return len(_roots)


def _send_obj(s: socket.socket, text: str) -> None:
    b = text.encode()
    s.sendall(struct.pack("<I", len(b)) + b)


def _recv_obj(s: socket.socket, alive: Callable[[], bool] | None = None) -> str:
    n = struct.unpack("<I", _recv_exact(s, 4, alive))[0]
    return _recv_exact(s, n, alive).decode()


def _recv_exact(s: socket.socket, n: int, alive: Callable[[], bool] | None = None) -> bytes:
    """n bytes; with `alive`, polled in slices (a wait NCCL's abort flag ends)."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = s.recv(n - len(buf))
        except (socket.timeout, TimeoutError):
            if alive is not None and not alive():
                raise NcclError(ncclSystemError, "aborted while waiting for the bootstrap") from None
            continue
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return bytes(buf)


_params: dict[str, str] | None = None
_params_lock = threading.Lock()


def _param(name: str, default: str) -> str:
    """NCCL reads its parameters (environment, nccl.conf) once per process, at the first init
    (param.h): later changes to the environment do not count."""
    global _params
    with _params_lock:
        if _params is None:
            _params = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        return _params.get(name, default)


#: the stand-in's tuning (NCCL's picks per operation, size and topology; here an NVSwitch node):
#: allreduces below TREE_MAX bytes take the tree, then NVLS-tree, ring, and NVLS (CollNet
#: instead with NCCL_COLLNET_ENABLE=1) from RING_MAX on; allgathers PAT below PAT_MAX, then the
#: ring; broadcasts the ring
ALGOS = ("ring", "tree", "pat", "nvls", "nvls_tree", "collnet")
TREE_MAX = 16 << 10
NVLS_TREE_MAX = 128 << 10
RING_MAX = 1 << 20
PAT_MAX = 64 << 10


def _collnet() -> bool:
    return _param("NCCL_COLLNET_ENABLE", "0") == "1"


def algorithm(op: int, nbytes: int) -> str:
    """The algorithm the stand-in's NCCL picks for one collective."""
    if op == _OP_AR:
        if nbytes < TREE_MAX:
            return "tree"
        if nbytes < NVLS_TREE_MAX:
            return "nvls_tree"
        if nbytes < RING_MAX:
            return "ring"
        return "collnet" if _collnet() else "nvls"
    if op == _OP_AG:
        return "pat" if nbytes < PAT_MAX else "ring"
    return "ring"


def _available() -> list[str]:
    return [a for a in ALGOS if a != "collnet" or _collnet()]


def _stopped(pid: int) -> bool:
    """Whether process `pid` (on this host) is stopped (SIGSTOP, a debugger)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def get_unique_id() -> Any:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    th = threading.Thread(target=_serve_root, args=(listener,), daemon=True, name="fake-nccl-root")
    with _roots_lock:
        _roots.add(th)
    th.start()
    raw = _MAGIC + struct.pack("<H", port) + os.urandom(NCCL_UNIQUE_ID_BYTES - len(_MAGIC) - 2)
    if _major() >= 14:
        return raw
    signed = _char_signed()
    return tuple((b - 256 if signed and b > 127 else b) for b in raw)


def get_version() -> int:
    return 22205


def get_build_version() -> int:
    return 22205


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


# ---------------------------------------------------------------------------------- communicator
class NcclConfig:
    def __init__(self, split_share: int = 0) -> None:
        self.split_share = split_share


_numbers = iter(range(1, 1 << 62))
_numbers_lock = threading.Lock()


class NcclCommunicator:
    """ncclComm_t of one rank (see the module docstring for the semantics kept). Made by CuPy's
    constructor (blocking init) or by `LIB.init` (non-blocking)."""

    _comm = 0
    nonblocking = False

    def __init__(self, ndev: int, commId: Any, rank: int, config: Any = None) -> None:  # noqa: N803
        if _major() >= 14:
            if not isinstance(commId, bytes):
                raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(commId).__name__})")
            if len(commId) != NCCL_UNIQUE_ID_BYTES:
                raise ValueError(f"commId length {len(commId)} != {NCCL_UNIQUE_ID_BYTES}.")
            raw = commId
        else:
            if config is not None:
                raise TypeError("__init__() takes exactly 3 positional arguments (4 given)")
            if not isinstance(commId, tuple):
                raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(commId).__name__})")
            assert len(commId) == NCCL_UNIQUE_ID_BYTES
            signed = _char_signed()
            raw = bytes(_to_char(v, signed) for v in commId)
        self._setup(int(ndev), raw, int(rank), blocking=True)

    @classmethod
    def _nonblocking(cls, ndev: int, raw: bytes, rank: int) -> "NcclCommunicator":
        self = cls.__new__(cls)
        self._setup(ndev, raw, rank, blocking=False)
        return self

    def _setup(self, ndev: int, raw: bytes, rank: int, blocking: bool) -> None:
        if raw[:len(_MAGIC)] != _MAGIC:
            raise NcclError(ncclInvalidArgument, "not a unique id")
        with _numbers_lock:
            self.no = next(_numbers)
        self.nonblocking = not blocking
        self.rank, self.ndev = rank, ndev
        self.device = fakedevice.DEVICE.current_device()
        self._raw_id = raw
        self._aborted = threading.Event()
        self._guard = threading.Lock()
        self._active: list[str] = []
        self._blocked = 0          # active calls now waiting for peers (what abort may interrupt)
        self._async_error = ncclSuccess
        self._outstanding = 0
        self._out_cv = threading.Condition()
        self._seq = 0
        self._peers: dict[str, dict[int, socket.socket]] = {}   # algorithm -> rank -> its connection
        self._stash: dict[tuple[str, int], socket.socket] = {}   # accepted for an algorithm not connecting yet
        self._addrs: list[str] = []
        self._pids: list[int] = []
        self._hosts: list[str] = []
        self._net = False
        self._job: threading.Thread | None = None   # a non-blocking call still in progress
        self._job_error = ncclSuccess
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_SLICE)
        self._comm = 1
        _note(self.no, "init_begin")
        if blocking:
            try:
                self._init(in_call=True)
            except BaseException:
                self._aborted.set()
                self._close_sockets()
                self._comm = 0   # CuPy sets its handle only once init returned
                raise
            finally:
                _note(self.no, "init_end")
        else:
            self._background(self._init, "init")

    def _init(self, in_call: bool) -> None:
        """Rendezvous at the root (blocking: no timeout; non-blocking: until abort), then connect
        every algorithm when NCCL_RUNTIME_CONNECT=0."""
        raw = self._raw_id
        root_port = struct.unpack_from("<H", raw, len(_MAGIC))[0]
        # NCCL compares bus ids of ranks with the same host hash ($NCCL_HOSTID overrides it); the
        # class's identity, not an instance's: a test that bypasses p2pft's check bypasses only that.
        host = _param("NCCL_HOSTID", "")
        ident = f"{host}/{fakedevice.FakeDevice.identity(fakedevice.DEVICE)}"
        me = f"127.0.0.1:{self._listener.getsockname()[1]}@{os.getpid()}"
        deadline = time.monotonic() + 600
        while True:   # the root listens before the id exists
            try:
                root = socket.create_connection(("127.0.0.1", root_port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline or self._aborted.is_set():
                    raise NcclError(ncclSystemError, "bootstrap root unreachable") from None
                time.sleep(0.01)
        _send_obj(root, f"{self.rank}|{self.ndev}|{ident}|{me}")
        try:
            if self.nonblocking:
                root.settimeout(_SLICE)
                table = _recv_obj(root, alive=lambda: not self._aborted.is_set())
            else:
                root.settimeout(None)   # CuPy's init: nothing can end this wait but every rank arriving
                with self._waiting(in_call):
                    table = _recv_obj(root)
        except (OSError, EOFError):
            raise NcclError(ncclSystemError, "bootstrap root went away") from None
        finally:
            root.close()
        if table == "DUP":
            self._listener.close()
            self._comm = 0
            raise NcclError(ncclInvalidUsage, "Duplicate GPU detected")
        entries = [e.rsplit("#", 1) for e in table.split("|")]
        self._addrs = [a.split("@")[0] for a, _h in entries]
        self._pids = [int(a.split("@")[1]) for a, _h in entries]
        self._hosts = [h for _a, h in entries]
        # Ranks of one host talk over P2P/NVLink or shared memory unless both are disabled (or
        # NCCL_HOSTID makes them two hosts): a dead peer then leaves the kernel spinning with no
        # error at all; over the network the proxy reports ncclRemoteError.
        self._net = (host != "" or
                     (_param("NCCL_P2P_DISABLE", "0") == "1" and _param("NCCL_SHM_DISABLE", "0") == "1"))
        if _param("NCCL_RUNTIME_CONNECT", "1") == "0":
            for algo in _available():
                self._connect(algo, in_call)

    def _background(self, fn: Callable[[bool], None], what: str) -> None:
        """A non-blocking call's work after it returned ncclInProgress (NCCL's async job)."""
        def run() -> None:
            try:
                fn(False)
            except NcclError as e:
                self._job_error = e.status
            except (OSError, EOFError):
                self._job_error = ncclSystemError
            finally:
                if what == "init":
                    _note(self.no, "init_end")
        self._job = threading.Thread(target=run, daemon=True, name=f"fake-nccl-{what}")
        self._job.start()

    def _in_progress(self) -> bool:
        job = self._job
        return job is not None and job.is_alive()

    def forget(self, algo: str) -> None:
        """Test hook: `algo` counts as not connected yet, as if runtime connect had not reached it."""
        self._peers.pop(algo, None)

    # ------------------------------------------------------------------ guard
    def _enter(self, what: str) -> None:
        with self._guard:
            if self._comm == 0:
                _violation(f"use after abort/destroy: {what}")
                raise NcclError(ncclInvalidArgument, f"{what} on a NULL communicator")
            if what == "abort":
                if len(self._active) > self._blocked:   # beside a call that is not waiting for peers
                    _violation(f"abort during a call that is not blocked: {self._active}")
            elif self._active:
                _violation(f"concurrent calls on one communicator: {what} during {self._active}")
            if (self.nonblocking and what not in ("abort", "async_error", "check_async_error")
                    and self._in_progress()):
                _violation(f"{what} before the previous call on a non-blocking communicator completed")
            self._active.append(what)

    def _leave(self, what: str) -> None:
        with self._guard:
            self._active.remove(what)

    class _Waiting:
        def __init__(self, comm: "NcclCommunicator", on: bool) -> None:
            self.comm, self.on = comm, on

        def __enter__(self) -> None:
            if self.on:
                with self.comm._guard:
                    self.comm._blocked += 1

        def __exit__(self, *exc: Any) -> None:
            if self.on:
                with self.comm._guard:
                    self.comm._blocked -= 1

    def _waiting(self, in_call: bool) -> "NcclCommunicator._Waiting":
        """A host call waiting for peers (abort may end it)."""
        return NcclCommunicator._Waiting(self, in_call)

    # ------------------------------------------------------------------ connect
    def _connect(self, algo: str, in_call: bool = False) -> None:
        """Connect every pair for one algorithm (the lower rank connects); blocks until every
        peer connects that algorithm too (at init, or inside its first collective using it)."""
        with self._waiting(in_call):
            self._connect_pairs(algo)

    def _connect_pairs(self, algo: str) -> None:
        code = ALGOS.index(algo)
        peers: dict[int, socket.socket] = {}
        for j in range(self.rank + 1, self.ndev):
            host, port = self._addrs[j].rsplit(":", 1)
            while True:
                if self._aborted.is_set():
                    raise NcclError(ncclSystemError, "aborted while connecting")
                try:
                    s = socket.create_connection((host, int(port)), timeout=_SLICE)
                    s.sendall(struct.pack("<ii", self.rank, code))
                    got = self._read(s, 4)
                    if got is None:
                        raise NcclError(ncclSystemError, "aborted while connecting")
                    peers[j] = s
                    break
                except (OSError, EOFError):
                    time.sleep(0.01)   # peer not there yet (or dead): NCCL retries
        while len(peers) < self.ndev - 1:
            if self._aborted.is_set():
                raise NcclError(ncclSystemError, "aborted while connecting")
            stashed = [k for k in self._stash if k[0] == algo]
            if stashed:
                s = self._stash.pop(stashed[0])
                s.sendall(b"ok!!")
                peers[stashed[0][1]] = s
                continue
            try:
                s, _ = self._listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError:
                raise NcclError(ncclSystemError, "aborted while connecting") from None
            s.settimeout(_SLICE)
            got = self._read(s, 8)
            if got is None:
                raise NcclError(ncclSystemError, "aborted while connecting")
            r, c = struct.unpack("<ii", got)
            self._stash[(ALGOS[c], r)] = s   # answered when this rank connects that algorithm
        for s in peers.values():
            s.settimeout(_SLICE)
        self._peers[algo] = peers

    def _read(self, s: socket.socket, n: int) -> bytes | None:
        """n bytes, or None once aborted; EOF raises."""
        s.settimeout(_SLICE)
        buf = bytearray()
        while len(buf) < n:
            if self._aborted.is_set():
                return None
            try:
                chunk = s.recv(n - len(buf))
            except (socket.timeout, TimeoutError):
                continue
            if not chunk:
                raise EOFError("peer closed")
            buf += chunk
        return bytes(buf)

    def _write(self, s: socket.socket, data: bytes) -> bool:
        view = memoryview(data)
        while view:
            if self._aborted.is_set():
                return False
            try:
                n = s.send(view)
            except (socket.timeout, TimeoutError):
                continue
            view = view[n:]
        return True

    # ------------------------------------------------------------------ kernels
    def _stuck(self) -> None:
        """A kernel that cannot finish spins until abort."""
        self._aborted.wait()

    def _exchange(self, op: int, seq: int, payload: bytes, count: int, arg: int, senders: list[int],
                  receivers: list[int], algo: str) -> dict[int, bytes] | None:
        """Send payload to `receivers`, read one message from each of `senders`; None when stuck."""
        conns = self._peers[algo]
        head = _HDR.pack(b"FNCD", op, seq, count, arg, self.rank, len(payload))

        def send_all() -> None:
            for j in receivers:
                try:
                    if not self._write(conns[j], head + payload):
                        return
                except OSError:
                    self._peer_lost()
                    return
        th = threading.Thread(target=send_all, daemon=True)
        th.start()
        got: dict[int, bytes] = {}
        for j in senders:
            try:
                h = self._read(conns[j], _HDR.size)
                if h is None:
                    return None
                _m, op2, seq2, count2, arg2, _r, nbytes = _HDR.unpack(h)
                if (op2, seq2, count2, arg2) != (op, seq, count, arg):
                    return None           # NCCL does not check: the ranks wait on each other
                body = self._read(conns[j], nbytes)
                if body is None:
                    return None
                got[j] = body
            except (OSError, EOFError):
                self._peer_lost()
                return None
        th.join()
        return got

    def _peer_lost(self) -> None:
        if self._net:
            self._async_error = ncclRemoteError

    def _launch(self, stream: int, what: str, kernel: Any, algo: str) -> None:
        self._enter(what)
        try:
            _note(self.no, f"enqueue:{what}")
            if algo in self._peers:
                self._enqueue(stream, kernel)
            elif self.nonblocking:   # the connect goes on in the background; the call returns in progress
                _note(self.no, f"lazy_connect:{algo}")

                def connect_then_enqueue(in_call: bool) -> None:
                    self._connect(algo, in_call)
                    self._enqueue(stream, kernel)
                self._background(connect_then_enqueue, what)
            else:
                _note(self.no, f"lazy_connect:{algo}")
                self._connect(algo, in_call=True)   # runtime connect: inside the host call, per algorithm
                self._enqueue(stream, kernel)
        finally:
            self._leave(what)

    def _enqueue(self, stream: int, kernel: Any) -> None:
        self._seq += 1
        seq = self._seq
        with self._out_cv:
            self._outstanding += 1
        _note(self.no, "kernel_queued")

        def run() -> None:
            _note(self.no, "kernel_begin")
            try:
                if not kernel(seq):
                    self._stuck()
            finally:
                _note(self.no, "kernel_end")
                with self._out_cv:
                    self._outstanding -= 1
                    self._out_cv.notify_all()
        fakedevice.STREAMS[stream].enqueue(run)

    @staticmethod
    def _view(ptr: int, count: int, dtype: int) -> torch.Tensor:
        import ctypes

        dt = _TORCH[dtype]
        nbytes = count * torch.empty(0, dtype=dt).element_size()
        if nbytes == 0:
            return torch.empty(0, dtype=dt)
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dt, count=count)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,  # noqa: N802
                  stream: int) -> None:
        if op != NCCL_SUM:
            raise NcclError(ncclInvalidArgument, "the stand-in sums only")

        algo = algorithm(_OP_AR, count * torch.empty(0, dtype=_TORCH[datatype]).element_size())
        others = [j for j in range(self.ndev) if j != self.rank]

        def kernel(seq: int) -> bool:
            mine = self._view(sendbuf, count, datatype).clone()
            got = self._exchange(_OP_AR, seq, _raw(mine), count, datatype, others, others, algo)
            if got is None:
                return False
            total = torch.zeros(count, dtype=mine.dtype)
            for r in range(self.ndev):   # rank order: every rank gets the same bits
                part = mine if r == self.rank else torch.frombuffer(bytearray(got[r]), dtype=mine.dtype,
                                                                       count=count) if count else mine
                total += part
            self._view(recvbuf, count, datatype).copy_(total)
            return True
        self._launch(stream, "allReduce", kernel, algo)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:  # noqa: N802
        others = [j for j in range(self.ndev) if j != self.rank]
        algo = algorithm(_OP_AG, count * self.ndev * torch.empty(0, dtype=_TORCH[datatype]).element_size())

        def kernel(seq: int) -> bool:
            mine = self._view(sendbuf, count, datatype).clone()
            got = self._exchange(_OP_AG, seq, _raw(mine), count, datatype, others, others, algo)
            if got is None:
                return False
            out = self._view(recvbuf, count * self.ndev, datatype)
            for r in range(self.ndev):
                part = mine if r == self.rank else torch.frombuffer(bytearray(got[r]), dtype=mine.dtype,
                                                                       count=count)
                out[r * count:(r + 1) * count].copy_(part)
            return True
        self._launch(stream, "allGather", kernel, algo)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        def kernel(seq: int) -> bool:
            buf = self._view(buff, count, datatype)
            data = _raw(buf.clone())
            if self.rank == root:
                others = [j for j in range(self.ndev) if j != self.rank]
                got = self._exchange(_OP_BC, seq, data, count, datatype, [], others, "ring")
                return got is not None
            got = self._exchange(_OP_BC, seq, b"", count, datatype, [root], [], "ring")
            if got is None:
                return False
            if got[root]:
                buf.view(torch.uint8).copy_(torch.frombuffer(bytearray(got[root]), dtype=torch.uint8))
            return True
        self._launch(stream, "bcast", kernel, algo=algorithm(_OP_BC, 0))

    def async_error(self) -> int:
        """ncclCommGetAsyncError: in progress while a non-blocking call's work goes on."""
        self._enter("async_error")
        try:
            if self._async_error != ncclSuccess:
                return self._async_error
            if self._in_progress():
                return ncclInProgress
            return self._job_error
        finally:
            self._leave("async_error")

    def check_async_error(self) -> None:
        self._enter("check_async_error")
        try:
            time.sleep(CHECK_S)   # widened: an unsynchronised abort from another thread overlaps it
            err = self._async_error if self._async_error != ncclSuccess else self._job_error
            if err != ncclSuccess:
                raise NcclError(err, "remote process exited or there was a network error")
        finally:
            self._leave("check_async_error")

    def abort(self) -> None:
        if self._comm == 0:
            return
        self._enter("abort")
        try:
            self._aborted.set()   # NCCL's abort flag: kernels and host waits on peers give up first
            self._close_sockets()
            job = self._job
            if job is not None:
                job.join(10)      # ncclCommAbort joins the init (and async) work first
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:   # a blocked call returns before the free
                with self._guard:
                    if self._active == ["abort"]:
                        break
                time.sleep(0.005)
            time.sleep(ABORT_S)   # ncclCommAbort tears down proxies and frees memory: it takes a while
            self._wait_local_peers()
        finally:
            self._leave("abort")
            self._comm = 0

    def destroy(self) -> None:
        if self._comm == 0:
            return
        self._enter("destroy")
        try:
            job = self._job
            if job is not None:
                job.join()        # ncclCommDestroy waits for the init (and async) work first
            with self._out_cv:      # ncclCommDestroy flushes the queued work first
                while self._outstanding:
                    self._out_cv.wait(_SLICE)
            self._close_sockets()
            self._wait_local_peers()
        finally:
            self._leave("destroy")
            self._comm = 0

    def __del__(self) -> None:
        # CuPy's __dealloc__ calls destroy(): blocking (queued work, stopped local peers), on the
        # thread that drops the last reference. Not at interpreter exit (the stand-in must let
        # the test processes end).
        if self._comm and not self.nonblocking and not sys.is_finalizing():
            self.destroy()

    def _wait_local_peers(self) -> None:
        """Abort and destroy join NCCL's proxy thread, which waits for the other ranks on the node
        (NVIDIA/nccl#829, #863): while a peer process of the same host (same NCCL_HOSTID) is stopped
        (SIGSTOP), they do not return. A dead peer (gone from /proc) holds nothing up, and nor does a
        rank of another host."""
        mine = self._hosts[self.rank] if self._hosts else ""
        while any(_stopped(pid) for r, pid in enumerate(self._pids)
                  if r != self.rank and (self._hosts[r] if self._hosts else "") == mine):
            time.sleep(_SLICE)

    def _close_sockets(self) -> None:
        socks = [s for conns in self._peers.values() for s in conns.values()] + list(self._stash.values())
        for s in socks + [self._listener]:
            try:
                s.close()
            except OSError:
                pass

    @property
    def comm(self) -> int:
        return self._comm


class _Lib:
    """The non-blocking libnccl calls p2pft makes through ctypes (`p2pft.transport.ncclapi.NcclLib`)."""

    version = get_version()

    def init(self, world: int, uid: bytes, rank: int) -> NcclCommunicator:
        """ncclCommInitRankConfig with blocking=0: returns at once, in progress."""
        if len(uid) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"NCCL unique id must be {NCCL_UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        return NcclCommunicator._nonblocking(int(world), bytes(uid), int(rank))


LIB = _Lib()
