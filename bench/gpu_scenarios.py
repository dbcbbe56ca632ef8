"""The rank side of bench/gpu_check.py: what each scenario's processes do, on a GPU or on the stand-in.

Every scenario runs in fresh processes, forked from gpu_check's server (which imported torch and
p2pft once and initialised nothing). A rank writes what it saw to ``result.<rank>.json`` in the
scenario's folder (``partial.<rank>.json`` first where the process may be taken down), with its
own verdict: ``ok`` and ``why``, the expectations it found unmet. gpu_check adds what the parent
saw (exit statuses, when it killed or stopped a peer) and writes the scenario's row.

Ranks and the parent meet through marks, small JSON files in the scenario's folder
(``<what>.<rank>.json``, ``<what>.parent.json``): addresses, barriers, "the collective is seen
spinning", "the peer was killed at t".

Device work goes through `Gpu`: on CUDA, torch (a sleep kernel calibrated with CUDA events, since
torch under CUDA 13 reports no clock rate; timing events) and CuPy (raw non-blocking streams, so
that a stream of the check's own is never one of torch's pooled streams that p2pft may also
hold); on the CPU stand-in (``tests/fakes`` first on ``PYTHONPATH``), the stand-in's streams, whose
queued work runs later and in order, as a GPU's does. Every injected delay is measured on the
device, so a check whose fault did not happen fails instead of passing.

The preflight (`preflight`) is here too: what the lent image holds, one libnccl in the process,
CuPy and torch on the same device and CUDA runtime. Its /proc/self/maps reader is a parameter.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

MiB = 1 << 20
SECRET = b"gpu-check"
PARENT = -1                      # the rank number of the parent's marks
#: a NcclCommunicator's host call: the start of the collective's clock and the poll (see transport/nccl.py)
SPIN_MIN_S = 0.5
CHURN_EPOCHS = 32
AUTO_EPOCHS = 30
#: exit status of a process that p2pft takes down because an NCCL release hung (transport/nccl.py)
EXIT_RELEASE_HUNG = 4
TAKE_DOWN_LINE = "taking this process down"


def _try(fn: Callable[[], Any]) -> str:
    """The class name of what `fn` raised, or "none"."""
    try:
        fn()
        return "none"
    except Exception as e:  # noqa: BLE001 - the class is the result
        return type(e).__name__


def os_threads() -> int:
    """Threads of this process, native ones (NCCL's) included."""
    return len(os.listdir("/proc/self/task"))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(float(v), nd)


# ---------------------------------------------------------------------------- preflight
def read_proc_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return f.read().splitlines()


_LIBNCCL = re.compile(r"libnccl\.so(\.\d+)*$")


def libnccl_paths(lines: Iterable[str]) -> list[str]:
    """The distinct NCCL libraries mapped, from /proc/<pid>/maps lines (NCCL's plugins,
    libnccl-net*.so and the like, are not NCCL)."""
    found = set()
    for ln in lines:
        i = ln.find("/")
        if i < 0:
            continue
        path = ln[i:].strip()
        if path.endswith(" (deleted)"):
            path = path[:-len(" (deleted)")]
        if _LIBNCCL.match(os.path.basename(path)):
            found.add(path)
    return sorted(found)


def _nccl_tuple(v: Any) -> tuple[int, ...] | None:
    """(major, minor, patch) of NCCL's version as torch (a tuple) or CuPy (an int code) gives it."""
    if isinstance(v, (tuple, list)) and v:
        return tuple(int(x) for x in v[:3])
    if isinstance(v, int) and v > 0:
        return (v // 10000, v // 100 % 100, v % 100) if v >= 10000 else (v // 1000, v // 100 % 10, v % 100)
    return None


def _norm_uuid(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).hex() if len(v) == 16 else None
    s = str(v).lower()
    s = s[4:] if s.startswith("gpu-") else s
    s = s.replace("-", "")
    return s if re.fullmatch(r"[0-9a-f]{32}", s) else None


def gather_versions() -> dict[str, Any]:
    """torch, CUDA, the driver, NCCL as torch and CuPy see it, CuPy, the installed CuPy and NCCL
    packages, the device each of torch and CuPy calls device 0, and how p2pft was installed."""
    import importlib.metadata as md

    out: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    dists = sorted({(d.metadata["Name"] or "").lower() for d in md.distributions()} - {""})
    out["cupy_dists"] = [d for d in dists if re.fullmatch(r"cupy(-cuda\d+x?)?", d)]
    out["nccl_dists"] = [d for d in dists if d.startswith("nvidia-nccl")]
    try:
        import torch
        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = bool(torch.cuda.is_available())
        if out["cuda_available"]:
            out["device_count"] = torch.cuda.device_count()
            p = torch.cuda.get_device_properties(0)
            out["device"] = p.name
            out["torch_uuid"] = _norm_uuid(getattr(p, "uuid", None))
            if hasattr(p, "pci_bus_id"):
                out["torch_pci"] = [int(getattr(p, k, 0)) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
            try:
                out["nccl_torch"] = _nccl_tuple(torch.cuda.nccl.version())
            except Exception as e:  # noqa: BLE001 - recorded
                out["nccl_torch"] = f"{type(e).__name__}: {e}"[:200]
    except ImportError as e:
        out["torch"] = f"ImportError: {e}"
    try:
        import cupy
        out["cupy"] = cupy.__version__
        from cupy.cuda import nccl
        out["nccl_cupy"] = _nccl_tuple(int(nccl.get_version()))
        out["nccl_cupy_build"] = _nccl_tuple(int(nccl.get_build_version()))
        rt = cupy.cuda.runtime
        for key, call in (("cupy_runtime", "runtimeGetVersion"), ("driver", "driverGetVersion")):
            if hasattr(rt, call):
                out[key] = int(getattr(rt, call)())
        if hasattr(rt, "getDeviceProperties"):
            props = rt.getDeviceProperties(0)
            out["cupy_uuid"] = _norm_uuid(props.get("uuid"))
        if hasattr(rt, "deviceGetPCIBusId"):
            dom, bus, devfn = rt.deviceGetPCIBusId(0).split(":")
            out["cupy_pci"] = [int(dom, 16), int(bus, 16), int(devfn.split(".")[0], 16)]
    except Exception as e:  # noqa: BLE001 - no CuPy, no NCCL in it, or no device
        out.setdefault("cupy", f"{type(e).__name__}: {e}"[:300])
    try:
        import p2pft.transport as tr
        from p2pft.transport import native
        from p2pft.transport.backend import probe_nccl
        from p2pft.transport.device import device_api
        out["p2pft_transport"] = str(Path(tr.__file__).resolve().parent)
        out["device_api"] = device_api().name
        probe = probe_nccl()
        out["probe_nccl"] = {"ok": bool(probe.ok), "detail": str(getattr(probe, "detail", ""))[:200]}
        out["ring_loop"] = ("native (the C extension)" if native.native_loop() is not None else
                            "python (the optional C extension was not built: no C compiler or Python headers "
                            "at install time, or $P2PFT_NATIVE_RING=0)")
    except Exception as e:  # noqa: BLE001 - p2pft not installed: the first check says so
        out["p2pft_transport"] = f"{type(e).__name__}: {e}"[:300]
    return out


def preflight_checks(info: dict[str, Any], nccl_libs: list[str], cuda: bool) -> list[dict[str, Any]]:
    """The preflight's verdicts, one per check, from what `gather_versions` found and the NCCL
    libraries mapped. On CUDA: exactly one libnccl; otherwise (the stand-in) none expected."""
    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append({"check": name, "ok": bool(ok), "detail": detail})

    where = info.get("p2pft_transport", "")
    check("p2pft_installed", isinstance(where, str) and where.startswith("/"),
          f"p2pft.transport from {where} (install: python3 -m pip install --no-deps --no-build-isolation "
          "--no-index -e .)")
    if len(nccl_libs) > 1:
        check("one_libnccl", False, f"{len(nccl_libs)} NCCL libraries loaded in one process: {nccl_libs} (a second "
              "CuPy or NCCL package, e.g. cupy-cuda12x beside a cu13 torch, preloads its own)")
    elif cuda:
        check("one_libnccl", len(nccl_libs) == 1,
              f"loaded: {nccl_libs}" if nccl_libs else "no libnccl loaded after importing torch and cupy.cuda.nccl")
    else:
        check("one_libnccl", True, f"the stand-in loads no NCCL; loaded: {nccl_libs}")
    cupys = info.get("cupy_dists", [])
    check("one_cupy", len(cupys) <= 1, f"CuPy packages installed: {cupys}")
    if not cuda:
        check("standin", info.get("device_api") not in (None, "cuda") and str(info.get("cupy", "")).endswith("-fake"),
              f"device api {info.get('device_api')}, cupy {info.get('cupy')}")
        return checks
    check("torch_cuda", bool(info.get("torch_cuda")) and bool(info.get("cuda_available"))
          and int(info.get("device_count", 0)) >= 1,
          f"torch {info.get('torch')} built for CUDA {info.get('torch_cuda')}, "
          f"available={info.get('cuda_available')}, devices={info.get('device_count')}")
    nt, nc = info.get("nccl_cupy"), info.get("nccl_torch")
    check("cupy_nccl", isinstance(nc, (tuple, list)) and info.get("device_api") == "cuda"
          and bool((info.get("probe_nccl") or {}).get("ok")),
          f"cupy {info.get('cupy')}, NCCL through CuPy {nc}, p2pft device api {info.get('device_api')}, "
          f"probe {info.get('probe_nccl')}")
    check("nccl_versions_agree", nt is not None and nc is not None and list(nt) == list(nc),
          f"NCCL {nt} as torch sees it, {nc} as CuPy sees it (one library answers both when one is loaded)")
    tmaj = str(info.get("torch_cuda") or "").split(".")[0]
    crt = info.get("cupy_runtime")
    check("same_cuda_runtime", isinstance(crt, int) and tmaj.isdigit() and crt // 1000 == int(tmaj),
          f"torch built for CUDA {info.get('torch_cuda')}, CuPy's runtime {crt}")
    drv = info.get("driver")
    check("driver_new_enough", isinstance(drv, int) and isinstance(crt, int) and drv // 1000 >= crt // 1000,
          f"driver supports CUDA {drv}, CuPy's runtime {crt}")
    tu, cu = info.get("torch_uuid"), info.get("cupy_uuid")
    tp, cp = info.get("torch_pci"), info.get("cupy_pci")
    if tu and cu:
        same, how = tu == cu, f"UUID {tu} (torch) / {cu} (CuPy)"
    elif tp and cp:
        same, how = list(tp) == list(cp), f"PCI {tp} (torch) / {cp} (CuPy)"
    else:
        same, how = False, f"no identity to compare: torch uuid={tu} pci={tp}, CuPy uuid={cu} pci={cp}"
    check("same_device", same, f"device 0: {how}")
    return checks


def preflight(read_maps: Callable[[], Iterable[str]] | None = None, cuda: bool | None = None) -> dict[str, Any]:
    """Versions and the preflight's checks in this process, after torch's and CuPy's NCCL are
    both loaded (`read_maps`: the /proc/self/maps reader, default `read_proc_maps`; `cuda`: judge
    as on CUDA, default: whether p2pft's device api is CUDA)."""
    info = gather_versions()
    if cuda is None:
        cuda = info.get("device_api") == "cuda"
    libs = libnccl_paths((read_maps or read_proc_maps)())
    info["libnccl_loaded"] = libs
    checks = preflight_checks(info, libs, cuda)
    failed = [f"{c['check']}: {c['detail']}" for c in checks if not c["ok"]]
    return {"ok": not failed, "why": failed, "checks": checks, "versions": info}


# ---------------------------------------------------------------------------- the device
class _CudaStamp:
    """A timing event at the end of the current CUDA stream."""

    def __init__(self, torch: Any) -> None:
        self.ev = torch.cuda.Event(enable_timing=True)
        self.ev.record()

    def done(self) -> bool:
        return bool(self.ev.query())

    def wait(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() > end:
                return False
            time.sleep(0.002)
        return True

    def since(self, other: "_CudaStamp") -> float:
        """Device seconds from `other` to this (both done)."""
        return float(other.ev.elapsed_time(self.ev)) / 1e3


class _FakeStamp:
    """The same on the stand-in: a closure queued on the stream notes the time it runs."""

    def __init__(self, stream: Any) -> None:
        self._ev = threading.Event()
        self.t = 0.0
        stream.enqueue(self._hit)

    def _hit(self) -> None:
        self.t = time.monotonic()
        self._ev.set()

    def done(self) -> bool:
        return self._ev.is_set()

    def wait(self, timeout: float) -> bool:
        return self._ev.wait(timeout)

    def since(self, other: "_FakeStamp") -> float:
        return self.t - other.t


class Gpu:
    """The device one rank uses, through torch and CuPy on CUDA, or the stand-in's streams. Every
    method acts on the calling thread's current stream (`using` switches it)."""

    def __init__(self, api: Any, index: int) -> None:
        import torch

        self.torch, self.api, self.index = torch, api, index
        self.cuda = api.name == "cuda"
        if self.cuda:
            torch.cuda.set_device(index)
            self.dev = torch.device("cuda", index)
        else:
            self.dev = torch.device("cpu")
        self.probe = torch.empty(0, device=self.dev)
        self.cycles_per_s = 0.0
        self.calibration: dict[str, Any] = {}
        self._keep: list[Any] = []    # CuPy streams behind torch ExternalStreams

    # streams
    def current(self) -> Any:
        """The current stream as p2pft's device seam sees it (query, record, synchronize)."""
        return self.api.current_stream(self.probe)

    def side_stream(self) -> Any:
        """A stream of our own: on CUDA a raw non-blocking CuPy stream (never one of torch's 32
        pooled streams, which p2pft's own streams may be), seen by torch as an ExternalStream."""
        if not self.cuda:   # a stand-in stream of its own (new_stream hands out pooled ones, as torch's)
            return type(self.current())()
        import cupy

        with cupy.cuda.Device(self.index):
            cs = cupy.cuda.Stream(non_blocking=True)
        self._keep.append(cs)
        return self.torch.cuda.ExternalStream(cs.ptr, device=self.dev)

    def using(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.torch.cuda.stream(stream) if self.cuda else self.api.use_stream(stream)

    # work queued on the current stream
    def stamp(self) -> Any:
        return _CudaStamp(self.torch) if self.cuda else _FakeStamp(self.current())

    def sleep(self, seconds: float) -> None:
        """Queue `seconds` of device work without blocking the host."""
        if not self.cuda:
            self.api.slow_kernel(seconds, self.current())
            return
        if not self.cycles_per_s:
            self.calibrate()
        self.torch.cuda._sleep(int(seconds * self.cycles_per_s))

    def fill(self, t: Any, value: float) -> None:
        """A write of `t` queued behind what the stream holds (an optimizer step's, say)."""
        if self.cuda:
            t.fill_(value)
        else:
            self.current().enqueue(lambda: t.fill_(value))

    def full(self, n: int, value: float) -> Any:
        return self.torch.full((n,), float(value), device=self.dev)

    def read(self, fn: Callable[[], Any]) -> Any:
        """`fn`'s host result after the current stream's work (on CUDA the read itself waits)."""
        if not self.cuda:
            self.current().synchronize()
        return fn()

    def synchronize(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.index)
        else:
            self.current().synchronize()

    def wait_idle(self, stream: Any, timeout: float) -> float | None:
        """Seconds until `stream` has nothing left queued, or None after `timeout`."""
        t0 = time.monotonic()
        while not stream.query():
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(0.005)
        return time.monotonic() - t0

    def stream_usable(self, timeout: float) -> bool:
        """Whether new work on the current stream runs (after an abort, say)."""
        y = self.torch.zeros(1024, device=self.dev)
        self.fill(y, 2.0)
        s = self.stamp()
        return s.wait(timeout) and bool(self.torch.all(y == 2.0))

    def calibrate(self) -> dict[str, Any]:
        """Cycles per second of torch.cuda._sleep, measured with CUDA events after a warm-up
        (the clock ramps up under load; the fastest rate seen makes every sleep at least as long
        as asked), and the clock the device reports, where CuPy can read it."""
        torch = self.torch
        if not self.cuda:
            return {"standin": True}
        torch.cuda._sleep(20_000_000)
        rates = []
        for cycles in (50_000_000, 100_000_000, 100_000_000):
            a = _CudaStamp(torch)
            torch.cuda._sleep(cycles)
            b = _CudaStamp(torch)
            b.ev.synchronize()
            rates.append(cycles / max(b.since(a), 1e-6))
        self.cycles_per_s = max(rates)
        out: dict[str, Any] = {"sleep_cycles_per_s": round(self.cycles_per_s), "rates": [round(r) for r in rates]}
        try:
            import cupy
            attr = 13   # cudaDevAttrClockRate (the field cudaDeviceProp lost in CUDA 13)
            out["reported_clock_khz"] = int(cupy.cuda.runtime.deviceGetAttribute(attr, self.index))
        except Exception as e:  # noqa: BLE001 - informative only
            out["reported_clock_khz"] = f"{type(e).__name__}"
        self.calibration = out
        return out

    def memory(self) -> dict[str, Any]:
        """Device memory in use (MiB): the whole device's (cudaMemGetInfo) and this process's
        (NVML, where it answers); the stand-in has none (its resident set instead)."""
        if not self.cuda:
            with open("/proc/self/statm") as f:
                return {"rss_mib": round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB, 1)}
        free, total = self.torch.cuda.mem_get_info(self.index)
        out: dict[str, Any] = {"device_used_mib": round((total - free) / MiB, 1)}
        try:
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()]
            if mine and mine[0] is not None:
                out["process_mib"] = round(mine[0] / MiB, 1)
        except Exception:  # noqa: BLE001 - NVML absent or not answering: the device-wide figure remains
            pass
        return out


class Op:
    """A host call on a thread of its own: the class of what it raised, and when it returned."""

    def __init__(self, fn: Callable[[], Any], name: str = "gpu-check-op") -> None:
        self.error: str | None = None
        self.t_return: float | None = None        # time.time(), comparable across processes
        self.mono_return: float | None = None
        self.th = threading.Thread(target=self._run, args=(fn,), daemon=True, name=name)
        self.th.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        self.error = _try(fn)
        self.t_return, self.mono_return = time.time(), time.monotonic()

    def join(self, timeout: float) -> bool:
        self.th.join(timeout)
        return not self.th.is_alive()


def wait_spinning(stream: Any, pre: Any, op: Op, min_s: float = SPIN_MIN_S, timeout: float = 30.0) -> float | None:
    """Seconds the collective of `op` was seen spinning: its stream got past `pre` (a stamp
    queued just before the call) and still had work queued, the call not returned, for `min_s` on
    end. None if the call returned first, or nothing was queued within `timeout` (the host call
    blocked before it enqueued anything: an init or a connect inside the call)."""
    end = time.monotonic() + timeout
    since: float | None = None
    while time.monotonic() < end:
        if not op.th.is_alive():
            return None
        t = time.monotonic()
        if pre.done() and not stream.query():
            since = t if since is None else since
            if t - since >= min_s:
                return t - since
        else:
            since = None
        time.sleep(0.01)
    return None


# ---------------------------------------------------------------------------- a rank
class Ctx:
    """One rank of a scenario: its marks, its data server, its communicators, its device."""

    def __init__(self, body: str, rank: int, world: int, wd: Path, layout: str, limit: float) -> None:
        from p2pft.transport.device import device_api

        self.body, self.rank, self.world, self.wd, self.layout, self.limit = body, rank, world, wd, layout, limit
        self.api = device_api()
        self.cuda = self.api.name == "cuda"
        self._gpu: Gpu | None = None
        self.ds: Any = None
        self.peers: list[str] = []

    @property
    def gpu(self) -> Gpu:
        if self._gpu is None:
            self._gpu = Gpu(self.api, self.rank if self.layout == "two_gpu" else 0)
        return self._gpu

    # marks
    def _mark_path(self, what: str, rank: int) -> Path:
        return self.wd / f"{what}.{'parent' if rank == PARENT else rank}.json"

    def mark(self, what: str, value: Any = None) -> None:
        write_mark(self._mark_path(what, self.rank), value)

    def wait_mark(self, what: str, rank: int, timeout: float) -> dict[str, Any] | None:
        return wait_mark(self._mark_path(what, rank), timeout)

    def barrier(self, what: str, timeout: float = 60.0) -> None:
        self.mark(what)
        for r in range(self.world):
            if self.wait_mark(what, r, timeout) is None:
                raise SystemExit(f"rank {r} never reached {what!r}")

    def partial(self, out: dict[str, Any]) -> None:
        """What this rank saw so far, for a process that may be taken down next."""
        write_mark(self.wd / f"partial.{self.rank}.json", out)

    # the data plane
    def serve(self) -> None:
        from p2pft.transport import DataServer

        self.ds = DataServer("127.0.0.1", 0, secret=SECRET)
        self.mark("addr", self.ds.addr)
        for r in range(self.world):
            m = self.wait_mark("addr", r, 60)
            if m is None:
                raise SystemExit(f"rank {r} never came")
            self.peers.append(str(m["v"]))

    def share_device(self) -> None:
        """For these processes only: p2pft's "one device" check would refuse two NCCL ranks on one
        GPU, which NCCL allows with distinct NCCL_HOSTID (each rank a host of its own)."""
        if self.layout == "one_gpu":
            real = self.api.identity
            rank = self.rank
            self.api.identity = lambda index=None: f"{real(index)}#gpu-check-rank{rank}"

    def comm(self, epoch: int, timeout: float, backend: str = "nccl", connect_timeout: float = 30.0) -> Any:
        return self.ds.communicator(epoch, 0, self.rank, self.peers, backend=backend, timeout=timeout,
                                    connect_timeout=connect_timeout)

    def close(self) -> None:
        if self.ds is not None:
            self.ds.close()


def write_mark(path: Path, value: Any = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"t": time.time(), "v": value}))
    os.replace(tmp, path)


def wait_mark(path: Path, timeout: float) -> dict[str, Any] | None:
    end = time.monotonic() + timeout
    while True:
        try:
            got: dict[str, Any] = json.loads(path.read_text())
            return got
        except (OSError, ValueError):
            pass
        if time.monotonic() > end:
            return None
        time.sleep(0.01)


def verdict(out: dict[str, Any], why: list[str]) -> dict[str, Any]:
    out["why"] = why
    out["ok"] = not why
    return out


# ---------------------------------------------------------------------------- one rank
def b_preflight(ctx: Ctx) -> dict[str, Any]:
    return preflight(cuda=ctx.cuda)


def b_nccl_one_rank(ctx: Ctx) -> dict[str, Any]:
    """Init, sums, a joiner's zeros, ncclCommAbort timed to its return, a new epoch after it."""
    g = ctx.gpu
    torch = g.torch
    ctx.serve()
    why: list[str] = []
    out: dict[str, Any] = {}
    n_el = 16 * MiB if ctx.cuda else MiB // 4            # 64 MiB on a GPU
    x = g.full(n_el, 1.0)
    g.synchronize()
    t = time.monotonic()
    c = ctx.comm(1, timeout=60.0)
    out["build_s"] = _r(time.monotonic() - t)
    t = time.monotonic()
    n = c.allreduce(x, tag=1)
    out["init_and_first_allreduce_s"] = _r(time.monotonic() - t)
    if not (n == 1 and bool(torch.all(x == 1))):
        why.append(f"one-rank sum wrong (count {n})")
    times = []
    for i in range(10):
        g.synchronize()
        t = time.monotonic()
        c.allreduce(x, tag=2 + i)
        times.append(time.monotonic() - t)
    out[f"allreduce_{n_el * 4 // MiB}MiB_median_s"] = _r(statistics.median(times), 5)
    if not (c.allreduce(x, contribute=False, tag=99) == 0 and int(torch.count_nonzero(x)) == 0):
        why.append("a joiner's buffer was not zeroed")
    t = time.monotonic()
    c.abort("gpu check")
    out["abort_call_s"] = _r(time.monotonic() - t, 4)          # the hand-off to the release thread
    released = c.wait_released(30.0)
    out["abort_s"] = _r(time.monotonic() - t, 4) if released else None   # ncclCommAbort itself, to its return
    if not released:
        why.append("ncclCommAbort did not return within 30 s")
    out["after_abort"] = _try(lambda: c.allreduce(x))
    if out["after_abort"] != "CommAborted":
        why.append(f"an allreduce after abort raised {out['after_abort']}, not CommAborted")
    c.close()
    c2 = ctx.comm(2, timeout=60.0)
    x.fill_(2)
    t = time.monotonic()
    n2 = c2.allreduce(x, tag=1)
    out["reinit_epoch2_first_allreduce_s"] = _r(time.monotonic() - t)
    if not (n2 == 1 and bool(torch.all(x == 2))):
        why.append("the epoch after an abort did not sum")
    t = time.monotonic()
    c2.close()
    out["destroy_s"] = _r(time.monotonic() - t, 4) if c2.wait_released(30.0) else None
    if out["destroy_s"] is None:
        why.append("ncclCommDestroy did not return within 30 s")
    return verdict(out, why)


def _abort_during_queued_compute(ctx: Ctx, c: Any, x: Any, queued_s: float,
                                 bound_s: float) -> tuple[dict[str, Any], list[str]]:
    """Queue `queued_s` of compute, start a collective behind it on a thread, abort 0.5 s later:
    a host that did not block behind the compute (no host sync in the collective path) returns
    within `bound_s`, while the compute still runs."""
    g = ctx.gpu
    stream = g.current()
    a = g.stamp()
    g.sleep(queued_s)
    b = g.stamp()
    op = Op(lambda: c.allreduce(x, timeout=60.0))
    time.sleep(0.5)
    still = not b.done()
    t = time.monotonic()
    c.abort("gpu check: abort while queued compute runs")
    op.join(queued_s + 30.0)
    running_at_return = not b.done()
    o: dict[str, Any] = {"queued_s": queued_s, "compute_running_at_abort": still, "error": op.error,
                         "returned_after_abort_s": _r(op.mono_return - t) if op.mono_return else None,
                         "compute_running_at_return": running_at_return}
    o["drained_s"] = _r(g.wait_idle(stream, queued_s + 30.0))
    o["released"] = c.wait_released(30.0)
    if b.wait(1.0):
        o["queued_measured_s"] = _r(b.since(a))
    why = []
    if not still:
        why.append("the queued compute had ended before the abort (injection too short: sleep calibration?)")
    if op.error != "CommAborted":
        why.append(f"the aborted call raised {op.error}, not CommAborted")
    r = o["returned_after_abort_s"]
    if r is None or r > bound_s or not running_at_return:
        why.append(f"the call returned {r} s after abort (bound {bound_s} s) with the compute "
                   f"{'still running' if running_at_return else 'done'}: the host was blocked behind the queued "
                   "compute (a host sync in the collective path)")
    if o["drained_s"] is None:
        why.append("the stream did not drain after abort")
    if not o["released"]:
        why.append("ncclCommAbort did not return within 30 s")
    return o, why


def b_stream_order(ctx: Ctx) -> dict[str, Any]:
    """NCCL on torch's current stream behind queued work; the host not blocked by that work;
    the TCP ring's staging between side streams."""
    from p2pft.transport import DataServer

    g = ctx.gpu
    torch = g.torch
    ctx.serve()
    why: list[str] = []
    out: dict[str, Any] = {"calibration": g.calibrate()}
    c = ctx.comm(1, timeout=60.0)
    x = torch.zeros(MiB, device=g.dev)
    c.allreduce(x)                                     # init outside the measured part
    a = g.stamp()
    g.sleep(0.5)
    g.fill(x, 3.0)                                     # the value arrives late
    n = c.allreduce(x, tag=1)
    done = g.wait_idle(g.current(), 0.1) is not None   # (the stand-in's worker may still be leaving the last item)
    b = g.stamp()
    ok_sum = g.read(lambda: bool(torch.all(x * 2 == 6.0)))
    b.wait(30)
    out["nccl"] = {"count": n, "stream_done_on_return": bool(done), "sum_ok": ok_sum,
                   "queued_measured_s": _r(b.since(a))}
    if not (n == 1 and done and ok_sum):
        why.append(f"NCCL stream order: {out['nccl']}")
    if b.since(a) < 0.4:
        why.append("the queued fill took under 0.4 s: the check proves nothing (sleep calibration?)")
    c.close()
    c2 = ctx.comm(2, timeout=60.0)
    c2.allreduce(x)
    out["nccl_host_not_blocked"], w = _abort_during_queued_compute(ctx, c2, x, 3.0 if ctx.cuda else 2.5,
                                                                   0.5 if ctx.cuda else 1.5)
    why += w
    c2.close()
    # The TCP ring with device tensors, two ranks in this process, each on a stream of its own:
    # the copy stream waits for the slow fill, the caller's stream for the copies up.
    servers = [DataServer("127.0.0.1", 0) for _ in range(2)]
    peers = [s.addr for s in servers]
    comms = [s.communicator(1, 0, r, peers) for r, s in enumerate(servers)]
    res: list[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            comms[r].piece_bytes = 4 * MiB
            with g.using(g.side_stream()):
                t = torch.zeros(5 * MiB + 7, device=g.dev)
                g.sleep(0.05)
                g.fill(t, float(r + 1))
                comms[r].allreduce(t, tag=1)
                res[r] = g.read(lambda: bool(torch.all(t * 2 == 6.0)))
        except BaseException as e:  # noqa: BLE001 - reported
            res[r] = repr(e)
    ths = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(120)
    for cc in comms:
        cc.close()
    for s in servers:
        s.close()
    out["tcp_staged"] = {"ranks_ok": res}
    if res != [True, True]:
        why.append(f"TCP staging between streams: {res}")
    return verdict(out, why)


# ---------------------------------------------------------------------------- two ranks
def b_sum(ctx: Ctx) -> dict[str, Any]:
    g = ctx.gpu
    torch = g.torch
    ctx.share_device()
    ctx.serve()
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    c = ctx.comm(1, timeout=20.0)
    out["init_done"] = c.wait_init(60)
    out["init_s"] = _r(time.monotonic() - t0, 4)
    ctx.barrier("inited")
    n = 64 * MiB // 4 if ctx.cuda else MiB // 4
    x = g.full(n, ctx.rank + 1)
    out["count"] = c.allreduce(x, tag=1)
    out["sum_ok"] = g.read(lambda: bool(torch.all(x == 3.0)))
    y = g.full(n, ctx.rank + 1)
    out["joiner_count"] = c.allreduce(y, contribute=ctx.rank == 0, tag=2)
    out["joiner_ok"] = g.read(lambda: bool(torch.all(y == 1.0)))
    times = []
    for i in range(5):
        g.synchronize()
        t1 = time.monotonic()
        c.allreduce(x, tag=10 + i)
        g.synchronize()
        times.append(time.monotonic() - t1)
    out[f"allreduce_{n * 4 // MiB}MiB_median_s"] = _r(statistics.median(times), 5)
    c.close()
    why = []
    if not out["init_done"]:
        why.append("init did not finish within 60 s")
    if not (out["count"] == 2 and out["sum_ok"]):
        why.append(f"sum wrong (count {out['count']})")
    if not (out["joiner_count"] == 1 and out["joiner_ok"]):
        why.append(f"joiner's sum wrong (count {out['joiner_count']})")
    return verdict(out, why)


def b_count_mismatch(ctx: Ctx) -> dict[str, Any]:
    """Different element counts: ProtocolMismatch on both ranks well before the timeout. The
    ranks start together (a barrier) and the timeout is long, so that a rank descheduled for a
    while on a busy machine is not taken for a hang (the flake this check had with a 3 s timeout
    counted from each rank's own start)."""
    g = ctx.gpu
    ctx.share_device()
    ctx.serve()
    c = ctx.comm(1, timeout=20.0)
    out: dict[str, Any] = {"init_done": c.wait_init(60)}
    x = g.torch.ones(1000 + ctx.rank, device=g.dev)
    stream = g.current()
    ctx.barrier("go")
    t1 = time.monotonic()
    out["error"] = _try(lambda: c.allreduce(x))
    out["raised_after_s"] = _r(time.monotonic() - t1)
    c.close()
    out["released"] = c.wait_released(15.0)
    out["drained_s"] = _r(g.wait_idle(stream, 15.0))
    why = []
    if out["error"] != "ProtocolMismatch":
        why.append(f"raised {out['error']}, not ProtocolMismatch")
    if out["raised_after_s"] > 5.0:
        why.append(f"raised after {out['raised_after_s']} s (bound 5 s; the timeout is 20 s)")
    if not out["released"]:
        why.append("the release did not return within 15 s")
    if out["drained_s"] is None:
        why.append("the stream did not drain")
    return verdict(out, why)


def b_slow_first_step(ctx: Ctx) -> dict[str, Any]:
    """(a) compute queued ahead of the first allreduce, longer than its timeout, does not count
    against it (the clock starts when the stream reaches the collective); (b) the host is not
    blocked behind that compute: an abort during it returns at once."""
    g = ctx.gpu
    torch = g.torch
    ctx.share_device()
    ctx.serve()
    T = 2.0 if ctx.cuda else 1.5              # the ranks' host skew must stay well below it
    out: dict[str, Any] = {"timeout_s": T, "calibration": g.calibrate()}
    why: list[str] = []
    c = ctx.comm(1, timeout=T)
    out["init_done"] = c.wait_init(60)
    x = g.full(MiB // 4, ctx.rank + 1)
    ctx.barrier("a")
    S = (1.5 + 0.1 * ctx.rank) * T                   # both longer than the timeout, rank 1 a little more
    a0 = g.stamp()
    g.sleep(S)
    a1 = g.stamp()
    t1 = time.monotonic()
    out["error"] = _try(lambda: c.allreduce(x))
    out["call_s"] = _r(time.monotonic() - t1)
    a1.wait(30)
    out["queued_measured_s"] = _r(a1.since(a0))
    out["sum_ok"] = g.read(lambda: bool(torch.all(x == 3.0)))
    if a1.since(a0) < 1.2 * T:
        why.append(f"the queued compute ({a1.since(a0):.2f} s measured) was not longer than the timeout ({T} s): "
                   "the check proves nothing (sleep calibration?)")
    if out["error"] != "none":
        why.append(f"the first allreduce raised {out['error']} although only queued compute delayed it")
    elif not out["sum_ok"]:
        why.append("the first allreduce's sum is wrong")
    c.close()
    c.wait_released(10.0)
    c2 = ctx.comm(2, timeout=30.0)
    c2.wait_init(60)
    ctx.barrier("b")
    if ctx.rank == 1:   # never joins: only the abort can end rank 0's call
        ctx.wait_mark("b_done", 0, 120)
        c2.close()
        return verdict(out, why)
    out["host_not_blocked"], w = _abort_during_queued_compute(ctx, c2, x, 3.0 * T if ctx.cuda else 2.5,
                                                              0.5 if ctx.cuda else 1.5)
    why += w
    ctx.mark("b_done")
    c2.close()
    return verdict(out, why)


def _peer_fault(ctx: Ctx, mode: str) -> dict[str, Any]:
    """Rank 1 stays out of rank 0's allreduce; once the collective is seen spinning on it, the
    parent kills or stops rank 1 (mode kill, stop, watchdog), or rank 0 closes its communicator
    (close). Rank 0 reports the error, when it came, the abort, and whether its stream drained."""
    g = ctx.gpu
    ctx.share_device()
    ctx.serve()
    T = {"kill": 5.0, "stop": 3.0, "watchdog": 3.0, "close": 30.0}[mode]
    c = ctx.comm(1, timeout=T)
    out: dict[str, Any] = {"timeout_s": T, "init_done": c.wait_init(60)}
    ctx.barrier("inited")
    if ctx.rank == 1:
        if mode == "close":
            ctx.wait_mark("done", 0, 120)
            c.close()
            return verdict(out, [])
        time.sleep(ctx.limit)              # killed, or stopped, by the parent
        return verdict(out, ["rank 1 outlived the scenario"])
    why: list[str] = []
    x = g.full(MiB // 4, 1.0)
    stream = g.current()
    pre = g.stamp()
    op = Op(lambda: c.allreduce(x))
    out["spinning_s"] = _r(wait_spinning(stream, pre, op))
    ctx.mark("spinning", out["spinning_s"])   # the parent acts now (also when not seen spinning)
    if out["spinning_s"] is None:
        why.append("the collective was never seen spinning (its host call blocked before enqueueing, or returned)")
    if mode == "close":
        t = time.monotonic()
        c.close()
        out["close_s"] = _r(time.monotonic() - t)
        out["op_returned"] = op.join(10)
        out["error"] = op.error
        out["released"] = c.wait_released(10.0)
        if out["close_s"] > 2.0:
            why.append(f"close() took {out['close_s']} s")
        if not out["op_returned"] or out["error"] != "CommAborted":
            why.append(f"the allreduce {'returned ' + str(out['error']) if out['op_returned'] else 'never returned'}"
                       ", not CommAborted")
        if not out["released"]:
            why.append("ncclCommAbort did not return within 10 s of close()")
    else:
        fault = ctx.wait_mark({"kill": "killed", "stop": "stopped", "watchdog": "stopped"}[mode], PARENT, 60)
        if fault is None:
            raise SystemExit("the parent never injected the fault")
        out["fault_at"] = fault["t"]
        ctx.partial(out)                  # the watchdog may take this process down once the abort starts
        op.join(T + 30)
        out["error"] = op.error
        out["raised_after_fault_s"] = _r(op.t_return - fault["t"]) if op.t_return else None
        t = time.monotonic()
        out["released"] = c.wait_released(10.0)
        out["abort_s"] = _r(time.monotonic() - t) if out["released"] else None
        r = out["raised_after_fault_s"]
        if mode == "kill":
            if out["error"] not in ("PeerFailed", "CommError"):
                why.append(f"raised {out['error']}, not PeerFailed/CommError (the death was not noticed as such)")
            if r is None or r >= T:
                why.append(f"raised {r} s after the kill: not before the {T} s timeout")
        else:
            if out["error"] != "CommTimeout":
                why.append(f"raised {out['error']}, not CommTimeout (a stopped peer says nothing)")
            if r is None or r > T + 2.0:
                why.append(f"raised {r} s after the stop (timeout {T} s)")
        if not out["released"]:
            why.append("ncclCommAbort did not return within 10 s" + (
                " (held by the stopped peer although the ranks are distinct NCCL hosts)" if mode == "stop" else ""))
    out["drained_s"] = _r(g.wait_idle(stream, 15.0))
    if out["drained_s"] is None:
        why.append("the stream did not drain: the stuck kernel was not released")
    out["stream_usable"] = g.stream_usable(15.0)
    if not out["stream_usable"]:
        why.append("new work on the stream did not run")
    ctx.mark("done")
    if mode != "close":
        c.close()
    return verdict(out, why)


def b_kill_peer(ctx: Ctx) -> dict[str, Any]:
    return _peer_fault(ctx, "kill")


def b_stop_peer(ctx: Ctx) -> dict[str, Any]:
    return _peer_fault(ctx, "stop")


def b_stop_peer_watchdog(ctx: Ctx) -> dict[str, Any]:
    return _peer_fault(ctx, "watchdog")


def b_close_during(ctx: Ctx) -> dict[str, Any]:
    return _peer_fault(ctx, "close")


def b_fast_forward(ctx: Ctx) -> dict[str, Any]:
    """A step buffer served to the peer while this rank's next allGather spins on that peer."""
    from p2pft.transport import StateSnapshot, fetch_state
    from p2pft.transport.device import written_event

    g = ctx.gpu
    torch = g.torch
    ctx.share_device()
    ctx.serve()
    c = ctx.comm(1, timeout=20.0)
    out: dict[str, Any] = {"init_done": c.wait_init(60)}
    why: list[str] = []
    ctx.barrier("inited")
    if ctx.rank == 0:
        buf = g.full(4 * MiB // 4, 5.0)                  # the step this rank reduced
        ready = written_event(buf)
        ctx.ds.serve_state(lambda req: StateSnapshot(meta={"step": 7}, tensors={"g7": buf}, ready=ready))
        nxt = torch.ones(16, device=g.dev)
        stream = g.current()
        pre = g.stamp()
        op = Op(lambda: c.allreduce(nxt, tag=8))      # step 8's tag exchange: spinning on rank 1
        out["spinning_s"] = _r(wait_spinning(stream, pre, op))
        ctx.mark("spinning", out["spinning_s"])
        op.join(30)
        out["next_step"] = op.error or "stuck"
        if out["spinning_s"] is None:
            why.append("the next step's collective was never seen spinning")
    else:
        ctx.wait_mark("spinning", 0, 60)
        t1 = time.monotonic()
        snap = fetch_state(ctx.peers[0], {}, secret=SECRET, timeout=10.0)
        out["fetch_s"] = _r(time.monotonic() - t1)
        out["data_ok"] = bool(torch.all(snap.tensors["g7"] == 5.0))
        out["next_step"] = _try(lambda: c.allreduce(torch.ones(16, device=g.dev), tag=8))
        if not out["data_ok"]:
            why.append("the fetched step buffer is wrong")
        if out["fetch_s"] > 5.0:
            why.append(f"the fetch took {out['fetch_s']} s while the donor's collective spun")
    if out["next_step"] != "none":
        why.append(f"the next step raised {out['next_step']}")
    c.close()
    return verdict(out, why)


def b_auto_epochs(ctx: Ctx) -> dict[str, Any]:
    """30 data epochs under data plane auto with both ranks on one device: every one falls back
    to the TCP ring (no NCCL id made), and nothing accumulates."""
    g = ctx.gpu
    torch = g.torch
    ctx.serve()          # no share_device: the ranks' device identities are equal
    fell_back, sums = [], []
    base: tuple[int, int, int] | None = None
    for e in range(1, AUTO_EPOCHS + 1):
        c = ctx.comm(e, timeout=20.0, backend="nccl-auto")
        x = g.full(4096, ctx.rank + 1)
        n = c.allreduce(x, tag=e)
        sums.append(n == 2 and g.read(lambda: bool(torch.all(x == 3.0))))
        fell_back.append(c.tcp is not None)
        ctx.barrier(f"e{e}")
        c.close()
        if e == 1:
            time.sleep(0.2)
            base = (threading.active_count(), os_threads(), open_fds())
    time.sleep(0.5)
    assert base is not None
    out: dict[str, Any] = {"epochs": AUTO_EPOCHS, "fell_back": sum(fell_back), "sums_ok": all(sums),
                           "py_thread_growth": threading.active_count() - base[0],
                           "os_thread_growth": os_threads() - base[1], "fd_growth": open_fds() - base[2]}
    want = AUTO_EPOCHS if ctx.layout == "one_gpu" else 0
    why = []
    if not out["sums_ok"]:
        why.append("a sum was wrong")
    if out["fell_back"] != want:
        why.append(f"{out['fell_back']} of {AUTO_EPOCHS} epochs on the TCP ring, expected {want}")
    if max(out["py_thread_growth"], out["os_thread_growth"]) > 3 or out["fd_growth"] > 3:
        why.append(f"threads or fds grew: {out}")
    return verdict(out, why)


def b_churn(ctx: Ctx) -> dict[str, Any]:
    """32 NCCL communicators one after the other (every fourth aborted, the others destroyed):
    GPU memory, threads and fds flat from the fourth epoch on."""
    g = ctx.gpu
    torch = g.torch
    ctx.share_device()
    ctx.serve()
    samples: list[dict[str, Any]] = []
    sums: list[bool] = []
    released: list[bool] = []
    epoch_s: list[float] = []
    for e in range(1, CHURN_EPOCHS + 1):
        t = time.monotonic()
        c = ctx.comm(e, timeout=20.0)
        x = g.full(4096, ctx.rank + 1)
        n = c.allreduce(x, tag=e)
        sums.append(n == 2 and g.read(lambda: bool(torch.all(x == 3.0))))
        ctx.barrier(f"e{e}")                 # both reduced before either releases
        if e % 4 == 0:
            c.abort("gpu check: churn")
        c.close()
        released.append(c.wait_released(20.0))
        epoch_s.append(time.monotonic() - t)
        if e in (4, CHURN_EPOCHS):
            time.sleep(0.5)                    # threads that end after the release returned
        samples.append({"epoch": e, "threads": os_threads(), "fds": open_fds(), **g.memory()})
    base, last = samples[3], samples[-1]
    grow = {k: round(last[k] - base[k], 1) for k in base if k != "epoch" and k in last}
    out: dict[str, Any] = {"epochs": CHURN_EPOCHS, "aborted_epochs": CHURN_EPOCHS // 4, "growth_from_epoch_4": grow,
                           "epoch4": base, "last": last, "sums_ok": all(sums), "all_released": all(released),
                           "epoch_s_first_median_last": [_r(epoch_s[0]), _r(statistics.median(epoch_s)),
                                                         _r(epoch_s[-1])]}
    why = []
    if not all(sums):
        why.append("a sum was wrong")
    if not all(released):
        why.append(f"{released.count(False)} releases did not return within 20 s")
    if grow["threads"] > 2 or grow["fds"] > 2:
        why.append(f"threads grew by {grow['threads']}, fds by {grow['fds']} over {CHURN_EPOCHS - 4} epochs")
    if "process_mib" in grow and grow["process_mib"] > 64:
        why.append(f"this process's GPU memory grew by {grow['process_mib']} MiB")
    elif "process_mib" not in grow and grow.get("device_used_mib", 0) > 256:
        why.append(f"the device's used memory grew by {grow['device_used_mib']} MiB")
    return verdict(out, why)


def b_peer_dies_before_init(ctx: Ctx) -> dict[str, Any]:
    """Rank 1 takes the unique id (go) and dies before NCCL's init: rank 0's init waits on NCCL's
    bootstrap for a rank that never comes. Rank 0 must fail the operation and, after close(),
    not keep its init (a cancelled init; NCCL's bootstrap root, one thread and its sockets, may
    stay), or be taken down with the documented exit status."""
    import p2pft.transport.nccl as nccl_mod

    g = ctx.gpu
    ctx.share_device()
    ctx.serve()
    T, CT = 10.0, 10.0
    c1 = ctx.comm(1, timeout=T)
    x = g.full(4096, 1.0)
    c1.allreduce(x)
    ctx.barrier("e1")
    c1.close()
    c1.wait_released(20.0)
    time.sleep(0.5)
    base_threads, base_fds = os_threads(), open_fds()
    before = {t.ident for t in threading.enumerate()}
    ctx.barrier("e2")
    out: dict[str, Any] = {}
    if ctx.rank == 1:
        # Die at the first call that reaches NCCL once the id is known (CuPy's module, the
        # non-blocking ctypes path, the blocking init): after go, before NCCL's init.
        box: list[Any] = []

        def dying(orig: Callable[..., Any]) -> Callable[..., Any]:
            def call(*a: Any, **k: Any) -> Any:
                if box and box[0].uid_known.is_set():
                    os.kill(os.getpid(), signal.SIGKILL)
                return orig(*a, **k)
            return call
        for name in ("nccl", "nccl_nonblocking"):
            if hasattr(ctx.api, name):
                setattr(ctx.api, name, dying(getattr(ctx.api, name)))
        if hasattr(nccl_mod, "new_nccl_comm"):
            nccl_mod.new_nccl_comm = dying(nccl_mod.new_nccl_comm)
        out["injected_at"] = "after go, at the first call that reaches NCCL (before its init)"
        ctx.partial(out)
        c2 = ctx.comm(2, timeout=T, connect_timeout=CT)
        box.append(c2)
        c2.uid_known.wait(60)
        time.sleep(10.0)                      # not reached NCCL through those calls: die anyway
        ctx.partial({"injected_at": "10 s after go (no call reached NCCL through the patched calls)"})
        os.kill(os.getpid(), signal.SIGKILL)
        return verdict(out, ["rank 1 was to die before init but lived"])
    c2 = ctx.comm(2, timeout=T, connect_timeout=CT)
    t1 = time.monotonic()
    out["error"] = _try(lambda: c2.allreduce(x))
    out["raised_after_s"] = _r(time.monotonic() - t1)
    c2.close()
    window = 20.0 if ctx.cuda else 8.0
    if getattr(c2, "cancellable", True) is False:
        # CuPy's blocking init (no ctypes path here): p2pft's bound is the process exit, after
        # the id hand-off, the timeout and the release limit.
        window = CT + T + float(os.environ.get("P2PFT_NCCL_ABORT_TIMEOUT_S", "60")) + 10.0
        out["blocking_init"] = True
    ctx.partial(out)
    t2 = time.monotonic()
    standin_roots: Callable[[], int] | None = None
    if not ctx.cuda:
        from cupy.cuda import nccl as fake_nccl
        standin_roots = getattr(fake_nccl, "live_roots", None)

    def leftovers() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()
                      and not t.name.startswith("fake-nccl-root"))   # the stand-in's bootstrap root
    gone = None
    while time.monotonic() - t2 < window:
        if not leftovers() and os_threads() - base_threads <= 1 and open_fds() - base_fds <= 2:
            gone = time.monotonic() - t2
            break
        time.sleep(0.1)
    out.update(window_s=window, released_after_close_s=_r(gone), leftover_threads=leftovers(),
               os_threads_over_baseline=os_threads() - base_threads, fds_over_baseline=open_fds() - base_fds)
    if standin_roots is not None:
        out["standin_bootstrap_roots"] = standin_roots()
    why = []
    if out["error"] not in ("PeerFailed", "CommTimeout", "CommError", "CommAborted"):
        why.append(f"raised {out['error']}")
    if out["raised_after_s"] > T + 2.0:
        why.append(f"raised after {out['raised_after_s']} s (timeout {T} s)")
    if gone is None:
        why.append(f"{window:g} s after close() the init is still there: threads {out['leftover_threads']}, "
                   f"{out['os_threads_over_baseline']} threads and {out['fds_over_baseline']} fds over the baseline "
                   "(an init that cannot be cancelled leaks for good)")
    return verdict(out, why)


def b_catchup_cuda(ctx: Ctx) -> dict[str, Any]:
    """A joiner fetches state into its own device tensor while its last optimizer write (-1) is
    still queued on its training stream, from a donor whose write of that state (5, over 0) is
    still queued too: with `after` (the joiner's) and `ready` (the donor's) the copies land after
    both writes. A control fetch without `after` shows the race the check would otherwise miss."""
    from p2pft.transport import StateSnapshot, fetch_state
    from p2pft.transport.device import written_event

    g = ctx.gpu
    ctx.serve()
    n_el = 16 * MiB if ctx.cuda else MiB // 4
    L = 1.5 if ctx.cuda else 1.2               # the joiner's queued compute; the donor's is a third of it
    out: dict[str, Any] = {"MiB": n_el * 4 // MiB, "joiner_queued_s": L, "donor_queued_s": round(L / 3, 3),
                           "calibration": g.calibrate()}
    why: list[str] = []
    if ctx.rank == 0:
        buf = g.full(n_el, 0.0)
        train = g.side_stream()                # the donor's training stream (not the serving thread's)
        pending: list[bool] = []

        def snapshot(req: Any) -> Any:
            buf.zero_()
            g.synchronize()
            with g.using(train):
                g.sleep(L / 3)
                g.fill(buf, 5.0)               # the donor's step: still queued when the copies are set up
                ready = written_event(buf)
            pending.append(not ready.query())
            return StateSnapshot(meta={"step": 7}, tensors={"w": buf}, ready=ready)
        ctx.ds.serve_state(snapshot)
        ctx.mark("serving")
        if ctx.wait_mark("fetched", 1, 120) is None:
            why.append("the joiner never finished")
        out["donor_write_pending_at_serve"] = pending
        if not pending or not all(pending):
            why.append(f"the donor's write had finished before serving ({pending}): injection too short")
        return verdict(out, why)
    ctx.wait_mark("serving", 0, 60)
    side = g.side_stream()                     # the joiner's training stream

    def fetch(after: bool) -> tuple[Any, dict[str, Any]]:
        w = g.full(n_el, 0.0)
        g.synchronize()
        with g.using(side):
            g.sleep(L)
            g.fill(w, -1.0)                    # this process's optimizer step, still queued
            ev = written_event(w)
        o: dict[str, Any] = {"write_pending_at_fetch": not ev.query()}
        t = time.monotonic()
        snap = fetch_state(ctx.peers[0], {}, secret=SECRET, timeout=30.0, into={"w": w},
                           after=ev if after else None)
        o["fetch_s"] = _r(time.monotonic() - t)
        side.synchronize()
        g.synchronize()
        o["in_place"] = snap.tensors["w"].data_ptr() == w.data_ptr()
        o["values"] = {str(v): int((w == v).sum()) for v in (5.0, -1.0, 0.0)}
        return w, o
    # A first fetch allocates the pinned staging buffers on both sides; a page-locked allocation
    # synchronizes every stream implicitly (CUDA's programming guide), which would order the copies
    # by itself.
    warm = g.full(n_el, 0.0)
    fetch_state(ctx.peers[0], {}, secret=SECRET, timeout=30.0, into={"w": warm})
    g.synchronize()
    _, out["control_without_after"] = fetch(False)
    w, out["with_after"] = fetch(True)
    ctx.mark("fetched")
    a, ctl = out["with_after"], out["control_without_after"]
    if not a["write_pending_at_fetch"]:
        why.append("the joiner's write had finished before the fetch: injection too short")
    if not a["in_place"]:
        why.append("the snapshot did not land in the joiner's tensor")
    if a["values"]["5.0"] != n_el:
        why.append(f"after the fetch the tensor holds {a['values']}, not the donor's 5.0 everywhere: the copies "
                   "raced a queued write (the joiner's optimizer step: -1, or the donor's: 0)")
    if ctl["values"]["-1.0"] != n_el:
        why.append(f"the control fetch without `after` did not show the race ({ctl['values']}): the check cannot "
                   "tell ordered copies from lucky timing")
    return verdict(out, why)


def b_diloco(ctx: Ctx) -> dict[str, Any]:
    """DiLoCo replicas (one per rank) whose syncs run on NCCL (one GPU: distinct NCCL_HOSTID); the
    last one is killed after 3 syncs, the others go on (three replicas: two keep the majority)."""
    import torch

    from p2pft import Runtime
    from p2pft.transport import DataServer
    from p2pft.trainer import DiLoCo

    g = ctx.gpu
    ctx.share_device()
    built: list[Any] = []
    orig = DataServer.communicator

    def recording(self: Any, *a: Any, **k: Any) -> Any:
        comm = orig(self, *a, **k)
        built.append(comm)
        return comm
    DataServer.communicator = recording
    addrs = [f"127.0.0.1:{p}" for p in os.environ["GPU_CHECK_PORTS"].split(",")]
    rt = Runtime(replica_id=f"r{ctx.rank}", listen=addrs[ctx.rank], seeds=[a for a in addrs if a != addrs[ctx.rank]],
                 data_plane="nccl", secret=SECRET, comm_timeout=10.0).start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16)).to(g.dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = DiLoCo(rt, model, opt, sync_every=4, batch_per_replica=4, min_replicas=ctx.world, loop_timeout=None)
    dl.start()
    syncs: list[dict[str, Any]] = []
    out: dict[str, Any] = {"syncs": syncs}
    killed: dict[str, Any] | None = None
    victim = ctx.rank == ctx.world - 1
    deadline = time.monotonic() + ctx.limit - 15.0
    while time.monotonic() < deadline:
        idx = dl.begin()
        dl.zero_grad()
        if idx:
            gen = torch.Generator().manual_seed(idx[0])
            xb = torch.randn(len(idx), 16, generator=gen).to(g.dev)
            (model(xb) - torch.tanh(xb.flip(1))).pow(2).mean().backward()
        res = dl.commit()
        if res.outer is not None and res.outer.committed:
            syncs.append({"sync": res.syncs, "n": res.outer.contributors, "digest": dl.digest(), "t": time.time()})
            ctx.mark("syncs", res.syncs)
            ctx.partial(out)
        if not victim:
            killed = killed or ctx.wait_mark("killed", PARENT, 0)
            if killed is not None and sum(1 for s in syncs if s["t"] > killed["t"]) >= 2:
                break
    types = sorted({type(c).__name__ for c in built})
    out.update(communicators=len(built), communicator_types=types,
               tcp_fallbacks=sum(1 for c in built if getattr(c, "tcp", None) is not None))
    why = []
    if types != ["NcclCommunicator"] or out["tcp_fallbacks"]:
        why.append(f"the syncs did not all run on NCCL: {types}, {out['tcp_fallbacks']} TCP fallbacks")
    if not victim:
        after = [s for s in syncs if killed is not None and s["t"] > killed["t"]]
        out["syncs_after_kill"] = len(after)
        out["kill_to_next_commit_s"] = _r(after[0]["t"] - killed["t"]) if after and killed else None
        if killed is None:
            why.append("the last replica was never killed (fewer than 3 syncs together?)")
        elif len(after) < 2 or any(s["n"] != ctx.world - 1 for s in after):
            why.append(f"after the kill: {after}")
    dl.close()
    rt.close(leave=True)
    return verdict(out, why)


BODIES: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "preflight": b_preflight, "nccl_one_rank": b_nccl_one_rank, "stream_order": b_stream_order,
    "sum": b_sum, "count_mismatch": b_count_mismatch, "slow_first_step": b_slow_first_step,
    "kill_peer": b_kill_peer, "stop_peer": b_stop_peer, "stop_peer_watchdog": b_stop_peer_watchdog,
    "close_during": b_close_during, "fast_forward": b_fast_forward, "auto_epochs": b_auto_epochs,
    "churn": b_churn, "peer_dies_before_init": b_peer_dies_before_init, "catchup_cuda": b_catchup_cuda,
    "diloco": b_diloco,
}


def rank_main(body: str, rank: int, world: int, wd: str, layout: str, env: dict[str, str], log: str,
              limit: float) -> None:
    """A rank process: its log, its environment, a hard limit (faulthandler dumps the threads
    and exits), then the scenario; its result to result.<rank>.json."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:   # die with the check (Linux): a rank must not outlive a killed parent
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - elsewhere the hard limit still ends it
        pass
    os.environ.clear()
    os.environ.update(env)
    import faulthandler
    faulthandler.enable()
    faulthandler.dump_traceback_later(limit, exit=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    ctx = Ctx(body, rank, world, Path(wd), layout, limit)
    try:
        res = BODIES[body](ctx)
    except BaseException as e:  # noqa: BLE001 - the row says what broke
        traceback.print_exc()
        res = {"ok": False, "why": [f"rank {rank} raised {type(e).__name__}: {e}"[:500]]}
    res["wall_s"] = _r(time.monotonic() - t0)
    write_mark(Path(wd) / f"result.{rank}.json", res)
    try:
        ctx.close()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Not the interpreter's teardown: a communicator left to CuPy's finalizer would run a
        # blocking destroy there; what the scenario checks is done.
        os._exit(0)
