"""The first thing to run on a lent GPU (under 8 minutes on one GPU): does the NCCL path work?

    python3 bench/gpu_check.py --json OUT/gpu_check.json [--only NAME,...] [--budget-s 450] [--list]

docs/gpu.md has the commands for the lent machine and what each result means.

First a preflight, in a fresh process: the versions (torch, CUDA, the driver, NCCL as torch and
CuPy see it, CuPy), exactly one libnccl loaded, CuPy and torch on the same device and CUDA
runtime, p2pft installed. A failed preflight is reported and no scenario runs.

Then the scenarios, each in fresh processes (forked from a server that imported torch and p2pft
once, nothing initialised) with a hard limit of its own, in order of importance within a global
budget (a scenario that no longer fits is reported as skipped, which fails the run). Two NCCL
ranks share the one GPU as two processes with distinct ``NCCL_HOSTID`` (NCCL then takes them for
two hosts and allows one GPU twice), P2P and SHM off (they talk over sockets), p2pft's
shared-device check bypassed in those processes only. Every row of the JSON says what was
injected, what was expected, what was observed, and ok; the logs of every process go into one
tar file beside the JSON (``gpu_check_logs.tar.gz``). Faults are injected only once they are
seen to bite (a peer is killed once the collective is seen spinning on it), and every injected
delay is measured on the device, so a check whose fault did not happen fails.

Without CUDA it says so and exits 0. With ``tests/fakes`` first on ``PYTHONPATH`` (the CPU
stand-in of CuPy's NCCL and of the device) the preflight and every scenario that needs no real
GPU run on the stand-in: that is how CI keeps this script working. Exit status 1 when a check
failed or was skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_scenarios as gs  # noqa: E402 - beside this file
from p2pft.chaos.records import read_stats  # noqa: E402
from p2pft.deploy.ports import free_ports  # noqa: E402
from p2pft.deploy.procs import spawn as spawn_child, terminate  # noqa: E402

MiB = 1 << 20
DEFAULT_BUDGET_S = 450.0
LOGS_TAR = "gpu_check_logs.tar.gz"
#: a scenario needs at least this much of the budget to start
MIN_START_S = 20.0


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One row of the results: a rank body of gpu_scenarios (or a runner here) in fresh processes."""

    name: str
    body: str
    ranks: int
    layout: str                          # one_rank, one_gpu (two NCCL hosts on one device), two_gpu
    limit_s: float
    injected: str
    expect: str
    where: str = "any"                   # any (the stand-in too), gpu, gpus2
    env: tuple[tuple[str, str], ...] = ()
    exits: tuple[tuple[int, ...] | None, ...] = ()   # accepted exit statuses per rank (None: any); default 0
    driver: str | None = None            # the parent's part: kill, stop, diloco_kill
    runner: Callable[[Path, float], dict[str, Any]] | None = None


def pair_scenarios(layout: str) -> list[Scenario]:
    """The two-rank scenarios, on one GPU (one_gpu) or one GPU per rank (two_gpu)."""
    pre = "pair_one_gpu_" if layout == "one_gpu" else "pair_two_gpus_"
    where = "any" if layout == "one_gpu" else "gpus2"
    two = layout == "two_gpu"
    held = "; with two GPUs on one host ncclCommAbort may wait for the stopped local peer: then the " \
           "watchdog takes rank 0 down (exit 4), the documented bound" if two else ""
    out = [
        Scenario(pre + "sum", "sum", 2, layout, 60, "none: init, a sum, a joiner (contribute=False), 5 timed sums",
                 "count 2 and the sum; the joiner's count 1 and its peer's values"),
        Scenario(pre + "count_mismatch", "count_mismatch", 2, layout, 45,
                 "different element counts on the two ranks (1000 and 1001), both starting together",
                 "ProtocolMismatch on both ranks within 5 s (timeout 20 s); the release returns; the stream drains"),
        Scenario(pre + "slow_first_step", "slow_first_step", 2, layout, 75,
                 "(a) 1.5 and 1.6 timeouts (2 s; 1.5 s on the stand-in) of compute queued ahead of the first "
                 "allreduce (measured on the device); (b) 3 timeouts of compute (2.5 s on the stand-in) queued "
                 "ahead of an allreduce the peer never joins, aborted 0.5 s in",
                 "(a) no timeout and the right sum; (b) the call returns CommAborted within 0.5 s of the abort "
                 "(1.5 s on the stand-in) while the compute still runs (the host was not blocked behind it), "
                 "and the stream drains"),
        Scenario(pre + "kill_peer", "kill_peer", 2, layout, 60,
                 "rank 1 SIGKILLed once rank 0's allreduce was seen spinning on it for 0.5 s",
                 "rank 0 raises PeerFailed/CommError before its 5 s timeout; ncclCommAbort returns; the stream "
                 "drains and runs new work", exits=((0,), (-signal.SIGKILL,)), driver="kill",
                 env=(("P2PFT_NCCL_ABORT_TIMEOUT_S", "30"),)),
        Scenario(pre + "stop_peer", "stop_peer", 2, layout, 60,
                 "rank 1 SIGSTOPped once rank 0's allreduce was seen spinning on it for 0.5 s",
                 "rank 0 raises CommTimeout after its 3 s timeout; ncclCommAbort returns (the stopped rank is "
                 "another NCCL host); the stream drains and runs new work" + held,
                 exits=((0, 4) if two else (0,), None), driver="stop",
                 env=(("P2PFT_NCCL_ABORT_TIMEOUT_S", "8" if two else "12"),)),
        Scenario(pre + "close_during", "close_during", 2, layout, 45,
                 "close() on rank 0 while its allreduce spins on the idle rank 1",
                 "close() returns within 2 s; the allreduce raises CommAborted; ncclCommAbort returns (released); "
                 "the stream drains", env=(("P2PFT_NCCL_ABORT_TIMEOUT_S", "30"),)),
        Scenario(pre + "fast_forward", "fast_forward", 2, layout, 45,
                 "rank 1 fetches a step buffer from rank 0 while rank 0's next allGather spins on rank 1",
                 "the fetch is served within 5 s with the right data; the next step then completes on both"),
        Scenario(pre + "auto_epochs", "auto_epochs", 2, layout, 90,
                 f"{gs.AUTO_EPOCHS} data epochs under data plane auto with the ranks on "
                 + ("different GPUs" if two else "one device (identities equal)"),
                 ("every epoch on NCCL" if two else "every epoch on the TCP ring (no NCCL id made)")
                 + "; right sums; threads and fds flat"),
    ]
    if not two:
        out += [
            Scenario(pre + "stop_peer_watchdog", "stop_peer_watchdog", 2, layout, 45,
                     "rank 1 SIGSTOPped while rank 0's allreduce spins on it; rank 0's release limit "
                     "($P2PFT_NCCL_ABORT_TIMEOUT_S) 1 ms, shorter than any ncclCommAbort",
                     "rank 0 times out (CommTimeout), then the watchdog takes it down: exit status 4 and the "
                     "'taking this process down' line, within 10 s of its timeout (a process whose stream holds "
                     "a stuck NCCL kernel does exit)",
                     exits=((4,), None), driver="stop", env=(("P2PFT_NCCL_ABORT_TIMEOUT_S", "0.001"),)),
            Scenario(pre + "peer_dies_before_init", "peer_dies_before_init", 2, layout, 75,
                     "rank 1 SIGKILLs itself after receiving the unique id (go), before ncclCommInitRank",
                     "rank 0's first operation raises within its 10 s timeout; after close() its init does not "
                     "linger: within 20 s (8 s on the stand-in) no thread of that communicator is left and "
                     "threads/fds are back to the baseline (NCCL's bootstrap root excepted: 1 thread, 2 fds); or "
                     "rank 0 is taken down with exit status 4",
                     exits=((0, 4), (-signal.SIGKILL,)), env=(("P2PFT_NCCL_ABORT_TIMEOUT_S", "15"),)),
            Scenario(pre + "catchup_cuda", "catchup_cuda", 2, layout, 60,
                     "rank 1 fetches state into its own device tensor while its optimizer write (-1) is queued "
                     "behind 1.5 s of compute on its training stream; rank 0 serves a buffer whose write (5 over "
                     "0) is queued behind 0.5 s on its own training stream; a control fetch without `after`",
                     "with `after` the tensor ends 5.0 everywhere (copies after both writes), in place; the "
                     "control ends -1 everywhere (the race the ordering prevents is real)"),
            Scenario(pre + "churn", "churn", 2, layout, 150,
                     f"{gs.CHURN_EPOCHS} NCCL communicators one after another (every fourth aborted, the others "
                     "destroyed)",
                     "right sums; every release returns; from epoch 4 to the last, threads and fds grow by at most "
                     "2 and this process's GPU memory by at most 64 MiB (the device's by 256 MiB without NVML)"),
            Scenario(pre + "diloco", "diloco", 3, layout, 120,
                     "three DiLoCo replicas (sync every 4 inner steps) over NCCL, three NCCL hosts on the one GPU; "
                     "rank 2 SIGKILLed once all had committed 3 syncs",
                     "every communicator is NCCL (no TCP fallback); equal global-weight digests wherever two or "
                     "more replicas committed a sync (3+ such syncs, 1+ by all three); ranks 0 and 1 commit 2 more "
                     "syncs together", exits=((0,), (0,), (-signal.SIGKILL,)),
                     driver="diloco_kill"),
        ]
    else:
        out += [Scenario(pre + "churn", "churn", 2, layout, 150, f"{gs.CHURN_EPOCHS} NCCL communicators, one GPU each",
                         "as pair_one_gpu_churn")]
    return [dataclasses.replace(s, where=where) for s in out]


def scenarios() -> list[Scenario]:
    """Every scenario, in the order they run (the most telling first)."""
    one = {s.name: s for s in pair_scenarios("one_gpu")}
    order = ["sum", "count_mismatch", "slow_first_step", "kill_peer", "stop_peer", "stop_peer_watchdog",
             "close_during", "peer_dies_before_init", "catchup_cuda", "fast_forward", "churn", "diloco",
             "auto_epochs"]
    single = [
        Scenario("nccl_one_rank", "nccl_one_rank", 1, "one_rank", 60,
                 "none: one rank, 64 MiB sums, a joiner, an abort, a new epoch after it",
                 "right sums; ncclCommAbort returns (abort_s is the call itself, to its return); an allreduce "
                 "after it raises CommAborted; the next epoch sums; ncclCommDestroy returns"),
        Scenario("stream_order", "stream_order", 1, "one_rank", 60,
                 "0.5 s of compute then a fill queued ahead of a one-rank allreduce; 3 s of compute ahead of "
                 "one aborted 0.5 s in; two TCP ranks with device tensors, each on a raw stream of its own",
                 "the allreduce reads the late fill and returns with its stream done; the aborted call returns "
                 "CommAborted within 0.5 s while the compute still runs; the TCP ranks sum right"),
    ]
    out = single[:1] + [one["pair_one_gpu_" + n] for n in order[:6]] + single[1:] + \
        [one["pair_one_gpu_" + n] for n in order[6:]]
    out += [
        Scenario("replicas_tcp_cuda", "", 3, "gpu", 150,
                 "three example replicas on the GPU over the TCP ring; r2 SIGKILLed at step 10, restarted",
                 "the survivors go on; the restarted replica catches up into CUDA tensors; equal digests at "
                 "common steps, the joiner's included", where="gpu",
                 runner=lambda tmp, limit: check_replicas(["cuda:0"] * 3, "tcp", tmp, limit)),
        Scenario("replicas_auto_one_gpu", "", 3, "gpu", 150,
                 "the same under data plane auto, all replicas on the one GPU",
                 "NCCL cannot run between replicas on one GPU (one device identity): auto must fall back to the "
                 "TCP ring in every communicator (no NCCL communicator ready); equal digests. NCCL between "
                 "replicas runs in replicas_nccl (2+ GPUs) and pair_one_gpu_diloco", where="gpu",
                 runner=lambda tmp, limit: check_replicas(["cuda:0"] * 3, "auto", tmp, limit)),
    ]
    out += [s for s in pair_scenarios("two_gpu")]
    out += [
        Scenario("nccl_vs_torch", "", 2, "gpus2", 200,
                 "none: 64 and 256 MiB sums, p2pft's NCCL and torch.distributed's",
                 "right sums; bus bandwidths recorded", where="gpus2",
                 runner=lambda tmp, limit: check_bandwidth(min(gpu_count(), 8), tmp, limit)),
        Scenario("replicas_nccl", "", 3, "gpus2", 150, "replicas over NCCL, one GPU each; a kill and a catch-up",
                 "every communicator NCCL; equal digests", where="gpus2",
                 runner=lambda tmp, limit: check_replicas([f"cuda:{i}" for i in range(min(3, gpu_count()))],
                                                          "nccl", tmp, limit)),
    ]
    return out


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ---------------------------------------------------------------------------- fresh rank processes
_CTX: Any = None


def _context() -> Any:
    """Rank processes are forked from a server that has imported torch and p2pft once (and
    initialised nothing: no CUDA, no NCCL): each scenario still gets fresh processes, without
    paying for the imports every time."""
    global _CTX
    if _CTX is None:
        import multiprocessing as mp
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "p2pft.transport", "gpu_scenarios"])
    return _CTX


def rank_env(layout: str, rank: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if layout == "one_gpu":
        # Two hosts to NCCL (it refuses one GPU twice on one host), talking over sockets.
        env.update(P2PFT_FAKE_GPU="0", NCCL_HOSTID=f"p2pft-gpu-check-{rank}", NCCL_P2P_DISABLE="1",
                   NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", NCCL_SOCKET_IFNAME=env.get("NCCL_SOCKET_IFNAME", "lo"))
    return env


def _signal(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _drive_fault(sig: int, what: str) -> Callable[[list[Any], Path, float], dict[str, Any]]:
    def drive(procs: list[Any], wd: Path, end: float) -> dict[str, Any]:
        m = gs.wait_mark(wd / "spinning.0.json", max(1.0, end - time.monotonic()))
        if m is None:
            return {"fault": f"not sent: rank 0 never reported its collective ({what})"}
        gs.write_mark(wd / f"{what}.parent.json")
        t = time.time()
        _signal(procs[1].pid, sig)
        return {"fault": f"SIG{signal.Signals(sig).name[3:]} to rank 1", "fault_at": t}
    return drive


def _drive_diloco_kill(procs: list[Any], wd: Path, end: float) -> dict[str, Any]:
    last = len(procs) - 1
    while time.monotonic() < end:
        marks = [gs.wait_mark(wd / f"syncs.{r}.json", 0) for r in range(len(procs))]
        if all(m is not None and int(m["v"]) >= 3 for m in marks):
            gs.write_mark(wd / "killed.parent.json")
            t = time.time()
            _signal(procs[last].pid, signal.SIGKILL)
            return {"fault": f"SIGKILL to rank {last}", "fault_at": t, "syncs_at_kill": [m["v"] for m in marks if m]}
        if any(p.exitcode is not None for p in procs):
            break
        time.sleep(0.05)
    return {"fault": "not sent: the replicas did not reach 3 syncs together"}


DRIVERS: dict[str, Callable[[list[Any], Path, float], dict[str, Any]]] = {
    "kill": _drive_fault(signal.SIGKILL, "killed"),
    "stop": _drive_fault(signal.SIGSTOP, "stopped"),
    "diloco_kill": _drive_diloco_kill,
}


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_ranks(sc: Scenario, tmp: Path, limit: float) -> dict[str, Any]:
    """`sc` in fresh rank processes with a hard limit; what each rank and the parent saw."""
    wd = tmp / sc.name
    shutil.rmtree(wd, ignore_errors=True)    # marks of an earlier run would mislead the ranks
    wd.mkdir(parents=True)
    logs = [wd / f"rank{r}.log" for r in range(sc.ranks)]
    ctx = _context()
    extra = dict(sc.env)
    if sc.body == "diloco":
        extra["GPU_CHECK_PORTS"] = ",".join(str(p) for p in free_ports(sc.ranks))
    procs = []
    for r in range(sc.ranks):
        env = {**rank_env(sc.layout, r), **extra}
        pr = ctx.Process(target=gs.rank_main, args=(sc.body, r, sc.ranks, str(wd), sc.layout, env, str(logs[r]), limit),
                         name=f"gpu-check-{sc.name}-{r}", daemon=True)
        pr.start()
        procs.append(pr)
    end = time.monotonic() + limit + 5.0     # the ranks' own limit first (their threads dumped)
    parent: dict[str, Any] = {}
    timed_out: list[int] = []
    try:
        if sc.driver:
            parent.update(DRIVERS[sc.driver](procs, wd, end))
        for r, pr in enumerate(procs):
            pr.join(max(0.1, end - time.monotonic()))
            if pr.exitcode is None:
                timed_out.append(r)
            elif r == 0 and "fault_at" in parent:
                parent["rank0_exit_after_fault_s"] = round(time.time() - parent["fault_at"], 3)
            if r == 0 and sc.driver == "stop":   # the stopped rank has done its part
                _signal(procs[1].pid, signal.SIGCONT)
                procs[1].kill()
    finally:
        for pr in procs:
            if pr.exitcode is None:
                _signal(pr.pid, signal.SIGCONT)
                pr.kill()
                pr.join(5)
    exits = [None if r in timed_out else pr.exitcode for r, pr in enumerate(procs)]
    ranks: list[dict[str, Any] | None] = []
    for r in range(sc.ranks):
        m = gs.wait_mark(wd / f"result.{r}.json", 0) or gs.wait_mark(wd / f"partial.{r}.json", 0)
        ranks.append(m["v"] if m else None)
    why = JUDGES.get(sc.body, _no_judge)(sc, ranks, exits, parent, logs)
    for r in range(sc.ranks):
        accepted = sc.exits[r] if r < len(sc.exits) else (0,)
        res = ranks[r]
        if r in timed_out:
            why.append(f"rank {r} did not finish within {limit:g} s (its threads are in its log)")
        elif accepted is not None and exits[r] not in accepted:
            why.append(f"rank {r} exited {exits[r]}, expected {' or '.join(map(str, accepted))}")
        if res is not None and "ok" in res and not res["ok"]:
            why += [f"rank {r}: {w}" for w in res.get("why", [])] or [f"rank {r} not ok"]
        elif res is None and exits[r] == 0:
            why.append(f"rank {r} exited 0 without a result")
    observed: dict[str, Any] = {f"rank{r}": ranks[r] for r in range(sc.ranks)}
    observed["exits"] = exits
    observed.update(parent)
    row: dict[str, Any] = {"observed": observed, "ok": not why, "why": why}
    if why:
        row["log_tails"] = {f"rank{r}": _tail(logs[r]) for r in range(sc.ranks)}
    return row


def _no_judge(sc: Scenario, ranks: list[Any], exits: list[Any], parent: dict[str, Any],
              logs: list[Path]) -> list[str]:
    return []


def _judge_taken_down(sc: Scenario, ranks: list[Any], exits: list[Any], parent: dict[str, Any],
                      logs: list[Path]) -> list[str]:
    """Where rank 0 was taken down (exit 4), its log must say why."""
    if exits[0] == gs.EXIT_RELEASE_HUNG and gs.TAKE_DOWN_LINE not in _tail(logs[0], 100_000):
        return [f"rank 0 exited {gs.EXIT_RELEASE_HUNG} without the '{gs.TAKE_DOWN_LINE}' line"]
    return []


def _judge_watchdog(sc: Scenario, ranks: list[Any], exits: list[Any], parent: dict[str, Any],
                    logs: list[Path]) -> list[str]:
    why = _judge_taken_down(sc, ranks, exits, parent, logs)
    part = ranks[0] or {}
    if part.get("spinning_s") is None:
        why.append("rank 0's collective was never seen spinning")
    t = parent.get("rank0_exit_after_fault_s")
    if exits[0] == gs.EXIT_RELEASE_HUNG and (t is None or t > part.get("timeout_s", 3.0) + 10.0):
        why.append(f"rank 0 was taken down {t} s after the stop (bound: its timeout + 10 s)")
    return why


def _judge_stop(sc: Scenario, ranks: list[Any], exits: list[Any], parent: dict[str, Any],
                logs: list[Path]) -> list[str]:
    """Two GPUs on one host: the abort held by the stopped local peer, and the watchdog's exit,
    is the documented outcome too."""
    why = _judge_taken_down(sc, ranks, exits, parent, logs)
    if exits[0] == gs.EXIT_RELEASE_HUNG:
        ranks[0] = {**(ranks[0] or {}), "taken_down_by_watchdog": True}
        if sc.layout != "two_gpu":
            why.append("ncclCommAbort waited for the stopped peer although it is another NCCL host: the watchdog "
                       "took rank 0 down")
    return why


def _judge_peer_dies(sc: Scenario, ranks: list[Any], exits: list[Any], parent: dict[str, Any],
                     logs: list[Path]) -> list[str]:
    if exits[0] == gs.EXIT_RELEASE_HUNG:   # the documented bound: the process exits, a launcher restarts it
        ranks[0] = {**(ranks[0] or {}), "taken_down": True}
    return _judge_taken_down(sc, ranks, exits, parent, logs)


def _judge_diloco(sc: Scenario, ranks: list[Any], exits: list[Any], parent: dict[str, Any],
                  logs: list[Path]) -> list[str]:
    """Equal digests wherever two replicas committed the same sync; some with every replica."""
    by_sync: dict[int, list[dict[str, Any]]] = {}
    for res in ranks:
        for s in (res or {}).get("syncs", []):
            by_sync.setdefault(int(s["sync"]), []).append(s)
    shared = {k: v for k, v in by_sync.items() if len(v) > 1}
    parent["syncs_compared"] = len(shared)
    parent["syncs_with_every_replica"] = sum(1 for v in shared.values() if len(v) == sc.ranks)
    parent["digests_equal"] = all(len({s["digest"] for s in v}) == 1 for v in shared.values())
    why = []
    if len(shared) < 3 or not parent["syncs_with_every_replica"]:
        why.append(f"{len(shared)} syncs committed by two or more replicas, {parent['syncs_with_every_replica']} by "
                   "every one: too few to compare (want 3+, and 1+ by every replica)")
    if not parent["digests_equal"]:
        why.append("the replicas' global weights differ at a common sync")
    return why


JUDGES: dict[str, Callable[[Scenario, list[Any], list[Any], dict[str, Any], list[Path]], list[str]]] = {
    "stop_peer_watchdog": _judge_watchdog, "stop_peer": _judge_stop, "kill_peer": _judge_taken_down,
    "close_during": _judge_taken_down, "peer_dies_before_init": _judge_peer_dies, "diloco": _judge_diloco,
}


# ---------------------------------------------------------------------------- replicas
def _last_step(path: Path) -> int:
    st = [r["step"] for r in read_stats(path) if r.get("kind") is None and "step" in r and r.get("c")]
    return max(st, default=-1)


def check_replicas(devices: list[str], plane: str, tmp: Path, budget_s: float = 100.0) -> dict[str, Any]:
    """len(devices) replicas, one SIGKILLed at step 10 and restarted; digests at equal steps;
    which data plane each communicator really used (from the replicas' logs)."""
    n = len(devices)
    wd = tmp / f"replicas-{plane}"
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    addrs = [f"127.0.0.1:{p}" for p in free_ports(n)]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stats: dict[str, Path] = {}

    def spawn(i: int, name: str) -> None:
        seeds = ",".join(a for j, a in enumerate(addrs) if j != i)
        stats[name] = wd / f"{name}.jsonl"
        log = open(wd / f"{name}.log", "wb")
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
                                   + _tail(wd / f"{dead[0]}.log"))
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")

    obs: dict[str, Any] = {"replicas": n, "devices": devices, "data_plane": plane}
    why: list[str] = []
    t_start = time.time()
    try:
        for i in range(n):
            spawn(i, f"r{i}")
        obs["start_s"] = wait(lambda: all(_last_step(p) >= 10 for p in stats.values()), budget_s * 0.5, "step 10")
        victim = n - 1
        procs[f"r{victim}"].kill()
        procs[f"r{victim}"].wait(10)
        t_kill = time.time()
        at_kill = max(_last_step(stats[f"r{i}"]) for i in range(n - 1))
        obs["survivors_resume_s"] = wait(lambda: all(_last_step(stats[f"r{i}"]) >= at_kill + 3 for i in range(n - 1)),
                                         30, "survivors to go on")
        spawn(victim, f"r{victim}b")
        joined = stats[f"r{victim}b"]

        def caught_up() -> bool:
            return any(r.get("event") == "catchup_done" for r in read_stats(joined))
        obs["restart_to_caught_up_s"] = wait(caught_up, budget_s - (time.time() - t_start) - 15, "catch-up")
        target = _last_step(stats["r0"]) + 10
        wait(lambda: all(_last_step(p) >= target for k, p in stats.items() if k != f"r{victim}"),
             max(5.0, budget_s - (time.time() - t_start) - 5), f"step {target} everywhere")
        obs["kill_to_caught_up_s"] = time.time() - t_kill
    except (RuntimeError, TimeoutError) as e:
        why.append(f"{type(e).__name__}: {e}"[:2000])
    finally:
        terminate(list(procs.values()), grace=10)
    digests: dict[int, dict[str, str]] = {}
    for name, path in stats.items():
        for r in read_stats(path):
            if "digest" in r and r.get("kind") is None:
                digests.setdefault(int(r["step"]), {})[name] = r["digest"]
    shared = {s: d for s, d in digests.items() if len(d) > 1}
    joined_steps = [s for s, d in shared.items() if f"r{n - 1}b" in d]
    obs["digest_steps_compared"] = len(shared)
    obs["joiner_steps_compared"] = len(joined_steps)
    obs["digests_equal"] = all(len(set(d.values())) == 1 for d in shared.values())
    text = "".join(_tail(wd / f"{k}.log", 10_000_000) for k in stats)
    obs["nccl_communicators_ready"] = text.count("nccl communicator epoch=") - text.count(" failed: ")
    obs["tcp_ring_fallbacks"] = text.count("this communicator uses the TCP ring")
    obs["nccl_ran"] = obs["nccl_communicators_ready"] > 0
    if not obs["digests_equal"]:
        why.append("digests differ at a common step")
    if not joined_steps:
        why.append("no step of the restarted replica to compare")
    if plane == "auto" and len(set(devices)) == 1:
        obs["nccl_ran_why_not"] = ("one GPU: every replica has the same device identity, so data plane auto uses "
                                   "the TCP ring (NCCL refuses one GPU twice on one host)")
        if obs["nccl_ran"] or not obs["tcp_ring_fallbacks"]:
            why.append(f"on one GPU auto must fall back to the TCP ring: {obs['nccl_communicators_ready']} NCCL "
                       f"communicators ready, {obs['tcp_ring_fallbacks']} fallbacks")
    if plane == "nccl" and (not obs["nccl_ran"] or obs["tcp_ring_fallbacks"]):
        why.append("data plane nccl did not run NCCL in every communicator")
    return {"observed": obs, "ok": not why, "why": why}


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
        tp: list[float] = []
        tt: list[float] = []
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


def check_bandwidth(ngpu: int, tmp: Path, limit: float = 180.0) -> dict[str, Any]:
    port = free_ports(1)[0]
    wd = tmp / "bw"
    wd.mkdir(exist_ok=True)
    procs = [subprocess.Popen([sys.executable, __file__, "--bw-worker", str(r), "--world", str(ngpu),
                               "--tmp", str(wd), "--port", str(port)]) for r in range(ngpu)]
    rcs: list[int | None] = []
    for p in procs:
        try:
            rcs.append(p.wait(limit))
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
    ok = rcs == [0] * ngpu and len(res) == ngpu and all(r["sum_ok"] for r in res)
    return {"observed": {"ranks": ngpu, "rows": rows, "returncodes": rcs}, "ok": ok,
            "why": [] if ok else [f"return codes {rcs}, {len(res)} results"]}


# ---------------------------------------------------------------------------- main
def _summary(name: str, r: dict[str, Any]) -> str:
    obs = r.get("observed") or {}
    keys = ("init_s", "raised_after_s", "raised_after_fault_s", "abort_s", "close_s", "fetch_s", "fell_back",
            "returned_after_abort_s", "error", "growth_from_epoch_4", "syncs_after_kill")
    r0 = obs.get("rank0") or {}
    nums = ", ".join(f"{k}={v}" for k in keys for v in [r0.get(k)] if v is not None)
    status = "SKIPPED" if r.get("skipped") else ("ok" if r.get("ok") else "FAILED")
    tail = nums if r.get("ok") else "; ".join(r.get("why", []))
    return f"{name:<36} {status:<7} {tail}"[:400]


def select(all_sc: list[Scenario], only: str | None, ngpu: int, standin: bool) -> tuple[list[Scenario], list[str]]:
    """The scenarios this machine can run (and --only's choice among them); unknown names."""
    def runnable(s: Scenario) -> bool:
        return s.where == "any" or (s.where == "gpu" and ngpu >= 1 and not standin) or \
            (s.where == "gpus2" and ngpu >= 2 and not standin)
    here = [s for s in all_sc if runnable(s)]
    if not only:
        return here, []
    pats = [w.strip() for w in only.split(",") if w.strip()]
    unknown = [p for p in pats if not any(fnmatch.fnmatchcase(s.name, p) for s in here)]
    return [s for s in here if any(fnmatch.fnmatchcase(s.name, p) for p in pats)], unknown


def run_one(sc: Scenario, tmp: Path, limit: float) -> dict[str, Any]:
    try:
        if sc.runner is not None:
            return sc.runner(tmp, limit)
        return run_ranks(sc, tmp, limit)
    except Exception as e:  # noqa: BLE001 - one broken check does not hide the others
        return {"ok": False, "why": [f"{type(e).__name__}: {e}"[:2000]], "observed": {}}


def tar_logs(tmp: Path, dest: Path) -> None:
    with tarfile.open(dest, "w:gz") as tf:
        tf.add(str(tmp), arcname="gpu_check_logs")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here; the logs' tar file goes beside it")
    p.add_argument("--tmp", default=None, help="directory for logs (default: a fresh temporary one)")
    p.add_argument("--only", default=None, help="comma list of scenario names or patterns (fnmatch) to run; the "
                                                "preflight always runs")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="the whole run's budget in seconds; a scenario that no longer fits is skipped")
    p.add_argument("--list", action="store_true", help="list the scenarios this machine would run, and exit")
    p.add_argument("--bw-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.bw_worker is not None:
        bw_worker(args.bw_worker, args.world, Path(args.tmp), args.port)
        return 0
    t_start = time.monotonic()
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
    chosen, unknown = select(scenarios(), args.only, ngpu, standin)
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; choose from "
                + ", ".join(s.name for s in select(scenarios(), None, ngpu, standin)[0]))
    if args.list:
        for s in chosen:
            print(f"{s.name:<36} {s.limit_s:>4.0f} s  {s.injected}")
        return 0
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="p2pft-gpu-check-"))
    tmp.mkdir(parents=True, exist_ok=True)
    result.update(standin=standin, budget_s=args.budget_s, logs=str(tmp))

    def save() -> None:
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    pre = Scenario("preflight", "preflight", 1, "one_rank", 120, "none: the environment as it is",
                   "p2pft installed; one libnccl in the process; one CuPy; NCCL as torch and CuPy see it equal; "
                   "CuPy's CUDA runtime of torch's major version and a driver for it; CuPy and torch on one device")
    t0 = time.monotonic()
    row = {"injected": pre.injected, "expect": pre.expect, **run_one(pre, tmp, pre.limit_s),
           "wall_s": round(time.monotonic() - t0, 2)}
    result["preflight"] = row
    pf = (row.get("observed") or {}).get("rank0") or {}
    result["versions"] = pf.get("versions", {})
    print(f"gpu_check: {'the CPU stand-in' if standin else f'{ngpu} GPU(s)'}; preflight "
          f"{'ok' if row['ok'] else 'FAILED'}; versions: " + json.dumps(result["versions"])[:700], flush=True)
    if not row["ok"]:
        for w in row.get("why", []):
            print(f"  preflight: {w}")
        result["ok"] = False
        result["stopped"] = "the preflight failed: no scenario ran (see preflight.why)"
        save()
        if args.json:
            tar_logs(tmp, Path(args.json).parent / LOGS_TAR)
        print("gpu_check: PREFLIGHT FAILED, nothing else ran")
        return 1
    save()
    for sc in chosen:
        left = args.budget_s - (time.monotonic() - t_start)
        limit = min(sc.limit_s, left - 5.0)
        t0 = time.monotonic()
        if limit < min(MIN_START_S, sc.limit_s):
            r = {"ok": False, "skipped": f"budget: {max(0.0, left):.0f} s left of {args.budget_s:g} s",
                 "why": ["skipped: out of budget"], "observed": {}}
        else:
            r = run_one(sc, tmp, limit)
        result["checks"][sc.name] = {"injected": sc.injected, "expect": sc.expect, **r, "limit_s": round(limit, 1),
                                     "wall_s": round(time.monotonic() - t0, 2)}
        print(_summary(sc.name, result["checks"][sc.name]), flush=True)
        save()
    ok = all(r.get("ok") for r in result["checks"].values())
    result["ok"] = ok
    save()
    if args.json:
        tar_logs(tmp, Path(args.json).parent / LOGS_TAR)
        result["logs_tar"] = LOGS_TAR
        save()
    where = "on the CPU stand-in" if standin else f"{ngpu} GPU(s)"
    failed = [n for n, r in result["checks"].items() if not r.get("ok")]
    print(f"gpu_check: {where}, {'all checks passed' if ok else 'FAILED: ' + ', '.join(failed)} "
          f"in {result['wall_s']:.0f} s (logs in {tmp})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
