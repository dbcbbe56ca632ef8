"""The step engine's options, grouped by concept and built once.

``FaultTolerant``, ``HSDP`` and ``DiLoCo`` keep their documented keywords; each builds one
``EngineOptions`` from them and hands it to ``StepEngine``, which reads the groups instead of
25 keywords forwarded by hand at each level. Every default lives here (the adapters' keyword
defaults read these class attributes), and each group checks its own values once, naming the
keyword a user wrote.
"""
from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ...core.view import JobTarget, TargetKind
from ...runtime import COMM_TIMEOUT_S
from .optstep import GradHook
from ..state.user import Stateful

RANK_TIMEOUT_S = 10.0       # a rank silent for this long takes its replica down
# DiLoCo's loop may sit in one sync up to its (longer) communicator timeout: a longer default.
DILOCO_LOOP_TIMEOUT_S = 120.0


def exit_replica(rank: int, silent_s: float) -> None:
    """Default reaction to a stalled rank: end this process; the launcher then ends the rest of
    the replica and restarts it whole (the replica is the unit of failure)."""
    logging.shutdown()
    os._exit(75)


class InitialState(str, enum.Enum):
    """How the first participants of a job agree on their state before step 0."""

    BROADCAST = "broadcast"   # take the lead's weights, buffers and registered state (DDP's way)
    CHECK = "check"           # compare digests: a mismatch is an error before step 0
    OFF = "off"               # trust the user


class OnFinished(str, enum.Enum):
    """What a replica that starts after the job finished does."""

    EXIT = "exit"             # raise JobFinished (exit 0)
    WAIT = "wait"             # wait (up to start_timeout) for a further target


@dataclass(frozen=True)
class JobOptions:
    """The job's life as one replica declares it; the same keywords on every algorithm."""

    target: JobTarget | None = None
    min_replicas: int = 1
    start_timeout: float = 120.0
    resume_grace: float = 15.0
    allow_restart_from_scratch: bool = False
    on_finished: OnFinished = OnFinished.EXIT
    initial_state: InitialState = InitialState.BROADCAST
    finish_timeout: float = 300.0

    @classmethod
    def make(cls, *, total_steps: int | None = None, total_samples: int | None = None,
             **kw: Any) -> JobOptions:
        """Checked options (ValueError names the bad one)."""
        if total_steps is not None and total_samples is not None:
            raise ValueError("declare total_steps or total_samples, not both")
        target = None
        for name, n, kind in (("total_steps", total_steps, TargetKind.STEPS),
                              ("total_samples", total_samples, TargetKind.SAMPLES)):
            if n is not None:
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ValueError(f"{name} must be a positive int, got {n!r}")
                target = JobTarget(kind, n)
        mr = kw.get("min_replicas", 1)
        if isinstance(mr, bool) or not isinstance(mr, int) or mr < 1:
            raise ValueError(f"min_replicas must be a positive int, got {mr!r}")
        for name in ("start_timeout", "resume_grace", "finish_timeout"):
            if name in kw and not kw[name] > 0:
                raise ValueError(f"{name} must be positive, got {kw[name]!r}")
        try:
            kw["on_finished"] = OnFinished(kw.get("on_finished", OnFinished.EXIT))
            kw["initial_state"] = InitialState(kw.get("initial_state", InitialState.BROADCAST))
        except ValueError as exc:
            raise ValueError(f"{exc}: on_finished is one of {[o.value for o in OnFinished]}, initial_state one "
                             f"of {[o.value for o in InitialState]}") from None
        return cls(target=target, **kw)


@dataclass(frozen=True)
class Timeouts:
    """How long each wait of the step protocol may last. Grouped because they constrain each
    other: a loop blocked in one allreduce (``comm_timeout``) must not be taken for a stalled
    one (``loop_timeout``)."""

    step_timeout: float = 120.0         # commit() raises StepTimeout after this long without a view
    comm_timeout: float = COMM_TIMEOUT_S  # one allreduce (the Runtime's comm_timeout)
    loop_timeout: float | None = 60.0   # longest the loop may go without a beat (Runtime.loop_beat)
    rank_timeout: float = RANK_TIMEOUT_S  # a silent rank of a multi-rank replica takes it down

    def __post_init__(self) -> None:
        if self.loop_timeout is not None and self.loop_timeout <= self.comm_timeout:
            raise ValueError(f"loop_timeout={self.loop_timeout} s must exceed the communicator timeout "
                             f"({self.comm_timeout} s): an allreduce may block that long without a beat")


@dataclass(frozen=True)
class UpdateRule:
    """What one optimizer step does with the mean gradient (``OptimizerStep``): the learning-rate
    policy over contributors and the user's scheduler, scaler and hooks. Grouped because a
    replay and a fast-forward must run exactly the same rule as a live step."""

    lr_policy: str = "sqrt"
    nominal_replicas: int | None = None
    lr_scheduler: Any = None
    grad_scaler: Any = None
    grad_hook: GradHook | None = None
    after_step: GradHook | None = None


@dataclass(frozen=True)
class Capacity:
    """What the engine keeps, and so how much memory it holds: header slots (the most
    participants a step can count), committed steps kept for peers that fast-forward (more while a
    peer is paused, from its step on), and the bytes of reduced steps a joiner logs while its
    snapshot arrives, which also bound that longer log."""

    max_slots: int = 256
    recent_keep: int = 2
    replay_cap_bytes: int = 2 << 30
    # Per rank of an FSDP replica: each rank logs only its own shard's reduced steps.
    shard_replay_cap_bytes: int = 1 << 30


@dataclass(frozen=True)
class DataPlaneOptions:
    """How this replica's state and gradients travel: the data plane asked for ("auto", "nccl",
    "tcp"; None: the runtime's, else ``$P2PFT_DATA_PLANE``), the shared secret of its state
    streams, and a bound on the bytes per second it serves to joiners."""

    data_plane: str | None = None
    secret: bytes | None = None
    state_rate_limit: float | None = None


@dataclass(frozen=True)
class CheckpointOptions:
    """Disk checkpoints (``torch.distributed.checkpoint``): where, how often (every
    ``every`` committed steps; 0: never written, only resumed from), whether a replica
    resumes from the newest one that verifies, and how many are kept."""

    directory: str
    every: int = 0
    resume: bool = True
    keep: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)) or not str(self.directory):
            raise ValueError(f"checkpoint_dir must be a path, got {self.directory!r}")
        for name in ("every", "keep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "every" else 1):
                raise ValueError(f"checkpoint_{name} must be an int >= {0 if name == 'every' else 1}, got {v!r}")

    @classmethod
    def of(cls, directory: str | os.PathLike[str] | None, every: int = 0, resume: bool = True,
           keep: int = 2) -> CheckpointOptions | None:
        """None without a directory (``checkpoint_every`` then must be 0)."""
        if directory is None:
            if every:
                raise ValueError("checkpoint_every needs a checkpoint_dir")
            return None
        return cls(os.fspath(directory), every, resume, keep)


@dataclass(frozen=True)
class EngineOptions:
    """Everything a ``StepEngine`` is configured with besides its model, optimizer, group and
    servers: built once by the adapter, read by the engine and its helpers."""

    batch_per_replica: int
    timeouts: Timeouts = field(default_factory=Timeouts)
    update: UpdateRule = field(default_factory=UpdateRule)
    capacity: Capacity = field(default_factory=Capacity)
    data: DataPlaneOptions = field(default_factory=DataPlaneOptions)
    state: Mapping[str, Stateful] = field(default_factory=dict)   # registered user state, by name
    on_rank_lost: Callable[[int, float], None] = exit_replica
    job: JobOptions = field(default_factory=JobOptions)     # the job's life (``job/life.py``)
    checkpoint: CheckpointOptions | None = None


__all__ = ["DILOCO_LOOP_TIMEOUT_S", "InitialState", "JobOptions", "OnFinished",
           "Capacity", "CheckpointOptions", "DataPlaneOptions", "EngineOptions",
           "RANK_TIMEOUT_S", "Timeouts", "UpdateRule",
           "exit_replica"]
