"""One-shot check of the GPU paths, for a machine with at least one CUDA device (< 7 minutes).

    python bench/gpu_check.py [--json results/gpu_check.json] [--tmp DIR]

With one GPU:
  * nccl_one_rank: a one-rank NCCL communicator built by the DataServer (id, init, allreduce of
    64 MiB, contribute=False, abort, re-init under a new data epoch), with timings;
  * stream_order: CuPy's NCCL call and the TCP backend's pinned staging on real tensors written
    by a slow kernel just before the call (no sync): the collective sees the finished values,
    and a kernel launched right after it sees the finished sum;
  * replicas_tcp_cuda: 3 replicas of the example job sharing the GPU (`--device cuda
    --data-plane tcp`), one SIGKILLed and restarted: it catches up and every digest at equal
    steps is equal;
  * replicas_auto_one_gpu: the same under `--data-plane auto`: NCCL refuses two ranks on one GPU,
    so the communicators must fall back to the TCP ring (device identities compared) and train.
With two or more GPUs, also:
  * nccl_lost_before_first: rank 1 of a two-GPU NCCL communicator SIGKILLed between init and its
    first collective: rank 0 gets a CommError within its 5 s timeout (bounded connect);
  * nccl_close_during_stuck: close() while a collective waits on an idle peer returns at once
    (ncclCommAbort, not ncclCommDestroy) and the collective raises CommAborted;
  * nccl_vs_torch: bus bandwidth of p2pft's NCCL allreduce against torch.distributed's NCCL, in
    the same processes (one per GPU), 64 and 256 MiB;
  * replicas_nccl: one replica per GPU (up to 3) with `--data-plane nccl`, a kill and a catch-up.

Without a GPU it says that it found none and exits 0. Exit status 1 when a check failed.
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


# ---------------------------------------------------------------------------- NCCL failure cases (2 GPUs)
def case_worker(case: str, rank: int, tmp: Path) -> None:
    """One rank of a two-GPU failure case: its result as JSON in tmp/<case>-<rank>.json."""
    import torch
    from p2pft.transport import CommError, DataServer

    torch.cuda.set_device(rank)
    ds = DataServer("127.0.0.1", 0)
    (tmp / f"{case}-addr{rank}").write_text(ds.addr)
    other = tmp / f"{case}-addr{1 - rank}"
    while not other.exists():
        time.sleep(0.05)
    peers = [ds.addr, other.read_text()] if rank == 0 else [other.read_text(), ds.addr]
    c = ds.communicator(1, 0, rank, peers, backend="nccl", timeout=5.0, connect_timeout=30.0)
    out: dict[str, Any] = {}
    c.wait_init(120)
    (tmp / f"{case}-inited{rank}").write_text("1")
    if rank == 1:
        time.sleep(60)          # killed (lost_before_first) or idle (close_during) until the parent stops it
        return
    x = torch.ones(MiB, device="cuda")
    if case == "lost_before_first":
        time.sleep(1.0)         # the parent kills rank 1 meanwhile
        t0 = time.time()
        try:
            c.allreduce(x)
            out["error"] = None
        except CommError as e:
            out["error"] = type(e).__name__
        out["raised_after_s"] = time.time() - t0
    else:                       # close_during: a collective stuck on rank 1, closed from another thread
        errs: list[str] = []
        th = threading.Thread(target=lambda: errs.append(_try(lambda: c.allreduce(x, timeout=60.0))))
        th.start()
        time.sleep(1.0)
        t0 = time.time()
        c.close()
        out["close_s"] = time.time() - t0
        th.join(10)
        out["op_returned"] = not th.is_alive()
        out["error"] = errs[0] if errs else None
    c.close()
    (tmp / f"{case}-0.json").write_text(json.dumps(out))


def _try(fn: Callable[[], Any]) -> str:
    try:
        fn()
        return "none"
    except Exception as e:  # noqa: BLE001 - the class is the result
        return type(e).__name__


def check_nccl_case(case: str, tmp: Path) -> dict[str, Any]:
    """lost_before_first: rank 1 SIGKILLed between init and its first collective, rank 0 must get a
    CommError within its 5 s timeout; close_during: close() during a collective stuck on rank 1
    must return at once (abort, not destroy)."""
    procs = [spawn_child([sys.executable, __file__, "--case", case, "--bw-worker", str(r), "--tmp", str(tmp)],
                         stdout=subprocess.DEVNULL, stderr=open(tmp / f"{case}-{r}.log", "wb"))
             for r in range(2)]
    try:
        end = time.time() + 150
        while not all((tmp / f"{case}-inited{r}").exists() for r in range(2)):
            if time.time() > end or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"init did not finish: {(tmp / f'{case}-0.log').read_text()[-1500:]}")
            time.sleep(0.1)
        if case == "lost_before_first":
            procs[1].kill()
        procs[0].wait(60)
        out = json.loads((tmp / f"{case}-0.json").read_text())
    finally:
        terminate(procs, grace=5)
    if case == "lost_before_first":
        out["ok"] = out["error"] is not None and out["raised_after_s"] < 8.0
    else:
        out["ok"] = out["close_s"] < 2.0 and out["op_returned"] and out["error"] == "CommAborted"
    return out


# ---------------------------------------------------------------------------- main
def _summary(name: str, r: dict[str, Any]) -> str:
    keys = [k for k, v in r.items() if isinstance(v, float)]
    nums = ", ".join(f"{k}={r[k]:.3g}" for k in keys[:5])
    if "rows" in r:
        nums = "; ".join(f"{x['MiB']} MiB p2pft {x['p2pft_busbw_GBs']:.1f} / torch {x['torch_busbw_GBs']:.1f} GB/s"
                         for x in r["rows"])
    return f"{name:<20} {'ok' if r.get('ok') else 'FAILED':<7} {nums or r.get('error', '')}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--tmp", default=None, help="directory for logs (default: a fresh temporary one)")
    p.add_argument("--bw-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.bw_worker is not None and args.case:
        case_worker(args.case, args.bw_worker, Path(args.tmp))
        return 0
    if args.bw_worker is not None:
        bw_worker(args.bw_worker, args.world, Path(args.tmp), args.port)
        return 0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    ngpu = gpu_count()
    result: dict[str, Any] = {"gpus": ngpu, "checks": {}}
    if ngpu == 0:
        print("gpu_check: no GPU found (torch.cuda sees no device); nothing to check")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    import torch
    result["torch"] = torch.__version__
    result["device"] = torch.cuda.get_device_name(0)
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="p2pft-gpu-check-"))
    tmp.mkdir(parents=True, exist_ok=True)
    result["logs"] = str(tmp)
    checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("nccl_one_rank", check_nccl_one_rank),
        ("stream_order", check_stream_order),
        ("replicas_tcp_cuda", lambda: check_replicas(["cuda:0"] * 3, "tcp", tmp)),
        ("replicas_auto_one_gpu", lambda: check_replicas(["cuda:0"] * 3, "auto", tmp)),
    ]
    if ngpu >= 2:
        checks += [("nccl_lost_before_first", lambda: check_nccl_case("lost_before_first", tmp)),
                   ("nccl_close_during_stuck", lambda: check_nccl_case("close_during", tmp)),
                   ("nccl_vs_torch", lambda: check_bandwidth(ngpu, tmp)),
                   ("replicas_nccl", lambda: check_replicas([f"cuda:{i}" for i in range(min(3, ngpu))], "nccl", tmp))]
    for name, fn in checks:
        t0 = time.time()
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001 - one failed check does not hide the others
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        r["wall_s"] = time.time() - t0
        result["checks"][name] = r
        print(_summary(name, r), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    ok = all(r.get("ok") for r in result["checks"].values())
    print(f"gpu_check: {ngpu} GPU(s), {'all checks passed' if ok else 'SOME CHECKS FAILED'} (logs in {tmp})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
