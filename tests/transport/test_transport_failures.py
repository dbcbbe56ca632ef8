"""Failure semantics with real processes: SIGKILL, SIGSTOP, recovery on the next epoch."""

from __future__ import annotations

import signal
import time

import pytest

from transport_testutil import RankProc

pytestmark = pytest.mark.slow

BIG = 64 << 20  # 64 Mi float32 = 256 MB


@pytest.fixture
def ranks(request: pytest.FixtureRequest) -> list[RankProc]:
    procs: list[RankProc] = []
    yield procs
    for p in procs:
        if p.p.poll() is None:
            try:
                p.kill(signal.SIGCONT)
            except OSError:
                pass
        p.stop()


def _start(procs: list[RankProc], n: int, epoch: int = 1, timeout: float = 10.0) -> list[str]:
    procs.extend(RankProc() for _ in range(n))
    peers = [p.addr for p in procs]
    for r, p in enumerate(procs):
        p.send(cmd="comm", epoch=epoch, rank=r, peers=peers, timeout=timeout)
    for p in procs:
        p.expect("comm")
    return peers


def _no_leaks(p: RankProc, baseline_fds: int) -> None:
    p.send(cmd="stats")
    st = p.expect("stats")
    assert not [t for t in st["threads"] if t.startswith(("p2pft-send", "p2pft-recv"))], st["threads"]
    assert st["fds"] <= baseline_fds, (st["fds"], baseline_fds)


def test_sigkill_mid_allreduce_names_dead_peer_everywhere_then_next_epoch_works(ranks: list[RankProc]) -> None:
    n, victim = 4, 2
    peers = _start(ranks, n)
    baseline = []
    for p in ranks:
        p.send(cmd="stats")
        baseline.append(p.expect("stats")["fds"])
    for p in ranks:
        p.send(cmd="allreduce", epoch=1, nel=BIG, seed=1)
    starts = [p.expect("started", timeout=30)["t"] for p in ranks]
    # Kill while bytes are flowing: the op takes several hundred ms for 256 MB on loopback.
    time.sleep(max(0.0, max(starts) + 0.15 - time.time()))
    ranks[victim].kill()
    t_kill = time.time()
    survivors = [r for r in range(n) if r != victim]
    for r in survivors:
        msg = ranks[r].expect("error", "done", timeout=15)
        assert msg["event"] == "error", f"rank {r} finished an allreduce with a dead peer: {msg}"
        assert msg["peer_rank"] == victim, f"rank {r} blamed {msg}"
        assert msg["peer_addr"] == peers[victim]
        assert msg["cls"] in ("PeerFailed", "CommTimeout"), msg
        assert msg["t"] - t_kill < 1.0, f"rank {r} learned after {msg['t'] - t_kill:.3f} s"
        print(f"rank {r}: {msg['cls']} after {1e3 * (msg['t'] - t_kill):.1f} ms: {msg['reason']}")
    # Same processes, same DataServers: epoch 2 without the dead rank works and is correct.
    live = [ranks[r] for r in survivors]
    new_peers = [p.addr for p in live]
    for i, p in enumerate(live):
        p.send(cmd="close", epoch=1)
        p.expect("closed")
        p.send(cmd="comm", epoch=2, rank=i, peers=new_peers, timeout=10.0)
        p.expect("comm")
    for p in live:
        p.send(cmd="allreduce", epoch=2, nel=100_003, seed=5, check=True)
    for p in live:
        p.expect("started")
        msg = p.expect("done", "error", timeout=20)
        assert msg["event"] == "done" and msg["ok"] and msg["count"] == len(live), msg
    for i, p in enumerate(live):
        p.send(cmd="close", epoch=2)
        p.expect("closed")
        _no_leaks(p, baseline[survivors[i]])


def test_sigstop_gives_commtimeout_within_timeout(ranks: list[RankProc]) -> None:
    n, victim, timeout = 3, 1, 1.5
    _start(ranks, n, timeout=timeout)
    for p in ranks:  # connections are up and one op went through
        p.send(cmd="allreduce", epoch=1, nel=1000, seed=2)
    for p in ranks:
        p.expect("started")
        assert p.expect("done", "error")["event"] == "done"
    ranks[victim].kill(signal.SIGSTOP)
    try:
        # 64 MB: rank 0's sends to the stopped rank overflow the socket buffers and block;
        # rank 2 starves on it. Both must name it, within timeout +- 20 %.
        survivors = [r for r in range(n) if r != victim]
        for r in survivors:
            ranks[r].send(cmd="allreduce", epoch=1, nel=16 << 20, seed=2)
        started = {r: ranks[r].expect("started", timeout=30)["t"] for r in survivors}
        for r in survivors:
            msg = ranks[r].expect("error", "done", timeout=timeout * 3)
            assert msg["event"] == "error", msg
            assert msg["cls"] == "CommTimeout", msg
            # Not before the first survivor has waited 0.8 x timeout (a rank may learn it from a
            # neighbour that started earlier), not after its own start + 1.2 x timeout.
            early, late = msg["t"] - min(started.values()), msg["t"] - started[r]
            assert early >= 0.8 * timeout and late <= 1.2 * timeout + 0.1, (r, early, late)
            assert msg["peer_rank"] == victim, msg
    finally:
        ranks[victim].kill(signal.SIGCONT)


def test_rank_that_never_connects_times_out_and_peers_name_it(ranks: list[RankProc]) -> None:
    ranks.extend(RankProc() for _ in range(2))
    peers = [ranks[0].addr, ranks[1].addr, "127.0.0.1:9"]  # rank 2 never exists: refused
    for r in range(2):
        ranks[r].send(cmd="comm", epoch=1, rank=r, peers=peers, timeout=5.0, connect_timeout=1.0)
        ranks[r].expect("comm")
    for p in ranks:
        p.send(cmd="allreduce", epoch=1, nel=1000, seed=0)
    msgs = []
    for p in ranks:
        p.expect("started")
        msgs.append(p.expect("error", "done", timeout=20))
    assert all(m["event"] == "error" for m in msgs), msgs
    # Rank 1 connects to rank 2 (refused); rank 0 waits for rank 2's connection.
    assert msgs[1]["peer_rank"] == 2 and msgs[1]["cls"] == "PeerFailed", msgs[1]
    assert msgs[0]["peer_rank"] == 2, msgs[0]
