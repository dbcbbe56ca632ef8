"""The NCCL unique id hand-off and the failure links, over real data servers on loopback.

No GPU is needed: the id travels and the links fail before ncclCommInitRank (which, without a
device, only records an error for the first operation). Ids are CuPy's real ones when
`cupy.cuda.nccl` imports (it does without a GPU, CuPy >= 14 with nvidia-nccl-cu12); the same
hand-off also runs with random ids so it is tested where CuPy is absent.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from typing import Any, Callable

import pytest

from p2pft.transport import CommAborted, CommTimeout, DataServer, PeerFailed, ProtocolMismatch

try:
    importlib.import_module("cupy.cuda.nccl")
    HAVE_CUPY_NCCL = True
except Exception:  # noqa: BLE001 - ImportError, or CuPy without its NCCL library
    HAVE_CUPY_NCCL = False


def _random_uid() -> bytes:
    return os.urandom(128)


def _servers(n: int, secret: bytes | None = b"k", uid: Callable[[], bytes] | None = _random_uid,
             **kw: Any) -> list[DataServer]:
    out = []
    for _ in range(n):
        s = DataServer("127.0.0.1", 0, secret=secret, **kw)
        s.nccl_uid_factory = uid
        out.append(s)
    return out


def _wait(pred: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def _close(comms: list[Any], servers: list[DataServer]) -> None:
    for c in comms:
        c.close()
    for s in servers:
        s.close()


def _handoff(uid_factory: Callable[[], bytes] | None) -> None:
    servers = _servers(4, uid=uid_factory)
    peers = [s.addr for s in servers]
    # Rank 0 last: its id connections wait in the others' pending tables; rank 3 after rank 0.
    order = [1, 2, 0, 3]
    comms: dict[int, Any] = {}
    try:
        for r in order:
            comms[r] = servers[r].communicator(7, 2, r, peers, backend="nccl", timeout=2.0, connect_timeout=5.0)
            if r == 0:
                time.sleep(0.05)
        for r in range(4):
            assert comms[r].uid_known.wait(5.0), f"rank {r} never got the id"
        ids = {comms[r].unique_id for r in range(4)}
        assert len(ids) == 1 and len(next(iter(ids))) == 128
        time.sleep(0.2)
        assert all(comms[r].failed is None for r in range(4)), [comms[r].failed for r in range(4)]
        # A new data epoch gets a new id.
        c2 = [servers[r].communicator(8, 2, r, peers, backend="nccl", connect_timeout=5.0) for r in range(4)]
        assert all(c.uid_known.wait(5.0) for c in c2)
        assert len({c.unique_id for c in c2}) == 1 and c2[0].unique_id not in ids
        for c in c2:
            c.close()
    finally:
        _close(list(comms.values()), servers)


@pytest.mark.skipif(not HAVE_CUPY_NCCL, reason="cupy.cuda.nccl is not importable (install p2pft[cuda12])")
def test_handoff_of_real_nccl_ids() -> None:
    _handoff(None)   # the server's default: cupy.cuda.nccl.get_unique_id()


def test_handoff_of_random_ids() -> None:
    _handoff(_random_uid)


def test_wrong_secret_is_refused_and_both_sides_name_the_peer() -> None:
    a, = _servers(1, secret=b"one")
    b, = _servers(1, secret=b"two")
    peers = [a.addr, b.addr]
    c0 = a.communicator(1, 0, 0, peers, backend="nccl", connect_timeout=1.0)
    c1 = b.communicator(1, 0, 1, peers, backend="nccl", connect_timeout=1.0)
    try:
        assert _wait(lambda: c0.failed is not None and c1.failed is not None, 5.0)
        assert isinstance(c0.failed, ProtocolMismatch) and c0.failed.peer_rank == 1
        assert isinstance(c1.failed, CommTimeout) and c1.failed.peer_rank == 0 and c1.failed.peer_addr == a.addr
        assert b.counters["hello_bad_mac"] >= 1
        assert not c1.uid_known.is_set()
    finally:
        _close([c0, c1], [a, b])


def test_unknown_backend_is_refused_before_anything_is_built() -> None:
    s, = _servers(1)
    try:
        with pytest.raises(ValueError, match="unknown backend 'gloo'"):
            s.communicator(1, 0, 0, [s.addr], backend="gloo")
        s.communicator(1, 0, 0, [s.addr], backend="tcp").close()  # the key was not taken
    finally:
        s.close()


def test_tampered_id_fails_its_mac() -> None:
    """The id is authenticated on its own: a hello that passes but an id changed on the way fails."""
    from p2pft.transport.ncclid import uid_mac

    h = b"x" * 92
    uid = os.urandom(128)
    assert uid_mac(b"k", h, uid) != uid_mac(b"k", h, bytes([uid[0] ^ 1]) + uid[1:])
    assert uid_mac(None, h, uid) == bytes(32)


def test_abort_reaches_every_rank_naming_the_aborter() -> None:
    servers = _servers(3)
    peers = [s.addr for s in servers]
    comms = [s.communicator(3, 0, r, peers, backend="nccl", connect_timeout=5.0) for r, s in enumerate(servers)]
    try:
        assert all(c.uid_known.wait(5.0) for c in comms)
        t0 = time.monotonic()
        comms[2].abort("superseded by data epoch 4")
        assert _wait(lambda: all(c.failed is not None for c in comms), 2.0)
        assert time.monotonic() - t0 < 1.0
        for c in comms[:2]:
            assert isinstance(c.failed, CommAborted) and c.failed.peer_rank == 2, c.failed
            assert c.failed.peer_addr == peers[2]
        # A failed communicator unregisters itself (right after recording its error): the same
        # (epoch, shard) may then be created again.
        made: list[Any] = []

        def recreate() -> bool:
            try:
                made.append(servers[0].communicator(3, 0, 0, peers, backend="nccl", connect_timeout=0.2))
                return True
            except ValueError:
                return False
        assert _wait(recreate, 2.0)
        made[0].close()
    finally:
        _close(comms, servers)


def test_rank0_absent_times_out_naming_rank0() -> None:
    servers = _servers(2)
    dead = DataServer("127.0.0.1", 0)
    peers = [dead.addr, servers[1].addr]
    dead.close()
    c1 = servers[1].communicator(1, 0, 1, peers, backend="nccl", connect_timeout=0.5)
    try:
        assert _wait(lambda: c1.failed is not None, 3.0)
        assert isinstance(c1.failed, CommTimeout) and c1.failed.peer_rank == 0
    finally:
        _close([c1], servers)


def test_peer_that_never_opens_its_communicator_is_named() -> None:
    servers = _servers(2)
    servers[1].pending_timeout = 0.5
    peers = [s.addr for s in servers]
    c0 = servers[0].communicator(1, 0, 0, peers, backend="nccl", connect_timeout=2.0)
    try:
        assert _wait(lambda: c0.failed is not None, 5.0)
        assert isinstance(c0.failed, CommTimeout) and c0.failed.peer_rank == 1, c0.failed
    finally:
        _close([c0], servers)


def test_nobody_starts_nccl_init_until_every_rank_holds_the_id() -> None:
    """Rank 2 never opens its communicator (it moved on to a newer data epoch): rank 0 gets no
    ack from it and names it; rank 1 holds the id but never gets go, and learns rank 0's verdict.
    Neither starts ncclCommInitRank, which could not be cancelled once blocked on rank 2."""
    servers = _servers(3)
    peers = [s.addr for s in servers]
    c1 = servers[1].communicator(4, 0, 1, peers, backend="nccl", connect_timeout=1.0)
    c0 = servers[0].communicator(4, 0, 0, peers, backend="nccl", connect_timeout=1.0)
    try:
        assert _wait(lambda: c0.failed is not None and c1.failed is not None, 5.0)
        assert isinstance(c0.failed, CommTimeout) and c0.failed.peer_rank == 2, c0.failed
        assert isinstance(c1.failed, CommTimeout) and c1.failed.peer_rank == 2, c1.failed
        assert not c0.uid_known.is_set() and not c1.uid_known.is_set()
    finally:
        _close([c0, c1], servers)


def test_backends_that_differ_are_a_protocol_mismatch() -> None:
    servers = _servers(2)
    peers = [s.addr for s in servers]
    c1 = servers[1].communicator(1, 0, 1, peers, backend="tcp", connect_timeout=1.0)
    c0 = servers[0].communicator(1, 0, 0, peers, backend="nccl", connect_timeout=1.0)
    try:
        assert _wait(lambda: c0.failed is not None and c1.failed is not None, 5.0)
        assert isinstance(c1.failed, ProtocolMismatch) and "nccl data plane" in c1.failed.reason
        assert isinstance(c0.failed, ProtocolMismatch) and c0.failed.peer_rank == 1
    finally:
        _close([c0, c1], servers)


_RANK = r"""
import os, sys, time
from p2pft.transport import DataServer
s = DataServer("127.0.0.1", 0, secret=b"k")
s.nccl_uid_factory = lambda: os.urandom(128)
print(s.addr, flush=True)
peers = sys.stdin.readline().split()
c = s.communicator(1, 0, int(sys.argv[1]), peers, backend="nccl", connect_timeout=10.0)
c.uid_known.wait(10)
print("uid", c.unique_id.hex(), flush=True)
time.sleep(60)
"""


def test_sigkill_of_a_rank_names_it_on_every_survivor() -> None:
    """A killed process closes its links: rank 0 sees it at once and relays it to the others."""
    servers = _servers(2)
    proc = subprocess.Popen([sys.executable, "-c", _RANK, "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    comms: list[Any] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        child = proc.stdout.readline().strip()
        peers = [servers[0].addr, servers[1].addr, child]
        proc.stdin.write(" ".join(peers) + "\n")
        proc.stdin.flush()
        comms = [s.communicator(1, 0, r, peers, backend="nccl", connect_timeout=10.0) for r, s in enumerate(servers)]
        line = proc.stdout.readline().split()
        assert comms[0].uid_known.wait(5.0)  # rank 0 records the id right after saying go
        assert line[0] == "uid" and bytes.fromhex(line[1]) == comms[0].unique_id
        assert comms[1].uid_known.wait(5.0) and comms[1].unique_id == comms[0].unique_id
        t0 = time.monotonic()
        proc.kill()
        assert _wait(lambda: all(c.failed is not None for c in comms), 3.0)
        elapsed = time.monotonic() - t0
        for c in comms:
            assert isinstance(c.failed, PeerFailed) and c.failed.peer_rank == 2, c.failed
            assert c.failed.peer_addr == child
        assert elapsed < 1.0, elapsed
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()
        _close(comms, servers)


def _cuda_devices() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _nccl_ok() -> bool:
    from p2pft.transport import nccl_available
    return nccl_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _nccl_ok(), reason="needs cupy with NCCL and a CUDA device")
def test_server_built_nccl_communicator_on_one_gpu() -> None:
    import torch

    ds = DataServer("127.0.0.1", 0)
    try:
        c = ds.communicator(1, 0, 0, [ds.addr], backend="nccl", timeout=60.0)
        x = torch.arange(1001, dtype=torch.float32, device="cuda")
        assert c.allreduce(x, tag=4) == 1 and torch.equal(x, torch.arange(1001, dtype=torch.float32, device="cuda"))
        assert c.allreduce(x, contribute=False, tag=5) == 0 and int(torch.count_nonzero(x)) == 0
        c.abort("next epoch")
        with pytest.raises(CommAborted):
            c.allreduce(x)
        c2 = ds.communicator(2, 0, 0, [ds.addr], backend="nccl", timeout=60.0)
        x.fill_(2)
        assert c2.allreduce(x) == 1 and bool(torch.all(x == 2))
        c2.close()
    finally:
        ds.close()


_GPU_RANK = r"""
import sys, time, torch
from pathlib import Path
from p2pft.transport import DataServer
rank, world, d = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
torch.cuda.set_device(rank)
s = DataServer("127.0.0.1", 0, secret=b"k")
(d / f"a{rank}").write_text(s.addr)
end = time.time() + 60
while not all((d / f"a{r}").exists() for r in range(world)) and time.time() < end:
    time.sleep(0.05)
peers = [(d / f"a{r}").read_text() for r in range(world)]
c = s.communicator(1, 0, rank, peers, backend="nccl", timeout=60.0, connect_timeout=30.0, device=rank)
x = torch.full((1 << 20,), float(rank + 1), device="cuda")
n = c.allreduce(x, contribute=True, tag=5)
assert n == world and bool(torch.all(x == world * (world + 1) / 2)), (n, x[:4])
c.close()
s.close()
print("ok", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not _nccl_ok() or _cuda_devices() < 2, reason="needs 2 GPUs with cupy and NCCL")
def test_two_gpus_id_handed_over_by_data_servers(tmp_path: Any) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", _GPU_RANK, str(r), "2", str(tmp_path)], stdout=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and all("ok" in o for o in outs)
