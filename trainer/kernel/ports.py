"""What the step kernel hands its parts: one typed port per part, never the kernel itself.

Each part of a replica's step machinery (catch-up, the donor, pauses, the recent-steps log,
the job's life, checkpoints) declares here the few members of the kernel it reads or calls,
the way etcd's ``RawNode`` hands its application a ``Ready`` and ``Status()`` rather than the
raft struct. ``StepEngine`` satisfies every port structurally (the type checker proves it where
the parts are built), a part never touches a private member of another, and a new algorithm
composes the same parts through the same ports.
"""
from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Callable, Protocol, Union

import torch

if TYPE_CHECKING:
    from ...core.meta import MemberMeta, Status
    from ...core.view import JobTarget, Member, View
    from ...core.viewplan import PlanMemory
    from ...transport.backend import Backend, DataPlane
    from ...transport.base import Communicator
    from ...transport.stream import StateSnapshot
    from .attempt import Attempt, Entry
    from .errors import Stopped
    from .cursor import DataCursor
    from .group import ReplicaGroup
    from .requests import RequestKind, StateRequest
    from .state_io import StateIO


#: one entry of a replica's event log (``engine.events``): scalars only, written as JSON lines
Event = dict[str, Union[str, int, float, bool, None]]
#: the msgpack-able half of a state snapshot (``capture_state``); its tensors travel beside it
StateMeta = dict[str, object]


class RuntimePort(Protocol):
    """The control plane as the kernel and its parts read it (``p2pft.runtime.Runtime``, rank 0
    only): the committed view and the members' gossip, this trainer's status, step and beats,
    and the data-plane evidence it reports. Nothing else of the Runtime is read below the
    algorithms, so a test drives the kernel with a fake of these members (no sockets)."""

    @property
    def node_id(self) -> str: ...

    @property
    def replica_id(self) -> str: ...

    @property
    def view(self) -> View | None: ...

    @property
    def closed(self) -> bool: ...

    @property
    def status(self) -> Status: ...

    @property
    def data_plane(self) -> DataPlane: ...       # the data plane asked for, when the options leave it

    @property
    def data_dir(self) -> str | None: ...        # named in the job's refusal to restart from scratch

    @property
    def recorded_step(self) -> int | None: ...   # the job's furthest step recorded in data_dir

    @property
    def failure_view_wait(self) -> float: ...    # how long a view that drops a failed peer may take

    def wait_view(self, pred: Callable[[View], bool], timeout: float,
                  loop_timeout: float | None = None) -> View | None: ...

    def me(self) -> Member | None: ...

    def member_step(self, node: str) -> int: ...

    def member_meta(self, node: str) -> MemberMeta | None: ...

    def set_status(self, status: Status, step: int | None = None) -> None: ...

    def publish_step(self, step: int) -> None: ...

    def loop_beat(self, timeout: float) -> None: ...

    def declare_job(self, target: JobTarget | None, allow_scratch: bool = False) -> None: ...

    def report_failure(self, node: str) -> None: ...

    def request_new_data_epoch(self, failed_data_epoch: int) -> None: ...

    def close(self, leave: bool = True, timeout: float = 2.0) -> None: ...   # a lost rank takes the replica down


class CommFactory(Protocol):
    """What builds one communicator of `(epoch, shard)` in which this rank is `rank` of
    `peers` (``DataServer.communicator``, the default; a test hands in-memory ones)."""

    def __call__(self, epoch: int, shard: int, rank: int, peers: list[str], *, timeout: float,
                 connect_timeout: float, backend: Backend, device: int | None) -> Communicator: ...


class DataServerPort(Protocol):
    """This rank's data server as the kernel and its parts use it (``p2pft.transport.DataServer``):
    its address (the source host of outgoing state requests), the donor callback it serves,
    and the communicators it builds (``comms.ShardComms``, unless given a ``CommFactory``)."""

    @property
    def addr(self) -> str: ...

    @property
    def host(self) -> str: ...

    def serve_state(self, provider: Callable[[dict[str, object]], StateSnapshot | None]) -> None: ...

    def communicator(self, epoch: int, shard: int, rank: int, peers: list[str], *, timeout: float,
                     connect_timeout: float, backend: Backend, device: int | None) -> Communicator: ...

    def calling(self, min_epoch: int, shard: int) -> bool: ...

    def close(self) -> None: ...


class CatchupControl(Protocol):
    """The catch-up of a replica, as the kernel and the other parts drive it (``catchup.Catchup``)."""

    donor: tuple[str, tuple[str, ...]] | None   # the attempt's choice of a donor
    end_step: int | None                       # the job's last step, when known

    def start(self, why: str, again: bool = False) -> None: ...

    def stop(self) -> None: ...

    def at_head(self, step: int) -> bool: ...

    def settle(self, step: int) -> bool: ...

    def kick(self) -> None: ...

    def ready_step(self) -> int | None: ...

    def on_reduced(self, entry: Entry, all_ready: bool) -> bool: ...

    def on_idle(self, all_ready: bool) -> bool: ...

    def take_head(self, step: int) -> bool: ...


class PauseControl(Protocol):
    """A replica's pauses (``job.pause.Pauses``): ``with kernel.pause("eval"):``."""

    why: str | None

    def __call__(self, why: str = "pause") -> AbstractContextManager[None]: ...


class LifeHooks(Protocol):
    """The job's life as the kernel calls it (``job.life.JobLife``): the start, the per-step
    hooks, the end barrier."""

    def start(self) -> None: ...

    @property
    def done(self) -> bool: ...

    @property
    def is_leader(self) -> bool: ...

    @property
    def leader(self) -> str | None: ...

    def finish(self, timeout: float | None = None) -> int: ...

    def before_begin(self) -> None: ...

    def lead_now(self) -> tuple[bool, str | None]: ...

    def on_begin(self, lead: tuple[bool, str | None], finished: int | None) -> None: ...

    def stop_plan(self, view: View | None) -> Attempt | None: ...

    def done_ahead(self, att: Attempt) -> tuple[tuple[int, int], ...]: ...

    def stopped(self, att: Attempt) -> Stopped: ...

    def note_lead(self, lead: bool) -> None:
        """The step just committed is led by this replica (or not)."""

    def on_step(self) -> None:
        """After every committed step (a live one, a fast-forward, a hand-over)."""


class CheckpointControl(Protocol):
    """Disk checkpoints (``state.checkpoints.Checkpoints``)."""

    def resume(self) -> int | None: ...

    def on_step(self) -> None: ...

    def close(self) -> None: ...


class DonorControl(Protocol):
    """What the replica serves its peers (``donor.Donor``)."""

    def provide(self, wire: dict[str, object]) -> StateSnapshot | None: ...

    def register(self, kind: RequestKind, provider: Callable[[StateRequest], StateSnapshot | None]) -> None: ...

    def busy(self) -> None: ...

    def idle(self) -> None: ...

    def serve_queued(self) -> None: ...


class RecentLog(Protocol):
    """The short log of committed steps (``recent.RecentSteps``)."""

    def signature(self, step: int) -> str | None: ...

    def serve(self, lo: int, hi: int) -> StateSnapshot | None: ...


class CommsState(Protocol):
    """The replica's communicators, as the job's life asks about them (``comms.ShardComms``)."""

    def unusable(self) -> BaseException | None: ...


class ReplicaState(Protocol):
    """The replica's state and where it stands: read by every part."""

    @property
    def rt(self) -> RuntimePort | None: ...    # rank 0 only: the control plane

    @property
    def group(self) -> ReplicaGroup: ...

    @property
    def rank(self) -> int: ...

    @property
    def shard(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def synced(self) -> bool: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def opt(self) -> torch.optim.Optimizer: ...

    @property
    def state_io(self) -> StateIO: ...

    @property
    def events(self) -> deque[Event]: ...

    @property
    def secret(self) -> bytes | None: ...

    @property
    def loop_timeout(self) -> float | None: ...

    @property
    def ds(self) -> DataServerPort: ...

    def beat(self) -> None:
        """Tell the control plane the loop runs (rank 0; a no-op elsewhere)."""

    def digest(self) -> str: ...

    def capture_state(self) -> tuple[StateMeta, dict[str, torch.Tensor]]: ...


class CatchupPort(ReplicaState, Protocol):
    """What catch-up needs: the state above, plus applying steps and restoring snapshots."""

    @property
    def state_rate_limit(self) -> float | None: ...

    def mark_synced(self, synced: bool) -> None: ...

    def apply(self, e: Entry) -> None: ...

    def restore_snapshot(self, snap: StateSnapshot) -> None: ...


class DonorPort(ReplicaState, Protocol):
    """What the donor serves from: the state, the short log of recent steps."""

    @property
    def recent(self) -> RecentLog: ...


class RecoveryParts(ReplicaState, Protocol):
    """The parts a pause, a fast-forward and the job's life drive."""

    @property
    def catchup(self) -> CatchupControl: ...

    @property
    def donor(self) -> DonorControl: ...

    @property
    def recent(self) -> RecentLog: ...

    @property
    def comms(self) -> CommsState: ...

    @property
    def cursor(self) -> DataCursor: ...

    @property
    def in_step(self) -> bool: ...


class FastForwardPort(RecoveryParts, Protocol):
    """A fast-forward applies logged steps and then does what a commit does after."""

    @property
    def buf_device(self) -> torch.device: ...

    @property
    def began_step(self) -> int:
        """The step whose samples this replica's current ranges are (see ``begin``)."""

    def measure(self, e: Entry) -> None: ...

    def apply(self, e: Entry) -> None: ...

    def committed(self) -> None: ...


class PausePort(RecoveryParts, Protocol):
    """A pause also tells the kernel it left the data plane on purpose."""

    def rejoined_after_pause(self) -> None: ...


class LifePort(RecoveryParts, Protocol):
    """The job's life: loads the initial state, and runs idle rounds at the end barrier."""

    def load_state(self, meta: StateMeta, tensors: dict[str, torch.Tensor]) -> None: ...

    def state_mutation(self) -> AbstractContextManager[None]: ...

    def receive_into(self) -> dict[str, torch.Tensor] | None: ...

    def idle_round(self, timeout: float) -> None:
        """Collective: one reduce round contributing nothing, waiting at most `timeout` for a
        view (joiners still catching up at the end barrier finish theirs)."""

    @property
    def plan_memory(self) -> PlanMemory:
        """Rank 0: the view plan's memory of its last look (was this replica left out since?)."""

    def membership_checked(self) -> None:
        """Rank 0: a finished peer agreed with our last steps (``PlanMemory.after_pause``)."""


__all__ = ["CatchupControl", "CatchupPort", "CheckpointControl", "CommFactory", "CommsState", "DataServerPort",
           "DonorPort", "Event", "FastForwardPort", "LifeHooks", "LifePort", "PauseControl", "PausePort", "RecentLog",
           "RecoveryParts", "ReplicaState", "DonorControl", "RuntimePort", "StateMeta"]
