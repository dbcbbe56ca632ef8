"""The NCCL path's failure handling, on the CPU stand-in of CuPy's NCCL binding and of the device.

Every test here runs real processes (or real threads on real sockets) against `tests/fakes`: a
fake ``cupy.cuda.nccl`` with NCCL's failure behaviour (rendezvous, lazy connect inside the
first collective, stuck kernels until abort, destroy waiting for queued work, "Duplicate GPU",
CuPy 13's tuple-of-chars ids) and a device whose copies complete later, in a worker, visible
only through events. One test per defect of the NCCL path (see docs/transport.md, "GPU").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

OWN_RING_LOOP = True   # the ring loop is not what these tests are about: run once
HERE = Path(__file__).resolve().parent
FAKES = HERE.parent / "fakes"
WORKER = str(HERE / "nccl_fake_worker.py")
pytestmark = pytest.mark.slow


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES), str(HERE)]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("NCCL_RUNTIME_CONNECT", None)
    env.update(extra or {})
    return env


class Ranks:
    """`world` worker processes wired to each other's data servers; each `run` is one scenario
    on a fresh epoch (the processes, and their import of torch, are shared by the tests)."""

    def __init__(self, world: int = 2) -> None:
        self.procs = [subprocess.Popen([sys.executable, WORKER, str(r), str(world)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
                      for r in range(world)]
        self.epoch = 0
        addrs = [self.line(r, 30) for r in range(world)]
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(" ".join(addrs) + "\n")
            p.stdin.flush()

    def start(self, scenario: str, env: dict[str, str] | None = None) -> None:
        self.epoch += 1
        cmd = json.dumps({"scenario": scenario, "epoch": self.epoch, "env": env or {}})
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(cmd + "\n")
            p.stdin.flush()

    def run(self, scenario: str, env: dict[str, str] | None = None, timeout: float = 20.0) -> list[dict[str, Any]]:
        self.start(scenario, env)
        return [self.result(r, timeout) for r in range(len(self.procs))]

    def run_released(self, scenario: str, env: dict[str, str] | None = None,
                     timeout: float = 20.0) -> list[dict[str, Any]]:
        """A scenario where only rank 0 acts: once it has reported, the others (waiting, taking
        no part) are released."""
        self.start(scenario, env)
        out = [self.result(0, timeout)]
        for p in self.procs[1:]:
            assert p.stdin is not None
            p.stdin.write("release\n")
            p.stdin.flush()
        return out + [self.result(r, timeout) for r in range(1, len(self.procs))]

    def line(self, r: int, timeout: float) -> str:
        import select

        p = self.procs[r]
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"rank {r}: no output within {timeout} s")
        line = p.stdout.readline()
        if not line:
            p.kill()
            raise AssertionError(f"rank {r} exited: {p.wait(5)} {p.stderr.read()[-3000:] if p.stderr else ''}")
        return line.strip()

    def result(self, r: int, timeout: float) -> dict[str, Any]:
        line = self.line(r, timeout)
        while not line.startswith("{"):
            line = self.line(r, timeout)
        return json.loads(line)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    f.close()


@pytest.fixture(scope="module")
def ranks() -> Any:
    pool = Ranks()
    yield pool
    pool.close()


@pytest.fixture
def violations(tmp_path: Path) -> Path:
    return tmp_path / "violations.txt"


def test_sum_and_joiner_on_the_stand_in(ranks: Ranks) -> None:
    """The happy path the defect tests build on: two ranks sum; then only rank 0 contributes
    (rank 1 joins with zeros, which do not count)."""
    for r in ranks.run("sum"):
        assert r["ok"] and not r["tcp"], r
        assert r["n"] == 2 and r["m"] == 1, r
        assert r["x"] == [3.0 * i for i in range(16)], r


@pytest.mark.parametrize("sig,nccl_first", [(signal.SIGKILL, False), (signal.SIGSTOP, False),
                                             (signal.SIGSTOP, True)], ids=["kill", "stop", "stop-nccl-first"])
def test_rank_lost_between_init_and_first_collective(sig: int, nccl_first: bool, violations: Path) -> None:
    """Defect 1: with lazy connect the first collective connected inside the host call, blocking
    the caller with no timeout (a stopped peer: for ever; a killed one: until an abort from
    another thread freed the communicator under it). Now the connect happens inside the bounded
    init and the survivor gets a CommError within its timeout, without a concurrent call.
    nccl-first: NCCL read its parameters before p2pft set NCCL_RUNTIME_CONNECT=0 (torch's NCCL
    first in the process), so it connects algorithm by algorithm; a warm-up of only a small
    allreduce (the tree) left the tag exchange's allGather (the ring) to connect inside the
    training thread's host call. The warm-up now runs every kind of collective the
    communicator uses."""
    pair = Ranks()
    try:
        env = {"FAKE_NCCL_VIOLATIONS": str(violations)}
        if nccl_first:
            env["TEST_NCCL_FIRST"] = "1"
            env["P2PFT_NCCL_WARM_MAX_BYTES"] = str(2 << 20)   # the stand-in's algorithms all show up below 2 MiB
        pair.start("kill_after_init", env)
        for r in range(2):
            assert pair.line(r, 30) == "inited"
        pair.procs[1].send_signal(sig)
        res = pair.result(0, 15)
    finally:
        pair.close()
    assert not res["ok"] and res["err"] in ("PeerFailed", "CommError", "CommTimeout"), res
    assert res["s"] < 4.0, res
    assert not violations.exists() or violations.read_text() == "", violations.read_text()


def test_abort_from_another_thread_during_a_collective(ranks: Ranks, violations: Path) -> None:
    """Defect 2: abort, async-error polling and enqueues on one communicator from several threads
    without a lock; now one lock per communicator: no concurrent call, no use after abort."""
    res = ranks.run_released("abort_during", {"FAKE_NCCL_VIOLATIONS": str(violations)})[0]
    assert res["ok"] and res["err"] == "CommAborted", res
    assert res["s"] < 1.0, res
    assert not violations.exists() or violations.read_text() == "", violations.read_text()


def test_close_during_a_stuck_collective(ranks: Ranks, violations: Path) -> None:
    """Defect 3: close() called ncclCommDestroy, which waits for the stuck collective for ever;
    now close() aborts when a collective is in flight, and returns at once."""
    res = ranks.run_released("close_during", {"FAKE_NCCL_VIOLATIONS": str(violations)})[0]
    assert res["ok"], res
    assert res["returned_s"] < 1.0 and res["err"] == "CommAborted", res
    assert not violations.exists() or violations.read_text() == "", violations.read_text()


def test_close_after_a_failure_another_thread_has_not_aborted_yet(ranks: Ranks, violations: Path) -> None:
    """close() chose ncclCommDestroy when no operation was in flight, but an operation that ended
    in an error leaves its kernel queued, stuck on the peer. With the failure recorded by another
    thread that had not reached ncclCommAbort yet, destroy waited for that kernel for ever while
    holding the communicator's lock, and the abort waited for the lock: the replica hung (a 30 s
    stall in `p2pft chaos --data-plane nccl` on the stand-in). close() now aborts whenever the
    communicator failed or a collective was not seen to finish."""
    res = ranks.run_released("close_after_failure", {"FAKE_NCCL_VIOLATIONS": str(violations)})[0]
    assert res["err"] == "CommAborted", res
    assert res["ok"] and res["s"] < 2.0, res
    assert not violations.exists() or violations.read_text() == "", violations.read_text()


def test_close_while_an_allreduce_is_about_to_enqueue(ranks: Ranks, violations: Path) -> None:
    """close() decided "idle, destroy" before an allreduce that had passed its checks counted
    itself in flight; the allreduce then enqueued onto the closing communicator, and destroy
    (which flushes queued work) waited for that kernel for ever. Now an operation counts itself
    atomically with the check that the communicator is open, and nothing is enqueued once it
    failed or is closing: the allreduce raises CommAborted and close() returns."""
    res = ranks.run_released("close_race", {"FAKE_NCCL_VIOLATIONS": str(violations)})[0]
    assert res["ok"] and res["released"], res
    assert res["err"] == "CommAborted" and res["returned_s"] < 2.0, res
    assert not violations.exists() or violations.read_text() == "", violations.read_text()


def test_abort_held_up_by_a_stopped_local_peer_is_bounded() -> None:
    """Real ncclCommAbort waits for the other ranks' processes on the node (its proxy thread),
    so with a SIGSTOPped peer it does not return; the stand-in's abort does the same. It ran on
    the training thread, holding the communicator's lock: the survivor's collective never
    reported its timeout. Now the abort runs on a thread of its own: the survivor gets its
    CommTimeout within the timeout, and a watchdog (as PyTorch's heartbeat monitor) takes the
    process down with one CRITICAL line and exit status 4 once the abort has not returned
    within $P2PFT_NCCL_ABORT_TIMEOUT_S."""
    pair = Ranks()
    try:
        pair.start("kill_after_init", {"P2PFT_NCCL_ABORT_TIMEOUT_S": "2"})
        for r in range(2):
            assert pair.line(r, 30) == "inited"
        pair.procs[1].send_signal(signal.SIGSTOP)
        res = pair.result(0, 10)
        assert not res["ok"] and res["err"] == "CommTimeout" and res["s"] < 4.0, res
        rc = pair.procs[0].wait(10)
        err = pair.procs[0].stderr.read() if pair.procs[0].stderr else ""
        pair.procs[1].send_signal(signal.SIGCONT)
    finally:
        pair.close()
    assert rc == 4, (rc, err[-2000:])
    assert "ncclCommAbort of the NCCL communicator" in err and "taking this process down" in err, err[-2000:]


def test_two_ranks_on_one_device_is_one_clear_error(ranks: Ranks) -> None:
    """Defect 4: NCCL refuses two ranks on one GPU at init; the ranks now compare device
    identities during the id hand-off and fail with one error that says so and what to do."""
    res = ranks.run("sum", {"P2PFT_FAKE_GPU": "0"})
    for r in res:   # rank 0 finds it; the others get its verdict, by name (the engine stops on it)
        assert not r["ok"] and r["err"] == "SharedDevice" and r["s"] < 3.0, r
        assert "one device" in r["msg"] and "data_plane='tcp'" in r["msg"], r


def test_two_ranks_on_one_device_under_auto_take_the_tcp_ring(ranks: Ranks) -> None:
    """Defect 4 under data plane auto: the same shared device makes the communicator a TCP ring
    (device tensors staged through pinned slots), and the sums are right."""
    for r in ranks.run("sum_auto", {"P2PFT_FAKE_GPU": "0"}):
        assert r["ok"] and r["tcp"] and r["n"] == 2 and r["m"] == 1, r
        assert r["x"] == [3.0 * i for i in range(16)], r


@pytest.mark.parametrize("signed", ["0", "1"])
def test_cupy13_id_as_c_chars_of_either_signedness(ranks: Ranks, signed: str) -> None:
    """Defect 5: CuPy 13 takes the id as a tuple of C chars; on aarch64 char is unsigned and the
    signed values raised OverflowError, which the TypeError fallback did not catch."""
    # CuPy's own (blocking) init is what takes the tuple: the non-blocking one goes through ctypes
    res = ranks.run("sum", {"FAKE_CUPY_VERSION": "13", "FAKE_CHAR_SIGNED": signed, "FAKE_NCCL_NONBLOCKING": "0"})
    assert all(r["ok"] and r["n"] == 2 for r in res), res


def test_slow_first_step_within_the_timeout(ranks: Ranks) -> None:
    """Defect 9: the timeout started before the compute queued ahead of the collective had run,
    so a slow first step read as a dead peer; now it counts from an event before the collective."""
    for r in ranks.run("slow_first_step"):
        assert r["ok"] and r["n"] == 2 and r["x"] == 3.0, r


def test_mismatched_counts_are_a_protocol_mismatch(ranks: Ranks) -> None:
    """Defect 10: NCCL does not check element counts (a hang or an out-of-bounds read); the tag
    exchange now carries count and dtype and fails both ranks with ProtocolMismatch."""
    for r in ranks.run("mismatch_count"):
        assert not r["ok"] and r["err"] == "ProtocolMismatch" and "size mismatch" in r["msg"], r
        assert r["s"] < 1.5, r


def test_mismatched_broadcast_counts_are_a_protocol_mismatch(ranks: Ranks) -> None:
    """Broadcast counts were not checked either: the ranks hung until their timeout (or the
    receivers wrote past their buffers). Broadcast now all-gathers (root, count, dtype) first."""
    for r in ranks.run("bcast_mismatch"):
        assert not r["ok"] and r["err"] == "ProtocolMismatch" and "broadcast mismatch" in r["msg"], r
        assert r["s"] < 1.5, r


_STAGING = r"""
import sys, threading, time, torch
import fakedevice
from p2pft.transport import DataServer, CommError
from p2pft.transport.staging import DeviceStager

case = sys.argv[1]
servers = [DataServer("127.0.0.1", 0, secret=b"s") for _ in range(2)]
servers[0].piece_bytes = servers[1].piece_bytes = 256
peers = [s.addr for s in servers]
comms = [s.communicator(1, 0, r, peers, timeout=5.0) for r, s in enumerate(servers)]
N = 256                                  # 4 pieces of 64 floats
out = {}

if case == "receive_first":
    def rank(r):
        fakedevice.DEVICE.set_current_stream(fakedevice.DEVICE.new_stream())   # training on a side stream
        a = torch.full((N,), float(r + 1))
        comms[r].allreduce(a)                    # contributes: ends with uploads queued
        b = torch.full((N,), 100.0 * (r + 1))
        comms[r].allreduce(b, contribute=False)  # a joiner: starts by receiving into slot 0
        fakedevice.DEVICE.current_stream().synchronize()
        out[r] = (a.tolist(), b.tolist())
    ths = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ths]; [t.join(30) for t in ths]
    ok = all(out[r][0] == [3.0] * N and out[r][1] == [0.0] * N for r in range(2))
    print("OK" if ok else f"CORRUPT {[(sorted(set(out[r][0])), sorted(set(out[r][1]))) for r in out]}")
elif case == "retry":
    class Failing(DeviceStager):
        def wait_down(self, p):
            super().wait_down(p)
            if p.index == 2:
                comms[1].abort("injected")
    def rank(r):
        t = torch.full((N,), float(r + 1))
        saved = t.clone()
        st = None
        if r == 1:
            base = comms[1]._cuda_stager(t)
            st = Failing(base.api, t, base.cache)
        try:
            comms[r].staged_allreduce(t, stager=st)
        except CommError:
            pass
        t.copy_(saved)                          # the retry restores the gradients
        time.sleep(0.3)                         # uploads still queued would land now
        out[r] = t.tolist() == saved.tolist()
    ths = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ths]; [t.join(30) for t in ths]
    print("OK" if all(out.values()) and len(out) == 2 else f"CORRUPT {out}")
for s in servers:
    s.close()
"""


@pytest.mark.parametrize("case", ["receive_first", "retry"])
def test_staging_stream_order(case: str) -> None:
    """Defects 6 and 7, over the TCP ring with device tensors staged through the stand-in's
    deferred copy engine. receive_first: upload events were per call, so a call that starts by
    receiving overwrote a slot the previous call was still uploading from. retry: a failed piece
    skipped finish(), so the retry's restore raced the uploads still queued."""
    out = subprocess.run([sys.executable, "-c", _STAGING, case], capture_output=True, text=True, timeout=60,
                         env=_env({"P2PFT_FAKE_COPY_DELAY_S": "0.05"}))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "OK", out.stdout + out.stderr[-2000:]


_DONOR = r"""
import torch
import fakedevice
from p2pft.transport import DataServer, StateSnapshot, fetch_state

dev = fakedevice.DEVICE
w = torch.zeros(4096)
s = DataServer("127.0.0.1", 0)
s.state_chunk_bytes = 4096

def provide(req):
    train = dev.new_stream()                  # the training thread's stream, not the donor thread's
    dev.slow_kernel(0.3, train)               # the step that writes the state is still running
    dev.copy_async(w, torch.full((4096,), 7.0), train)
    return StateSnapshot(meta={}, tensors={"w": w}, ready=train.record())

s.serve_state(provide)
snap = fetch_state(s.addr, {}, timeout=30.0)
s.close()
print("OK" if snap.tensors["w"].tolist() == [7.0] * 4096 else "STALE")
"""


def test_donor_copies_after_the_stream_that_wrote_the_state() -> None:
    """Defect 8: the donor's copy stream waited on its own thread's current stream, not on the
    stream that wrote the tensors it serves; now on the snapshot's `ready` event."""
    out = subprocess.run([sys.executable, "-c", _DONOR], capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "OK", out.stdout + out.stderr[-2000:]


_RECENT = r"""
import time
import torch
import fakedevice
from p2pft.transport import CommError, DataServer, fetch_state
from p2pft.transport.device import written_event
from p2pft.trainer.kernel.attempt import Entry
from p2pft.trainer.kernel.recent import RecentSteps

dev = fakedevice.DEVICE
recent = RecentSteps(keep=2)
flat = torch.full((4096,), 3.0)          # step 5's reduced buffer, cloned on the training stream
s = DataServer("127.0.0.1", 0)           # as a replica's: serving from its start
s.state_chunk_bytes = 4096
s.serve_state(lambda req: recent.serve(5, 6))
recent.append(Entry(5, flat, 2, [True, True], ready=written_event(flat)))
dev.slow_kernel(20.0)                    # the next tag exchange, stuck until the fetching peer joins it
t0 = time.monotonic()
try:
    snap = fetch_state(s.addr, {}, timeout=3.0)
except CommError as e:
    print(f"BLOCKED after {time.monotonic() - t0:.1f} s: {e}")
else:
    print("OK" if snap.tensors["g5"].tolist() == [3.0] * 4096 else "STALE")
s.close()
"""


def test_fast_forward_source_does_not_wait_behind_its_next_collective() -> None:
    """A replica whose allreduce of step N failed while its peer's succeeded fast-forwards from
    that peer, which is already in step N+1's tag exchange waiting for it. The peer's donor
    thread copied step N's buffer on a stream that waited for everything queued on the
    compute stream so far, stuck collective included: both waited until the communicator's
    timeout (10 s stalls in `p2pft chaos --data-plane nccl`). The copy now waits only for the
    event recorded when the buffer was written."""
    out = subprocess.run([sys.executable, "-c", _RECENT], capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "OK", out.stdout + out.stderr[-2000:]
