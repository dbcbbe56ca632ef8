"""The step kernel in one process: replicas' kernels over a fake runtime, a fake data server and
in-memory communicators, with no socket opened (issue 39).

The kernel reads the control plane through ``RuntimePort`` and its data server through
``DataServerPort`` (trainer/kernel/ports.py), and builds its communicators with the factory it is
given (``compose.kernel(comm_factory=...)``). Everything else is real: the kernel, its parts
(catch-up, the donor, pauses, the job's life), ``MeanGradient``, the step buffer, the views
(``p2pft.core.view``'s ``View``/``Member``, set by the test as the leader would commit them) and
the data plane's errors. The fakes are held to the contracts they stand for: the communicator
sums in place over ranks that meet on one (data epoch, shard), counts only contributors, checks
the frame header (tag, size, dtype, peers) and raises the transport's ``CommError`` subclasses.
"""
from __future__ import annotations

import copy
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import torch

from p2pft.core.meta import MemberMeta, Status
from p2pft.core.view import JobTarget, Member, Role, View
from p2pft.transport import CommAborted, CommError, CommTimeout, PeerFailed, ProtocolMismatch
from p2pft.transport.backend import Backend, DataPlane
from p2pft.transport.base import Communicator
from p2pft.transport.stream import StateSnapshot
from p2pft.trainer.compose import kernel as build_kernel
from p2pft.trainer.kernel.algorithm import MeanGradient
from p2pft.trainer.kernel.attempt import Attempt, Plan, StepResult
from p2pft.trainer.kernel.engine import WAIT_ROLE_S, StepEngine
from p2pft.trainer.kernel.errors import StepTimeout
from p2pft.trainer.kernel.group import LocalGroup
from p2pft.trainer.kernel.options import Options
from p2pft.trainer.kernel.ports import DataServerPort, RuntimePort
from p2pft.trainer.kernel.stepbuf import StepBuffer
from p2pft.trainer.state.layouts import WHOLE_STATE

LR = 0.1
COMM_TIMEOUT = 1.0     # one allreduce; a test that kills a peer does so while the survivor waits
STEP_TIMEOUT = 5.0     # never reached except in the test that waits for it (with its own, shorter one)
THREAD_JOIN_S = 10.0


# ---------------------------------------------------------------------------------- no sockets
@pytest.fixture(autouse=True)
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every connect or bind in this module raises, and is remembered: a background thread that
    swallowed the error (a catch-up worker, a view follower) still fails the test."""
    tried: list[str] = []

    def refuse(what: str) -> Callable[..., Any]:
        def call(sock: socket.socket, *args: Any, **kw: Any) -> Any:
            tried.append(f"{what}{args}")
            raise AssertionError(f"socket {what}{args} in an in-process kernel test")
        return call
    for name in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, name, refuse(name))
    yield tried
    assert not tried, f"the kernel touched sockets: {tried}"


# ---------------------------------------------------------------------------------- the data plane
@dataclass
class _Op:
    """One collective of a room: each rank's arrival, then the result every rank reads."""

    kind: str
    arrivals: dict[int, tuple[torch.Tensor, bool, int]] = field(default_factory=dict)  # rank -> tensor, contribute, tag
    count: int = -1           # contributors, once done
    error: CommError | None = None


@dataclass
class _Room:
    """Where the communicators of one (data epoch, shard) meet, as a ring's ranks connect to
    each other's data ports. A failure is the room's: every rank learns it (the ring's error
    frames), naming the peer it is about."""

    key: tuple[int, int]
    peers: dict[int, list[str]] = field(default_factory=dict)   # rank -> the peers it was built with
    ops: dict[int, _Op] = field(default_factory=dict)           # sequence number -> op
    failure: CommError | None = None
    gone: set[int] = field(default_factory=set)                 # ranks whose communicator closed


class Fabric:
    """The in-memory data plane of one test, shared by its replicas (one thread each)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.dead: set[str] = set()                       # data addresses of killed processes
        self.built: list[tuple[str, int, int, int]] = []  # (own address, data epoch, rank, world)
        self.waiting: set[str] = set()                    # addresses blocked in a collective now
        self._rooms: dict[tuple[int, int], _Room] = {}

    def factory(self, epoch: int, shard: int, rank: int, peers: list[str], *, timeout: float,
                connect_timeout: float, backend: Backend, device: int | None) -> MemComm:
        """A ``CommFactory``: what ``DataServer.communicator`` would build, in memory."""
        assert backend is Backend.TCP and device is None, (backend, device)
        assert timeout > 0 and connect_timeout > 0
        with self.cond:
            room = self._rooms.get((epoch, shard))
            if room is None or room.failure is not None or rank in room.peers:
                room = self._rooms[(epoch, shard)] = _Room((epoch, shard))   # a fresh ring
            room.peers[rank] = list(peers)
            self.built.append((peers[rank], epoch, rank, len(peers)))
        return MemComm(self, room, rank, list(peers), timeout)

    def kill(self, addr: str) -> None:
        """The process serving `addr` died: its connections reset."""
        with self.cond:
            self.dead.add(addr)
            self.cond.notify_all()

    def epochs_of(self, addr: str) -> list[int]:
        return [e for a, e, _, _ in self.built if a == addr]


class MemComm(Communicator):
    """An in-memory allreduce with the TCP ring's contract (transport/base.py, transport/tcp.py):
    an in-place SUM over the ranks; ``contribute=False`` counts the rank's buffer as zeros and not
    in the returned count; a world of one zeroes a non-contributor's buffer; every rank's tag,
    size and dtype must agree (else ``ProtocolMismatch``); the first error is sticky; a dead or
    closed peer is ``PeerFailed``, no progress ``CommTimeout``, ``abort`` ``CommAborted``, each
    naming the peer it is about. A ring that fails half-way leaves a buffer that is neither the
    input nor the sum, and so does this one (the kernel must restore its saved contribution)."""

    def __init__(self, fabric: Fabric, room: _Room, rank: int, peers: list[str], timeout: float) -> None:
        self.fabric, self.room = fabric, room
        self.epoch, self.shard = room.key
        self.rank, self.world, self.peers = rank, len(peers), peers
        self.timeout = timeout
        self._seq = 0
        self._failed: CommError | None = None
        self._closed = False

    @property
    def failed(self) -> CommError | None:
        return self._failed

    def allreduce(self, tensor: Any, *, contribute: bool = True, tag: int = 0, timeout: float | None = None) -> int:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            raise TypeError("a contiguous tensor")
        return self._collective("allreduce", tensor, bool(contribute), int(tag), timeout)

    def broadcast(self, tensor: Any, root: int, *, timeout: float | None = None) -> None:
        if not 0 <= root < self.world:
            raise ValueError(f"root {root} out of range for world {self.world}")
        self._collective("broadcast", tensor, True, root, timeout)

    def _collective(self, kind: str, tensor: torch.Tensor, contribute: bool, tag: int, timeout: float | None) -> int:
        f, room = self.fabric, self.room
        me = self.peers[self.rank]
        with f.cond:
            if self._failed is not None:
                raise self._failed.copy()
            if self._closed:
                raise CommError("communicator closed")
            if self.world == 1:
                if kind == "allreduce" and not contribute:
                    tensor.zero_()
                return 1 if contribute else 0
            op = room.ops.setdefault(self._seq, _Op(kind))
            self._seq += 1
            op.arrivals[self.rank] = (tensor, contribute, tag)
            if len(op.arrivals) == self.world:
                self._complete(op)
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            f.waiting.add(me)
            try:
                while True:
                    if op.count >= 0:
                        return op.count
                    err = self._failure(op, deadline)
                    if err is not None:
                        self._fail(err)
                        tensor.add_(1.0)   # half-reduced: whatever a broken ring left there
                        raise err
                    f.cond.wait(max(0.0, deadline - time.monotonic()))
            finally:
                f.waiting.discard(me)

    def _failure(self, op: _Op, deadline: float) -> CommError | None:
        """Under the fabric's lock: why this op cannot complete, if it cannot."""
        if self._failed is not None:
            return self._failed
        if op.error is not None:
            return op.error
        room = self.room
        if room.failure is not None:
            return room.failure
        for r, addr in enumerate(self.peers):
            if r != self.rank and (addr in self.fabric.dead or r in room.gone):
                return PeerFailed("connection reset by peer", peer_rank=r, peer_addr=addr)
        if time.monotonic() >= deadline:
            r = next(r for r in range(self.world) if r not in op.arrivals)
            return CommTimeout("no progress within the timeout", peer_rank=r, peer_addr=self.peers[r])
        return None

    def _complete(self, op: _Op) -> None:
        """Under the lock, by the last rank to arrive: check the header, sum in rank order (one
        result, bitwise the same on every rank), write it into every rank's tensor."""
        arr = op.arrivals
        t0 = arr[0][0]
        for r, (t, _, tag) in sorted(arr.items()):
            if tag != arr[0][2] or t.numel() != t0.numel() or t.dtype != t0.dtype or self.room.peers[r] != self.peers:
                op.error = ProtocolMismatch(f"rank {r} sent another header (tag {tag}, {t.numel()} x {t.dtype})",
                                            peer_rank=r, peer_addr=self.peers[r],
                                            tags={q: got[2] for q, got in arr.items()})
                self.fabric.cond.notify_all()
                return
        if op.kind == "broadcast":
            src = arr[arr[0][2]][0].clone()     # the root, which every rank passed as the tag
            for t, _, _ in arr.values():
                t.copy_(src)
            op.count = self.world
        else:
            total = torch.zeros_like(t0)
            for _, (t, contrib, _) in sorted(arr.items()):
                if contrib:
                    total += t
            for t, _, _ in arr.values():
                t.copy_(total)
            op.count = sum(1 for _, c, _ in arr.values() if c)
        self.fabric.cond.notify_all()

    def _fail(self, err: CommError) -> None:
        """Under the lock: sticky here, and the room's (the others hear of it, naming the same peer)."""
        if self._failed is None:
            self._failed = err
        if self.room.failure is None:
            self.room.failure = type(err)(err.reason, peer_rank=err.peer_rank, peer_addr=err.peer_addr,
                                          origin=self.rank)
        self.fabric.cond.notify_all()

    def abort(self, reason: str) -> None:
        with self.fabric.cond:
            if self._failed is None:
                self._failed = CommAborted(f"aborted: {reason}")
            if self.room.failure is None:
                self.room.failure = CommAborted(f"a peer aborted: {reason}", peer_rank=self.rank,
                                                peer_addr=self.peers[self.rank])
            self.fabric.cond.notify_all()

    def close(self) -> None:
        with self.fabric.cond:
            self._closed = True
            self.room.gone.add(self.rank)
            self.fabric.cond.notify_all()


def test_the_fake_communicator_keeps_the_ring_contract() -> None:
    """What the kernel tests below rely on: contributors only, in place, the same sum on every
    rank, a tag mismatch refused, a dead peer named."""
    fabric = Fabric()
    peers = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    comms = [fabric.factory(1, 0, r, peers, timeout=1.0, connect_timeout=1.0, backend=Backend.TCP, device=None)
             for r in range(3)]
    bufs = [torch.full((4,), float(r + 1)) for r in range(3)]
    counts: list[int] = [0, 0, 0]

    def run(r: int, contribute: bool, tag: int = 0) -> None:
        counts[r] = comms[r].allreduce(bufs[r], contribute=contribute, tag=tag)
    threads = [threading.Thread(target=run, args=(r, r != 1)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(THREAD_JOIN_S)
    assert counts == [2, 2, 2]
    for b in bufs:
        assert b.tolist() == [4.0] * 4     # 1 + 3: rank 1 counted as zeros
    errors: list[BaseException] = []

    def bad(r: int) -> None:
        try:
            comms[r].allreduce(bufs[r], tag=r)   # every rank another tag
        except CommError as exc:
            errors.append(exc)
    threads = [threading.Thread(target=bad, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(THREAD_JOIN_S)
    assert len(errors) == 3 and all(isinstance(e, ProtocolMismatch) for e in errors)
    assert isinstance(comms[0].failed, ProtocolMismatch)   # sticky
    one = fabric.factory(2, 0, 0, peers[:2], timeout=0.2, connect_timeout=1.0, backend=Backend.TCP, device=None)
    fabric.kill(peers[1])
    with pytest.raises(PeerFailed) as got:
        one.allreduce(torch.ones(2))
    assert got.value.peer_addr == peers[1]


# ---------------------------------------------------------------------------------- the control plane
class Cluster:
    """What every replica's runtime reads alike: the committed view (set by the test, as the
    leader would commit it), what gossip says of each member, the data servers by address."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.view: View | None = None
        self.gossip: dict[str, MemberMeta] = {}
        self.servers: dict[str, FakeDataServer] = {}

    def publish(self, view: View) -> None:
        with self.cond:
            assert self.view is None or view.epoch > self.view.epoch, "epochs only grow"
            self.view = view
            self.cond.notify_all()

    def tell(self, node: str, **changes: Any) -> None:
        with self.cond:
            self.gossip[node] = dataclasses.replace(self.gossip[node], **changes)

    def fetch_state(self, addr: str, request: dict[str, Any], *, secret: bytes | None = None, timeout: float = 60.0,
                    rate_limit_bytes_per_s: float | None = None, into: Mapping[str, torch.Tensor] | None = None,
                    source_host: str | None = None, after: Any = None) -> StateSnapshot:
        """``transport.stream.fetch_state`` in memory: the donor's provider answers on this thread;
        the meta crosses msgpack as on the wire, the tensors are copied (into `into`'s, by name)."""
        ds = self.servers.get(addr)
        if ds is None or ds.closed or ds.provider is None:
            raise PeerFailed("connection refused", peer_addr=addr)
        snap = ds.provider(msgpack.unpackb(msgpack.packb(request), strict_map_key=False))
        if snap is None:
            raise CommError("the donor has nothing to give", peer_addr=addr)
        meta = msgpack.unpackb(msgpack.packb(snap.meta), strict_map_key=False)
        tensors = {}
        for name, t in snap.tensors.items():
            dst = into.get(name) if into is not None else None
            if dst is not None and dst.shape == t.shape and dst.dtype == t.dtype:
                tensors[name] = dst.copy_(t)
            else:
                tensors[name] = t.detach().clone()
        return StateSnapshot(meta=meta, tensors=tensors)


class FakeRuntime:
    """The ``RuntimePort`` of one replica over a ``Cluster``: views are the cluster's; what the
    kernel says (status, step, beats, failures) is recorded, and told to the cluster's gossip."""

    data_plane = DataPlane.TCP
    data_dir: str | None = None
    recorded_step: int | None = None

    def __init__(self, cluster: Cluster, node: str, data_addr: str, failure_view_wait: float = 3.0) -> None:
        self.cluster = cluster
        self.node_id = node
        self.replica_id = node.rsplit(".", 1)[0]
        self.failure_view_wait = failure_view_wait
        self.status = Status.FRESH
        self.closed = False
        self.statuses: list[tuple[Status, int | None]] = []
        self.published: list[int] = []
        self.beats: list[float] = []
        self.failures: list[str] = []           # nodes reported on data-plane evidence
        self.fresh_asked: list[int] = []        # data epochs it asked to replace
        self.declared: list[JobTarget | None] = []
        self.waits: list[float] = []            # the timeout of every wait_view
        cluster.gossip[node] = MemberMeta(replica_id=self.replica_id, data_addrs=(data_addr,), status=Status.FRESH,
                                          step=0)

    @property
    def view(self) -> View | None:
        return self.cluster.view

    def wait_view(self, pred: Callable[[View], bool], timeout: float,
                  loop_timeout: float | None = None) -> View | None:
        """Waits on the cluster's condition (no polling): a view the test publishes wakes it."""
        self.waits.append(timeout)
        deadline = time.monotonic() + timeout
        c = self.cluster
        with c.cond:
            while True:
                v = c.view
                if v is not None and pred(v):
                    return v
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                c.cond.wait(left)
                if loop_timeout:
                    self.loop_beat(loop_timeout)

    def me(self) -> Member | None:
        v = self.cluster.view
        return v.member(self.node_id) if v is not None else None

    def member_step(self, node: str) -> int:
        meta = self.cluster.gossip.get(node)
        return max(meta.step, 0) if meta is not None else 0

    def member_meta(self, node: str) -> MemberMeta | None:
        return self.cluster.gossip.get(node)

    def set_status(self, status: Status, step: int | None = None) -> None:
        self.status = status
        self.statuses.append((status, step))
        self.cluster.tell(self.node_id, status=status, **({"step": step} if step is not None else {}))

    def publish_step(self, step: int) -> None:
        self.published.append(step)
        self.cluster.tell(self.node_id, step=step)

    def loop_beat(self, timeout: float) -> None:
        self.beats.append(timeout)

    def declare_job(self, target: JobTarget | None, allow_scratch: bool = False) -> None:
        self.declared.append(target)

    def report_failure(self, node: str) -> None:
        self.failures.append(node)

    def request_new_data_epoch(self, failed_data_epoch: int) -> None:
        self.fresh_asked.append(failed_data_epoch)

    def close(self, leave: bool = True, timeout: float = 2.0) -> None:
        with self.cluster.cond:
            self.closed = True
            self.cluster.cond.notify_all()


class FakeDataServer:
    """The ``DataServerPort`` of one replica: an address, the donor callback it serves (read
    by ``Cluster.fetch_state``); it builds no communicator (the kernel is given a factory)."""

    def __init__(self, cluster: Cluster, addr: str) -> None:
        self.addr = addr
        self.host = addr.rsplit(":", 1)[0]
        self.provider: Callable[[dict[str, object]], StateSnapshot | None] | None = None
        self.closed = False
        cluster.servers[addr] = self

    def serve_state(self, provider: Callable[[dict[str, object]], StateSnapshot | None]) -> None:
        self.provider = provider

    def communicator(self, epoch: int, shard: int, rank: int, peers: list[str], *, timeout: float,
                     connect_timeout: float, backend: Backend, device: int | None) -> Communicator:
        raise AssertionError("the kernel builds its communicators with the factory it was given")

    def calling(self, min_epoch: int, shard: int) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


class RecordingGroup(LocalGroup):
    """A one-rank replica's group that keeps every attempt rank 0 planned (``broadcast``)."""

    def __init__(self) -> None:
        self.attempts: list[Attempt] = []

    def broadcast(self, obj: Any) -> Any:
        if isinstance(obj, Attempt):
            self.attempts.append(obj)
        return obj


def test_the_fakes_have_every_member_of_the_ports() -> None:
    """A member added to a port is added to its fake too (mypy checks the types: run it on this
    module; this catches the drift at test time)."""
    cluster = Cluster()
    for port, fake in ((RuntimePort, FakeRuntime(cluster, "r0.1", "127.0.0.1:1")),
                       (DataServerPort, FakeDataServer(cluster, "127.0.0.1:1"))):
        members = [n for n in vars(port) if not n.startswith("_")]
        assert "close" in members
        assert not [n for n in members if not hasattr(fake, n)], port


# ---------------------------------------------------------------------------------- replicas
@dataclass
class Replica:
    name: str
    node: str
    addr: str
    rt: FakeRuntime
    ds: FakeDataServer
    model: torch.nn.Linear
    kernel: StepEngine
    group: RecordingGroup
    x: torch.Tensor
    y: torch.Tensor
    backwards: list[int] = field(default_factory=list)

    def compute(self) -> list[int]:
        """begin(), then forward and backward on this replica's batch (when it has samples)."""
        idx = self.kernel.begin()
        if idx:
            self.kernel.zero_grad()
            torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()
        return idx

    def step(self) -> StepResult:
        self.compute()
        return self.kernel.commit()

    def grad(self, weights: torch.nn.Linear) -> list[torch.Tensor]:
        """This replica's gradient at `weights` (plain torch)."""
        m = copy.deepcopy(weights)
        m.zero_grad()
        torch.nn.functional.mse_loss(m(self.x), self.y).backward()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None]


def member(r: Replica, slot: int | None, since: int = 1, role: Role = Role.PARTICIPANT) -> Member:
    return Member(node=r.node, replica_id=r.name, addr=f"127.0.0.1:{7000 + int(r.name[1:])}", data_addrs=(r.addr,),
                  role=role, slot=slot, since=since)


def view(epoch: int, *members: Member, data_epoch: int | None = None) -> View:
    return View(epoch=epoch, members=tuple(members), data_epoch=data_epoch or epoch)


def sgd(weights: torch.nn.Linear, grads: list[list[torch.Tensor]]) -> torch.nn.Linear:
    """A plain-torch SGD step with the mean of `grads` (one list per replica)."""
    out = copy.deepcopy(weights)
    opt = torch.optim.SGD(out.parameters(), lr=LR)
    for p, *gs in zip(out.parameters(), *grads):
        p.grad = torch.stack(gs).sum(0) / len(gs)
    opt.step()
    return out


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


class Spawned:
    """A callable running on a thread of its own; ``result()`` joins it and returns its value or
    raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._out: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            self._out.append(exc)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def result(self, join_s: float = THREAD_JOIN_S) -> Any:
        self._thread.join(join_s)
        assert not self._thread.is_alive(), "the thread did not finish"
        if isinstance(self._out[0], BaseException):
            raise self._out[0]
        return self._out[0]


def run_all(*fns: Callable[[], Any], join_s: float = THREAD_JOIN_S) -> list[Any]:
    """Run each callable on a thread of its own (one per replica): their results in order, or
    the first exception one raised."""
    spawned = [Spawned(fn) for fn in fns]
    return [s.result(join_s) for s in spawned]


def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.005)


class World:
    """The replicas of one test over one cluster and one in-memory data plane."""

    def __init__(self) -> None:
        self.cluster = Cluster()
        self.fabric = Fabric()
        self.replicas: list[Replica] = []
        torch.manual_seed(0)
        self.base = torch.nn.Linear(4, 2)    # every replica starts from these weights

    def factory(self, epoch: int, shard: int, rank: int, peers: list[str], **kw: Any) -> Communicator:
        """The communicators every kernel of this world builds (a subclass may split some)."""
        return self.fabric.factory(epoch, shard, rank, peers, **kw)

    def first_view(self, *members: Member) -> View:
        return view(1, *members)

    def make(self, n: int, step_timeout: float = STEP_TIMEOUT, clip_norm: float | None = None,
             **extra: Any) -> list[Replica]:
        """`n` replicas, participants of view 1 (slot i), kernels built, nothing begun; `extra`
        adds ``Options`` fields (a job's target, its finish timeout)."""
        reps = []
        for i in range(n):
            name = f"r{i}"
            addr = f"127.0.0.1:{9000 + i}"
            node = f"{name}.1"
            rt = FakeRuntime(self.cluster, node, addr)
            ds = FakeDataServer(self.cluster, addr)
            model = copy.deepcopy(self.base)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            group = RecordingGroup()
            options = Options(batch_per_replica=2, lr_policy="none", initial_state="off", start_timeout=2.0,
                              step_timeout=step_timeout, comm_timeout=COMM_TIMEOUT, loop_timeout=4.0, max_slots=8,
                              clip_norm=clip_norm, **extra)
            buf = StepBuffer(list(model.parameters()), max_slots=options.max_slots)
            k = build_kernel(model, opt, MeanGradient(buf), group=group, runtime=rt, data_server=ds,
                             state_io=WHOLE_STATE, options=options.engine(comm_timeout=None, secret=None),
                             comm_factory=self.factory)
            gen = torch.Generator().manual_seed(100 + i)
            reps.append(Replica(name, node, addr, rt, ds, model, k, group, torch.randn(8, 4, generator=gen),
                                torch.randn(8, 2, generator=gen)))
            reps[-1].model.weight.register_hook(lambda g, r=reps[-1]: r.backwards.append(1))
        self.replicas += reps
        self.cluster.publish(self.first_view(*(member(r, slot=i) for i, r in enumerate(reps))))
        return reps

    def close(self) -> None:
        for r in self.replicas:
            r.kernel.request_stop()
            r.kernel.close()
            r.rt.close()
            r.ds.close()


@pytest.fixture
def world(no_sockets: list[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = World()
    # A catch-up pulls its snapshot from the donor's data server: in memory here.
    monkeypatch.setattr("p2pft.trainer.recovery.catchup.fetch_state", w.cluster.fetch_state)
    yield w
    w.close()


# ---------------------------------------------------------------------------------- (a) one step
def test_two_kernels_commit_the_mean_gradient(world: World) -> None:
    a, b = world.make(2)
    ra, rb = run_all(a.step, b.step)
    for r in (ra, rb):
        assert r.committed and r.contributors == 2 and r.step == 1 and r.retries == 0, r
    assert a.kernel.digest() == b.kernel.digest()
    want = sgd(world.base, [a.grad(world.base), b.grad(world.base)])
    same_weights(a.model, want)
    same_weights(b.model, want)
    with pytest.raises(AssertionError):       # the comparison can fail: one replica's gradient alone
        same_weights(a.model, sgd(world.base, [a.grad(world.base)]))
    # What the control plane heard, and the data plane the kernel was given.
    for r in (a, b):
        assert r.rt.published == [0, 1] and r.rt.status is Status.READY, (r.rt.published, r.rt.status)
        assert r.rt.beats and r.rt.declared == [None]
        assert world.fabric.epochs_of(r.addr) == [1]
        assert [att.kind for att in r.group.attempts] == [Plan.ALLREDUCE]
    assert world.cluster.gossip[a.node].step == 1 and world.cluster.gossip[b.node].status is Status.READY


# ---------------------------------------------------------------------------------- (b) a peer dies
def test_a_peer_failing_mid_step_the_survivor_retries_on_the_next_view(world: World) -> None:
    a, b = world.make(2)
    b.compute()                      # b trains, then dies before its allreduce completes
    survivor = Spawned(a.step)
    until(lambda: a.addr in world.fabric.waiting)     # a is blocked in the allreduce of data epoch 1
    world.fabric.kill(b.addr)
    until(lambda: a.rt.failures == [b.node])           # the evidence reached the control plane
    assert survivor.alive(), "a waits for the next view"
    world.cluster.publish(view(2, member(a, slot=0)))  # the leader's view without the dead peer
    res = survivor.result()
    assert res.committed and res.contributors == 1 and res.retries == 1 and res.step == 1, res
    assert len(a.backwards) == 1, "the retry reused the saved gradients"
    same_weights(a.model, sgd(world.base, [a.grad(world.base)]))
    assert world.fabric.epochs_of(a.addr) == [1, 2]
    kinds = [e["kind"] for e in a.kernel.events]
    assert "comm_error" in kinds
    assert next(e for e in a.kernel.events if e["kind"] == "comm_error")["peer"] == b.node
    assert a.rt.published[-1] == 1


# ---------------------------------------------------------------------------------- (c) the view plan
def test_taken_back_while_computing_rejoins_catches_up_and_hands_over(world: World) -> None:
    a, b = world.make(2)
    run_all(a.step, b.step)                          # step 0 with both: a is a participant of view 1
    a.compute()
    b.compute()
    # a was dropped and taken back while computing step 1: same slot, its membership's `since`
    # moved on; it may hold a step the others redid without it, so it must not contribute.
    world.cluster.publish(view(3, member(a, slot=0, since=3), member(b, slot=1)))
    ra, rb = run_all(a.kernel.commit, b.kernel.commit)
    att = a.group.attempts[-1]
    assert att.kind is Plan.ALLREDUCE and att.rejoin and att.demote and not att.contribute, att
    assert not b.group.attempts[-1].rejoin and b.group.attempts[-1].contribute
    assert rb.committed and rb.contributors == 1, rb            # b's gradients alone
    assert not ra.committed and ra.contributors == 1, ra         # a logs the step for its replay
    excluded = [e for e in a.kernel.events if e["kind"] == "excluded"]
    assert len(excluded) == 1 and excluded[0]["epoch"] == 3 and excluded[0]["step"] == 1
    assert [e["why"] for e in a.kernel.events if e["kind"] == "catchup_start"] == ["excluded"]
    assert not a.kernel.synced and a.rt.status is Status.JOINING
    # b trains on; a answers with zeros, pulls b's snapshot (in memory), replays, hands over.
    end = time.monotonic() + THREAD_JOIN_S
    while not a.kernel.synced and time.monotonic() < end:
        run_all(a.step, b.step)
    assert a.kernel.synced and a.kernel.step == b.kernel.step
    assert a.kernel.digest() == b.kernel.digest()
    assert any(e["kind"] == "catchup_done" for e in a.kernel.events)
    assert a.rt.status is Status.READY


def test_a_slot_taken_while_computing_contributes_nothing(world: World) -> None:
    a, b = world.make(2)
    a.compute()
    b.compute()
    world.cluster.publish(view(2, member(a, slot=2), member(b, slot=1)))   # a re-slotted while it computed
    ra, rb = run_all(a.kernel.commit, b.kernel.commit)
    att = a.group.attempts[-1]
    assert att.demote and not att.contribute and not att.rejoin, att
    for r in (ra, rb):
        assert r.committed and r.contributors == 1 and r.step == 1, r
    assert not ra.trained and rb.trained                       # a's samples are not in the mean
    assert a.kernel.synced and a.kernel.digest() == b.kernel.digest()
    same_weights(a.model, sgd(world.base, [b.grad(world.base)]))
    assert ra.slot_ranks == {1: 1}                             # b's slot, at b's data rank


# ---------------------------------------------------------------------------------- (d) left out
def test_a_replica_not_in_the_view_waits_then_times_out(world: World) -> None:
    step_timeout = 0.6
    a, b = world.make(2, step_timeout=step_timeout)
    a.compute()
    world.cluster.publish(view(2, member(b, slot=1)))      # a left out after it began
    t0 = time.monotonic()
    with pytest.raises(StepTimeout):
        a.kernel.commit()
    took = time.monotonic() - t0
    assert step_timeout <= took < step_timeout + 2.0, took
    kinds = [att.kind for att in a.group.attempts]
    assert kinds[-1] is Plan.TIMEOUT and set(kinds[:-1]) == {Plan.WAIT}, kinds
    assert len(kinds) <= 4, f"each WAIT waits for a view, it does not spin: {kinds}"
    assert a.rt.waits and max(a.rt.waits) <= WAIT_ROLE_S
    assert world.fabric.epochs_of(a.addr) == []             # no communicator: it was on no data plane
    assert a.kernel.step == 0 and len(a.backwards) == 1


# ---------------------------------------------------------------------------------- clipping
def test_the_global_norm_is_clipped_on_the_mean_and_rides_with_the_entry(world: World) -> None:
    """With ``clip_norm`` the kernel measures the mean gradient's norm once, as the entry is made,
    and the step clips by it: both replicas equal a plain-torch step whose mean gradient went
    through ``clip_grad_norm_``; the entry a peer fast-forwards or a joiner replays carries it."""
    a, b = world.make(2, clip_norm=0.05)
    ra, rb = run_all(a.step, b.step)
    assert ra.committed and rb.committed and ra.contributors == 2
    assert a.kernel.digest() == b.kernel.digest()
    want = copy.deepcopy(world.base)
    grads = [a.grad(world.base), b.grad(world.base)]
    for p, *gs in zip(want.parameters(), *grads):
        p.grad = torch.stack(gs).sum(0) / len(gs)
    norm = float(torch.nn.utils.clip_grad_norm_(want.parameters(), 0.05))
    torch.optim.SGD(want.parameters(), lr=LR).step()
    same_weights(a.model, want)
    same_weights(b.model, want)
    assert norm > 0.05, "the test's gradients must be clipped"
    entry = a.kernel.recent._entries[-1]
    assert entry.norm is not None and abs(entry.norm - norm) < 1e-5 * norm
    assert a.kernel.optimizer_step.last_clip < 1.0


def test_the_norm_is_measured_over_every_shard_of_the_replica() -> None:
    """Rank 0 of a two-rank replica: the norm is over both ranks' shards (their squared norms
    agreed in rank order), divided by the contributors."""
    from types import SimpleNamespace

    from p2pft.trainer.kernel.attempt import Entry
    flat = torch.tensor([3.0, 4.0, 0.0, 0.0])                 # this shard's summed gradient: norm 5
    other = 12.0 ** 2                                         # the other rank's shard: norm 12
    buf = SimpleNamespace(grad_numel=2)
    fake = SimpleNamespace(optimizer_step=SimpleNamespace(clip_norm=1.0), algo=SimpleNamespace(buffer=lambda s: buf),
                           group=SimpleNamespace(agree=lambda mine: [mine, other]),
                           cursor=SimpleNamespace(batch_per_slot=8))
    e = Entry(step=0, flat=flat, count=1, mask=[True])
    StepEngine.measure(fake, e)   # type: ignore[arg-type]
    assert e.norm == pytest.approx(13.0)
    e2 = Entry(step=0, flat=flat * 2, count=2, mask=[True, True])   # two contributors: the mean's norm
    fake.group = SimpleNamespace(agree=lambda mine: [mine, other * 4])
    StepEngine.measure(fake, e2)  # type: ignore[arg-type]
    assert e2.norm == pytest.approx(13.0)
    # One of the two trained half of its samples (a partial span): the mean divides by 1.5.
    e3 = Entry(step=0, flat=flat * 2, count=2, mask=[True, True], short={1: 4})
    StepEngine.measure(fake, e3)  # type: ignore[arg-type]
    assert e3.norm == pytest.approx(26.0 / 1.5)
