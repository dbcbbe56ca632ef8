"""NCCL's bootstrap root: made only for an id whose init will run (on the CPU stand-in).

ncclGetUniqueId starts a bootstrap root in the calling process, a thread and a listening socket
that stay until every rank of the id has reached it: for an id whose init never runs, for the
life of the process. The stand-in's root behaves the same (it never gives up), so an id made
before the hand-off is known to succeed shows up here as a thread and an fd per attempt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OWN_RING_LOOP = True
HERE = Path(__file__).resolve().parent
FAKES = HERE.parent / "fakes"
pytestmark = pytest.mark.slow


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("NCCL_RUNTIME_CONNECT", None)
    env.update(extra or {})
    return env


_LEAK = r"""
import json, os, threading, time
import torch
from cupy.cuda import nccl
from p2pft.transport import DataServer

def fds():
    return len(os.listdir("/proc/self/fd"))

servers = [DataServer("127.0.0.1", 0, secret=b"s") for _ in range(2)]
peers = [s.addr for s in servers]

def epoch(e, backend, ranks=(0, 1), connect_timeout=5.0):
    cs = [servers[r].communicator(e, 0, r, peers, backend=backend, timeout=5.0, connect_timeout=connect_timeout)
          for r in ranks]
    for c in cs:
        c.wait_init(10)
    return cs

for c in epoch(1, "nccl-auto"):   # warm: the fallback ring's and the device's threads exist once
    c.close()
base_fd, base_th = fds(), threading.active_count()
out = {}
sums = []
# 1. data epochs under auto on a shared device: every one becomes a TCP ring
for e in range(2, 22):
    cs = epoch(e, "nccl-auto")
    xs = [torch.full((64,), float(r + 1)) for r in range(2)]
    ths = [threading.Thread(target=lambda r=r: sums.append(cs[r].allreduce(xs[r]))) for r in range(2)]
    [t.start() for t in ths]
    ths[0].join(10)
    cs[0].close()            # as a rank moving on to the next data epoch does, the other one maybe not done yet
    ths[1].join(10)
    cs[1].close()
    out.setdefault("tcp", []).append(all(c.tcp is not None for c in cs) and all(x.tolist() == [3.0] * 64 for x in xs))
# 2. failed hand-offs: rank 1 never opens its communicator
servers[1].pending_timeout = 0.2
for e in range(100, 110):
    c, = epoch(e, "nccl", ranks=(0,), connect_timeout=0.3)
    out.setdefault("failed", []).append(type(c.failed).__name__)
    c.close()
deadline = time.monotonic() + 5.0
while time.monotonic() < deadline and (threading.active_count() > base_th + 2 or fds() > base_fd + 2):
    time.sleep(0.05)
out.update(sums=sums, roots=nccl.live_roots(), fd_growth=fds() - base_fd,
           thread_growth=threading.active_count() - base_th)
for s in servers:
    s.close()
print(json.dumps(out))
"""


def test_no_bootstrap_root_left_by_fallbacks_and_failed_handoffs() -> None:
    """20 data epochs under auto on a shared device and 10 hand-offs that fail (rank 1 never
    comes) leave no bootstrap root, no thread and no fd behind: rank 0 makes the id only after
    every rank acked and no device is shared. Before, each of the 30 left a root for good.
    Each fallback epoch sums once, and rank 0 closes as soon as its own sum returned: the id
    links no longer carry that close to rank 1 (whose ring has its own failure detection), where
    it aborted the sum rank 1 was still finishing."""
    out = subprocess.run([sys.executable, "-c", _LEAK], capture_output=True, text=True, timeout=120,
                         env=_env({"P2PFT_FAKE_GPU": "0", "P2PFT_FAKE_COPY_DELAY_S": "0.02"}))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(res["tcp"]) and len(res["tcp"]) == 20 and res["sums"] == [2] * 40, res
    assert res["failed"] == ["CommTimeout"] * 10, res
    assert res["roots"] == 0, res
    assert res["fd_growth"] <= 2 and res["thread_growth"] <= 2, res
