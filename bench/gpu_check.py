"""The first thing to run on a lent GPU (about ten minutes on one GPU): does the NCCL path work?

    python bench/gpu_check.py [--json results/gpu_check.json] [--tmp DIR] [--only NAME,...]

It records the versions (torch, CUDA driver, NCCL from torch and from CuPy, CuPy, the libnccl
files loaded), then runs two NCCL ranks on one GPU: two processes with distinct
``NCCL_HOSTID`` (NCCL then takes them for two hosts and allows one GPU twice), P2P and SHM off
(the ranks talk over sockets), and p2pft's shared-device check bypassed for these processes only.
Each scenario runs in two fresh rank processes (forked from a server that imported torch and
p2pft once, nothing initialised) with a hard timeout and ``faulthandler`` (a hung rank dumps its
threads to its log and exits):

  * sum: a sum and a joiner (contribute=False), with init and allreduce times;
  * count_mismatch: different element counts: ProtocolMismatch on both ranks, no hang;
  * slow_first_step: 1.5 s (rank 1: 2 s) of kernels queued ahead of the first allreduce (timeout
    1 s): no timeout;
  * kill_peer / stop_peer: the peer SIGKILLed / SIGSTOPped after init: the survivor's error and
    the time ncclCommAbort took (a stopped peer may hold abort up: then the watchdog takes the
    survivor down, exit status 4, which is the expected outcome and recorded as such);
  * close_during: close() while a collective is stuck on the idle peer: returns at once;
  * fast_forward: a step buffer served to the peer while this rank's next allGather spins on it;
  * auto_epochs: 30 data epochs under data plane ``auto`` on the shared GPU: every one falls back
    to the TCP ring (identities compared), threads and fds counted (no bootstrap root left).

Then, on a GPU only: one-rank NCCL timings, stream order on real kernels, and three replicas of
the example job sharing the GPU over TCP and under ``auto``, each with a kill and a catch-up.
With two or more GPUs it also runs the two-rank scenarios with one GPU per rank (P2P on), NCCL
bus bandwidth against torch.distributed's in the same processes, and replicas with
``--data-plane nccl``.

Without CUDA it says so and exits 0. With ``tests/fakes`` first on ``PYTHONPATH`` (the CPU
stand-in of CuPy's NCCL and of the device) it runs the two-rank scenarios end to end on the
stand-in, in well under a minute: that is how CI keeps this script working. JSON out
(``--json``); exit status 1 when a check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from p2pft.deploy.ports import free_ports
from p2pft.chaos.records import read_stats
from p2pft.deploy.procs import spawn as spawn_child, terminate

MiB = 1 << 20
#: a rank process that has not finished by then dumps its threads (faulthandler) and exits
WORKER_LIMIT_S = 60.0
PAIR_SCENARIOS = ("sum", "count_mismatch", "slow_first_step", "kill_peer", "stop_peer", "close_during",
                  "fast_forward", "auto_epochs")
AUTO_EPOCHS = 30


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _slow_fill(x: Any, value: float) -> None:
    """On the current stream: ~50 ms of spinning, then fill x (the value arrives late)."""
    import torch
    torch.cuda._sleep(50_000_000)
    x.fill_(value)


# ---------------------------------------------------------------------------- single-GPU checks
def check_nccl_one_rank() -> dict[str, Any]:
    import torch
    from p2pft.transport import CommAborted, DataServer

    ds = DataServer("127.0.0.1", 0)
    out: dict[str, Any] = {}
    try:
        x = torch.ones(16 * MiB, device="cuda")          # 64 MiB
        torch.cuda.synchronize()
        c, out["build_s"] = _timed(lambda: ds.communicator(1, 0, 0, [ds.addr], backend="nccl", timeout=60.0))
        n, out["init_and_first_allreduce_s"] = _timed(lambda: c.allreduce(x, tag=1))
        ok = n == 1 and bool(torch.all(x == 1))
        times = []
        for i in range(10):
            torch.cuda.synchronize()
            _, t = _timed(lambda: c.allreduce(x, tag=2 + i))
            times.append(t)
        out["allreduce_64MiB_median_s"] = statistics.median(times)
        ok &= c.allreduce(x, contribute=False, tag=99) == 0 and int(torch.count_nonzero(x)) == 0
        _, out["abort_s"] = _timed(lambda: c.abort("gpu check"))
        try:
            c.allreduce(x)
            ok = False
        except CommAborted:
            pass
        c.close()
        c2 = ds.communicator(2, 0, 0, [ds.addr], backend="nccl", timeout=60.0)
        x.fill_(2)
        n2, out["reinit_epoch2_first_allreduce_s"] = _timed(lambda: c2.allreduce(x, tag=1))
        ok &= n2 == 1 and bool(torch.all(x == 2))
        c2.close()
        out["ok"] = bool(ok)
    finally:
        ds.close()
    return out


def check_stream_order() -> dict[str, Any]:
    import torch
    from p2pft.transport import DataServer

    out: dict[str, Any] = {}
    # NCCL (one rank): the call is enqueued on torch's current stream behind the slow fill, and
    # returns only once that stream has finished it.
    ds = DataServer("127.0.0.1", 0)
    try:
        c = ds.communicator(1, 0, 0, [ds.addr], backend="nccl", timeout=60.0)
        x = torch.zeros(MiB, device="cuda")
        c.allreduce(x)                                   # init outside the measured part
        _slow_fill(x, 3.0)
        n = c.allreduce(x, tag=1)
        done = torch.cuda.current_stream().query()
        y = x * 2                                        # no sync: stream order only
        out["nccl"] = {"count": n, "stream_done_on_return": bool(done), "sum_ok": bool(torch.all(y == 6.0))}
        c.close()
    finally:
        ds.close()
    # TCP with CUDA tensors, two ranks on this GPU, each on its own stream: the copy stream waits
    # for the slow fill, the caller's stream waits for the copies up.
    servers = [DataServer("127.0.0.1", 0) for _ in range(2)]
    peers = [s.addr for s in servers]
    comms = [s.communicator(1, 0, r, peers) for r, s in enumerate(servers)]
    res: list[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            comms[r].piece_bytes = 4 * MiB
            with torch.cuda.stream(torch.cuda.Stream()):
                t = torch.zeros(5 * MiB + 7, device="cuda")
                _slow_fill(t, float(r + 1))
                comms[r].allreduce(t, tag=1)
                y = t * 2
                res[r] = bool(torch.all(y == 6.0))
        except BaseException as e:  # noqa: BLE001 - reported
            res[r] = repr(e)
    ths = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(120)
    for c in comms:
        c.close()
    for s in servers:
        s.close()
    out["tcp_staged"] = {"ranks_ok": res}
    out["ok"] = (out["nccl"]["count"] == 1 and out["nccl"]["stream_done_on_return"] and out["nccl"]["sum_ok"]
                 and res == [True, True])
    return out


# ---------------------------------------------------------------------------- replicas
def _last_step(path: Path) -> int:
    st = [r["step"] for r in read_stats(path) if r.get("kind") is None and "step" in r and r.get("c")]
    return max(st, default=-1)


def check_replicas(devices: list[str], plane: str, tmp: Path, budget_s: float = 100.0) -> dict[str, Any]:
    """len(devices) replicas, one SIGKILLed at step 10 and restarted; digests at equal steps."""
    n = len(devices)
    addrs = [f"127.0.0.1:{p}" for p in free_ports(n)]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stats: dict[str, Path] = {}

    def spawn(i: int, name: str) -> None:
        seeds = ",".join(a for j, a in enumerate(addrs) if j != i)
        stats[name] = tmp / f"{plane}-{name}.jsonl"
        log = open(tmp / f"{plane}-{name}.log", "wb")
        procs[name] = spawn_child(  # dies with this script, like every launcher here
            [sys.executable, "-m", "p2pft.trainer.examples.replica", "--replica-id", f"r{i}", "--listen", addrs[i],
             "--seeds", seeds, "--stats", str(stats[name]), "--device", devices[i], "--data-plane", plane,
             "--mlp-params", "2000000", "--batch", "4", "--digest-every", "5", "--step-delay", "0.02",
             "--min-replicas", str(n), "--log-level", "INFO"],
            stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ, OMP_NUM_THREADS="2"))
        log.close()

    def wait(cond: Callable[[], bool], timeout: float, what: str) -> float:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if cond():
                return time.time() - t0
            dead = [k for k, p in procs.items() if p.poll() is not None and p.returncode != -signal.SIGKILL]
            if dead:
                raise RuntimeError(f"{dead[0]} exited ({procs[dead[0]].returncode}) waiting for {what}: "
                                   + (tmp / f"{plane}-{dead[0]}.log").read_text()[-1500:])
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")

    out: dict[str, Any] = {"replicas": n, "devices": devices, "data_plane": plane}
    t_start = time.time()
    try:
        for i in range(n):
            spawn(i, f"r{i}")
        out["start_s"] = wait(lambda: all(_last_step(p) >= 10 for p in stats.values()), budget_s, "step 10")
        victim = n - 1
        procs[f"r{victim}"].kill()
        procs[f"r{victim}"].wait(10)
        t_kill = time.time()
        at_kill = max(_last_step(stats[f"r{i}"]) for i in range(n - 1))
        out["survivors_resume_s"] = wait(lambda: all(_last_step(stats[f"r{i}"]) >= at_kill + 3 for i in range(n - 1)),
                                         60, "survivors to go on")
        spawn(victim, f"r{victim}b")
        joined = stats[f"r{victim}b"]

        def caught_up() -> bool:
            return any(r.get("event") == "catchup_done" for r in read_stats(joined))
        out["restart_to_caught_up_s"] = wait(caught_up, budget_s - (time.time() - t_start), "catch-up")
        target = _last_step(stats["r0"]) + 10
        wait(lambda: all(_last_step(p) >= target for k, p in stats.items() if k != f"r{victim}"), 60,
             f"step {target} everywhere")
        out["kill_to_caught_up_s"] = time.time() - t_kill
    finally:
        terminate(list(procs.values()), grace=20)
    digests: dict[int, dict[str, str]] = {}
    for name, path in stats.items():
        for r in read_stats(path):
            if "digest" in r and r.get("kind") is None:
                digests.setdefault(int(r["step"]), {})[name] = r["digest"]
    shared = {s: d for s, d in digests.items() if len(d) > 1}
    joined_steps = [s for s, d in shared.items() if f"r{n - 1}b" in d]
    out["digest_steps_compared"] = len(shared)
    out["joiner_steps_compared"] = len(joined_steps)
    out["digests_equal"] = all(len(set(d.values())) == 1 for d in shared.values())
    out["ok"] = bool(out["digests_equal"] and joined_steps)
    return out


# ---------------------------------------------------------------------------- multi-GPU bandwidth
def bw_worker(rank: int, world: int, tmp: Path, port: int) -> None:
    """One process per GPU: p2pft NCCL and torch.distributed NCCL, timed alternately."""
    import torch
    import torch.distributed as dist
    from p2pft.transport import DataServer

    torch.cuda.set_device(rank)
    ds = DataServer("127.0.0.1", 0)
    (tmp / f"addr{rank}").write_text(ds.addr)
    deadline = time.time() + 60
    while not all((tmp / f"addr{r}").exists() for r in range(world)) and time.time() < deadline:
        time.sleep(0.05)
    peers = [(tmp / f"addr{r}").read_text() for r in range(world)]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comm = ds.communicator(1, 0, rank, peers, backend="nccl", timeout=120.0, connect_timeout=60.0)
    rows = []
    for mib in (64, 256):
        x = torch.ones(mib * MiB // 4, device="cuda")
        comm.allreduce(x)
        dist.all_reduce(x)
        tp, tt = [], []
        for i in range(8):
            for which in ((0, 1) if i % 2 else (1, 0)):
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if which == 0:
                    comm.allreduce(x, tag=i)
                else:
                    dist.all_reduce(x)
                torch.cuda.synchronize()
                (tp if which == 0 else tt).append(time.perf_counter() - t0)
        busf = 2 * (world - 1) / world * mib * MiB / 1e9
        rows.append({"MiB": mib, "p2pft_busbw_GBs": busf / statistics.median(tp),
                     "torch_busbw_GBs": busf / statistics.median(tt)})
    x = torch.full((MiB,), float(rank + 1), device="cuda")
    comm.allreduce(x, tag=123)
    ok = bool(torch.all(x == world * (world + 1) / 2))
    (tmp / f"bw{rank}.json").write_text(json.dumps({"rank": rank, "rows": rows, "sum_ok": ok}))
    comm.close()
    dist.destroy_process_group()
    ds.close()


def check_bandwidth(ngpu: int, tmp: Path) -> dict[str, Any]:
    port = free_ports(1)[0]
    wd = tmp / "bw"
    wd.mkdir(exist_ok=True)
    procs = [subprocess.Popen([sys.executable, __file__, "--bw-worker", str(r), "--world", str(ngpu),
                               "--tmp", str(wd), "--port", str(port)]) for r in range(ngpu)]
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(180))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs.append(None)
    res = [json.loads((wd / f"bw{r}.json").read_text()) for r in range(ngpu) if (wd / f"bw{r}.json").exists()]
    rows = []
    if len(res) == ngpu:
        for i, row in enumerate(res[0]["rows"]):  # the slowest rank decides
            rows.append({"MiB": row["MiB"],
                         "p2pft_busbw_GBs": min(r["rows"][i]["p2pft_busbw_GBs"] for r in res),
                         "torch_busbw_GBs": min(r["rows"][i]["torch_busbw_GBs"] for r in res)})
    return {"ranks": ngpu, "rows": rows, "returncodes": rcs,
            "ok": rcs == [0] * ngpu and len(res) == ngpu and all(r["sum_ok"] for r in res)}



# ---------------------------------------------------------------------------- versions
def _libnccl_loaded() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f if "libnccl" in ln and "/" in ln})
    except OSError:
        return []


def versions() -> dict[str, Any]:
    """torch, CUDA, the driver, NCCL as torch and CuPy see it, CuPy, and the libnccl files loaded."""
    out: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch
        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            try:
                v = torch.cuda.nccl.version()
                out["nccl_torch"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            except Exception as e:  # noqa: BLE001 - recorded
                out["nccl_torch"] = f"{type(e).__name__}: {e}"
    except ImportError as e:
        out["torch"] = f"ImportError: {e}"
    try:
        import cupy
        out["cupy"] = cupy.__version__
        from cupy.cuda import nccl
        out["nccl_cupy"] = int(nccl.get_version())
        out["nccl_cupy_build"] = int(nccl.get_build_version())
        try:
            out["driver"] = int(cupy.cuda.runtime.driverGetVersion())
        except Exception:  # noqa: BLE001 - the stand-in has no driver
            pass
    except Exception as e:  # noqa: BLE001 - no CuPy, or no NCCL in it
        out.setdefault("cupy", f"{type(e).__name__}: {e}"[:200])
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        pass
    out["libnccl_loaded"] = _libnccl_loaded()
    return out


# ---------------------------------------------------------------------------- two NCCL ranks
def _pair_env(layout: str, rank: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if layout == "one_gpu":
        # Two hosts to NCCL (it refuses one GPU twice on one host), talking over sockets.
        env.update(P2PFT_FAKE_GPU="0", NCCL_HOSTID=f"p2pft-gpu-check-{rank}", NCCL_P2P_DISABLE="1",
                   NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", NCCL_SOCKET_IFNAME=env.get("NCCL_SOCKET_IFNAME", "lo"))
    return env


def _wait_file(path: Path, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _slow_kernels(api: Any, seconds: float, device: int) -> None:
    """Queue `seconds` of kernels on the current stream without blocking the host."""
    if api.name != "cuda":
        api.slow_kernel(seconds)
        return
    import torch
    rate = getattr(torch.cuda.get_device_properties(device), "clock_rate", 1_500_000) * 1e3   # cycles/s
    torch.cuda._sleep(int(seconds * rate))


def pair_worker(scenario: str, rank: int, tmp: Path, layout: str) -> None:
    """One rank of a two-rank scenario: its result as JSON in tmp/<scenario>-<rank>.json."""
    import faulthandler
    faulthandler.dump_traceback_later(WORKER_LIMIT_S, exit=True)
    import torch
    from p2pft.transport import CommError, DataServer, StateSnapshot, fetch_state
    from p2pft.transport.device import device_api, written_event

    api = device_api()
    cuda = api.name == "cuda"
    device = rank if layout == "two_gpu" else 0
    if cuda:
        torch.cuda.set_device(device)
    dev = torch.device("cuda", device) if cuda else torch.device("cpu")
    if layout == "one_gpu" and scenario != "auto_epochs":
        real = api.identity     # for this test only: p2pft's "one device" check would refuse the pair
        api.identity = lambda index=None: f"{real(index)}#gpu-check-rank{rank}"  # type: ignore[method-assign]
    ds = DataServer("127.0.0.1", 0, secret=b"gpu-check")
    (tmp / f"{scenario}-addr{rank}").write_text(ds.addr)
    other = tmp / f"{scenario}-addr{1 - rank}"
    if not _wait_file(other, 30):
        raise SystemExit("the other rank never came")
    peers = [ds.addr, other.read_text()] if rank == 0 else [other.read_text(), ds.addr]
    out: dict[str, Any] = {"rank": rank}

    def mark(name: str) -> None:
        (tmp / f"{scenario}-{name}{rank}").write_text("1")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        else:
            api.current_stream(None).synchronize()

    def comm(epoch: int = 1, timeout: float = 10.0, backend: str = "nccl") -> Any:
        return ds.communicator(epoch, 0, rank, peers, backend=backend, timeout=timeout, connect_timeout=30.0)

    t0 = time.monotonic()
    try:
        if scenario == "sum":
            c = comm()
            out["init_done"] = c.wait_init(60)
            out["init_s"] = round(time.monotonic() - t0, 4)
            n = 64 * MiB // 4 if cuda else MiB // 4
            x = torch.full((n,), float(rank + 1), device=dev)
            out["count"] = c.allreduce(x, tag=1)
            sync()
            out["sum_ok"] = bool(torch.all(x == 3.0))
            y = torch.full((n,), float(rank + 1), device=dev)
            out["joiner_count"] = c.allreduce(y, contribute=rank == 0, tag=2)
            sync()
            out["joiner_ok"] = bool(torch.all(y == 1.0))
            times = []
            for i in range(5):
                sync()
                t1 = time.monotonic()
                c.allreduce(x, tag=10 + i)
                sync()
                times.append(time.monotonic() - t1)
            out[f"allreduce_{n * 4 // MiB}MiB_median_s"] = round(statistics.median(times), 5)
            c.close()
            out["ok"] = out["count"] == 2 and out["sum_ok"] and out["joiner_count"] == 1 and out["joiner_ok"]
        elif scenario == "count_mismatch":
            c = comm(timeout=3.0)
            c.wait_init(60)
            t1 = time.monotonic()
            out["error"] = _try(lambda: c.allreduce(torch.ones(1000 + rank, device=dev)))
            out["raised_after_s"] = round(time.monotonic() - t1, 3)
            c.close()
            out["ok"] = out["error"] == "ProtocolMismatch" and out["raised_after_s"] < 3.0
        elif scenario == "slow_first_step":
            c = comm(timeout=1.0)
            c.wait_init(60)
            x = torch.full((MiB // 4,), float(rank + 1), device=dev)
            _slow_kernels(api, 1.5 + 0.5 * rank, device)   # both steps slower than the timeout, rank 1 more
            out["error"] = _try(lambda: c.allreduce(x))
            sync()
            out["ok"] = out["error"] == "none" and bool(torch.all(x == 3.0))
            c.close()
        elif scenario in ("kill_peer", "stop_peer", "close_during"):
            c = comm(timeout=5.0 if scenario == "kill_peer" else 3.0)
            out["init_done"] = c.wait_init(60)
            mark("inited")
            if rank == 1:
                time.sleep(WORKER_LIMIT_S)     # killed, stopped or left idle by the parent
                return
            if not _wait_file(tmp / f"{scenario}-go", 30):
                raise SystemExit("the parent never said go")
            x = torch.ones(MiB // 4, device=dev)
            if scenario == "close_during":
                errs: list[str] = []
                th = threading.Thread(target=lambda: errs.append(_try(lambda: c.allreduce(x, timeout=30.0))))
                th.start()
                time.sleep(1.0)
                t1 = time.monotonic()
                c.close()
                out["close_s"] = round(time.monotonic() - t1, 3)
                th.join(10)
                out["op_returned"] = not th.is_alive()
                out["error"] = errs[0] if errs else None
                out["released"] = c.wait_released(10)
                out["ok"] = out["close_s"] < 2.0 and out["op_returned"] and out["error"] == "CommAborted"
            else:
                t1 = time.monotonic()
                out["error"] = _try(lambda: c.allreduce(x))
                out["raised_after_s"] = round(time.monotonic() - t1, 3)
                t2 = time.monotonic()
                out["abort_returned"] = c.wait_released(10.0 if scenario == "kill_peer" else 1.5)
                out["abort_s"] = round(time.monotonic() - t2, 3) if out["abort_returned"] else None
                out["ok"] = out["error"] in ("PeerFailed", "CommTimeout", "CommError") and out["raised_after_s"] < 8.0
                if scenario == "kill_peer":
                    out["ok"] = out["ok"] and out["abort_returned"]
                if scenario == "stop_peer" and not out["abort_returned"]:
                    (tmp / f"{scenario}-{rank}.json").write_text(json.dumps(out))
                    time.sleep(WORKER_LIMIT_S)   # the abort watchdog takes this process down (exit 4)
                    return
        elif scenario == "fast_forward":
            c = comm(timeout=20.0)
            c.wait_init(60)
            if rank == 0:
                buf = torch.full((4 * MiB // 4,), 5.0, device=dev)     # the step this rank reduced
                ready = written_event(buf)
                ds.serve_state(lambda req: StateSnapshot(meta={"step": 7}, tensors={"g7": buf}, ready=ready))
                nxt = torch.ones(16, device=dev)
                errs = []
                th = threading.Thread(target=lambda: errs.append(_try(lambda: c.allreduce(nxt, tag=8))))
                th.start()                      # step 8's tag exchange: an allGather spinning on rank 1
                time.sleep(0.5)
                mark("spinning")
                th.join(30)
                out["next_step"] = errs[0] if errs else "stuck"
                out["ok"] = out["next_step"] == "none"
            else:
                _wait_file(tmp / f"{scenario}-spinning0", 30)
                t1 = time.monotonic()
                snap = fetch_state(peers[0], {}, secret=b"gpu-check", timeout=10.0)
                out["fetch_s"] = round(time.monotonic() - t1, 3)
                got = snap.tensors["g7"]
                out["data_ok"] = bool(torch.all(got == 5.0))
                out["next_step"] = _try(lambda: c.allreduce(torch.ones(16, device=dev), tag=8))
                out["ok"] = out["data_ok"] and out["fetch_s"] < 5.0 and out["next_step"] == "none"
            c.close()
        elif scenario == "auto_epochs":
            import threading as th_mod

            def fds() -> int:
                return len(os.listdir("/proc/self/fd"))
            fell_back, sums = [], []
            base: tuple[int, int] | None = None
            for e in range(1, AUTO_EPOCHS + 1):
                c = comm(epoch=e, backend="nccl-auto")
                x = torch.full((4096,), float(rank + 1), device=dev)
                n = c.allreduce(x, tag=e)
                sync()
                sums.append(n == 2 and bool(torch.all(x == 3.0)))
                fell_back.append(c.tcp is not None)
                c.close()
                if e == 1:
                    time.sleep(0.2)
                    base = (th_mod.active_count(), fds())
            time.sleep(0.5)
            assert base is not None
            out["thread_growth"] = th_mod.active_count() - base[0]
            out["fd_growth"] = fds() - base[1]
            out["fell_back"] = sum(fell_back)
            out["sums_ok"] = all(sums)
            want = AUTO_EPOCHS if layout == "one_gpu" else 0
            out["ok"] = (out["sums_ok"] and out["fell_back"] == want and out["thread_growth"] <= 3
                         and out["fd_growth"] <= 3)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
    except CommError as e:
        out.update(ok=False, error=f"{type(e).__name__}: {e}")
    out["wall_s"] = round(time.monotonic() - t0, 3)
    (tmp / f"{scenario}-{rank}.json").write_text(json.dumps(out))
    ds.close()


def _try(fn: Callable[[], Any]) -> str:
    """The class name of what `fn` raised, or "none"."""
    try:
        fn()
        return "none"
    except Exception as e:  # noqa: BLE001 - the class is the result
        return type(e).__name__


_CTX: Any = None


def _context() -> Any:
    """Rank processes are forked from a server that has imported torch and p2pft once (and
    initialised nothing: no CUDA, no NCCL): each scenario still gets fresh processes, without
    paying for the imports every time."""
    global _CTX
    if _CTX is None:
        import multiprocessing as mp
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "p2pft.transport"])
    return _CTX


def _pair_main(scenario: str, rank: int, wd: str, layout: str, env: dict[str, str], log: str) -> None:
    """A rank process: its environment and log first, then the scenario."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:   # die with the check (Linux): a rank must not outlive a killed parent
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - elsewhere the hard timeout still ends it
        pass
    os.environ.clear()
    os.environ.update(env)
    import faulthandler
    faulthandler.enable()
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pair_worker(scenario, rank, Path(wd), layout)


def check_pair(scenario: str, tmp: Path, layout: str = "one_gpu", limit: float = 90.0) -> dict[str, Any]:
    """Run `scenario` in two fresh rank processes (hard limit `limit` s); both ranks' results."""
    wd = tmp / f"pair-{layout}"
    wd.mkdir(parents=True, exist_ok=True)
    logs = [wd / f"{scenario}-{r}.log" for r in range(2)]
    ctx = _context()
    procs = []
    for r in range(2):
        env = _pair_env(layout, r)
        if scenario == "stop_peer":
            env["P2PFT_NCCL_ABORT_TIMEOUT_S"] = "4"
        pr = ctx.Process(target=_pair_main, args=(scenario, r, str(wd), layout, env, str(logs[r])),
                         name=f"gpu-check-{scenario}-{r}", daemon=True)
        pr.start()
        procs.append(pr)
    out: dict[str, Any] = {}
    end = time.monotonic() + limit

    def wait(pr: Any) -> int:
        pr.join(max(1.0, end - time.monotonic()))
        if pr.exitcode is None:
            raise TimeoutError(f"{pr.name} still running after {limit:g} s")
        return int(pr.exitcode)
    try:
        if scenario in ("kill_peer", "stop_peer", "close_during"):
            if not all(_wait_file(wd / f"{scenario}-inited{r}", max(1.0, end - time.monotonic())) for r in range(2)):
                raise RuntimeError("init did not finish")
            if scenario == "kill_peer":
                procs[1].kill()
            elif scenario == "stop_peer":
                os.kill(procs[1].pid, signal.SIGSTOP)
            (wd / f"{scenario}-go").write_text("1")
            out["rank0_exit"] = wait(procs[0])
            if scenario == "stop_peer":
                os.kill(procs[1].pid, signal.SIGCONT)
            res = [json.loads((wd / f"{scenario}-0.json").read_text())]
        else:
            out["exits"] = [wait(pr) for pr in procs]
            res = [json.loads((wd / f"{scenario}-{r}.json").read_text()) for r in range(2)]
    except (TimeoutError, RuntimeError, OSError, ValueError) as e:
        out.update(ok=False, error=f"{type(e).__name__}: {e}",
                   logs=[lg.read_text(errors="replace")[-1500:] for lg in logs])
        return out
    finally:
        for pr in procs:
            if pr.exitcode is None:
                try:
                    os.kill(pr.pid, signal.SIGCONT)
                except OSError:
                    pass
                pr.kill()
                pr.join(5)
    out["ranks"] = res
    out["ok"] = all(r.get("ok") for r in res)
    if scenario == "stop_peer" and not res[0].get("abort_returned"):
        # ncclCommAbort held up by the stopped peer: the watchdog must have taken rank 0 down
        out["watchdog_exit"] = out.get("rank0_exit") == 4
        out["ok"] = out["ok"] and out["watchdog_exit"]
    elif "rank0_exit" in out:
        out["ok"] = out["ok"] and out["rank0_exit"] == 0
    if "exits" in out:
        out["ok"] = out["ok"] and out["exits"] == [0, 0]
    if not out["ok"]:
        out["logs"] = [lg.read_text(errors="replace")[-1500:] for lg in logs]
    return out


# ---------------------------------------------------------------------------- main
def _summary(name: str, r: dict[str, Any]) -> str:
    nums = ""
    if "rows" in r:
        nums = "; ".join(f"{x['MiB']} MiB p2pft {x['p2pft_busbw_GBs']:.1f} / torch {x['torch_busbw_GBs']:.1f} GB/s"
                         for x in r["rows"])
    elif "ranks" in r:
        keys = ("init_s", "raised_after_s", "abort_s", "close_s", "fetch_s", "fell_back", "error")
        nums = ", ".join(f"{k}={v}" for k in keys for v in [r["ranks"][0].get(k)] if v is not None)
    else:
        nums = ", ".join(f"{k}={v:.3g}" for k, v in r.items() if isinstance(v, float))
    return f"{name:<28} {'ok' if r.get('ok') else 'FAILED':<7} {nums or r.get('error', '')}"[:300]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--tmp", default=None, help="directory for logs (default: a fresh temporary one)")
    p.add_argument("--only", default=None, help="comma list of checks to run (default: all)")
    p.add_argument("--pair-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--layout", default="one_gpu", help=argparse.SUPPRESS)
    p.add_argument("--bw-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pair_worker is not None:
        pair_worker(args.pair_worker, args.rank, Path(args.tmp), args.layout)
        return 0
    if args.bw_worker is not None:
        bw_worker(args.bw_worker, args.world, Path(args.tmp), args.port)
        return 0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    from p2pft.transport.device import device_api
    standin = device_api().name != "cuda"
    ngpu = gpu_count()
    result: dict[str, Any] = {"gpus": ngpu, "checks": {}}
    if ngpu == 0 and not standin:
        print("gpu_check: no GPU found (torch.cuda sees no device); nothing to check")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    result["standin"] = standin
    result["versions"] = versions()
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="p2pft-gpu-check-"))
    tmp.mkdir(parents=True, exist_ok=True)
    result["logs"] = str(tmp)
    checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (f"pair_one_gpu_{s}", (lambda s=s: check_pair(s, tmp, "one_gpu"))) for s in PAIR_SCENARIOS]
    if ngpu >= 1:
        checks += [
            ("nccl_one_rank", check_nccl_one_rank),
            ("stream_order", check_stream_order),
            ("replicas_tcp_cuda", lambda: check_replicas(["cuda:0"] * 3, "tcp", tmp)),
            ("replicas_auto_one_gpu", lambda: check_replicas(["cuda:0"] * 3, "auto", tmp)),
        ]
    if ngpu >= 2:
        checks += [(f"pair_two_gpus_{s}", (lambda s=s: check_pair(s, tmp, "two_gpu"))) for s in PAIR_SCENARIOS]
        checks += [("nccl_vs_torch", lambda: check_bandwidth(ngpu, tmp)),
                   ("replicas_nccl", lambda: check_replicas([f"cuda:{i}" for i in range(min(3, ngpu))], "nccl", tmp))]
    if args.only:
        wanted = {w.strip() for w in args.only.split(",") if w.strip()}
        unknown = wanted - {n for n, _ in checks}
        if unknown:
            p.error(f"unknown check(s) {', '.join(sorted(unknown))}; choose from {', '.join(n for n, _ in checks)}")
        checks = [(n, f) for n, f in checks if n in wanted]
    print(f"gpu_check: {'the CPU stand-in' if standin else f'{ngpu} GPU(s)'}; versions: "
          + json.dumps(result["versions"])[:600], flush=True)
    for name, fn in checks:
        t0 = time.time()
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001 - one failed check does not hide the others
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        r["wall_s"] = round(time.time() - t0, 2)
        result["checks"][name] = r
        print(_summary(name, r), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    ok = all(r.get("ok") for r in result["checks"].values())
    where = "on the CPU stand-in" if standin else f"{ngpu} GPU(s)"
    print(f"gpu_check: {where}, {'all checks passed' if ok else 'SOME CHECKS FAILED'} (logs in {tmp})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
