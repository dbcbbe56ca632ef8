"""Rank 0 builds the NCCL communicator of a new data epoch when the view announces it
(`ShardComms.prepare`), and the engine's attempt then gets that same communicator, already set up.

On the CPU stand-in (`tests/fakes` first on PYTHONPATH), in a process of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

OWN_RING_LOOP = True   # the ring loop is not what this is about: run once
FAKES = Path(__file__).resolve().parent.parent / "fakes"
pytestmark = pytest.mark.slow

_SCRIPT = r"""
import torch
from p2pft.transport import DataServer
from p2pft.transport.backend import Backend
from p2pft.trainer.kernel.comms import ShardComms
from p2pft.core.view import Member, Role, View

ds = DataServer("127.0.0.1", 0, secret=b"s")
me = Member("r0.a", "r0", "127.0.0.1:1", (ds.addr,), Role.JOINER, None)
view = View(7, (me,), data_epoch=5)
paused = View(8, (Member("r0.a", "r0", "127.0.0.1:1", (ds.addr,), Role.PAUSED, None),), data_epoch=8)

tcp = ShardComms(ds, 0, 5.0, backend=Backend.TCP)
tcp.prepare(view, "r0.a", 1)
assert not tcp._comms, "the TCP ring connects lazily: nothing to prepare"

sc = ShardComms(ds, 0, 5.0, backend=Backend.NCCL)
sc.prepare(paused, "r0.a", 1)
assert not sc._comms, "a paused member is off the data plane"
sc.prepare(view, "r0.a", 2)
assert not sc._comms, "members without one address per rank of the replica: the engine waits"
sc.prepare(view, "r0.a", 1)
first = sc._comms[5]
assert first.wait_init(10), "the prepared communicator sets itself up without the training thread"
got = sc.get(5, 0, [ds.addr])
assert got is first, "the attempt gets the prepared communicator"
x = torch.ones(4)
assert got.allreduce(x) == 1 and x.tolist() == [1.0] * 4
other = sc.get(5, 0, [ds.addr, "127.0.0.1:9"])    # not what it was built for: rebuilt
assert other is not first and first.failed is not None
sc.close()
tcp.close()
ds.close()
print("OK")
"""


def test_prepare_builds_the_communicator_the_attempt_then_gets() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "OK", out.stdout + out.stderr[-2000:]


_RANKS = r"""
import socket, struct, time
from p2pft.transport import DataServer
from p2pft.transport.backend import Backend
from p2pft.trainer.kernel.comms import ShardComms, _PREPARE_HEAD
from p2pft.core.view import Member, Role, View

ds0, ds1 = DataServer("127.0.0.1", 0, secret=b"s"), DataServer("127.0.0.1", 0, secret=b"s")
view = View(7, (Member("r0.a", "r0", "127.0.0.1:1", (ds0.addr, ds1.addr), Role.JOINER, None),), data_epoch=5)
rank0 = ShardComms(ds0, 0, 5.0, backend=Backend.NCCL)
rank1 = ShardComms(ds1, 1, 5.0, backend=Backend.NCCL)
side = rank1.listen("127.0.0.1")

assert ShardComms(ds0, 0, 5.0, backend=Backend.TCP).prepare_frame(view, "r0.a", 2, 1) == b"", "TCP: nothing ahead"
frame = rank0.prepare_frame(view, "r0.a", 2, 1)
s = socket.create_connection(side, timeout=5)
s.sendall(struct.pack(">q", 5) + frame[:5])        # split across reads, as TCP may deliver it
time.sleep(0.1)
s.sendall(frame[5:])
deadline = time.monotonic() + 10
while 5 not in rank1._comms and time.monotonic() < deadline:
    time.sleep(0.01)
built = rank1._comms.get(5)
assert built is not None, "rank 1 did not build the communicator it was told of"
assert built.wait_init(10), "rank 1's prepared communicator sets itself up without its training thread"
assert rank1.get(5, 0, [ds1.addr]) is built, "rank 1's attempt gets the prepared communicator"
s.sendall(struct.pack(">q", -1))                    # still answers pings on the same connection
assert s.recv(1) == b"\x01"
s.sendall(_PREPARE_HEAD.pack(-2, 1 << 20))          # a body no rank 0 sends: the connection ends
assert s.recv(1) == b"", "a malformed frame must end the side connection"
for x in (rank0, rank1):
    x.close()
for d in (ds0, ds1):
    d.close()
print("OK")
"""


def test_other_ranks_build_the_communicator_rank0_tells_them_of() -> None:
    """Ranks other than 0 do not see views: rank 0 tells each on the side channel which
    communicator of a new data epoch to build (data epoch, rank, peers), and the rank's next
    attempt gets it built; a frame no rank 0 sends ends the connection."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out = subprocess.run([sys.executable, "-c", _RANKS], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "OK", out.stdout + out.stderr[-2000:]


_SLOTS = r"""
import socket, struct, time
from p2pft.transport import DataServer
from p2pft.transport.backend import Backend
from p2pft.trainer.kernel.comms import PREPARE_THREADS, ShardComms, _PREPARE_HEAD
import json

ds0, ds1 = DataServer("127.0.0.1", 0, secret=b"s"), DataServer("127.0.0.1", 0, secret=b"s")
rank1 = ShardComms(ds1, 1, 2.0, backend=Backend.NCCL)
rank1.connect_timeout = 1.5
side = rank1.listen("127.0.0.1")
s = socket.create_connection(side, timeout=5)
body = json.dumps({"d": 5, "rank": 1, "peers": [ds0.addr, ds1.addr]}).encode()   # rank 0 never hands the id
s.sendall(struct.pack(">q", 5) + _PREPARE_HEAD.pack(-2, len(body)) + body)
deadline = time.monotonic() + 10
while 5 not in rank1._comms and time.monotonic() < deadline:
    time.sleep(0.01)
comm = rank1._comms[5]
time.sleep(0.5)
held = not comm.wait_init(0) and rank1._prepare_slots._value == PREPARE_THREADS - 1
deadline = time.monotonic() + 10
while comm.failed is None and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.3)
freed = rank1._prepare_slots._value == PREPARE_THREADS
rank1.close()
for d in (ds0, ds1):
    d.close()
print("OK" if held and freed else f"held={held} freed={freed} failed={comm.failed!r}")
"""


def test_a_prepare_slot_is_held_while_its_communicator_sets_itself_up() -> None:
    """The slots that bound communicators built ahead were released as soon as the build call
    returned, which is at once (the set-up runs on the communicator's own threads): they bounded
    nothing. A slot is now held until the set-up ended or failed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKES)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out = subprocess.run([sys.executable, "-c", _SLOTS], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "OK", out.stdout + out.stderr[-2000:]
