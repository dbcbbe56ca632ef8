"""``Runtime``: the control plane of one replica leader, for a synchronous training loop.

The node (gossip + Raft + views) runs on an asyncio loop in a background thread; the training
thread reads the latest committed view without a round trip (an attribute read), gets the
communicator of that view's data epoch (built once, cached, aborted when a newer data epoch
supersedes it), reports data-plane failures as evidence, and publishes its status and step.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from .core.config import DEFAULT, Profile
from .core.meta import Kind, MemberMeta, NodeSpec, Status
from .core.node import TRAINER_KIND
from .core.step import view_wait_after_failure
from .core.view import JobTarget, Member, Role, View
from .net import aio
from .net.dataprobe import DataProbe
from .net.driver import NodeServer
from .ops.log import default_logging, set_context
from .transport.addr import advertised, data_bind_host, parse_hostport

if TYPE_CHECKING:
    from .transport.server import DataServer

log = logging.getLogger(__name__)

COMM_TIMEOUT_S = 10.0   # one allreduce, unless the runtime (or an HSDP rank) is told otherwise


class RuntimeStartError(RuntimeError):
    """The runtime could not start, or was asked for something before it had a view."""


@dataclass(frozen=True)
class Placement:
    """Where this replica listens and which addresses peers are told to dial. Grouped because
    ``start()`` resolves them together: the data port follows the control host unless told
    otherwise, and a wildcard bind is advertised as the address peers can reach."""

    listen: str = "127.0.0.1:0"
    seeds: tuple[str, ...] = ()
    advertise: str | None = None                # control address peers use, when not the bound one (NAT, a proxy)
    data_host: str | None = None                # host the data port binds (default: the listen host)
    data_listen: str | None = None              # HOST:PORT the data port binds (wins over data_host)
    advertise_data: str | None = None           # data address peers use, when not the bound one
    data_addrs: tuple[str, ...] | None = None   # announced as given, one per shard (HSDP): no data server here
    metrics_port: int | str | None = None       # PORT or HOST:PORT for /metrics (None: off)


class StepRecord:
    """The furthest committed step of the job this trainer saw, kept in its data directory
    (``job.step``): evidence of the job that outlives every process. The views carry the job's
    step only as of their last commit (no view is committed while the job just trains), so
    after a total loss, witnesses included, the restored views may say step 0 while the job
    had reached step N; this record says N, and a replica restarted on the same directory with
    no checkpoint refuses to train a new model under the job's name (``JobLife``). Written at
    most every ``EVERY_S`` (atomic replace; a SIGKILL loses at most the steps since)."""

    NAME = "job.step"
    EVERY_S = 0.2

    def __init__(self, data_dir: str, replica_id: str) -> None:
        self.path = os.path.join(data_dir, self.NAME)
        self.replica_id = replica_id
        self._lock = threading.Lock()
        self.recorded = self._read()          # as found at start (None: no record)
        self._written = self.recorded or 0
        self._pending = 0
        self._next = 0.0

    def _read(self) -> int | None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                d = json.load(fh)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignoring the unreadable job record %s: %s", self.path, exc)
            return None
        step = d.get("step") if isinstance(d, dict) else None
        if d.get("replica_id") != self.replica_id or isinstance(step, bool) or not isinstance(step, int):
            log.warning("ignoring the job record %s: not one of replica %s", self.path, self.replica_id)
            return None
        return step

    def note(self, step: int) -> None:
        """Any thread: the job reached `step` (written now, or at the next note after the
        throttle)."""
        with self._lock:
            self._pending = max(self._pending, step)
            if self._pending <= self._written or time.monotonic() < self._next:
                return
            self._next = time.monotonic() + self.EVERY_S
            self._write(self._pending)

    def flush(self) -> None:
        with self._lock:
            if self._pending > self._written:
                self._write(self._pending)

    def _write(self, step: int) -> None:
        tmp = f"{self.path}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump({"replica_id": self.replica_id, "step": step}, fh)
            os.replace(tmp, self.path)
            self._written = step
        except OSError as exc:   # a full disk must not stop training; said once per throttle period
            log.warning("cannot write the job record %s: %s", self.path, exc)


class Runtime:
    """One replica leader's membership, views and communicators.

    Typical use::

        rt = Runtime(replica_id="r0", listen="127.0.0.1:7000", seeds=["127.0.0.1:7001"]).start()
        view = rt.view                 # latest committed View, no round trip

    The keywords are grouped once into a ``Placement`` (addresses), a ``NodeSpec`` (what the
    node announces about itself) and the timing ``Profile``, which go down to the driver and the
    node as they are.
    """

    def __init__(self, *, replica_id: str, listen: str = Placement.listen,
                 seeds: list[str] | tuple[str, ...] = (), data_host: str | None = None,
                 data_addrs: list[str] | None = None, shards: int = NodeSpec.shards, secret: bytes | None = None,
                 profile: Profile = DEFAULT, comm_timeout: float = COMM_TIMEOUT_S, kind: str = TRAINER_KIND,
                 status: Status | str = Status.FRESH, step: int = NodeSpec.step, advertise: str | None = None,
                 data_listen: str | None = None, advertise_data: str | None = None,
                 metrics_port: int | str | None = None, data_plane: str | None = None,
                 max_participants: int | None = NodeSpec.max_participants, data_dir: str | None = None) -> None:
        from .transport.backend import data_plane_from
        # The job's planned participants (max_participants): trainers beyond it wait as hot
        # spares (joiners kept current by the data plane), promoted in the view that removes a
        # dead participant. Checked here, with the rest of what the node announces.
        self.spec = NodeSpec(replica_id=str(replica_id), kind=Kind(kind), shards=shards, status=Status(status),
                             step=step, max_participants=max_participants)
        self.place = Placement(listen=listen, seeds=tuple(seeds), advertise=advertise, data_host=data_host,
                               data_listen=data_listen, advertise_data=advertise_data,
                               data_addrs=tuple(data_addrs) if data_addrs is not None else None,
                               metrics_port=metrics_port)
        self.replica_id = self.spec.replica_id
        # A durable voter identity (term, vote, log) kept there across restarts (None:
        # $P2PFT_DATA_DIR, else none: a new identity per process, as before).
        self.data_dir = data_dir if data_dir is not None else (os.environ.get("P2PFT_DATA_DIR") or None)
        # A trainer's record of the job's furthest step in that directory (see StepRecord).
        self.step_record = (StepRecord(self.data_dir, self.replica_id)
                            if self.data_dir is not None and self.spec.kind is Kind.TRAINER else None)
        # "auto" | "nccl" | "tcp" (None: $P2PFT_DATA_PLANE, else auto), for whoever builds communicators.
        self.data_plane = data_plane_from(data_plane)
        self.secret = secret
        self.profile = profile
        self.comm_timeout = comm_timeout           # one allreduce of the communicators built from these views
        self._status = self.spec.status or Status.FRESH
        self._step = self.spec.step
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
        self.metrics: Any = None                           # p2pft.ops.metrics.MetricsEndpoint once served
        self.probe: DataProbe | None = None                # data-port reachability of failed peers

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> "Runtime":
        """Bind the data and control ports and join the cluster; returns once the node runs.
        An explicit data_plane='nccl' that cannot work here fails first, before anything is bound."""
        from .transport.backend import check_data_plane
        from .transport.server import DataServer
        default_logging()   # a program that configured no logging still sees p2pft's INFO lines
        check_data_plane(self.data_plane)
        place = self.place
        if place.data_addrs is None:
            # The data port follows the control address's host unless told otherwise; a wildcard
            # bind is advertised as the address peers can reach (never 0.0.0.0).
            host, port = (parse_hostport(place.data_listen, "data listen address") if place.data_listen
                          else (data_bind_host(place.listen, place.data_host), 0))
            self.data = DataServer(host, port, secret=self.secret)
            self.data.ring_ack_timeout = self.profile.data_ack_timeout
            data_addrs: tuple[str, ...] = (place.advertise_data or advertised(self.data.addr, advertise=place.advertise,
                                                                              toward=place.seeds),)
        else:
            data_addrs = place.data_addrs
        self._thread = threading.Thread(target=self._run_loop, args=(data_addrs,),
                                        name=f"p2pft-control-{self.replica_id}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeStartError(f"control plane did not start within {timeout} s")
        if self._start_error is not None:
            raise RuntimeStartError(f"cannot start the control plane on {place.listen}: {self._start_error}")
        if place.metrics_port is not None:
            from .ops.metrics import serve_runtime_metrics
            try:
                self.metrics = serve_runtime_metrics(self, place.metrics_port)
            except (OSError, ValueError) as exc:
                self.close(leave=False)
                raise RuntimeStartError(f"cannot serve metrics on {place.metrics_port}: {exc}") from None
        return self

    def _run_loop(self, data_addrs: tuple[str, ...]) -> None:
        loop = aio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        # What the node announces: as configured, with the data addresses just bound and the
        # status and step the trainer may have set since.
        spec = replace(self.spec, data_addrs=data_addrs, status=self._status, step=self._step)
        server = NodeServer(listen=self.place.listen, spec=spec, seeds=self.place.seeds, secret=self.secret,
                            profile=self.profile, advertise=self.place.advertise, data_dir=self.data_dir)
        server.on_view.append(self._on_view)
        self.server = server
        if data_addrs:
            self.probe = DataProbe(server, parse_hostport(data_addrs[0], "data address").host)
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
        if self.step_record is not None:
            self.step_record.flush()
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
        retire (trainer/kernel/comms.py follows the views and aborts them)."""
        self._view = view
        if self.step_record is not None and view.high_water > 0 and view.finished is None:
            self.step_record.note(view.high_water)
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
        """The committed step `node` last told gossip about (0 when unknown), from the driver's
        published snapshot (at most ``MEMBERS_EVERY_S`` old): no read of the node's live table."""
        st = self.server.members.get(node) if self.server is not None else None
        return st.step if st is not None else 0

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
        """What gossip last said about `node` (immutable; None when unknown), from the same
        snapshot as ``member_step``."""
        st = self.server.members.get(node) if self.server is not None else None
        return st.meta if st is not None else None

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
        if self.step_record is not None:
            self.step_record.note(step)
        # Through the loop like every other call; it sends nothing by itself (probes carry it).
        self._call(lambda now: self.server.node.set_step(step), poke=False)  # type: ignore[union-attr]

    @property
    def status(self) -> Status:
        return self._status

    @property
    def recorded_step(self) -> int | None:
        """The job's furthest step recorded in this trainer's data directory by an earlier
        process (None: no data directory, or no record)."""
        return self.step_record.recorded if self.step_record is not None else None


__all__ = ["COMM_TIMEOUT_S", "Placement", "Runtime", "RuntimeStartError", "StepRecord", "Member", "Role", "View"]
