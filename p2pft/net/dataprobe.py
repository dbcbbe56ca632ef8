"""Is a peer's data port reachable from here? Probes after data-plane evidence, and the bound.

A ring connect that fails is reported as evidence against the peer (``Runtime.report_failure``);
gossip then suspects it, and a process that is gone is declared dead. A peer that answers
gossip but whose data port cannot be opened (an address peers cannot reach, a firewalled port,
a loopback address among remote hosts) is not dead, and used to stay in every view: the job
retried forever. So the runtime also probes the peer's data addresses from this process (a TCP
connect, closed at once), every ``PROBE_EVERY_S``; once they have failed for
``DATA_UNREACHABLE_S`` while gossip still holds the peer alive, it logs one ERROR line naming the
member and the address and names it in its gossip metadata, and the leader leaves it out of the
view (p2pft/core/reach.py). It keeps probing, and withdraws the name at the first connect that
succeeds: the member comes back as a joiner.

The bound: longer than a lost SYN's first retransmission (1 s) plus a probe's own timeout, so
one dropped packet under load never names a peer; a paused process still accepts connections
(the kernel completes the handshake), and a host that is gone is suspected by gossip within a
second (it is then SUSPECT, not ALIVE, and is never named: death is SWIM's to declare). The
price of a misconfigured member is one stall of about the ring's connect timeout plus this bound,
once, instead of a livelock.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ..core.messages import ALIVE, DEAD, LEFT
from ..transport.addr import is_loopback, parse_hostport
from ..transport.wire import source_address

if TYPE_CHECKING:
    from .driver import NodeServer
    from ..core.view import View

log = logging.getLogger(__name__)

DATA_UNREACHABLE_S = 4.0   # probes failing this long name the member (see the module docstring)
PROBE_EVERY_S = 1.0        # between two probes of a member whose data port failed
PROBE_TIMEOUT_S = 2.0      # one connect attempt
MAX_PROBED = 256           # members probed at once; evidence beyond it waits for a slot


class DataProbe:
    """Runs on the runtime's event loop, beside the node server."""

    def __init__(self, server: "NodeServer", own_host: str, bound: float = DATA_UNREACHABLE_S) -> None:
        self.server = server
        self.own_host = own_host            # this process's data host (the probes' source)
        self.bound = bound
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._since: dict[str, float] = {}
        self.named: dict[str, str] = {}      # node -> the address that failed (what we told the leader)
        self.warned: set[str] = set()        # "<node>@<addr>" already named at ERROR (one line each)

    def suspect(self, node: str) -> None:
        """Loop thread: data-plane evidence against `node`; probe it unless already probing."""
        t = self._tasks.get(node)
        if (t is None or t.done()) and len(self._tasks) < MAX_PROBED and not self.server.closing:
            self._tasks[node] = asyncio.get_running_loop().create_task(self._probe(node))

    def close(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        self._tasks.clear()

    async def _probe(self, node: str) -> None:
        try:
            while not self.server.closing and self.server.node is not None:
                g = self.server.node.gossip.members.get(node)
                if g is None or g.state in (DEAD, LEFT) or not g.meta.data_addrs:
                    break                           # gone: death is gossip's business
                bad, started = None, time.monotonic()
                for addr in g.meta.data_addrs:
                    why = await self._try(addr)
                    if why is not None:
                        bad = (addr, why)
                        break
                if bad is None:
                    break
                now = time.monotonic()
                since = self._since.setdefault(node, started)   # failing since the first failed attempt began
                if now - since >= self.bound and g.state == ALIVE and node not in self.named:
                    self.named[node] = bad[0]
                    key = f"{node}@{bad[0]}"
                    level = logging.WARNING if key in self.warned else logging.ERROR   # one ERROR line each
                    self.warned.add(key)
                    log.log(level, "member %s is alive but its data address %s cannot be reached from here (%s) for "
                              "%.1f s: leaving it out of the view until it can; check its --data-listen/"
                              "--advertise-data and firewalls", node, bad[0], bad[1], now - since,
                              extra={"node": self.server.node.id})
                    self._publish()
                await asyncio.sleep(PROBE_EVERY_S)
        finally:
            self._since.pop(node, None)
            self._tasks.pop(node, None)
            if self.named.pop(node, None) is not None and not self.server.closing:
                log.warning("the data address of %s is reachable again (or it is gone): it may rejoin", node,
                            extra={"node": self.server.node.id if self.server.node else "-"})
                self._publish()

    async def _try(self, addr: str) -> str | None:
        """None when a TCP connection to `addr` opens from here, else why not."""
        try:
            host, port = parse_hostport(addr, "data address")
        except ValueError as exc:
            return str(exc)
        if is_loopback(host) and not is_loopback(self.own_host):
            return "a loopback address, and this replica is on another host"
        src = source_address(self.own_host, host)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, local_addr=src), PROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return f"no answer within {PROBE_TIMEOUT_S:g} s"
        except OSError as exc:
            return exc.strerror or type(exc).__name__
        writer.close()
        return None

    def check_view(self, view: "View") -> None:
        """Loop thread, per committed view: name at ERROR, once each, a loopback address among
        members on other hosts (ours or a peer's), and peers naming this replica unreachable."""
        node = self.server.node
        if node is None:
            return
        me = node.id

        def loop(a: str) -> bool:
            return is_loopback(parse_hostport(a, "address").host)
        own = [self.server.addr, *node.gossip.meta.data_addrs]
        lines: list[tuple[str, str]] = []
        for m in view.members:
            if m.node == me:
                continue
            if not loop(m.addr):     # m is on another host: none of our addresses may be loopback
                lines += [(f"self@{a}", f"this replica advertises the loopback address {a} among members on other "
                                        f"hosts ({m.replica_id} at {m.addr}): they cannot reach it; give --listen/"
                                        "--advertise (and --data-listen/--advertise-data) an address they can reach")
                          for a in own if loop(a)]
            if not loop(self.server.addr):   # we are on the network: none of m's may be loopback
                lines += [(f"{m.node}@{a}", f"member {m.node} advertises the loopback address {a} among members "
                                            "on other hosts: peers here cannot reach it")
                          for a in (m.addr, *m.data_addrs) if loop(a)]
        naming = sorted(g.meta.replica_id or g.node for g in node.gossip.members.values()
                        if me in g.meta.data_unreachable and g.state == ALIVE)
        if naming:
            lines.append((f"named:{','.join(naming)}", f"members {', '.join(naming)} cannot reach this replica's "
                          f"data address ({','.join(node.gossip.meta.data_addrs)}): it is left out of the view "
                          "until they can; check --data-listen/--advertise-data and firewalls"))
        for key, text in lines:
            if key not in self.warned and len(self.warned) < 4096:
                self.warned.add(key)
                log.error("%s", text, extra={"node": me})

    def _publish(self) -> None:
        node = self.server.node
        if node is not None:
            node.set_data_unreachable(tuple(sorted(self.named)), time.monotonic())
            self.server.poke()


__all__ = ["DATA_UNREACHABLE_S", "DataProbe", "PROBE_EVERY_S", "PROBE_TIMEOUT_S"]
