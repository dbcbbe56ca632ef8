"""The end barrier of a replica left out after its last commit, in one process (the kernels of
tests/trainer/test_kernel_inprocess.py: a fake runtime, fake data servers, in-memory
communicators; the kernels, the job's life and catch-up are the real ones).

The job's last step (1 -> 2) finishes at replica c only: its ring allreduce completes there while
a's and b's fail naming c (``SplitAt``). c applies the step with a, b and c as contributors and
waits at the end barrier, 'done' at step 2 (its view still lists it). The leader drops c; a and b
redo the step without it (other contributors, other weights) and say 'done' at step 2 too. Before
``viewplan.must_check_end``, c took the view's ``finished = 2`` as its own end: synced, at the
finished step, nothing else checked. Now it compares its signature of step 1 with a finished
peer's first: it leaves with ``JobFinished`` naming the step it holds once the job finished, or
catches up from a snapshot while the job waits for it as a joiner, and then returns the end with
the others' weights.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from p2pft.core import viewplan
from p2pft.core.meta import Status
from p2pft.core.view import JobTarget, Member, Role, TargetKind, View
from p2pft.transport import CommError, PeerFailed
from p2pft.transport.backend import Backend
from p2pft.transport.base import Communicator
from p2pft.trainer.kernel.errors import JobFinished
from tests.trainer.test_kernel_inprocess import (Fabric, Replica, Spawned, World, member, no_sockets, run_all,
                                                 until)

__all__ = ["no_sockets"]   # the autouse fixture of the kernel tests: no socket here either

T2 = JobTarget(TargetKind.STEPS, 2)
JOIN_S = 20.0


class SplitAt:
    """The next allreduce on data epoch `epoch` finishes at `at` only: the others' rings fail
    naming it (its last frames never reached them), their buffers left half-reduced."""

    def __init__(self, fabric: Fabric, epoch: int, at: str) -> None:
        self.fabric, self.epoch, self.at = fabric, epoch, at
        self.armed = False       # the communicator is built at the first step; armed before the split
        self.failed: set[str] = set()

    def factory(self, epoch: int, shard: int, rank: int, peers: list[str], *, timeout: float,
                connect_timeout: float, backend: Backend, device: int | None) -> Communicator:
        comm = self.fabric.factory(epoch, shard, rank, peers, timeout=timeout, connect_timeout=connect_timeout,
                                   backend=backend, device=device)
        return _SplitComm(comm, self, peers, rank) if epoch == self.epoch else comm


class _SplitComm(Communicator):
    def __init__(self, inner: Communicator, split: SplitAt, peers: list[str], rank: int) -> None:
        self.inner, self.split, self.peers = inner, split, peers
        self.me = peers[rank]
        self._failed: CommError | None = None

    def allreduce(self, tensor: Any, *, contribute: bool = True, tag: int = 0, timeout: float | None = None) -> int:
        if self._failed is not None:
            raise self._failed
        n = self.inner.allreduce(tensor, contribute=contribute, tag=tag, timeout=timeout)
        s = self.split
        if s.armed and self.me != s.at:
            s.failed.add(self.me)
            if len(s.failed) == len(self.peers) - 1:
                s.armed = False
            self._failed = PeerFailed("connection reset by peer", peer_rank=self.peers.index(s.at), peer_addr=s.at)
            tensor.add_(1.0)
            raise self._failed
        return n

    def broadcast(self, tensor: Any, root: int, *, timeout: float | None = None) -> None:
        self.inner.broadcast(tensor, root, timeout=timeout)

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)

    def close(self) -> None:
        self.inner.close()

    @property
    def failed(self) -> CommError | None:
        return self._failed or self.inner.failed


class JobWorld(World):
    """``World`` with a steps target and a data plane that can split one allreduce."""

    def __init__(self) -> None:
        super().__init__()
        self.split: SplitAt | None = None

    def factory(self, epoch: int, shard: int, rank: int, peers: list[str], **kw: Any) -> Communicator:
        if self.split is not None:
            return self.split.factory(epoch, shard, rank, peers, **kw)
        return self.fabric.factory(epoch, shard, rank, peers, **kw)

    def first_view(self, *members: Member) -> View:
        return jview(1, *members)

    def make_job(self, n: int, total_steps: int) -> list[Replica]:
        return self.make(n, step_timeout=10.0, total_steps=total_steps, finish_timeout=JOIN_S)


def jview(epoch: int, *members: Member, data_epoch: int | None = None, finished: int | None = None) -> View:
    return View(epoch=epoch, members=tuple(members), data_epoch=data_epoch or epoch, target=T2, finished=finished)


@pytest.fixture
def jworld(no_sockets: list[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[JobWorld]:
    w = JobWorld()
    # Snapshots and step signatures come from the donors' data servers: in memory here.
    monkeypatch.setattr("p2pft.trainer.recovery.catchup.fetch_state", w.cluster.fetch_state)
    monkeypatch.setattr("p2pft.trainer.job.barrier.fetch_state", w.cluster.fetch_state)
    yield w
    w.close()


def _done(w: JobWorld, r: Replica, step: int) -> bool:
    meta = w.cluster.gossip[r.node]
    return meta.status is Status.DONE and meta.step == step


def _split_last_step(w: JobWorld) -> tuple[list[Replica], list[Spawned]]:
    """Up to a and b done at step 2 after redoing step 1 without c, which waits at the end
    barrier holding its own step 1. Returns the replicas and their finish() calls."""
    w.split = split = SplitAt(w.fabric, epoch=1, at="127.0.0.1:9002")
    a, b, c = w.make_job(3, total_steps=2)
    assert c.addr == split.at
    run_all(a.step, b.step, c.step)                       # step 0, all three
    split.armed = True
    for r in (a, b, c):
        r.compute()
    sa, sb, sc = Spawned(a.kernel.commit), Spawned(b.kernel.commit), Spawned(c.kernel.commit)
    rc = sc.result()
    assert rc.committed and rc.contributors == 3 and c.kernel.step == 2, rc   # finished at c only
    until(lambda: c.node in a.rt.failures and c.node in b.rt.failures)
    fc = Spawned(c.kernel.finish)                          # c's view still lists it: 'done' at 2
    until(lambda: _done(w, c, 2))
    # The leader drops c; a and b redo step 1 without it.
    w.cluster.publish(jview(2, member(a, slot=0), member(b, slot=1)))
    ra, rb = sa.result(), sb.result()
    for r in (ra, rb):
        assert r.committed and r.contributors == 2 and r.step == 2 and r.retries >= 1, r
    assert a.kernel.digest() == b.kernel.digest() != c.kernel.digest()
    fa, fb = Spawned(a.kernel.finish), Spawned(b.kernel.finish)
    until(lambda: _done(w, a, 2) and _done(w, b, 2))
    return [a, b, c], [fa, fb, fc]


def test_a_replica_left_out_after_the_last_step_leaves_behind_the_end(jworld: JobWorld) -> None:
    """The leader finishes the job without c (it is in no view): c's signature of step 1 is not
    the finished peers', so c leaves with JobFinished naming step 2, never as the job's end."""
    (a, b, c), (fa, fb, fc) = _split_last_step(jworld)
    jworld.cluster.publish(jview(3, member(a, slot=0), member(b, slot=1), finished=2))
    assert fa.result(JOIN_S) == 2 and fb.result(JOIN_S) == 2
    with pytest.raises(JobFinished) as got:
        fc.result(JOIN_S)
    assert got.value.step == 2 and got.value.held == 2
    assert c.kernel.digest() != a.kernel.digest()


def test_a_replica_left_out_after_the_last_step_catches_up_as_a_joiner(jworld: JobWorld) -> None:
    """Taken back as a joiner before the job finished: c finds its step 1 redone, catches up
    from a snapshot through the barrier's idle rounds, says 'done', and returns the end with the
    others' weights."""
    (a, b, c), (fa, fb, fc) = _split_last_step(jworld)
    jworld.cluster.publish(jview(3, member(a, slot=0), member(b, slot=1), member(c, None, since=3, role=Role.JOINER),
                                 data_epoch=3))
    until(lambda: c.kernel.synced and _done(jworld, c, 2) and Status.JOINING in [s for s, _ in c.rt.statuses],
          timeout=JOIN_S)
    jworld.cluster.publish(jview(4, member(a, slot=0), member(b, slot=1), member(c, None, since=3, role=Role.JOINER),
                                 data_epoch=3, finished=2))
    assert [f.result(JOIN_S) for f in (fa, fb, fc)] == [2, 2, 2]
    assert c.kernel.digest() == a.kernel.digest() == b.kernel.digest()
    assert [e["why"] for e in c.kernel.events if e["kind"] == "catchup_start"] == [
        "its last step was redone without it"]


def test_the_old_end_barrier_returns_the_redone_step_as_the_end(jworld: JobWorld,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the check (synced at the finished step was enough), c returns the end holding
    weights no other replica holds."""
    monkeypatch.setattr(viewplan, "must_check_end", lambda memory, view, node: False)
    (a, b, c), (fa, fb, fc) = _split_last_step(jworld)
    jworld.cluster.publish(jview(3, member(a, slot=0), member(b, slot=1), finished=2))
    assert [f.result(JOIN_S) for f in (fa, fb, fc)] == [2, 2, 2]
    assert c.kernel.digest() != a.kernel.digest()
