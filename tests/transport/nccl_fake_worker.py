"""One rank of a defect scenario on the NCCL stand-in (run with tests/fakes first on PYTHONPATH).

argv: rank world. Prints its data address, reads the peers' addresses (one line, space
separated) from stdin, then runs one scenario per stdin line (JSON: scenario, epoch, env to set)
and prints one JSON line for each: {"ok": ..., "err": class, "msg": ..., "s": seconds, ...}.
A rank that takes no part in a scenario waits for a "release" line on stdin (the test sends it
once the other rank has reported), so it stays exactly as long as the scenario needs.
One process serves many scenarios, so the suite pays for starting Python and torch once.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch

import fakedevice
from p2pft.transport import CommError, DataServer


def result(t0: float, **kw: Any) -> None:
    print(json.dumps({"s": round(time.monotonic() - t0, 3), **kw}), flush=True)


def wait_release(bound: float) -> None:
    """Block until the test sends "release" (bounded: a test that died must not leave us here)."""
    import select

    ready, _, _ = select.select([sys.stdin], [], [], bound)
    if ready:
        line = sys.stdin.readline().strip()
        assert line == "release", line


def allreduce_in_thread(comm: Any) -> tuple[threading.Thread, list[BaseException]]:
    """An allreduce on a thread of its own (started): the thread and the errors it raised."""
    errs: list[BaseException] = []

    def op() -> None:
        try:
            comm.allreduce(torch.ones(8), timeout=30.0)
        except BaseException as e:  # noqa: BLE001 - reported
            errs.append(e)
    th = threading.Thread(target=op)
    th.start()
    return th, errs


def run(scenario: str, epoch: int, rank: int, ds: DataServer, peers: list[str]) -> None:
    backend = "nccl-auto" if scenario.endswith("_auto") else "nccl"
    if os.environ.get("TEST_NCCL_FIRST") == "1":
        # Another NCCL user (torch's process group) initialised NCCL in this process before
        # p2pft set NCCL_RUNTIME_CONNECT=0: NCCL read its parameters then, and connects lazily.
        from cupy.cuda import nccl as fake_nccl

        from p2pft.transport import nccl as nccl_mod

        mode = os.environ.pop("NCCL_RUNTIME_CONNECT", None)
        fake_nccl._param("NCCL_RUNTIME_CONNECT", "1")
        if mode is not None:
            os.environ["NCCL_RUNTIME_CONNECT"] = mode
        nccl_mod.NCCL_PARAMS_READ_BEFORE_P2PFT = True   # what p2pft finds when that user came first
    comm = ds.communicator(epoch, 0, rank, peers, timeout=2.0, connect_timeout=5.0, backend=backend)
    t0 = time.monotonic()
    try:
        if scenario == "kill_after_init":
            comm.wait_init(20)
            print("inited", flush=True)
            if rank == 1:
                time.sleep(60)      # killed by the test
            time.sleep(0.5)
            t0 = time.monotonic()
            comm.allreduce(torch.ones(8), timeout=2.0)
        elif scenario in ("abort_during", "close_during"):
            if rank == 1:
                comm.wait_init(20)
                wait_release(20)    # takes no part: rank 0's collective is stuck on it
                return result(t0, ok=True)
            th, errs = allreduce_in_thread(comm)
            time.sleep(0.7)
            t0 = time.monotonic()
            if scenario == "abort_during":
                comm.abort("test")
            else:
                comm.close()
            closed_s = time.monotonic() - t0
            th.join(5)
            return result(t0, ok=not th.is_alive(), returned_s=round(closed_s, 3),
                          err=type(errs[0]).__name__ if errs else None)
        elif scenario == "close_after_failure":
            # Rank 1 takes no part, so rank 0's tag exchange is stuck. Another thread records a
            # failure (as the view follower aborting an old data epoch does) and is slow to get
            # to ncclCommAbort (telling the peers first); meanwhile the caller sees the failure
            # and closes the communicator, as the engine does when it moves to the next epoch.
            if rank == 1:
                comm.wait_init(20)
                wait_release(20)    # takes no part: rank 0's tag exchange is stuck on it
                return result(t0, ok=True)
            comm.wait_init(20)
            star = comm._star
            slow_close = star.close

            def late_close() -> None:
                if threading.current_thread() is aborter:
                    time.sleep(0.5)
                slow_close()
            star.close = late_close
            aborter = threading.Timer(0.5, comm.abort, args=("superseded",))
            aborter.start()
            try:
                comm.allreduce(torch.ones(8), timeout=30.0)
            except CommError as e:
                t0 = time.monotonic()
                done = threading.Event()
                threading.Thread(target=lambda: (comm.close(), done.set()), daemon=True).start()
                return result(t0, ok=done.wait(5.0), err=type(e).__name__)
            return result(t0, ok=False, msg="the collective did not fail")
        elif scenario == "close_race":
            # close() decides between destroy and abort from the operations in flight. An
            # allreduce that has passed its checks but not yet counted itself, and a close() slow
            # between its decision and the release (its on_dead callback), interleave: the
            # allreduce enqueues onto the closing communicator, and destroy waits for its kernel.
            if rank == 1:
                comm.wait_init(20)
                wait_release(20)    # takes no part: a collective of rank 0 would be stuck
                return result(t0, ok=True)
            comm.wait_init(20)
            in_window = threading.Event()
            real_turn = comm._turn

            class SlowTurn:   # widens the window between the checks and counting itself in flight
                def enter(self, c: Any, bound: float) -> None:
                    in_window.set()
                    time.sleep(0.3)
                    real_turn.enter(c, bound)

                def leave(self) -> None:
                    real_turn.leave()
            comm._turn = SlowTurn()
            on_dead = comm._on_dead

            def slow_on_dead(c: Any) -> None:
                time.sleep(0.6)
                if on_dead is not None:
                    on_dead(c)
            comm._on_dead = slow_on_dead
            th, errs = allreduce_in_thread(comm)
            in_window.wait(5)
            t0 = time.monotonic()
            done = threading.Event()
            threading.Thread(target=lambda: (comm.close(), done.set()), daemon=True).start()
            closed = done.wait(5.0)
            th.join(5)
            comm._turn = real_turn
            return result(t0, ok=closed and not th.is_alive(), returned_s=round(time.monotonic() - t0, 3),
                          released=comm.wait_released(5.0), err=type(errs[0]).__name__ if errs else None)
        elif scenario == "slow_first_step":
            fakedevice.DEVICE.slow_kernel(1.5)
            x = torch.full((16,), float(rank + 1))
            n = comm.allreduce(x, timeout=1.0)
            return result(t0, ok=True, n=n, x=x[0].item())
        elif scenario == "mismatch_count":
            comm.allreduce(torch.ones(10 + 2 * rank), timeout=2.0)
        elif scenario == "bcast_mismatch":
            comm.broadcast(torch.ones(10 + 2 * rank), 0, timeout=2.0)
        elif scenario in ("sum", "sum_auto"):
            x = torch.arange(16, dtype=torch.float32) * (rank + 1)
            n = comm.allreduce(x, tag=7)
            m = comm.allreduce(x, contribute=rank == 0, tag=8)
            return result(t0, ok=True, n=n, m=m, x=x.tolist(), tcp=getattr(comm, "tcp", None) is not None)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        result(t0, ok=True)
    except CommError as e:
        result(t0, ok=False, err=type(e).__name__, msg=str(e))
    except Exception as e:  # noqa: BLE001 - reported
        result(t0, ok=False, err=type(e).__name__, msg=repr(e))
    finally:
        comm.close()


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    ds = DataServer("127.0.0.1", 0, secret=b"s")
    print(ds.addr, flush=True)
    peers = sys.stdin.readline().split()
    assert len(peers) == world
    for line in sys.stdin:
        cmd = json.loads(line)
        os.environ.update(cmd.get("env") or {})
        run(cmd["scenario"], int(cmd["epoch"]), rank, ds, peers)
        for k in cmd.get("env") or {}:
            os.environ.pop(k, None)
    ds.close()


if __name__ == "__main__":
    main()
