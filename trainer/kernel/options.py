"""Every option of every algorithm: one ``Options`` a user builds (or overrides by keyword).

``Options`` is the one flat object the documented API takes (``FaultTolerant(rt, model, opt,
options, **overrides)``, the same for ``HSDP``, ``DiLoCo`` and local SGD) and the CLI's flags are
derived from; it checks every value and the cross-constraints once, naming the keyword. The kernel
reads it grouped by concept (``EngineOptions``: timeouts, the update rule, capacity, the data
plane, the job's life, checkpoints), which ``Options.engine`` builds. Every default lives here.
"""
from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field
import dataclasses
from typing import Any, Callable, Mapping

from ...core.view import JobTarget, TargetKind
from ...runtime import COMM_TIMEOUT_S
from .lr import LRPolicy
from .optstep import GradHook, GradScalerLike, LRSchedulerLike
from .user_state import Stateful

RANK_TIMEOUT_S = 10.0       # a rank silent for this long takes its replica down


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

    def __post_init__(self) -> None:
        """Checked however built (ValueError names the bad one)."""
        mr = self.min_replicas
        if isinstance(mr, bool) or not isinstance(mr, int) or mr < 1:
            raise ValueError(f"min_replicas must be a positive int, got {mr!r}")
        for name in ("start_timeout", "resume_grace", "finish_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        try:
            object.__setattr__(self, "on_finished", OnFinished(self.on_finished))
            object.__setattr__(self, "initial_state", InitialState(self.initial_state))
        except ValueError as exc:
            raise ValueError(f"{exc}: on_finished is one of {[o.value for o in OnFinished]}, initial_state one "
                             f"of {[o.value for o in InitialState]}") from None

    @classmethod
    def make(cls, *, total_steps: int | None = None, total_samples: int | None = None,
             **kw: Any) -> JobOptions:
        """The options with the job's target from `total_steps` or `total_samples`."""
        if total_steps is not None and total_samples is not None:
            raise ValueError("declare total_steps or total_samples, not both")
        target = None
        for name, n, kind in (("total_steps", total_steps, TargetKind.STEPS),
                              ("total_samples", total_samples, TargetKind.SAMPLES)):
            if n is not None:
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ValueError(f"{name} must be a positive int, got {n!r}")
                target = JobTarget(kind, n)
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
    lr_scheduler: LRSchedulerLike | None = None
    grad_scaler: GradScalerLike | None = None
    grad_hook: GradHook | None = None
    after_step: GradHook | None = None
    clip_norm: float | None = None


@dataclass(frozen=True)
class Capacity:
    """What the engine keeps, and so how much memory it holds: header slots (the most
    participants a step can count), committed steps kept for peers that fast-forward (more while a
    peer is paused, from its step on), and the bytes of reduced steps a joiner logs while its
    snapshot arrives, which also bound that longer log."""

    max_slots: int = 256
    recent_keep: int = 2
    replay_cap_bytes: int = 2 << 30


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
    plane: DataPlaneOptions = field(default_factory=DataPlaneOptions)   # how state and gradients travel
    state: Mapping[str, Stateful] = field(default_factory=dict)   # registered user state, by name
    on_rank_lost: Callable[[int, float], None] = exit_replica
    job: JobOptions = field(default_factory=JobOptions)     # the job's life (``job/life.py``)
    checkpoint: CheckpointOptions | None = None



@dataclass(frozen=True)
class Options:
    """Every option of a replica, flat, the same for every algorithm (docs/runtime.md lists them).

    Build one and pass it whole, or override by keyword: ``FaultTolerant(rt, model, opt, opts,
    step_timeout=30)``. A bad value or an impossible combination is one ``ValueError`` here,
    before anything is served. ``None`` where it means "the Runtime's" (``comm_timeout``,
    ``secret``) or "the algorithm's" (``lr_policy``: ``sqrt`` for a mean of gradients, ``none``
    for DiLoCo's outer step, whose pseudo-gradient already sums a whole span of updates)."""

    batch_per_replica: int
    # the job's life (docs/runtime.md, "A job's life")
    total_steps: int | None = None
    total_samples: int | None = None
    min_replicas: int = JobOptions.min_replicas
    start_timeout: float = JobOptions.start_timeout
    resume_grace: float = JobOptions.resume_grace
    allow_restart_from_scratch: bool = JobOptions.allow_restart_from_scratch
    on_finished: str = OnFinished.EXIT.value
    initial_state: str = InitialState.BROADCAST.value
    finish_timeout: float = JobOptions.finish_timeout
    # timeouts
    step_timeout: float = Timeouts.step_timeout
    loop_timeout: float | None = Timeouts.loop_timeout
    comm_timeout: float | None = None
    rank_timeout: float = Timeouts.rank_timeout
    on_rank_lost: Callable[[int, float], None] = exit_replica
    # the update rule: what one optimizer step does with the mean (a replay runs the same)
    lr_policy: str | None = None
    nominal_replicas: int | None = None
    lr_scheduler: LRSchedulerLike | None = None
    grad_scaler: GradScalerLike | None = None
    grad_hook: GradHook | None = None
    after_step: GradHook | None = None
    clip_norm: float | None = None      # clip the mean gradient's global norm (over every shard) to this
    state: Mapping[str, Stateful] = field(default_factory=dict)
    # memory
    max_slots: int = Capacity.max_slots
    recent_keep: int = Capacity.recent_keep
    replay_cap_bytes: int = Capacity.replay_cap_bytes
    # the data plane
    data_plane: str | None = DataPlaneOptions.data_plane
    secret: bytes | None = None
    state_rate_limit: float | None = DataPlaneOptions.state_rate_limit
    # checkpoints (torch.distributed.checkpoint)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 2
    resume: bool = True

    def __post_init__(self) -> None:
        b = self.batch_per_replica
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"batch_per_replica must be a positive int, got {b!r}")
        for name in ("max_slots", "recent_keep", "replay_cap_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("step_timeout", "rank_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.lr_policy is not None:
            LRPolicy.parse(self.lr_policy)
        c = self.clip_norm
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < float("inf")):
            raise ValueError(f"clip_norm must be a positive finite number or None, got {c!r}")
        if self.nominal_replicas is not None and (isinstance(self.nominal_replicas, bool)
                                                  or not isinstance(self.nominal_replicas, int)
                                                  or self.nominal_replicas < 1):
            raise ValueError(f"nominal_replicas must be a positive int, got {self.nominal_replicas!r}")
        self.job(1)                                          # the job's values and their combinations
        if self.loop_timeout is not None and not self.loop_timeout > 0:
            raise ValueError(f"loop_timeout must be positive or None, got {self.loop_timeout!r}")
        if self.comm_timeout is not None:   # else checked against the Runtime's, in ``engine``
            self.timeouts(self.comm_timeout)   # loop_timeout > comm_timeout
        CheckpointOptions.of(self.checkpoint_dir, self.checkpoint_every, self.resume, self.checkpoint_keep)

    @classmethod
    def of(cls, options: Options | None = None, **overrides: Any) -> Options:
        """`options` with `overrides` (keywords of this class; an unknown one is a TypeError)."""
        if options is None:
            return cls(**overrides)
        if not isinstance(options, Options):
            raise TypeError(f"options must be an Options, got {type(options).__name__}")
        return dataclasses.replace(options, **overrides) if overrides else options

    def job(self, span: int) -> JobOptions:
        """The job's life in kernel steps, `span` of the loop's steps each (a sync of DiLoCo or
        local SGD): ``total_steps`` counts the loop's steps and must be a multiple of it."""
        total = self.total_steps
        if total is not None and span > 1:
            if isinstance(total, bool) or not isinstance(total, int) or total < 1 or total % span:
                raise ValueError(f"total_steps={total!r} (inner steps) must be a positive multiple of the span "
                                 f"between syncs ({span})")
            total //= span
        return JobOptions.make(total_steps=total, total_samples=self.total_samples, min_replicas=self.min_replicas,
                               start_timeout=self.start_timeout, resume_grace=self.resume_grace,
                               allow_restart_from_scratch=self.allow_restart_from_scratch,
                               on_finished=self.on_finished, initial_state=self.initial_state,
                               finish_timeout=self.finish_timeout)

    def timeouts(self, comm_timeout: float) -> Timeouts:
        return Timeouts(step_timeout=self.step_timeout, comm_timeout=comm_timeout, loop_timeout=self.loop_timeout,
                        rank_timeout=self.rank_timeout)

    def update(self, lr_policy: str) -> UpdateRule:
        """The update rule of the kernel's optimizer step (`lr_policy`: the algorithm's default)."""
        return UpdateRule(lr_policy=self.lr_policy or lr_policy, nominal_replicas=self.nominal_replicas,
                          lr_scheduler=self.lr_scheduler, grad_scaler=self.grad_scaler, grad_hook=self.grad_hook,
                          after_step=self.after_step, clip_norm=self.clip_norm)

    def engine(self, *, comm_timeout: float | None, secret: bytes | None, span: int = 1,
               update: UpdateRule | None = None) -> EngineOptions:
        """The kernel's grouped options: `comm_timeout` and `secret` are the Runtime's (used where
        these options leave them None); a round every `span` of the loop's steps takes
        `span` batches; `update` replaces the update rule (DiLoCo's outer step)."""
        return EngineOptions(
            batch_per_replica=self.batch_per_replica * span,
            timeouts=self.timeouts(self.comm_timeout or comm_timeout or COMM_TIMEOUT_S),
            update=update if update is not None else self.update(LRPolicy.SQRT.value),
            capacity=Capacity(max_slots=self.max_slots, recent_keep=self.recent_keep,
                              replay_cap_bytes=self.replay_cap_bytes),
            plane=DataPlaneOptions(data_plane=self.data_plane, secret=self.secret or secret,
                                  state_rate_limit=self.state_rate_limit),
            state=dict(self.state), on_rank_lost=self.on_rank_lost, job=self.job(span),
            checkpoint=CheckpointOptions.of(self.checkpoint_dir, self.checkpoint_every, self.resume,
                                            self.checkpoint_keep))


__all__ = ["InitialState", "JobOptions", "OnFinished", "Options",
           "Capacity", "CheckpointOptions", "DataPlaneOptions", "EngineOptions",
           "RANK_TIMEOUT_S", "Timeouts", "UpdateRule",
           "exit_replica"]
