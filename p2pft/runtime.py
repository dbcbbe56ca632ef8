"""``Runtime``: the control plane of one replica leader, for a synchronous training loop.

The node (gossip + Raft + views) runs on an asyncio loop in a background thread; the training
thread reads the latest committed view without a round trip (an attribute read), gets the
communicator of that view's data epoch (built once, cached, aborted when a newer data epoch
supersedes it), reports data-plane failures as evidence, and publishes its status and step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from .net import aio
from .core.config import DEFAULT, Profile
from .net.dataprobe import DataProbe
from .net.driver import NodeServer
from .ops.log import set_context
from .core.node import TRAINER_KIND
from .core.meta import MemberMeta, Status
from .core.step import view_wait_after_failure
from .transport.addr import advertised, data_bind_host, parse_hostport
from .core.view import JobTarget, Member, Role, View

if TYPE_CHECKING:
    from .transport.server import DataServer

log = logging.getLogger(__name__)


class RuntimeStartError(RuntimeError):
    """The runtime could not start, or was asked for something before it had a view."""


class Runtime:
    """One replica leader's membership, views and communicators.

    Typical use::

        rt = Runtime(replica_id="r0", listen="127.0.0.1:7000", seeds=["127.0.0.1:7001"]).start()
        view = rt.view                 # latest committed View, no round trip
    """

    def __init__(self, *, replica_id: str, listen: str = "127.0.0.1:0", seeds: list[str] | tuple[str, ...] = (),
                 data_host: str | None = None, data_addrs: list[str] | None = None, shards: int = 1,
                 secret: bytes | None = None, profile: Profile = DEFAULT, comm_timeout: float = 10.0,
                 kind: str = TRAINER_KIND, status: Status | str = Status.FRESH, step: int = 0, advertise: str | None = None,
                 data_listen: str | None = None, advertise_data: str | None = None,
                 metrics_port: int | str | None = None, data_plane: str | None = None,
                 max_participants: int | None = None) -> None:
        from .transport.backend import data_plane_from
        self.replica_id = str(replica_id)
        if max_participants is not None and (isinstance(max_participants, bool) or not isinstance(max_participants, int)
                                             or max_participants < 1):
            raise ValueError(f"max_participants must be a positive int or None, got {max_participants!r}")
        # The job's planned participants: trainers beyond it wait as hot spares (joiners kept
        # current by the data plane), promoted in the view that removes a dead participant.
        self.max_participants = max_participants
        # "auto" | "nccl" | "tcp" (None: $P2PFT_DATA_PLANE, else auto), for whoever builds communicators.
        self.data_plane = data_plane_from(data_plane)
        self.listen = listen
        self.seeds = list(seeds)
        self.data_host = data_host
        self.shards = shards
        self.secret = secret
        self.profile = profile
        self.comm_timeout = comm_timeout
        self.kind = kind
        self._status = Status(status)
        self._step = step
        self._extra_data_addrs = data_addrs
        # Addresses peers use when they differ from the bound ones (NAT, a fault proxy in tests).
        self.advertise = advertise
        self.data_listen = data_listen
        self.advertise_data = advertise_data
        self.data: DataServer | None = None        # shard 0's data server (HSDP ranks have their own)
        self.server: NodeServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._view: View | None = None
        self._view_cv = threading.Condition()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._closed = False
        self._next_beat = 0.0
        self.view_log: list[tuple[float, int, int]] = []   # (wall time, epoch, data_epoch), bounded
        self.metrics_port = metrics_port                   # PORT or HOST:PORT for /metrics (None: off)
        self.metrics: Any = None                           # p2pft.ops.metrics.MetricsEndpoint once served
        self.probe: DataProbe | None = None                # data-port reachability of failed peers

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> "Runtime":
        """Bind the data and control ports and join the cluster; returns once the node runs.
        An explicit data_plane='nccl' that cannot work here fails first, before anything is bound."""
        from .transport.backend import check_data_plane
        from .transport.server import DataServer
        check_data_plane(self.data_plane)
        if self._extra_data_addrs is None:
            # The data port follows the control address's host unless told otherwise; a wildcard
            # bind is advertised as the address peers can reach (never 0.0.0.0).
            host, port = (parse_hostport(self.data_listen, "data listen address") if self.data_listen
                          else (data_bind_host(self.listen, self.data_host), 0))
            self.data = DataServer(host, port, secret=self.secret)
            self.data.ring_ack_timeout = self.profile.data_ack_timeout
            data_addrs = [self.advertise_data or advertised(self.data.addr, advertise=self.advertise,
                                                            toward=self.seeds)]
        else:
            data_addrs = list(self._extra_data_addrs)
        self._thread = threading.Thread(target=self._run_loop, args=(",".join(data_addrs),),
                                        name=f"p2pft-control-{self.replica_id}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeStartError(f"control plane did not start within {timeout} s")
        if self._start_error is not None:
            raise RuntimeStartError(f"cannot start the control plane on {self.listen}: {self._start_error}")
        if self.metrics_port is not None:
            from .ops.metrics import serve_runtime_metrics
            try:
                self.metrics = serve_runtime_metrics(self, self.metrics_port)
            except (OSError, ValueError) as exc:
                self.close(leave=False)
                raise RuntimeStartError(f"cannot serve metrics on {self.metrics_port}: {exc}") from None
        return self

    def _run_loop(self, data_addr: str) -> None:
        loop = aio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        server = NodeServer(listen=self.listen, replica_id=self.replica_id, seeds=self.seeds, kind=self.kind,
                            data_addr=data_addr, shards=self.shards, secret=self.secret, profile=self.profile,
                            status=self._status, step=self._step, advertise=self.advertise,
                            max_participants=self.max_participants)
        server.on_view.append(self._on_view)
        self.server = server
        if data_addr:
            self.probe = DataProbe(server, parse_hostport(data_addr.split(",")[0], "data address").host)
        try:
            loop.run_until_complete(server.start())
        except BaseException as exc:  # bind errors and the like: reported to start()
            self._start_error = exc
            self._started.set()
            loop.close()
            return
        set_context(node=server.node.id if server.node else "-")
        self._started.set()
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(asyncio.sleep(0))
            finally:
                loop.close()

    def close(self, leave: bool = True, timeout: float = 2.0) -> None:
        """Leave the cluster gracefully (or just stop) and release sockets and threads."""
        if self._closed:
            return
        self._closed = True
        loop, server = self._loop, self.server
        if loop is not None and server is not None and loop.is_running():
            if self.probe is not None:
                loop.call_soon_threadsafe(self.probe.close)
            fut = asyncio.run_coroutine_threadsafe(server.stop(leave=leave), loop)
            try:
                fut.result(timeout)
            except Exception:
                pass
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
        if self.data is not None:
            self.data.close()
        if self.metrics is not None:
            self.metrics.close()
        with self._view_cv:
            self._view_cv.notify_all()

    def __enter__(self) -> "Runtime":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ views
    @property
    def node_id(self) -> str:
        assert self.server is not None and self.server.node is not None
        return self.server.node.id

    @property
    def addr(self) -> str:
        assert self.server is not None
        return self.server.addr

    @property
    def view(self) -> View | None:
        """The latest committed view (replaced, never mutated: safe to read from any thread)."""
        return self._view

    @property
    def closed(self) -> bool:
        return self._closed

    def _on_view(self, view: View) -> None:
        """Loop thread: publish the view. The communicators it supersedes are the trainer's to
        retire (trainer/comms.py follows the views and aborts them)."""
        self._view = view
        d = view.data_epoch
        self.view_log.append((time.time(), view.epoch, d))
        if len(self.view_log) > 10_000:
            del self.view_log[:5_000]
        if self.probe is not None:
            self.probe.check_view(view)
        with self._view_cv:
            self._view_cv.notify_all()

    def wait_view(self, pred: Callable[[View], bool], timeout: float,
                  loop_timeout: float | None = None) -> View | None:
        """Block until the latest view satisfies pred (or timeout); returns it or None.

        The training thread passes its `loop_timeout`: waiting for a view is the loop working,
        so it keeps beating meanwhile (see loop_beat)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._view_cv:
                v = self._view
                if v is not None and pred(v):
                    return v
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._view_cv.wait(min(left, 0.05))
            if loop_timeout:
                self.loop_beat(loop_timeout)

    def me(self, view: View | None = None) -> Member | None:
        """This node's entry in `view` (default: the latest), None when it is not a member."""
        view = view if view is not None else self._view
        if view is None or self.server is None or self.server.node is None:
            return None
        return view.member(self.server.node.id)

    @property
    def failure_view_wait(self) -> float:
        """How long a view that removes a failed peer may take (the failure detector's timing):
        the trainer waits this long for one before asking for a fresh data epoch."""
        return view_wait_after_failure(self.profile.suspicion_min)

    def member_step(self, node: str) -> int:
        n = self.server.node if self.server else None
        return n.member_step(node) if n else 0

    # ------------------------------------------------------------------ into the control loop
    def _call(self, fn: Callable[[float], None], poke: bool = True) -> None:
        """Run `fn(now)` on the control loop: the one path from other threads into the node."""
        loop, server = self._loop, self.server
        if loop is None or server is None or self._closed:
            return

        def run() -> None:
            if server.node is not None and not server.closing:
                fn(time.monotonic())
                if poke:
                    server.poke()
        loop.call_soon_threadsafe(run)

    def report_failure(self, node: str, certain: bool = False) -> None:
        """Data-plane evidence: suspect the node now; also touch its control port (a refusal
        there means the process is gone, and it is declared dead at once)."""
        def fn(now: float) -> None:
            assert self.server is not None and self.server.node is not None
            n = self.server.node
            n.report_failure(node, now, certain)
            if not certain:
                n.touch(node, now)
                if self.probe is not None:   # alive on gossip but not on the data plane?
                    self.probe.suspect(node)
        self._call(fn)

    def loop_beat(self, timeout: float) -> None:
        """Training thread: the loop is running. If beats stop for `timeout` seconds while this
        process keeps gossiping (a wedged loop), the leader leaves this replica out of the view
        so the others' allreduces stop waiting for it; the next beat brings it back as a joiner.
        Cheap: forwarded to the control plane at most every 0.25 s."""
        t = time.monotonic()
        if t < self._next_beat or self.server is None:
            return
        self._next_beat = t + 0.25
        self._call(lambda now: self.server.node.loop_beat(now, timeout))  # type: ignore[union-attr]

    def set_status(self, status: Status, step: int | None = None) -> None:
        """This trainer's account of its state (``p2pft.core.meta.Status``): fresh, ready, joining,
        paused or done, at `step`."""
        status = Status(status)
        self._status = status
        self._call(lambda now: self.server.node.set_status(status, now, step))  # type: ignore[union-attr]

    def declare_job(self, target: JobTarget | None, allow_scratch: bool = False) -> None:
        """The job's end as this replica is configured (None: until told), and whether it may
        restart the job below the cluster's high-water step; the leader writes the first
        declaration into the views (``View.target``)."""
        self._call(lambda now: self.server.node.declare_job(target, allow_scratch, now))  # type: ignore[union-attr]

    def member_meta(self, node: str) -> MemberMeta | None:
        """What gossip last said about `node` (immutable; None when unknown)."""
        n = self.server.node if self.server else None
        m = n.gossip.members.get(node) if n is not None else None
        return m.meta if m is not None else None

    def request_new_data_epoch(self, failed_data_epoch: int) -> None:
        """Ask the leader for a fresh data epoch: the communicator of `failed_data_epoch` broke
        although no member is to be excluded (e.g. a peer paused for less than the failure
        timeout), so every member needs a new one."""
        def fn(now: float) -> None:
            assert self.server is not None and self.server.node is not None
            self.server.node.request_data_epoch(int(failed_data_epoch), now)
        self._call(fn)

    def publish_step(self, step: int) -> None:
        """Committed step count, carried on every gossip probe."""
        self._step = step
        set_context(step=step)
        # Through the loop like every other call; it sends nothing by itself (probes carry it).
        self._call(lambda now: self.server.node.set_step(step), poke=False)  # type: ignore[union-attr]

    @property
    def status(self) -> Status:
        return self._status


__all__ = ["Runtime", "RuntimeStartError", "Member", "Role", "View"]
