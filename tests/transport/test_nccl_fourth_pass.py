"""The NCCL path, fourth pass: no host sync in a collective, streams that are really p2pft's own,
bounded failure paths, and a stand-in as strict as NCCL (on the CPU stand-in of ``tests/fakes``).

Each test names the defect it catches; every one of them failed on the code before this pass
(its behaviour is described in the test's docstring).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

OWN_RING_LOOP = True   # the ring loop is not what these tests are about: run once
HERE = Path(__file__).resolve().parent
FAKES = HERE.parent / "fakes"
pytestmark = pytest.mark.slow


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("NCCL_RUNTIME_CONNECT", None)
    env.update(extra or {})
    return env


def _run(script: str, extra: dict[str, str] | None = None, timeout: float = 60.0) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                         env=_env(extra))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


class Pair:
    """Two processes of one script (argv: rank), wired to each other's data servers: each prints its
    address first, then reads both from stdin."""

    def __init__(self, script: str, envs: list[dict[str, str]]) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(envs[r]))
                      for r in range(2)]
        addrs = [self.line(r, 30) for r in range(2)]
        for r in range(2):
            self.send(r, " ".join(addrs))

    def send(self, r: int, text: str) -> None:
        p = self.procs[r]
        assert p.stdin is not None
        p.stdin.write(text + "\n")
        p.stdin.flush()

    def line(self, r: int, timeout: float) -> str:
        p = self.procs[r]
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"rank {r}: no output within {timeout} s")
        line = p.stdout.readline()
        if not line:
            err = p.stderr.read() if p.stderr else ""
            raise AssertionError(f"rank {r} exited ({p.wait(5)}): {err[-3000:]}")
        return line.strip()

    def result(self, r: int, timeout: float) -> dict[str, Any]:
        line = self.line(r, timeout)
        while not line.startswith("{"):
            line = self.line(r, timeout)
        return json.loads(line)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except OSError:
                    pass
                p.kill()
            p.wait(10)
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    f.close()


_HEAD = r"""
import json, os, sys, threading, time
import torch
import fakedevice
from cupy.cuda import nccl as fake
from p2pft.transport import CommError, DataServer
from p2pft.transport import nccl as nccl_mod

rank = int(sys.argv[1])
dev = fakedevice.DEVICE
ds = DataServer("127.0.0.1", 0, secret=b"s")
print(ds.addr, flush=True)
peers = sys.stdin.readline().split()

def say(**kw):
    print(json.dumps(kw), flush=True)
"""


# ---------------------------------------------------------------------------------- item 2
_NO_SYNC = r"""
import json, threading, time, torch, fakedevice
from cupy.cuda import nccl as fake
from p2pft.transport.nccl import NcclCommunicator, nccl_unique_id

dev = fakedevice.DEVICE
c = NcclCommunicator(1, 0, 0, 1, nccl_unique_id(), timeout=5.0)
assert c.wait_init(10)
assert c.allreduce(torch.ones(8)) == 1
no = c._comm.no
dev.slow_kernel(2.0)                     # the step's compute, queued on the caller's stream
t0 = time.monotonic()
errs = []

def op():
    try:
        c.allreduce(torch.ones(8), timeout=5.0)
    except Exception as e:
        errs.append(e)
th = threading.Thread(target=op)
th.start()
time.sleep(0.4)
enq = [t - t0 for t, n, w in list(fake.TIMELINE) if n == no and w.startswith("enqueue:") and t > t0]
c.abort("test")
th.join(10)
print(json.dumps({"enqueued_s": enq[0] if enq else None, "err": type(errs[0]).__name__ if errs else None,
                  "returned_s": time.monotonic() - t0}))
c.close()
"""


def test_a_collective_is_enqueued_without_waiting_for_the_work_queued_before_it() -> None:
    """The tag exchange's rows were made with ``torch.tensor(list, device=cuda)``: a copy from
    pageable memory, after which the host has waited for everything queued on the caller's
    stream (the stand-in now does that too). A collective started behind 2 s of queued compute
    was enqueued only 2 s later, the start-event clock never saw the compute, and an abort could
    not reach the host meanwhile. Now the rows go through the communicator's pinned and device
    buffers, copied asynchronously on the stream: enqueued at once, and aborted at once."""
    res = _run(_NO_SYNC)
    assert res["enqueued_s"] is not None and res["enqueued_s"] < 0.5, res
    assert res["err"] == "CommAborted" and res["returned_s"] < 1.5, res


# ---------------------------------------------------------------------------------- item 3
_STREAMS = r"""
import json, types, torch, fakedevice
from p2pft.transport.device import SideStream
from p2pft.transport.devcopy import PinnedPair
from p2pft.transport.staging import StagingTcpCommunicator

dev = fakedevice.DEVICE
user = dev.new_stream()                  # the training loop's stream, from torch's pool
dev.set_current_stream(user)
t = torch.zeros(64)
seen = {"side": set(), "copy": set(), "staging": set()}
for _ in range(100):                     # a long run: many helper threads, state copies, rings
    seen["side"].add(SideStream(t).stream.handle)
    pair = PinnedPair(64, "cpu")
    seen["copy"].add(pair.stream.handle)
    pair.release()
    seen["staging"].add(StagingTcpCommunicator._cuda_stager(types.SimpleNamespace(_stage=None, piece_bytes=64),
                                                             t).copy.handle)
print(json.dumps({"user": user.handle, "default": dev.default_stream().handle,
                  "seen": {k: sorted(v) for k, v in seen.items()},
                  "pool_aliases_user": any(dev.new_stream().handle == user.handle for _ in range(32))}))
"""


def test_our_streams_never_alias_each_other_nor_the_users() -> None:
    """``torch.cuda.Stream()`` hands out one of 32 pooled streams per device, round robin (the
    stand-in's `new_stream` now does too): the side stream, the staging and state-copy streams
    and the warm-up stream were such streams, so in a long run they were the training stream or
    each other's, and a donor's copy could queue behind a collective stuck on the joiner it
    serves. Now each role has one raw non-blocking stream per device, made once."""
    res = _run(_STREAMS)
    assert res["pool_aliases_user"], "the stand-in's pool must hand the user's stream out again"
    handles = {k: v for k, v in res["seen"].items()}
    for role, hs in handles.items():
        assert len(hs) == 1, (role, hs)
        assert res["user"] not in hs and res["default"] not in hs, (role, res)
    assert len({hs[0] for hs in handles.values()}) == len(handles), handles


# ---------------------------------------------------------------------------------- item 4a
_BLOCKED = _HEAD + r"""
c = ds.communicator(1, 0, rank, peers, backend="nccl", timeout=5.0, connect_timeout=5.0)
assert c.wait_init(20) and c.failed is None, c.failed
if rank == 1:
    sys.stdin.readline()                 # takes no part: rank 0's connect waits for it
    c.close()
    say(ok=True)
    sys.exit(0)
c._comm.forget("pat")                    # the tag exchange's algorithm is left to connect lazily
errs = []

def op():
    try:
        c.allreduce(torch.ones(8), timeout=30.0)
    except Exception as e:
        errs.append(e)
th = threading.Thread(target=op, daemon=True)
th.start()
time.sleep(0.5)
t0 = time.monotonic()
done = threading.Event()
how = os.environ["TEST_HOW"]
threading.Thread(target=lambda: (c.abort("test") if how == "abort" else c.close(), done.set()), daemon=True).start()
returned = done.wait(5.0)
returned_s = time.monotonic() - t0
th.join(5.0)
say(returned=returned, returned_s=round(returned_s, 3), op_done=not th.is_alive(),
    err=type(errs[0]).__name__ if errs else None, released=c.wait_released(5.0))
c.close()
"""


@pytest.mark.parametrize("how,blocking", [("close", "0"), ("abort", "0"), ("close", "1")],
                         ids=["close-cupy-blocking", "abort-cupy-blocking", "close-nonblocking"])
def test_abort_and_close_do_not_wait_for_an_enqueue_blocked_inside_nccl(how: str, blocking: str,
                                                                       tmp_path: Path) -> None:
    """A collective whose algorithm NCCL connects lazily blocks inside the host call until every
    peer makes the same call; the enqueue held the communicator's lock, which abort (the view
    follower's abort_below, the star watcher) and close() took to clear the handle: with a peer
    that never comes they waited for ever. Now they clear the handle under the state lock, and
    ncclCommAbort, which ends such a call (NCCL's abort flag), runs beside it after a short grace
    (the stand-in allows exactly that overlap). On the non-blocking communicator the enqueue
    returns in progress and is polled, so nothing blocks at all."""
    violations = tmp_path / "violations.txt"
    env = {"FAKE_NCCL_NONBLOCKING": blocking, "FAKE_NCCL_VIOLATIONS": str(violations), "TEST_HOW": how}
    pair = Pair(_BLOCKED, [env, env])
    try:
        res = pair.result(0, 30)
        pair.send(1, "bye")
        pair.result(1, 10)
    finally:
        pair.close()
    assert res["returned"] and res["returned_s"] < 1.0, res
    assert res["op_done"] and res["err"] == "CommAborted" and res["released"], res
    assert not violations.exists() or violations.read_text() == "", violations.read_text()


# ---------------------------------------------------------------------------------- item 4b
_LOST = _HEAD + r"""
if rank == 1:                            # lost between "go" and its init
    def die(*a, **k):
        os._exit(9)
    fake.LIB.init = die
    nccl_mod.new_nccl_comm = die
base = threading.active_count()
c = ds.communicator(1, 0, rank, peers, backend="nccl", timeout=2.0, connect_timeout=3.0)
deadline = time.monotonic() + 20
while c.failed is None and time.monotonic() < deadline:
    time.sleep(0.02)
t0 = time.monotonic()
c._init_thread.join(10)
gone_s = time.monotonic() - t0
c.close()
time.sleep(0.5)
turn = getattr(c, "_turn", None)
say(failed=type(c.failed).__name__, init_thread_alive=c._init_thread.is_alive(), gone_s=round(gone_s, 3),
    turn_free=getattr(turn, "setup", None) is None, thread_growth=threading.active_count() - base,
    roots=fake.live_roots())
time.sleep(60)
"""


def test_a_peer_lost_between_go_and_init_leaves_nothing_behind() -> None:
    """CuPy's init is blocking: when a peer dies after rank 0 said go but before its own init,
    every other rank's init thread (and rank 0's bootstrap root) waited for it for ever, holding
    the communicator and the device's set-up turn. Now init is non-blocking (ncclCommInitRankConfig
    with blocking=0, through ctypes on CUDA) and aborted once the communicator fails: the init
    thread is gone and the device free within a second. NCCL's bootstrap root cannot be cancelled
    by any API: it alone stays (one thread, one socket)."""
    pair = Pair(_LOST, [{}, {}])
    try:
        res = pair.result(0, 40)
        assert pair.procs[1].wait(10) == 9
    finally:
        pair.close()
    assert res["failed"] in ("PeerFailed", "CommTimeout"), res
    assert not res["init_thread_alive"] and res["gone_s"] < 2.0 and res["turn_free"], res
    assert res["roots"] == 1 and res["thread_growth"] <= 2, res


def test_a_blocking_init_that_cannot_end_takes_the_process_down() -> None:
    """Where only CuPy's blocking init is possible (libnccl not reachable through ctypes, NCCL
    older than 2.14), an init blocked on a lost peer cannot be cancelled at all: the process now
    exits (status 4, one CRITICAL line) once the init has not returned within its deadline plus
    $P2PFT_NCCL_ABORT_TIMEOUT_S, for its launcher to restart it, instead of leaking it for good."""
    env = {"FAKE_NCCL_NONBLOCKING": "0", "P2PFT_NCCL_ABORT_TIMEOUT_S": "1"}
    pair = Pair(_LOST, [env, env])
    try:
        t0 = time.monotonic()
        rc = pair.procs[0].wait(30)
        took = time.monotonic() - t0
        err = pair.procs[0].stderr.read() if pair.procs[0].stderr else ""
    finally:
        pair.close()
    assert rc == 4 and took < 15, (rc, took, err[-2000:])
    assert "ncclCommInitRank of the NCCL communicator" in err and "taking this process down" in err, err[-2000:]


# ---------------------------------------------------------------------------------- item 4c
_BESIDE = _HEAD + r"""
c1 = ds.communicator(1, 0, rank, peers, backend="nccl", timeout=10.0)
x = torch.ones(8)
assert c1.allreduce(x) == 2
no1 = c1._comm.no
if rank == 1:
    dev.slow_kernel(1.5)                 # rank 1's step computes longer: rank 0's collective waits for it
box = {}

def prepare():                           # the view thread builds epoch 2's communicator meanwhile
    time.sleep(0.2)
    box["c2"] = ds.communicator(2, 0, rank, peers, backend="nccl", timeout=10.0)
th = threading.Thread(target=prepare)
th.start()
c1.allreduce(x)
th.join(10)
c2 = box["c2"]
assert c2.wait_init(20) and c2.failed is None, c2.failed
ready = time.monotonic()
y = torch.ones(8)
n = c2.allreduce(y)
say(no1=no1, no2=c2._comm.no, ready=ready, n=n, timeline=list(fake.TIMELINE))
c1.close()
c2.close()
"""


def _setup_beside_collective(res: dict[str, Any]) -> list[str]:
    """Events of the new communicator's set-up (before it was ready) that happened while a kernel
    of the old one was queued or running."""
    busy: list[tuple[float, float]] = []
    open_at: list[float] = []
    for t, no, what in res["timeline"]:
        if no == res["no1"] and what == "kernel_queued":
            open_at.append(t)
        elif no == res["no1"] and what == "kernel_end" and open_at:
            busy.append((open_at.pop(0), t))
    busy += [(t, float("inf")) for t in open_at]
    return [f"{what} at {t:.3f}" for t, no, what in res["timeline"]
            if no == res["no2"] and t <= res["ready"] and any(a <= t <= b for a, b in busy)]


def test_a_set_up_never_runs_beside_a_running_collective_on_its_device() -> None:
    """A communicator built ahead (the view thread prepares the next data epoch's) ran its init
    and warm-up collectives at once, beside the training collective of the old communicator on
    the same device, which NCCL's docs call unsafe (operations on two communicators of a device
    are to be used at different times; an init's allocations may wait for a spinning kernel).
    Now a set-up takes the device's turn only when no collective runs, and a collective waits
    for a set-up (or makes it yield): no event of the new set-up falls inside an old kernel."""
    pair = Pair(_BESIDE, [{}, {}])
    try:
        res = [pair.result(r, 60) for r in range(2)]
    finally:
        pair.close()
    for r in res:
        assert r["n"] == 2, r["n"]
        assert not _setup_beside_collective(r), _setup_beside_collective(r)


# ---------------------------------------------------------------------------------- item 4d
_CATCHUP = r"""
import json, threading, time, types
import torch
import fakedevice
from p2pft.transport import DataServer, StateSnapshot
from p2pft.trainer.recovery.catchup import Catchup

dev = fakedevice.DEVICE
donor = DataServer("127.0.0.1", 0)
donor.state_chunk_bytes = 4096
good = torch.full((4096,), 7.0)
donor.serve_state(lambda req: StateSnapshot(meta={"step": 5, "shard": 0}, tensors={"w": good}))
model = torch.nn.Linear(64, 64, bias=False)         # 4096 parameters
w = model.weight.data.view(-1)
train = dev.new_stream()
dev.set_current_stream(train)                       # the training loop runs on a stream of its own
dev.slow_kernel(0.5, train)                         # the last optimizer step, still queued:
dev.copy_async(w, torch.full((4096,), 1.0), train)  # it writes the weights when it runs
e = types.SimpleNamespace(synced=True, rt=None, step=5, shard=0, secret=None, state_rate_limit=None,
                          events=[], model=model, opt=None, ds=types.SimpleNamespace(host="127.0.0.1"),
                          state_io=types.SimpleNamespace(receive_into=lambda m, o: {"w": w}))
e.mark_synced = lambda v: setattr(e, "synced", v)
c = Catchup(e, 1 << 20)
c.start("test")                                     # the training thread leaves the synced state
c.donor = ("d.1", (donor.addr,))
box = []
th = threading.Thread(target=lambda: box.append(c._fetch(0)))   # the catch-up worker's fetch
th.start()
th.join(30)
train.synchronize()
donor.close()
print(json.dumps({"into": box[0].tensors["w"] is w, "values": sorted(set(w.tolist()))}))
"""


def test_a_joiners_copies_follow_the_training_streams_pending_work() -> None:
    """The catch-up fetched into the model's CUDA tensors without ``after``: its copies waited
    for the fetch thread's default stream only, not for the optimizer kernels still queued on
    the training stream, which then overwrote the restored state. The catch-up now passes the
    event the training thread recorded when it left the synced state (joined with the worker's
    own last write): the snapshot's values are what remains."""
    res = _run(_CATCHUP)
    assert res["into"] and res["values"] == [7.0], res


# ---------------------------------------------------------------------------------- item 4e
_TIMEOUT_ENV = r"""
import json, os, threading, time, torch, fakedevice
from p2pft.transport.nccl import RELEASE_TIMEOUT_ENV, NcclCommunicator, nccl_unique_id

out = {}
os.environ[RELEASE_TIMEOUT_ENV] = "soon"
try:
    NcclCommunicator(1, 0, 0, 1, nccl_unique_id(), timeout=5.0)
    out["built"] = True
except ValueError as e:
    out["error"] = str(e)
os.environ.pop(RELEASE_TIMEOUT_ENV)
c = NcclCommunicator(1, 0, 0, 1, nccl_unique_id(), timeout=5.0)
assert c.wait_init(10)
fakedevice.DEVICE.slow_kernel(3.0)       # a collective in flight behind it: close() aborts
errs = []

def op():
    try:
        c.allreduce(torch.ones(8))
    except Exception as e:
        errs.append(type(e).__name__)
th = threading.Thread(target=op)
th.start()
time.sleep(0.3)
os.environ[RELEASE_TIMEOUT_ENV] = "soon"   # malformed after the build: not read again
t0 = time.monotonic()
try:
    c.close()
    out["closed"] = True
except Exception as e:
    out["close_error"] = repr(e)
out["close_s"] = round(time.monotonic() - t0, 3)
out["released"] = c.wait_released(5.0)
th.join(10)
out["op"] = errs
print(json.dumps(out))
"""


def test_a_malformed_abort_timeout_is_one_clear_error_and_loses_nothing() -> None:
    """$P2PFT_NCCL_ABORT_TIMEOUT_S was read when a communicator was released, after its handle
    had been cleared: a malformed value raised there, the handle was dropped unreleased, and
    CuPy's ``__dealloc__`` ran a blocking ncclCommDestroy on the caller's thread (which waits for
    the queued kernels). It is now read once, when the communicator is built: a malformed value
    is one ValueError naming it before anything exists, and a release never raises."""
    res = _run(_TIMEOUT_ENV)
    assert "P2PFT_NCCL_ABORT_TIMEOUT_S" in res.get("error", ""), res
    assert res.get("closed") and res["close_s"] < 0.5 and res["released"], res
    assert res["op"] == ["CommAborted"], res


# ---------------------------------------------------------------------------------- item 6
_HOSTS = _HEAD + r"""
c = ds.communicator(1, 0, rank, peers, backend="nccl", timeout=5.0)
assert c.wait_init(20) and c.failed is None, c.failed
say(inited=True)
if rank == 1:
    time.sleep(120)
sys.stdin.readline()                     # rank 1 is stopped now
comm = c._comm
t0 = time.monotonic()
done = threading.Event()
threading.Thread(target=lambda: (comm.abort(), done.set()), daemon=True).start()
say(returned=done.wait(1.5), s=round(time.monotonic() - t0, 3))
done.wait(30)                            # rank 1 runs again
os._exit(0)
"""


@pytest.mark.parametrize("hosts", ["same", "two"])
def test_abort_waits_only_for_stopped_peers_of_its_own_host(hosts: str) -> None:
    """NCCL's proxy thread, which ncclCommAbort joins, waits for the other ranks of its node; a
    rank on another host (another NCCL_HOSTID) does not hold it up. The stand-in's abort waited
    for every stopped rank whatever its host id, so a scenario with distinct host ids could not
    tell a proxy wait from anything else."""
    envs = [{"NCCL_HOSTID": "a"}, {"NCCL_HOSTID": "a" if hosts == "same" else "b"}]
    pair = Pair(_HOSTS, envs)
    try:
        for r in range(2):
            assert pair.result(r, 30)["inited"]
        os.kill(pair.procs[1].pid, signal.SIGSTOP)
        time.sleep(0.2)
        pair.send(0, "go")
        res = pair.result(0, 10)
        os.kill(pair.procs[1].pid, signal.SIGCONT)
    finally:
        pair.close()
    assert res["returned"] == (hosts == "two"), res


_LAZY = _HEAD + r"""
mode = os.environ.pop("NCCL_RUNTIME_CONNECT", None)   # NCCL read its parameters before p2pft set them:
assert fake._param("NCCL_RUNTIME_CONNECT", "1") == "1"  # it connects lazily
os.environ["NCCL_RUNTIME_CONNECT"] = mode or "0"
nccl_mod.NCCL_PARAMS_READ_BEFORE_P2PFT = True
c = ds.communicator(1, 0, rank, peers, backend="nccl", timeout=5.0)
assert c.wait_init(30) and c.failed is None, c.failed
ready = time.monotonic()
fc = c._comm
no = fc.no
sizes = [64, 64 << 10, 512 << 10, 2 << 20]   # gradients (bytes of float32) of every band
for n in sizes:
    assert c.allreduce(torch.ones(n // 4)) == 2
say(connected=sorted(fc._peers), picks=sorted({fake.algorithm(1, n) for n in sizes}),
    late=[w for t, k, w in list(fake.TIMELINE) if k == no and t > ready and w.startswith("lazy_connect:")])
c.close()
"""


@pytest.mark.parametrize("blocking", ["0", "1"], ids=["cupy-blocking", "nonblocking"])
def test_the_warm_up_connects_the_algorithms_nccl_picks_for_gradient_sizes(blocking: str) -> None:
    """NCCL connects six algorithms lazily (ring, tree, PAT, NVLS, NVLS-tree, CollNet), each inside
    the first call that uses it, waiting for every peer; the stand-in modelled two. Where NCCL
    read its parameters before p2pft (lazy connect in effect), the warm-up reached only the tree
    and the ring: a gradient whose size NCCL sums with NVLS-tree or NVLS connected inside the
    training thread's host call, unbounded (a peer lost meanwhile: blocked for ever). The warm-up
    now runs a ladder of sizes: every algorithm of every band is connected within the set-up."""
    env = {"P2PFT_NCCL_WARM_MAX_BYTES": str(2 << 20), "FAKE_NCCL_NONBLOCKING": blocking}
    pair = Pair(_LAZY, [env, env])
    try:
        res = [pair.result(r, 60) for r in range(2)]
    finally:
        pair.close()
    for r in res:
        assert r["picks"] == ["nvls", "nvls_tree", "ring", "tree"], r
        assert set(r["picks"]) <= set(r["connected"]) and r["late"] == [], r


# ---------------------------------------------------------------------------------- the ctypes binding
_SHIM_C = r"""
#include <stddef.h>
#include <string.h>
#include <stdlib.h>
typedef struct { size_t size; unsigned magic, version; int blocking, cga, minc, maxc; const char* net; } cfg_t;
typedef struct { unsigned char internal[128]; } shim_uid;
typedef struct { int nranks, rank, polls, aborted; } comm_t;
int shim_blocking = -1, shim_aborts = 0, shim_destroys = 0, shim_calls_in_progress = 0;
unsigned shim_magic = 0, shim_version = 0;
size_t shim_size = 0;
long shim_stream = 0;
unsigned char shim_id[128];
int ncclGetVersion(int* v) { *v = 22800; return 0; }
const char* ncclGetErrorString(int r) { return r == 0 ? "no error" : "shim error"; }
int ncclCommInitRankConfig(void** out, int nranks, shim_uid id, int rank, cfg_t* c) {
  comm_t* m = calloc(1, sizeof(comm_t));
  m->nranks = nranks; m->rank = rank; m->polls = 3;
  shim_blocking = c->blocking; shim_magic = c->magic; shim_version = c->version; shim_size = c->size;
  memcpy(shim_id, id.internal, 128);
  *out = m;
  return 7;
}
int ncclCommGetAsyncError(void* c, int* st) {
  comm_t* m = c;
  if (m->polls > 0) { m->polls--; *st = 7; } else { *st = 0; }
  return 0;
}
int ncclAllReduce(const void* s, void* r, size_t n, int dt, int op, void* c, void* stream) {
  comm_t* m = c;
  if (m->aborted || dt != 4 || op != 0) return 4;
  for (size_t i = 0; i < n; i++) ((long long*)r)[i] = ((const long long*)s)[i] * m->nranks;
  shim_stream = (long)stream;
  m->polls = 2;            /* a lazy connect: the call returns in progress */
  shim_calls_in_progress++;
  return 7;
}
int ncclAllGather(const void* s, void* r, size_t n, int dt, void* c, void* stream) { return 0; }
int ncclBcast(void* b, size_t n, int dt, int root, void* c, void* stream) { return 0; }
int ncclCommAbort(void* c) { ((comm_t*)c)->aborted = 1; shim_aborts++; return 0; }
int ncclCommDestroy(void* c) { shim_destroys++; return 0; }
"""

_SHIM_PY = r"""
import ctypes, json, sys
from p2pft.transport.ncclapi import NCCL_IN_PROGRESS, NcclApiError, _Config, load_libnccl, mapped_library

path = sys.argv[1]
ctypes.CDLL(path)                       # as CuPy's binding would have loaded it
lib = load_libnccl()
raw = lib.lib
uid = bytes(range(128))                 # zeros and high bytes inside: copied whole, by value
comm = lib.init(2, uid, 1)
states = [comm.async_error() for _ in range(4)]
src = (ctypes.c_int64 * 4)(1, 2, 3, 4)
dst = (ctypes.c_int64 * 4)()
comm.allReduce(ctypes.addressof(src), ctypes.addressof(dst), 4, 4, 0, 0x1234)
after = [comm.async_error() for _ in range(3)]
comm.abort()
try:
    comm.allReduce(ctypes.addressof(src), ctypes.addressof(dst), 4, 4, 0, 0x1234)
    used_after_abort = True
except NcclApiError:
    used_after_abort = False
g = lambda t, n: t.in_dll(raw, n).value
print(json.dumps({
    "path": lib.path == mapped_library("libnccl.so"), "version": lib.version, "states": states, "after": after,
    "blocking": g(ctypes.c_int, "shim_blocking"), "magic": g(ctypes.c_uint, "shim_magic"),
    "size_ok": g(ctypes.c_size_t, "shim_size") == ctypes.sizeof(_Config),
    "id_ok": bytes((ctypes.c_ubyte * 128).in_dll(raw, "shim_id")) == uid, "sum": list(dst),
    "stream": g(ctypes.c_long, "shim_stream"), "aborts": g(ctypes.c_int, "shim_aborts"),
    "handle_cleared": comm.comm == 0, "used_after_abort": used_after_abort, "in_progress": NCCL_IN_PROGRESS}))
"""


def test_the_ctypes_binding_drives_a_libnccl_as_nccl_h_lays_it_out(tmp_path: Path) -> None:
    """The non-blocking init and the calls p2pft makes through ctypes run on no machine here (no
    GPU): against a small C library with nccl.h's signatures they pass the id by value (all 128
    bytes), a config with blocking=0 and NCCL's magic and size, the stream, and report
    ncclInProgress until the state settles; abort clears the handle."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "shim.c"
    src.write_text(_SHIM_C)
    lib = tmp_path / "libnccl.so.2"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    env = {k: v for k, v in os.environ.items()}
    out = subprocess.run([sys.executable, "-c", _SHIM_PY, str(lib)], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["path"] and res["version"] == 22800, res
    assert res["states"] == [7, 7, 7, 0] and res["after"] == [7, 7, 0], res
    assert res["blocking"] == 0 and res["magic"] == 0xCAFEBEEF and res["size_ok"] and res["id_ok"], res
    assert res["sum"] == [2, 4, 6, 8] and res["stream"] == 0x1234, res
    assert res["aborts"] == 1 and res["handle_cleared"] and not res["used_after_abort"], res
