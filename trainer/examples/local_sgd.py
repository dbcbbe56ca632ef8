"""A fourth algorithm from the step kernel alone: local SGD (docs/architecture.md, "Adding an
algorithm").

Every replica takes ``sync_every`` optimizer steps on its own, then the replicas average their
weights. On the kernel that is: one kernel step per sync, the replica's weights packed as the
step's "gradient" (the kernel reduces the mean over the contributors), and an outer "optimizer"
that sets the weights to that mean. Everything else comes with the kernel: retries with the
saved contribution when a peer dies mid-sync, exactly-once data, catch-up of a restarted
replica, pauses, and the whole job's life (``total_steps``, ``min_replicas``, the same start,
``finish()``, checkpoints). The class is the first 60 lines; the rest is a runnable replica::

    python -m p2pft.trainer.examples.local_sgd --replica-id a --listen 127.0.0.1:7300 --seeds 127.0.0.1:7301
"""
from __future__ import annotations

from typing import Any

import torch

from p2pft.runtime import Runtime
from p2pft.trainer.kernel.attempt import StepResult
from p2pft.trainer.kernel.engine import StepEngine, data_server_of
from p2pft.trainer.algorithms.ft import WHOLE_STATE
from p2pft.trainer.kernel.group import LocalGroup
from p2pft.trainer.kernel.options import JobOptions
from p2pft.trainer.kernel.options import CheckpointOptions, DataPlaneOptions, EngineOptions, Timeouts


class AverageWeights(torch.optim.Optimizer):
    """The sync's update: the weights become the reduced mean the kernel unpacked into ``grad``."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 1.0})   # the kernel scales "lr" by its lr policy; unused here

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # torch's overloads; no closure
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_(p.grad)


class LocalSGD(StepEngine):
    """``begin()`` gives one local step's samples ([] while not contributing); ``commit()``
    takes the local optimizer step and, every ``sync_every`` of them, averages the weights."""

    def __init__(self, runtime: Runtime, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 sync_every: int, batch_per_replica: int, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 0, **job: Any) -> None:
        self.local_opt, self.h, self._k = optimizer, sync_every, 0
        self._idx: list[int] = []
        if job.get("total_steps"):   # counted in local steps, as the loop counts; the kernel's are syncs
            job["total_steps"] //= sync_every
        options = EngineOptions(batch_per_replica=batch_per_replica * sync_every,
                                timeouts=Timeouts(comm_timeout=runtime.comm_timeout),
                                data=DataPlaneOptions(secret=runtime.secret), job=JobOptions.make(**job),
                                checkpoint=CheckpointOptions.of(checkpoint_dir, checkpoint_every))
        super().__init__(model, AverageWeights(model.parameters()), group=LocalGroup(), runtime=runtime,
                         data_server=data_server_of(runtime), state_io=WHOLE_STATE, options=options)
        self._start_control()

    def begin(self, stop: bool = False) -> list[int]:
        if self._k == 0:
            self._idx = super().begin(stop)
        per = len(self._idx) // self.h
        return self._idx[self._k * per:(self._k + 1) * per]

    def zero_grad(self) -> None:
        self.local_opt.zero_grad(set_to_none=True)

    def commit(self) -> StepResult | None:
        """None after a local step; the kernel's result at a sync."""
        if self._idx:
            self.local_opt.step()
            self._k += 1
            if self._k < self.h:
                return None
            for p in self.buf.params:   # this replica's weights are its contribution
                p.grad = p.detach().clone()
        self._k = 0
        return self.commit_step()


def main() -> int:
    import argparse
    import json
    import sys
    import time

    from p2pft.deploy.job_args import add_job_args, job_kwargs
    from p2pft.ops.log import setup_logging
    from p2pft.trainer.kernel.errors import JobError

    p = argparse.ArgumentParser(description="a local-SGD replica of a small regression job")
    for flag, default in (("--replica-id", None), ("--listen", None), ("--seeds", ""), ("--stats", None)):
        p.add_argument(flag, default=default, required=default is None)
    for flag, value in (("--steps", 0), ("--min-replicas", 1), ("--seed", 0), ("--sync-every", 4)):
        p.add_argument(flag, type=int, default=value)
    p.add_argument("--step-delay", type=float, default=0.02)
    add_job_args(p)
    a = p.parse_args()
    setup_logging("INFO")
    torch.manual_seed(a.seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    rt = Runtime(replica_id=a.replica_id, listen=a.listen, seeds=[s for s in a.seeds.split(",") if s]).start()
    algo = LocalSGD(rt, model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=a.sync_every,
                    batch_per_replica=4, **job_kwargs(a))
    out = open(a.stats, "a", buffering=1)
    code = 0
    try:
        algo.start()
        while not algo.done:
            idx = algo.begin()
            algo.zero_grad()
            if idx:
                x = torch.stack([torch.sin(torch.arange(8.0) + i) for i in idx])
                model(x).sub(x.sum(1, keepdim=True).cos()).pow(2).mean().backward()
                time.sleep(a.step_delay)
            res = algo.commit()
            if res is not None:
                out.write(json.dumps({"t": time.time(), "step": res.step, "c": int(res.committed),
                                      "n": res.contributors, "role": res.role}) + "\n")
        end = algo.finish()
        out.write(json.dumps({"kind": "exit", "step": end, "digest": algo.digest()}) + "\n")
    except JobError as exc:
        print(f"replica {a.replica_id}: {exc}", file=sys.stderr, flush=True)
        code = exc.exit_code
    algo.close()
    rt.close(leave=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
