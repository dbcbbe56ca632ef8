"""Allreduce bus bandwidth of the p2pft tcp backend against torch Gloo, in the same processes.

Each rank is one process on loopback that holds both a p2pft DataServer communicator and a Gloo
process group; every iteration times both back to back (alternating which goes first) so that
background load hits both alike. Reported time is the slowest rank's, median over iterations;
bus bandwidth = 2 (n-1)/n * bytes / time.

    python bench/allreduce.py                       # 2,3,4 ranks x 1,16,64,256 MB
    python bench/allreduce.py --quick               # < ~60 s
    python bench/allreduce.py --ranks 3 --sizes 1,64 --json out.json
    python bench/allreduce.py --state               # fetch_state of 1 GB: GB/s and peak extra memory
    python bench/allreduce.py --ranks 2 --pin       # each rank on a core of its own (taskset-style)
    python bench/allreduce.py --python-loop         # p2pft on its Python ring loop, not the C one

CPU seconds per allreduce (per rank, process time) are reported beside bandwidth for both: on a
machine with fewer cores than ranks, wall time measures the machine, CPU time the code.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from typing import Any

from p2pft.deploy.procs import die_with_parent
from p2pft.deploy.ports import free_ports

MB = 1 << 20


def _free_port() -> int:
    return free_ports(1)[0]


# ---------------------------------------------------------------------------- allreduce workers
def _allreduce_worker(rank: int, n: int, gloo_port: int, sizes: list[int], warmup: int, iters: int,
                      chunk_bytes: int, lanes: int, bufsize: int | None, inline: bool, addr_q: Any, peers_q: Any,
                      out_q: Any, pin: bool = False) -> None:
    die_with_parent()
    if pin:  # one core per rank (rank r on core r mod ncpu): the CPU is not shared between ranks
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    import torch
    import torch.distributed as dist

    from p2pft.transport import DataServer

    torch.set_num_threads(1)
    server = DataServer(chunk_bytes=chunk_bytes, lanes=lanes, sock_bufsize=bufsize, inline_send=inline)
    addr_q.put((rank, server.addr))
    peers = peers_q.get(timeout=60)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=n)
    t0 = time.perf_counter()
    comm = server.communicator(1, 0, rank, peers, timeout=60.0)
    probe = torch.zeros(1)
    comm.allreduce(probe)
    setup_s = time.perf_counter() - t0
    results: dict[str, Any] = {"setup_s": setup_s, "times": {}}
    for mb in sizes:
        x = torch.randn(int(mb * MB) // 4)
        times: dict[str, list[float]] = {"p2pft": [], "gloo": []}
        cpu: dict[str, list[float]] = {"p2pft": [], "gloo": []}

        csw: dict[str, list[int]] = {"p2pft": [], "gloo": []}

        def run(backend: str) -> float:
            dist.barrier()
            c = time.process_time()
            v = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            t = time.perf_counter()
            if backend == "p2pft":
                comm.allreduce(x)
            else:
                dist.all_reduce(x)
            dt = time.perf_counter() - t
            cpu[backend].append(time.process_time() - c)
            csw[backend].append(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - v)
            return dt

        for _ in range(warmup):
            run("p2pft")
            run("gloo")
        for i in range(iters):
            order = ("p2pft", "gloo") if i % 2 == 0 else ("gloo", "p2pft")
            for b in order:
                times[b].append(run(b))
        results["times"][mb] = times
        results.setdefault("cpu", {})[mb] = {b: statistics.median(v[warmup:]) for b, v in cpu.items()}
        results.setdefault("csw", {})[mb] = {b: statistics.median(v[warmup:]) for b, v in csw.items()}
    comm.close()
    server.close()
    dist.destroy_process_group()
    out_q.put((rank, results))


def bench_allreduce(ranks: list[int], sizes: list[float], warmup: int, iters: int, chunk_bytes: int,
                    lanes: int, bufsize: int | None = None, inline: bool = True,
                    pin: bool = False) -> tuple[list[dict], list[dict]]:
    ctx = mp.get_context("spawn")
    rows: list[dict] = []
    setups: list[dict] = []
    for n in ranks:
        addr_q, out_q = ctx.Queue(), ctx.Queue()
        peers_qs = [ctx.Queue() for _ in range(n)]
        port = _free_port()
        procs = [ctx.Process(target=_allreduce_worker, args=(r, n, port, sizes, warmup, iters, chunk_bytes, lanes,
                                                             bufsize, inline, addr_q, peers_qs[r], out_q, pin),
                             daemon=True)
                 for r in range(n)]
        for p in procs:
            p.start()
        addrs = dict(addr_q.get(timeout=120) for _ in range(n))
        for q in peers_qs:
            q.put([addrs[r] for r in range(n)])
        res = dict(out_q.get(timeout=1800) for _ in range(n))
        for p in procs:
            p.join(30)
        setups.append({"ranks": n, "setup_ms": 1e3 * max(res[r]["setup_s"] for r in range(n))})
        for mb in sizes:
            for backend in ("p2pft", "gloo"):
                per_iter = [max(res[r]["times"][mb][backend][i] for r in range(n)) for i in range(iters)]
                t = statistics.median(per_iter)
                busbw = 2 * (n - 1) / n * mb * MB / t / 1e9
                cpu_s = statistics.mean(res[r]["cpu"][mb][backend] for r in range(n))
                csw = statistics.mean(res[r]["csw"][mb][backend] for r in range(n))
                rows.append({"backend": backend, "ranks": n, "mb": mb, "busbw_GBps": round(busbw, 3),
                             "time_s": round(t, 6), "cpu_s_per_rank": round(cpu_s, 6),
                             "ctx_switches_per_rank": round(csw, 1)})
    return rows, setups


# ---------------------------------------------------------------------------- state streaming
def _rss_peak_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _donor(total_bytes: int, addr_q: Any, done_q: Any, stop_q: Any) -> None:
    die_with_parent()
    import torch

    from p2pft.transport import DataServer, StateSnapshot

    per = total_bytes // 8
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float32] * 2
    tensors = {}
    for i, dt in enumerate(dtypes):
        el = per // torch.tensor([], dtype=dt).element_size()
        tensors[f"t{i}"] = torch.ones(el, dtype=dt)
    snap = StateSnapshot(meta={"step": 123}, tensors=tensors)
    server = DataServer()
    server.serve_state(lambda req: snap)
    _rss_peak_reset()
    base = _rss_kb("VmRSS")
    c = time.process_time()
    addr_q.put(server.addr)
    stop_q.get(timeout=600)
    done_q.put({"donor_peak_extra_mb": (_rss_kb("VmHWM") - base) / 1024,
                "donor_cpu_s_2_streams": time.process_time() - c})
    server.close()


def _joiner(addr: str, out_q: Any) -> None:
    die_with_parent()
    import torch  # noqa: F401 - counted in the baseline, not in the transfer

    from p2pft.transport import fetch_state

    _rss_peak_reset()
    base = _rss_kb("VmRSS")
    c = time.process_time()
    t = time.perf_counter()
    snap = fetch_state(addr, {"want": "all"}, timeout=60)
    dt = time.perf_counter() - t
    cpu = time.process_time() - c
    got = sum(x.numel() * x.element_size() for x in snap.tensors.values())
    peak_extra = (_rss_kb("VmHWM") - base) / 1024 - got / MB
    # Second pass into the tensors just received: the transfer without first-touch page faults.
    t = time.perf_counter()
    fetch_state(addr, {"want": "all"}, timeout=60, into=snap.tensors)
    warm = time.perf_counter() - t
    out_q.put({"bytes": got, "time_s": dt, "GBps": got / dt / 1e9, "joiner_cpu_s": cpu,
               "joiner_peak_extra_mb": peak_extra, "into_time_s": warm, "into_GBps": got / warm / 1e9})


def bench_state(total_mb: int) -> dict:
    ctx = mp.get_context("spawn")
    addr_q, done_q, stop_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    donor = ctx.Process(target=_donor, args=(total_mb * MB, addr_q, done_q, stop_q), daemon=True)
    donor.start()
    addr = addr_q.get(timeout=300)
    joiner = ctx.Process(target=_joiner, args=(addr, out_q), daemon=True)
    joiner.start()
    res = out_q.get(timeout=600)
    joiner.join(30)
    stop_q.put(True)
    res.update(done_q.get(timeout=60))
    donor.join(30)
    return res


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,3,4", help="comma-separated world sizes")
    ap.add_argument("--sizes", default="1,16,64,256", help="comma-separated tensor sizes in MB")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--chunk-kb", type=int, default=None, help="p2pft ring chunk size (default: library default)")
    ap.add_argument("--lanes", type=int, default=1, help="p2pft parallel connections per ring edge")
    ap.add_argument("--no-inline", action="store_true", help="p2pft: always hand sends to the sender thread")
    ap.add_argument("--python-loop", action="store_true",
                    help="p2pft: run allreduce on the Python ring loop instead of the C one (P2PFT_NATIVE_RING=0)")
    ap.add_argument("--bufsize-kb", type=int, default=None,
                    help="p2pft SO_SNDBUF/SO_RCVBUF (0: kernel autotuning; default: chosen per ring)")
    ap.add_argument("--quick", action="store_true", help="small run (< ~60 s)")
    ap.add_argument("--state", action="store_true", help="also time fetch_state of --state-mb")
    ap.add_argument("--state-only", action="store_true", help="only the state-streaming benchmark")
    ap.add_argument("--state-mb", type=int, default=1024)
    ap.add_argument("--pin", action="store_true",
                    help="pin rank r to core r mod ncpu (with ranks <= cores, each rank has a core of its own)")
    ap.add_argument("--json", metavar="FILE", help="write results as JSON")
    a = ap.parse_args(argv)

    from p2pft.transport import DEFAULT_CHUNK_BYTES

    from p2pft.transport import native

    if a.python_loop:
        os.environ[native.NATIVE_ENV] = "0"  # inherited by the rank processes
    loop = "c" if native.native_loop() is not None else "python"
    if a.quick:
        a.ranks, a.sizes, a.warmup, a.iters = "2,3", "1,16,64", 1, 5
        a.state_mb = min(a.state_mb, 256)
    ranks = [int(x) for x in a.ranks.split(",") if x]
    sizes = [float(x) if "." in x else int(x) for x in a.sizes.split(",") if x]
    chunk = a.chunk_kb * 1024 if a.chunk_kb else DEFAULT_CHUNK_BYTES
    bufsize = a.bufsize_kb * 1024 if a.bufsize_kb is not None else None
    out: dict[str, Any] = {"config": {"ranks": ranks, "sizes_mb": sizes, "warmup": a.warmup, "iters": a.iters,
                                      "chunk_bytes": chunk, "lanes": a.lanes,
                                      "bufsize": bufsize if bufsize is not None else "auto",
                                      "inline_send": not a.no_inline,
                                      "ring_loop": loop, "cpus": os.cpu_count(), "pinned": a.pin}}
    if not a.state_only:
        rows, setups = bench_allreduce(ranks, sizes, a.warmup, a.iters, chunk, a.lanes, bufsize,
                                       not a.no_inline, a.pin)
        ratios = []
        print(f"p2pft ring loop: {loop}")
        print(f"{'ranks':>5} {'MB':>6} {'p2pft GB/s':>11} {'gloo GB/s':>10} {'p2pft ms':>9} {'gloo ms':>9} "
              f"{'ratio':>6} {'p2pft cpu ms':>13} {'gloo cpu ms':>12} {'p2pft csw':>10} {'gloo csw':>9}")
        for n in ranks:
            for mb in sizes:
                p = next(r for r in rows if r["backend"] == "p2pft" and r["ranks"] == n and r["mb"] == mb)
                g = next(r for r in rows if r["backend"] == "gloo" and r["ranks"] == n and r["mb"] == mb)
                ratio = p["busbw_GBps"] / g["busbw_GBps"] if g["busbw_GBps"] else float("inf")
                ratios.append({"ranks": n, "mb": mb, "ratio": round(ratio, 3)})
                print(f"{n:>5} {mb:>6} {p['busbw_GBps']:>11.3f} {g['busbw_GBps']:>10.3f} "
                      f"{p['time_s'] * 1e3:>9.2f} {g['time_s'] * 1e3:>9.2f} {ratio:>6.2f} "
                      f"{p['cpu_s_per_rank'] * 1e3:>13.2f} {g['cpu_s_per_rank'] * 1e3:>12.2f} "
                      f"{p['ctx_switches_per_rank']:>10.0f} {g['ctx_switches_per_rank']:>9.0f}")
        for s in setups:
            print(f"communicator setup + first allreduce, {s['ranks']} ranks: {s['setup_ms']:.2f} ms")
        out.update(rows=rows, ratios=ratios, setup=setups)
    if a.state or a.state_only:
        st = bench_state(a.state_mb)
        print(f"fetch_state {st['bytes'] / 1e9:.2f} GB: {st['GBps']:.2f} GB/s ({st['time_s']:.2f} s, joiner cpu "
              f"{st['joiner_cpu_s']:.2f} s) into fresh tensors, {st['into_GBps']:.2f} GB/s into existing tensors; "
              f"peak extra memory: joiner {st['joiner_peak_extra_mb']:.1f} MB, "
              f"donor {st['donor_peak_extra_mb']:.1f} MB")
        out["state"] = st
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
