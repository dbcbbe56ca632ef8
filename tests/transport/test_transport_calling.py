"""DataServer.calling: a rank that is not in a collective sees a neighbour start one.

A DiLoCo replica back mid-span trains until its peers start the sync (trainer/kernel/offring.py):
the call is a neighbour's ring connection waiting for a communicator not built yet, or its first
bytes on a ring built at an earlier operation (whose connections stay up between operations).
"""
from __future__ import annotations

import threading
import time

import numpy as np

from p2pft.transport import DataServer


def _until(cond: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():   # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_neighbour_that_starts_a_collective_is_seen_before_and_after_the_ring_is_built() -> None:
    with DataServer() as a, DataServer() as b:
        peers = [a.addr, b.addr]
        assert not b.calling(1, 0)
        ca = a.communicator(1, 0, 0, peers, timeout=10.0, connect_timeout=10.0)
        out: list[int] = []
        x = np.ones(64, dtype=np.float32)
        th = threading.Thread(target=lambda: out.append(ca.allreduce(x)))
        th.start()
        # Not built here yet: a's connection waits in the server's pending table.
        assert _until(lambda: b.calling(1, 0)), "a's pending ring connection was not seen"
        assert b.calling(0, 0) and not b.calling(2, 0) and not b.calling(1, 1)   # epochs from min on; its shard
        cb = b.communicator(1, 0, 1, peers, timeout=10.0, connect_timeout=10.0)
        y = np.ones(64, dtype=np.float32)
        assert cb.allreduce(y) == 2
        th.join(10)
        assert out == [2] and float(y[0]) == 2.0
        # Between operations the ring stays connected and nothing is on the wire: no call.
        time.sleep(0.1)
        assert not b.calling(1, 0)
        th = threading.Thread(target=lambda: out.append(ca.allreduce(x)))
        th.start()
        # Built, connected: a's first bytes of the next operation are the call.
        assert _until(lambda: b.calling(1, 0)), "a's next operation on the built ring was not seen"
        assert cb.allreduce(y) == 2
        th.join(10)
        assert not b.calling(1, 0)
        ca.close()
        cb.close()
