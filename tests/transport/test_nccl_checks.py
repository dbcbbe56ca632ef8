"""Small checks of the NCCL path on the CPU stand-in: the buffer's device against the
communicator's, broadcast counts, and the joiner's device copies ordered by the caller's event."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from p2pft.transport.nccl import WARM_MAX_ENV

OWN_RING_LOOP = True
FAKES = Path(__file__).resolve().parent.parent / "fakes"
pytestmark = pytest.mark.slow


def _run(script: str, extra: dict[str, str] | None = None) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


_DEVICE = r"""
import torch
import fakedevice
from p2pft.transport import DataServer

ds = DataServer("127.0.0.1", 0)
c = ds.communicator(1, 0, 0, [ds.addr], backend="nccl", device=0, timeout=5.0)
x = torch.ones(4)
assert c.allreduce(x) == 1
out = []
for op in ("allreduce", "broadcast"):
    y = fakedevice.DEVICE.place(torch.ones(4), 1)
    try:
        c.allreduce(y) if op == "allreduce" else c.broadcast(y, 0)
        out.append(f"{op}: enqueued")
    except ValueError as e:
        out.append("OK" if "device 1" in str(e) and "device 0" in str(e) else f"{op}: {e!r}")
assert c.failed is None
c.close()
ds.close()
print(" ".join(out))
"""


def test_a_tensor_on_another_device_is_one_clear_error() -> None:
    """The buffer's device was never compared with the communicator's: NCCL would read another
    GPU's memory through the wrong device (an illegal access, or silently wrong data over peer
    access). Now a ValueError names both, before anything is enqueued, and the communicator
    stays usable."""
    assert _run(_DEVICE) == "OK OK"


_JOINER = r"""
import time
import torch
import fakedevice
from p2pft.transport import DataServer, StateSnapshot, fetch_state
from p2pft.transport.device import written_event

dev = fakedevice.DEVICE
w = torch.full((4096,), 7.0)
s = DataServer("127.0.0.1", 0)
s.state_chunk_bytes = 4096
ready = written_event(w)                 # the donor's state, written before what follows
s.serve_state(lambda req: StateSnapshot(meta={}, tensors={"w": w}, ready=ready))
mine = torch.zeros(4096)                 # the joiner's own parameter, last written on the compute stream
after = written_event(mine)
dev.slow_kernel(20.0)                    # then a collective stuck until this joiner joins it
t0 = time.monotonic()
snap = fetch_state(s.addr, {}, timeout=5.0, into={"w": mine}, after=after)
took = time.monotonic() - t0
s.close()
ok = snap.tensors["w"] is mine and mine.tolist() == [7.0] * 4096 and took < 3.0
print("OK" if ok else f"took {took:.1f} s, same={snap.tensors['w'] is mine}")
"""


def test_joiner_copies_wait_for_the_callers_event_not_the_default_stream() -> None:
    """The joiner's copies into its device tensors waited for the fetching thread's current
    stream (the default stream on a fetch thread), behind a collective stuck until that very
    joiner joins it. They now wait for the event the caller recorded where it last used them."""
    assert _run(_JOINER) == "OK"


_SIDE = r"""
import threading, time
import torch
import fakedevice
from p2pft.transport import DataServer
from p2pft.transport.device import SideStream, written_event

dev = fakedevice.DEVICE
ds = DataServer("127.0.0.1", 0)
c = ds.communicator(1, 0, 0, [ds.addr], backend="nccl", timeout=5.0)
c.wait_init(10)
train = dev.new_stream()
dev.set_current_stream(train)              # training runs on a side stream
dev.slow_kernel(3.0, dev.default_stream()) # other work keeps the default stream busy
buf = torch.zeros(4096)
dev.slow_kernel(0.3, train)                # the pseudo-gradient is written late, on the training stream
dev.copy_async(buf, torch.full((4096,), 2.0), train)
ready = written_event(buf)
side = SideStream(buf)
took = []

def sync() -> None:                        # DiLoCo's sync thread
    t0 = time.monotonic()
    with side.use(after=ready):
        c.allreduce(buf)
    took.append(time.monotonic() - t0)
th = threading.Thread(target=sync)
th.start()
th.join(20)
side.join(buf)                             # the training stream waits for the sum, the host does not
train.synchronize()
ok = took and took[0] < 1.5 and buf.tolist() == [2.0] * 4096
c.close()
ds.close()
print("OK" if ok else f"took={took} values={sorted(set(buf.tolist()))}")
"""


def test_a_helper_threads_collective_on_a_side_stream_after_the_owners_event() -> None:
    """DiLoCo's sync thread enqueued its allreduce on the default stream (a new thread's current
    stream): behind unrelated work there, and not after the training stream's write of the
    pseudo-gradient. `SideStream.use(after=...)` runs it on a stream of its own that starts after
    the owner's event; `join` orders the owner's stream after it."""
    assert _run(_SIDE) == "OK"


_NOSTAR = r"""
import sys, time
import torch
from p2pft.transport import CommError
from p2pft.transport.nccl import NcclCommunicator, nccl_unique_id

rank = int(sys.argv[1])
if rank == 0:
    uid = nccl_unique_id()
    print(uid.hex(), flush=True)
else:
    uid = bytes.fromhex(sys.stdin.readline().strip())
c = NcclCommunicator(1, 0, rank, 2, uid, timeout=2.0)   # a given id: no id links to see a death
assert c.wait_init(30)
print("inited", flush=True)
if rank == 1:
    time.sleep(60)
sys.stdin.readline()                                    # the test killed rank 1
t0 = time.monotonic()
try:
    c.allreduce(torch.ones(8))
    print("none", 0.0, flush=True)
except CommError as e:
    print(type(e).__name__, round(time.monotonic() - t0, 2), flush=True)
c.close()
"""


@pytest.mark.parametrize("link", ["p2p", "net"])
def test_a_dead_peer_is_reported_by_nccl_only_over_the_network(link: str) -> None:
    """Over P2P/NVLink or shared memory a kernel spinning on a dead peer reports nothing; only
    the network proxy raises ncclRemoteError. The stand-in used to raise it at once everywhere,
    which hid that p2pft must see deaths through its own links (or the timeout): here, with no
    id links (a given id), a death over P2P is a CommTimeout after the 2 s timeout, over the
    network an error at once."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if link == "net":
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    procs = [subprocess.Popen([sys.executable, "-c", _NOSTAR, str(r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    try:
        assert procs[0].stdout is not None and procs[1].stdin is not None and procs[0].stdin is not None
        procs[1].stdin.write(procs[0].stdout.readline())
        procs[1].stdin.flush()
        assert procs[0].stdout.readline().strip() == "inited"
        assert procs[1].stdout is not None and procs[1].stdout.readline().strip() == "inited"
        procs[1].kill()
        procs[1].wait(10)
        procs[0].stdin.write("go\n")
        procs[0].stdin.flush()
        err, secs = procs[0].stdout.readline().split()
        procs[0].wait(20)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    if link == "p2p":
        assert err == "CommTimeout" and 1.9 <= float(secs) < 4.0, (err, secs)
    else:
        assert err == "CommError" and float(secs) < 1.0, (err, secs)


_WARM = r"""
import sys
import torch
from p2pft.transport import nccl as nccl_mod
from p2pft.transport.nccl import NcclCommunicator, nccl_unique_id

rank, mode = int(sys.argv[1]), sys.argv[2]
nccl_mod._other_nccl_in_process = lambda: True      # as with torch's NCCL group of an HSDP replica
assert "libnccl" in open("/proc/self/maps").read()  # a CUDA torch loaded it: says nothing of NCCL's parameters
if mode == "lazy":
    nccl_mod.NCCL_PARAMS_READ_BEFORE_P2PFT = True   # another NCCL user initialised first
uid = nccl_unique_id() if rank == 0 else bytes.fromhex(sys.stdin.readline().strip())
if rank == 0:
    print(uid.hex(), flush=True)
c = NcclCommunicator(1, 0, rank, 2, uid, timeout=10.0)
assert c.wait_init(30)
kernels = c._comm._seq                               # collectives the stand-in ran so far
warm = 3 + len(nccl_mod.warm_ladder(nccl_mod.warm_max_bytes()))   # tag exchange, bcast, sum check, the ladder
x = torch.full((8,), float(rank + 1))
n = c.allreduce(x)
print(kernels, n, x[0].item(), 0 if mode == "eager" else warm, flush=True)
c.close()
"""


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_no_warm_up_kernel_beside_another_nccl_user_when_init_connected(mode: str) -> None:
    """A communicator set up ahead ran its warm-up collectives on its init thread, beside torch's
    NCCL group on the same device (NCCL's docs call unordered kernels of two communicators
    unsafe). Where NCCL connected everything inside init (the connect mode set before NCCL read
    it) and another NCCL user is in the process, no warm-up kernel runs; where NCCL may connect
    lazily, the warm-up still runs (connecting inside the bounded init matters more), with its
    ladder of allreduce sizes. The eager case used to be unreachable in a real process: the check
    was "is libnccl loaded", and a CUDA torch loads it at import (the stand-in now maps one too),
    while NCCL reads its parameters only at its first init."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[WARM_MAX_ENV] = str(2 << 20)     # the stand-in's algorithms all show up below 2 MiB
    procs = [subprocess.Popen([sys.executable, "-c", _WARM, str(r), mode], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    try:
        assert procs[0].stdout is not None and procs[1].stdin is not None
        procs[1].stdin.write(procs[0].stdout.readline())
        procs[1].stdin.flush()
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    for out, err in outs:
        kernels, n, v, expected = out.split()
        assert int(n) == 2 and float(v) == 3.0, (out, err[-2000:])
        assert int(kernels) == int(expected), (out, err[-2000:])
