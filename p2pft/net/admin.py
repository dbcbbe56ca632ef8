"""Admin requests (``admin.members``, ``admin.top``, ``admin.stats``): the client and the members report.

Operators and tests ask a running node about the cluster over its control port: one request
frame on a fresh connection, one ``admin.reply`` frame back on the same connection (the only
request/response exchange of the control protocol; ``NodeServer`` answers it). ``p2pft
members``, ``p2pft top``, the chaos harness and the tests use ``admin_request``; a CLI turns
its failures into one line with ``admin_error``.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

from ..core.node import Node
from ..transport.addr import parse_hostport
from .wire import DEFAULT_MAX_FRAME, FrameDecoder, WireError, encode


def members_report(node: Node, committed_at: float | None) -> dict[str, Any]:
    """The committed view as `node` sees it (the `p2pft members --json` object); `committed_at`
    is the wall time this node got that view."""
    view = node.view
    out: dict[str, Any] = {"node": node.id, "epoch": view.epoch if view else 0, "leader": node.leader,
                           "committed_at": committed_at, "members": [], "voter_id": node.voter_id,
                           "quorum_lost": quorum_lost_report(node)}
    if view:
        voters = set(view.voters)
        for m in view.members:
            state = node.member_state(m.node) if m.node != node.id else "alive"
            out["members"].append({
                "node": m.node, "replica_id": m.replica_id, "addr": m.addr, "role": m.role.value,
                "state": state, "step": node.member_step(m.node), "data_addr": ",".join(m.data_addrs),
                "slot": m.slot, "voter": m.voter_id in voters})
        out["data_epoch"] = view.data_epoch
    return out


def quorum_lost_report(node: Node) -> list[dict[str, str]]:
    """The voters this node has reported unreachable with a majority lost (``Node.quorum_lost``,
    the ERROR line's list): empty while a majority is reachable."""
    out = []
    for v in node.quorum_lost:
        m = node.view.member_of_voter(v) if node.view is not None else None
        out.append({"voter": v, "replica_id": m.replica_id if m is not None else v.rsplit(".", 1)[0],
                    "addr": m.addr if m is not None else ""})
    return out


async def admin_request(addr: str, mtype: str, *, secret: bytes | None = None, timeout: float = 3.0,
                        max_frame: int = DEFAULT_MAX_FRAME) -> dict[str, Any]:
    """One admin request/response over a fresh connection (raises OSError/TimeoutError/WireError)."""
    host, port = parse_hostport(addr)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        # A sender id of its own: the node's replay table keys on it, and other admin clients
        # (other processes, with their own sequence numbers) must not look like replays.
        sender = f"admin.{os.getpid()}.{random.getrandbits(32):08x}"
        writer.write(encode(mtype, sender, {}, secret=secret, max_frame=max_frame))
        await asyncio.wait_for(writer.drain(), timeout)
        decoder = FrameDecoder(secret=secret, max_frame=max_frame)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError()
            data = await asyncio.wait_for(reader.read(1 << 16), left)
            if not data:
                raise ConnectionError("peer closed the connection without answering (wrong secret?)")
            for m in decoder.feed(data):
                return m.body
    finally:
        writer.close()


def admin_error(exc: BaseException, peer: str, timeout: float) -> str | None:
    """The one line a CLI prints when an admin request to `peer` failed (None: not ours to explain)."""
    if isinstance(exc, ConnectionRefusedError):
        return f"nothing listens on {peer} (connection refused)"
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return f"no answer from {peer} within {timeout:g} s"
    if isinstance(exc, (OSError, ConnectionError)):
        return f"cannot reach {peer}: {exc}"
    if isinstance(exc, WireError):
        return f"bad answer from {peer}: {exc}"
    return None

__all__ = ["admin_error", "admin_request", "members_report", "quorum_lost_report"]
