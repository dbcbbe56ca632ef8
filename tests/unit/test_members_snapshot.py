"""Other threads read members through the driver's published snapshot, never the live table:
``Runtime.member_step``/``member_meta`` answer from ``NodeServer.members``, a mapping replaced
(not mutated) at most ``MEMBERS_EVERY_S`` after the node changes."""
from __future__ import annotations

import time
from collections.abc import Callable

from p2pft import Runtime
from p2pft.core.meta import MemberStatus, Status
from p2pft.net.driver import MEMBERS_EVERY_S


def _until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_member_reads_come_from_a_replaced_snapshot() -> None:
    rt = Runtime(replica_id="r0", data_plane="tcp").start()
    try:
        assert rt.server is not None
        me = rt.node_id
        assert _until(lambda: me in rt.server.members)
        first = rt.server.members
        assert isinstance(first[me], MemberStatus)
        rt.set_status(Status.READY, 7)
        rt.publish_step(7)
        assert _until(lambda: rt.member_step(me) == 7 and rt.member_meta(me) is not None
                      and rt.member_meta(me).status is Status.READY, 2.0 + MEMBERS_EVERY_S)
        assert rt.server.members is not first, "the snapshot was mutated in place, not replaced"
        assert first[me].step != 7, "an old snapshot changed under its reader"
        assert rt.member_step("nobody") == 0 and rt.member_meta("nobody") is None
    finally:
        rt.close()
