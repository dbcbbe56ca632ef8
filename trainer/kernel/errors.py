"""The errors a training loop sees from the job's life, under one base.

A loop catches ``JobError`` once and exits with ``exc.exit_code``: 0 when there is nothing
left to do (``Stopped``, ``JobFinished``), non-zero when the job cannot go on as asked. Each
error pickles with its fields, so the rank that decides (rank 0 of an FSDP replica, the one
that reads the views) can hand the very same error to every rank of the replica.
"""
from __future__ import annotations

from ...core.view import JobTarget

#: exit codes of the example replicas and of the README loop (docs/runtime.md lists them)
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_MISSING_STATE = 3     # the job cannot go on here: its state is lost ...
EXIT_STEP_TIMEOUT = 3      # ... or nothing to commit, no group, no end within the bound


class JobError(RuntimeError):
    """Base of the job's errors: ``except JobError as exc: sys.exit(exc.exit_code)``."""

    exit_code = EXIT_ERROR


class Stopped(JobError):
    """request_stop() was called while a step was in flight (graceful shutdown)."""

    exit_code = EXIT_OK


class StepTimeout(JobError):
    """No view in which this replica could commit appeared within the step timeout (or the
    group did not form within ``start_timeout``, or the end barrier within ``finish_timeout``)."""

    exit_code = EXIT_STEP_TIMEOUT


class JobFinished(Stopped):
    """The job finished (every participant reached its end) before this replica could train:
    nothing to do. A ``Stopped``, so the loop's one ``except Stopped`` covers it; exit 0.
    `held`: the step this replica holds when the job finished without it (a joiner still
    catching up, a pause back too late): its weights are not the job's, so it has no end to
    report."""

    def __init__(self, step: int, target: JobTarget | None, held: int | None = None) -> None:
        self.step, self.target, self.held = step, target, held
        what = f" (target {target})" if target is not None else ""
        if held is None:
            super().__init__(f"the job already finished at step {step}{what}: nothing to train")
        else:
            super().__init__(f"the job finished at step {step}{what} without this replica, which holds step "
                             f"{held}: its weights are not the job's final ones")

    def __reduce__(self) -> tuple[type[JobFinished], tuple[int, JobTarget | None, int | None]]:
        return (type(self), (self.step, self.target, self.held))


class MissingStateError(JobError):
    """The cluster reached ``high_water`` but no live peer holds any of its state and this
    replica has no checkpoint: starting from step 0 would silently train a new model."""

    exit_code = EXIT_MISSING_STATE

    def __init__(self, high_water: int, have_step: int) -> None:
        self.high_water, self.have_step = high_water, have_step
        super().__init__(
            f"the job reached step {high_water}, but no running replica holds it and this replica has no checkpoint: "
            "refusing to train from step 0; start a replica with its checkpoint, or pass "
            "allow_restart_from_scratch=True (--allow-restart-from-scratch) to train a new model")

    def __reduce__(self) -> tuple[type[MissingStateError], tuple[int, int]]:
        return (type(self), (self.high_water, self.have_step))


class JobConfigError(JobError, ValueError):
    """This replica's job declaration contradicts the one the group already runs with."""

    exit_code = EXIT_CONFIG


class InitialStateMismatch(JobError):
    """initial_state='check': the first participants' states differ before step 0."""

    exit_code = EXIT_CONFIG


__all__ = ["EXIT_CONFIG", "EXIT_ERROR", "EXIT_MISSING_STATE", "EXIT_OK", "EXIT_STEP_TIMEOUT", "InitialStateMismatch",
           "JobConfigError", "JobError", "JobFinished", "MissingStateError", "StepTimeout", "Stopped"]
