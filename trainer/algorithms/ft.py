"""``FaultTolerant``: the step protocol around an ordinary loop, for a replica of one rank.

A training loop calls ``begin()`` (which samples to train on, empty when this replica does not
contribute), runs forward/backward, then ``commit()``. ``commit`` allreduces the step buffer on
the current view's communicator and, on any data-plane error, waits for the next view and
retries with the saved local gradients: no recomputation, no restart. It is the step kernel
(``engine.py``) with one rank, the whole state, and the job's life; see docs/architecture.md.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ...runtime import Runtime
from ..kernel.attempt import StepResult
from ..kernel.engine import StepEngine, data_server_of
from ..kernel.errors import (InitialStateMismatch, JobConfigError, JobError, JobFinished, MissingStateError,
                             StepTimeout, Stopped)
from ..kernel.group import LocalGroup
from ..kernel.options import JobOptions
from ..kernel.options import Capacity, CheckpointOptions, DataPlaneOptions, EngineOptions, Timeouts, UpdateRule
from ..kernel.optstep import GradHook
from ..state.whole import capture, restore, state_digest
from ..kernel.state_io import StateIO
from ..state.user import Stateful

log = logging.getLogger(__name__)


def receive_into(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The joiner's own tensors, by snapshot name: the stream lands in them in place (no
    fresh allocation, no copy at restore). They hold nothing worth keeping while the
    replica catches up, and nothing reads them until the restore."""
    into = {f"param/{n}": p.data for n, p in model.named_parameters()}
    into.update({f"buffer/{n}": b for n, b in model.named_buffers()})
    by_param = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        name = by_param.get(id(p))
        if name is not None:
            into.update({f"optim/{name}/{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return into


WHOLE_STATE = StateIO(capture=capture, restore=restore, digest=state_digest, receive_into=receive_into)


class FaultTolerant(StepEngine):
    """Wraps a model and optimizer of one replica (``p2pft.trainer.FaultTolerant``).

    The job's life around the loop (``trainer/job/life.py``, the same on every algorithm): the first
    ``begin()`` joins the group (``min_replicas``, the same initial state everywhere, a job that
    already finished or lost its progress is refused), ``done`` says the target is reached,
    ``finish()`` is the end barrier, ``is_leader`` picks one participant for side work."""

    def __init__(self, runtime: Runtime, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 batch_per_replica: int, nominal_replicas: int | None = UpdateRule.nominal_replicas,
                 lr_policy: str = UpdateRule.lr_policy, max_slots: int = Capacity.max_slots,
                 recent_keep: int = Capacity.recent_keep, replay_cap_bytes: int = Capacity.replay_cap_bytes,
                 step_timeout: float = Timeouts.step_timeout, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 0, resume: bool = True,
                 state_rate_limit: float | None = DataPlaneOptions.state_rate_limit,
                 loop_timeout: float | None = Timeouts.loop_timeout, lr_scheduler: Any = None,
                 grad_scaler: Any = None, grad_hook: GradHook | None = None, after_step: GradHook | None = None,
                 state: dict[str, Stateful] | None = None, data_plane: str | None = DataPlaneOptions.data_plane,
                 total_steps: int | None = None, total_samples: int | None = None,
                 min_replicas: int = JobOptions.min_replicas, start_timeout: float = JobOptions.start_timeout,
                 resume_grace: float = JobOptions.resume_grace,
                 allow_restart_from_scratch: bool = JobOptions.allow_restart_from_scratch,
                 on_finished: str = JobOptions.on_finished.value,
                 initial_state: str = JobOptions.initial_state.value,
                 finish_timeout: float = JobOptions.finish_timeout) -> None:
        # Checked first: a bad option is one error before anything is served.
        options = EngineOptions(
            batch_per_replica=batch_per_replica,
            timeouts=Timeouts(step_timeout=step_timeout, comm_timeout=runtime.comm_timeout, loop_timeout=loop_timeout),
            update=UpdateRule(lr_policy=lr_policy, nominal_replicas=nominal_replicas, lr_scheduler=lr_scheduler,
                              grad_scaler=grad_scaler, grad_hook=grad_hook, after_step=after_step),
            capacity=Capacity(max_slots=max_slots, recent_keep=recent_keep, replay_cap_bytes=replay_cap_bytes),
            data=DataPlaneOptions(data_plane=data_plane, secret=runtime.secret, state_rate_limit=state_rate_limit),
            state=dict(state or {}),
            job=JobOptions.make(total_steps=total_steps, total_samples=total_samples, min_replicas=min_replicas,
                                start_timeout=start_timeout, resume_grace=resume_grace,
                                allow_restart_from_scratch=allow_restart_from_scratch, on_finished=on_finished,
                                initial_state=initial_state, finish_timeout=finish_timeout),
            checkpoint=CheckpointOptions.of(checkpoint_dir, checkpoint_every, resume))
        super().__init__(model, optimizer, group=LocalGroup(), runtime=runtime, data_server=data_server_of(runtime),
                         state_io=WHOLE_STATE, options=options)
        self._start_control()

    def commit(self) -> StepResult:
        """Collective. Allreduce the step's gradients, retry across views, apply (``StepResult``)."""
        return self.commit_step()


__all__ = ["FaultTolerant", "InitialStateMismatch", "JobConfigError", "JobError", "JobFinished", "MissingStateError",
           "StepResult", "StepTimeout", "Stopped", "WHOLE_STATE"]
