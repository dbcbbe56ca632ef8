"""torchtitan on p2pft: a torchtitan ``Trainer`` whose step is p2pft's (docs/torchtitan.md).

Why a subclass and no patch: torchtitan builds its trainer from the config that ``--module`` /
``--config`` name, so a trainer living here is selected with torchtitan's own flags
(``--module p2pft.trainer.integrations.torchtitan --config llama3_debugmodel``: any config a
torchtitan model registers, wrapped by ``p2pft_config``). The base class builds everything (mesh,
FSDP2 model, AdamW, LambdaLR, tokenizer, metrics); this class hands the model, the inner optimizer
and its scheduler to ``HSDP.launch`` and runs p2pft's loop instead of torchtitan's ``train()``.
One torchrun (R FSDP ranks) is one replica, the unit of failure: a replica that dies is restarted
whole and catches up from a peer while the others keep committing.

What differs from torchtitan's own step, and why:
- data are a map-style token file (``TokenData``): p2pft's replicated cursor hands out sample
  indices, which is what trains every sample once through failures (a stream has no index);
- the optimizer step runs inside ``commit()`` on the mean over replicas, so clipping
  (``training.max_norm``) is p2pft's ``clip_norm`` on the averaged gradient and the scheduler is
  stepped by p2pft once per committed step (a joiner's replay steps it alike);
- the loss is normalised by the replica's tokens (summed over its ranks, as torchtitan does);
- torchtitan's checkpointer only loads (``load_start``): the state it loads is the p2pft job's
  step 0, torchtitan's step and data position travel as p2pft state (``StartPoint``); p2pft writes
  its own checkpoints, which ``convert --to torchtitan`` turns into torchtitan's
  (``torchtitan_checkpoint.py``, docs/torchtitan.md "Checkpoints").

Run as ``python -m p2pft.trainer.integrations.torchtitan`` (under ``torchrun -m``): on a machine
without an accelerator it applies ``cpu_shims()`` before torchtitan is imported.
"""
from __future__ import annotations

if __name__ == "__main__":   # run as a script: run the module under its own name, the one --module imports
    import os as _os
    import sys as _sys
    from p2pft.deploy.procs import die_with_parent
    # torchrun starts ranks in sessions of their own: a killed torchrun must take them along,
    # also while they still import torch and torchtitan
    die_with_parent(_os.getppid())
    if _sys.argv[1:2] == ["convert"]:   # no torchtitan needed: DCP to DCP (torchtitan_checkpoint.py)
        from p2pft.trainer.integrations.torchtitan_checkpoint import main as _convert
        _sys.exit(_convert(_sys.argv[2:]))
    from p2pft.trainer.integrations.torchtitan import main as _main
    _sys.exit(_main())

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

import torch
import torch.distributed as dist

log = logging.getLogger("p2pft.torchtitan")


def on_cpu() -> bool:
    """No accelerator torch can use here: the CPU shims and CPU settings apply."""
    from torch._utils import _get_available_device_type
    return _get_available_device_type() is None


def cpu_shims() -> bool:
    """Let torchtitan 0.3.0 train on a CPU-only torch 2.13 (gloo); nothing where an accelerator
    exists. Each is a shim of a torch API, none touches torchtitan's source:

    1. device type: torchtitan picks its device when ``torchtitan.tools.utils`` is imported
       and falls back to "cuda" when torch reports no accelerator; torch's
       ``_get_available_device_type`` answers "cpu" while that module is imported (torch itself
       keeps the real answer);
    2. ``torch.cpu`` memory functions torchtitan's metrics call (``get_device_name``,
       ``get_device_properties``, ``memory_stats``, ``reset_peak_memory_stats``,
       ``empty_cache``): names and no-ops, so the memory figures read -1;
    3. ``torch.distributed.set_timeout``: torchtitan's ``train()`` lowers the process groups'
       timeouts after step 1 with an API newer than torch 2.13 (mapped to ``_set_pg_timeout``;
       p2pft's loop does not call it, a plain torchtitan run through this launcher does);
    4. ``torch.distributed.barrier``: that same step-1 call passes ``device_ids=[torch.cpu.current_device()]``,
       i.e. ``["cpu"]``, which torch rejects (ids are ints); a barrier whose ids are not all ints
       runs without them (the CPU barrier needs none). Every other call passes through.

    Must run before anything imports torchtitan; returns whether torchtitan's device is "cpu".
    Two CPU settings are not shims and live in the trainer: plain SDPA attention
    (``sdpa_attention``) and sum reduction in FSDP2 (``sum_reduction``).
    """
    if not on_cpu():
        return False
    import torch._utils as tu
    if "torchtitan.tools.utils" not in sys.modules:
        real = tu._get_available_device_type
        tu._get_available_device_type = lambda: "cpu"
        try:
            import torchtitan.tools.utils  # noqa: F401  (binds its device type now)
        finally:
            tu._get_available_device_type = real
    cpu: Any = torch.cpu
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name, fn in (("get_device_name", lambda device=None: "cpu"),
                     ("get_device_properties", lambda device=None: SimpleNamespace(name="cpu", total_memory=total)),
                     ("memory_stats", lambda device=None: {}),
                     ("reset_peak_memory_stats", lambda device=None: None),
                     ("empty_cache", lambda: None)):
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)
    c10d: Any = dist
    if not hasattr(c10d, "set_timeout"):
        c10d.set_timeout = c10d.distributed_c10d._set_pg_timeout
    if not getattr(c10d.barrier, "p2pft_cpu", False):
        barrier = c10d.barrier

        def cpu_barrier(*args: Any, device_ids: Any = None, **kw: Any) -> Any:
            if device_ids is not None and not all(isinstance(d, int) for d in device_ids):
                device_ids = None
            return barrier(*args, device_ids=device_ids, **kw)
        cpu_barrier.p2pft_cpu = True   # type: ignore[attr-defined]
        c10d.barrier = cpu_barrier
    return bool(sys.modules["torchtitan.tools.utils"].device_type == "cpu")


_SHIMMED = cpu_shims()

from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402  (after the shims)
from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from p2pft.core.view import Role  # noqa: E402
from p2pft.trainer.algorithms.hsdp import HSDP  # noqa: E402
from p2pft.trainer.data.tokens import TokenFile, write_tokens  # noqa: E402
from p2pft.trainer.integrations.torchtitan_checkpoint import (START, StartPoint, alias_state_keys,  # noqa: E402
                                                              live_digests)
from p2pft.trainer.kernel.attempt import StepResult  # noqa: E402
from p2pft.trainer.kernel.errors import JobError, Stopped  # noqa: E402


# ---------------------------------------------------------------------- CPU settings
def sdpa_attention(model_config: Any) -> int:
    """Plain causal SDPA in place of every FlexAttention / varlen attention of a model config:
    FlexAttention has no CPU backward. Causal over the whole packed sample (``TokenData`` gives
    no per-document positions, so no block mask is lost). Returns how many were replaced."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention
    found = list(model_config.traverse((FlexAttention.Config, VarlenAttention.Config)))
    for _, _, parent, attr in found:
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        elif parent is not None:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return len(found)


def sum_reduction(model_parts: Sequence[torch.nn.Module]) -> None:
    """FSDP2 reduce-scatters with a plain SUM: gloo has no PREMUL_SUM, which FSDP2 uses for the
    divide factor torchtitan sets (1.0: torchtitan divides by the replica's tokens itself)."""
    from torch.distributed.fsdp import FSDPModule
    for part in model_parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)


# ---------------------------------------------------------------------- data
class TokenData(BaseDataLoader):
    """A map-style token file (``p2pft.trainer.data.tokens``) as torchtitan's dataloader: sample
    ``i`` is ``seq_len + 1`` tokens, inputs and shifted labels. Under p2pft ``batch(indices)``
    is called with the cursor's indices; iterating it (plain torchtitan) gives global batch k as
    samples ``[k*B*W, (k+1)*B*W)``, rank r taking its r-th slice: the order p2pft hands a single
    replica, so both runs see the same data (checked step by step: the oracle). With gradient
    accumulation on several ranks a step holds the same samples in both, split over the ranks'
    microbatches differently (p2pft gives rank r a contiguous run of them)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        token_dtype: str = "uint16"
        """dtype of the token file (``uint16`` or ``uint32``); ``dataset_path`` is the file"""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int,
                 local_batch_size: int, **_: Any) -> None:
        if not config.dataset_path:
            raise ValueError("--dataloader.dataset_path must name a token file "
                             "(python -m p2pft.trainer.integrations.torchtitan prepare writes one)")
        self.tokens = TokenFile(config.dataset_path, seq_len, config.token_dtype)
        self.rank, self.world, self.batch_size = dp_rank, dp_world_size, local_batch_size
        self.next = 0
        self.position = 0   # the sample a loaded state points at (P2PFTTrainer starts there)

    def batch(self, indices: Sequence[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w = torch.stack([self.tokens[i % len(self.tokens)] for i in indices])
        return {"input": w[:, :-1].contiguous()}, w[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            start = (self.next * self.world + self.rank) * self.batch_size
            self.next += 1
            yield self.batch(range(start, start + self.batch_size))

    def state_dict(self) -> dict[str, Any]:
        # ``sample`` too: ``next`` counts batches of this run's ranks x local_batch_size, the
        # sample index is what a run at another rank count (or p2pft's cursor) resumes from
        return {"next": self.next, "sample": self.next * self.world * self.batch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        per = self.world * self.batch_size
        self.position = int(state_dict.get("sample", int(state_dict.get("next", 0)) * per))
        self.next = self.position // per   # plain iteration: the batch that holds it


# ---------------------------------------------------------------------- config
@dataclass(kw_only=True, slots=True)
class P2PFT:
    """p2pft's part of the config (``--p2pft.<field>``); the job's end is ``training.steps``,
    clipping ``training.max_norm``; every other ``Options`` field keeps its default."""

    replica_id: str = ""
    """this replica's id (one per torchrun; a restarted replica may keep it)"""
    listen: str = "127.0.0.1:7100"
    """HOST:PORT of rank 0's control plane; every rank's data port binds the same host"""
    seeds: str = ""
    """comma-separated HOST:PORT of other members (replicas, witnesses)"""
    min_replicas: int = 1
    """the first step waits for this many participants (start_timeout)"""
    start_timeout: float = 120.0
    step_timeout: float = 120.0
    rank_timeout: float = 10.0
    lr_policy: str = ""
    """contributor factor on the learning rate: sqrt, linear, none ("": p2pft's, sqrt)"""
    nominal_replicas: int = 0
    """the planned replica count of that factor (0: the most contributors seen)"""
    secret_file: str = ""
    """cluster secret (else $P2PFT_SECRET)"""
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    stats: str = ""
    """rank 0 appends one JSON line per commit() here (step, contributors, retries, role; loss, norm, lr)"""
    digest_every: int = 0
    """every N committed steps, record every rank's shard digest in ``stats``"""


ROLES = {r.value: i for i, r in enumerate(Role)}   # a step's role as a scalar for the metric loggers


class P2PFTTrainer(Trainer):
    """torchtitan's trainer, stepped by p2pft's ``HSDP`` (one object per rank)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        p2pft: P2PFT = field(default_factory=P2PFT)

    replica: HSDP

    def __init__(self, config: Config) -> None:
        self.replica_ready = False
        if on_cpu():
            if not _SHIMMED:
                raise RuntimeError("torchtitan was imported before p2pft's CPU shims: start it with "
                                   "`torchrun ... -m p2pft.trainer.integrations.torchtitan` (docs/torchtitan.md)")
            assert config.model_spec is not None
            sdpa_attention(config.model_spec.model)
        super().__init__(config)
        if on_cpu():
            sum_reduction(self.model_parts)
        dims, tr, p = self.parallel_dims, config.training, config.p2pft
        batch_degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
        if len(self.model_parts) != 1 or len(self.optimizers.optimizers) != 1 or batch_degree != dims.world_size:
            raise ValueError("p2pft steps one model part with one optimizer, sharded by FSDP only: "
                             "pipeline, tensor, context or expert parallelism and several optimizers "
                             "inside a replica are not supported yet")
        if not isinstance(self.dataloader, TokenData):
            raise ValueError("p2pft needs a map-style dataloader (TokenData: --dataloader.dataset_path TOKENS)")
        if not p.replica_id:
            raise ValueError("--p2pft.replica_id is required")
        if config.validator.enable:
            log.warning("torchtitan's validator does not run under p2pft")
        self.start = self.load_start(config)
        if tr.steps <= self.start.step:
            raise ValueError(f"the checkpoint loaded is at step {self.start.step}: --training.steps {tr.steps} "
                             "leaves nothing to train")
        if p.checkpoint_dir:
            alias_state_keys(self.model_parts[0])   # p2pft's checkpoints hold torchtitan's model keys
        from p2pft.net.wire import load_secret
        per_rank = self.gradient_accumulation_steps * tr.local_batch_size
        self.replica = HSDP.launch(
            self.model_parts[0], self.optimizers.optimizers[0],
            replica_id=p.replica_id, listen=p.listen, seeds=[s for s in p.seeds.split(",") if s],
            secret=load_secret(p.secret_file or None),
            batch_per_replica=per_rank * dims.world_size, total_steps=tr.steps - self.start.step,
            min_replicas=p.min_replicas,
            start_timeout=p.start_timeout, step_timeout=p.step_timeout, rank_timeout=p.rank_timeout,
            lr_policy=p.lr_policy or None, nominal_replicas=p.nominal_replicas or None,
            lr_scheduler=self.lr_schedulers.schedulers[0], checkpoint_dir=p.checkpoint_dir or None,
            checkpoint_every=p.checkpoint_every, state={START: self.start},
            clip_norm=float(tr.max_norm) if tr.max_norm > 0 else None)   # the mean's global norm, replay-exact
        self.replica_ready = True

    def load_start(self, config: Config) -> StartPoint:
        """torchtitan's own checkpoint load, which its ``train()`` (replaced by p2pft's loop) does
        first: with ``--checkpoint.enable``, the newest ``step-N`` under ``checkpoint.folder``, else
        ``--checkpoint.initial_load_path`` (the model only, unless
        ``--checkpoint.no-initial-load-model-only``). The p2pft job's step 0 is that state; p2pft's
        own checkpoints and peers, found later in ``HSDP.launch``, take precedence. Returns where
        step 0 lies in torchtitan's steps and samples (registered p2pft state: ``StartPoint``)."""
        ck, tr = config.checkpoint, config.training
        if ck.enable:
            log.warning("torchtitan's checkpointer loads the start state under p2pft and saves nothing "
                        "(p2pft's checkpoints: --p2pft.checkpoint_dir; `convert --to torchtitan` for torchtitan)")
            self.checkpointer.load(step=ck.load_step)
        elif ck.initial_load_path:
            log.warning("--checkpoint.initial_load_path is ignored without --checkpoint.enable (as by torchtitan)")
        assert isinstance(self.dataloader, TokenData)
        return StartPoint(step=self.step, sample=self.dataloader.position, local_batch=tr.local_batch_size,
                          ranks=self.parallel_dims.world_size, seq_len=tr.seq_len)

    # ------------------------------------------------------------------ one step
    def forward_backward(self, idx: list[int]) -> torch.Tensor:
        """torchtitan's ``train_step`` up to the optimizer, on the cursor's samples: microbatches
        of ``local_batch_size``, the loss divided by the replica's valid tokens. Returns this
        rank's loss sum / replica tokens (detached)."""
        t0 = time.perf_counter()
        mb = self.config.training.local_batch_size
        idx = [self.start.sample + i for i in idx]   # the job's sample i: the file's sample start + i
        batches = [self.dataloader.batch(idx[i:i + mb]) for i in range(0, len(idx), mb)]
        self.metrics_processor.data_loading_times.append(time.perf_counter() - t0)
        local = sum(((labels != IGNORE_INDEX).sum() for _, labels in batches), torch.tensor(0))
        self.metrics_processor.ntokens_since_last_log += sum(labels.numel() for _, labels in batches)
        dims = self.parallel_dims
        tokens = (dist_utils.dist_sum_tensor(local.to(self.device), dims.get_mesh("batch"))
                  if dims.dp_enabled else local.to(self.device))
        total = torch.zeros((), device=self.device)
        for inputs, labels in batches:
            inputs = {k: v.to(self.device) for k, v in inputs.items()}
            loss = self.forward_backward_step(input_dict=inputs, labels=labels.to(self.device),
                                              global_valid_tokens=tokens)
            total += loss.detach()
        return total

    def replica_loss(self, loss: torch.Tensor) -> float:
        """Collective over the replica: its mean loss (the ranks' sums over the replica's tokens)."""
        dims = self.parallel_dims
        return dist_utils.dist_sum(loss, dims.get_optional_mesh("loss")) if dims.dp_cp_enabled else float(loss)

    def log_step(self, res: StepResult, avg: float | None, gap: float) -> None:
        """torchtitan's metric logger (at torchtitan's step: ``StartPoint.step`` + p2pft's), with
        p2pft's step fields as extra scalars."""
        step = self.start.step + res.step
        if not (res.committed and avg is not None and self.metrics_processor.should_log(step)):
            return
        kernel = self.replica.kernel
        norm = getattr(kernel.optimizer_step, "last_norm", None)
        lrs = kernel.optimizer_step.last_lrs
        extra = {"p2pft/contributors": res.contributors, "p2pft/retries": res.retries,
                 "p2pft/role": ROLES.get(res.role, -1), "p2pft/commit_gap(s)": gap,
                 "p2pft/fast_forwarded": res.fast_forwarded, "lr": lrs[0] if lrs else float("nan")}
        self.metrics_processor.log(step, avg, avg, float("nan") if norm is None else norm, extra_metrics=extra)

    # ------------------------------------------------------------------ the job
    def train(self) -> int:
        """p2pft's loop over the job's life; returns the exit code (``JobError.exit_code``)."""
        from p2pft.trainer.examples.signals import StopOnSignal
        rep, p = self.replica, self.config.p2pft
        stop = StopOnSignal()
        stop.attach(rep)
        out = Stats(p.stats if rep.rt is not None else "")
        pids = rep.kernel.group.agree(os.getpid())
        out.write(kind="start", node=rep.rt.node_id if rep.rt else None, step=rep.step, pids=pids,
                  base=self.start.step, sample=self.start.sample, **self.titan_digests())
        try:
            rep.start()   # forming, the same start at step 0, a finished or lost job refused
        except JobError as exc:
            log.warning("replica %s: %s", p.replica_id, exc)
            out.write(kind="exit", step=rep.step, code=exc.exit_code)
            return exc.exit_code
        code, last = 0, time.monotonic()
        while not rep.done:
            try:
                idx = rep.begin(stop=stop.flag)
                rep.zero_grad()
                loss = self.forward_backward(idx) if idx else None
                res = rep.commit()
            except Stopped:
                break
            except JobError as exc:
                log.error("replica %s: %s", p.replica_id, exc)
                code = exc.exit_code
                break
            now = time.monotonic()
            gap, last = (now - last, now) if res.committed else (now - last, last)
            if res.committed:
                self.step = self.start.step + res.step   # torchtitan's step (its checkpoints' and metrics')
                self.gc_handler.run(self.step)
            avg = self.replica_loss(loss) if loss is not None and res.committed else None
            self.log_step(res, avg, gap)
            digests = rep.digests() if res.committed and p.digest_every and res.step % p.digest_every == 0 else None
            ostep = rep.kernel.optimizer_step   # the committed step's norm (before clipping) and lr
            out.write(step=res.step, c=int(res.committed), n=res.contributors, r=res.retries, role=res.role,
                      ff=res.fast_forwarded,
                      **({"loss": avg, "norm": ostep.last_norm, "lr": ostep.last_lrs[0] if ostep.last_lrs else None}
                         if avg is not None else {}),
                      **({"digest": ",".join(digests)} if digests else {}))
            for ev in list(rep.events):
                out.write(**{**ev, "kind": "event", "event": ev["kind"]})
            rep.events.clear()
        if not code and rep.done and not stop.flag:
            try:
                out.write(kind="event", event="finished", step=rep.finish())   # the end barrier
            except JobError as exc:
                code = exc.exit_code
        if rep.synced:
            out.write(kind="exit", step=rep.step, digest=",".join(rep.digests()), full=rep.full_digest(), code=code,
                      **self.titan_digests())
        else:
            out.write(kind="exit", step=rep.step, code=code)
        out.close()
        return code

    def titan_digests(self) -> dict[str, str]:
        """With ``--p2pft.digest_every``: the state's digests in torchtitan's names (model; optimizer
        tensors), as ``checkpoint_digests`` computes them from a checkpoint. Collective."""
        if not self.config.p2pft.digest_every:
            return {}
        d = live_digests(self.model_parts[0], self.optimizers.optimizers[0])
        return {"tt_model": d.model, "tt_optim": d.optim}

    def close(self) -> None:
        if self.replica_ready:
            self.replica.close()
        super().close()


class PlainTrainer(Trainer):
    """torchtitan's own ``Trainer`` and ``train()`` loop on ``TokenData`` (``--config plain_NAME``):
    the baseline a 1-replica p2pft run is compared with step by step (the oracle,
    tests/integration/test_torchtitan_oracle.py). It adds only what ``P2PFTTrainer`` adds around
    torchtitan's step on a CPU (``sdpa_attention``, ``sum_reduction``) and ``--losses FILE``:
    rank 0 appends one JSON line per logged step with what ``train_step`` hands its metrics
    logger (step, loss, the gradient norm before clipping, lr); the step itself is torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        losses: str = ""
        """rank 0 appends one JSON line per logged step here (step, loss, grad_norm, lr)"""

    def __init__(self, config: Config) -> None:
        if on_cpu():
            assert config.model_spec is not None
            sdpa_attention(config.model_spec.model)
        super().__init__(config)
        if on_cpu():
            sum_reduction(self.model_parts)
        if config.losses and dist.get_rank() == 0:
            out, log_metrics = Stats(config.losses), self.metrics_processor.log

            def record(step: int, loss: float, max_loss: float, grad_norm: float,
                       extra_metrics: dict[str, Any] | None = None) -> None:
                lrs = [v for k, v in (extra_metrics or {}).items() if k.startswith("lr/")]
                out.write(step=step, loss=loss, grad_norm=grad_norm, lr=lrs[0] if lrs else None)
                log_metrics(step, loss, max_loss, grad_norm, extra_metrics=extra_metrics)

            self.metrics_processor.log = record


class Stats:
    """Rank 0's JSON lines (``--p2pft.stats``): what the docs' figures and the test read."""

    def __init__(self, path: str) -> None:
        self.fh: TextIO | None = open(path, "a", buffering=1) if path else None

    def write(self, **rec: Any) -> None:
        if self.fh is not None:
            self.fh.write(json.dumps({"t": time.time(), **rec}, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


# ---------------------------------------------------------------------- configs (--config NAME)
def p2pft_config(base: Trainer.Config) -> P2PFTTrainer.Config:
    """A torchtitan config as a p2pft one: the same fields, the ``p2pft`` section, and a
    ``TokenData`` dataloader (the file from ``--dataloader.dataset_path``)."""
    if type(base) is not Trainer.Config:
        raise ValueError(f"p2pft wraps torchtitan's base Trainer configs; {type(base).__qualname__} builds "
                         "a trainer of its own")
    kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    if not isinstance(kw["dataloader"], TokenData.Config):
        kw["dataloader"] = TokenData.Config()
    return P2PFTTrainer.Config(**kw)


def plain_config(base: Trainer.Config) -> PlainTrainer.Config:
    """A torchtitan config for torchtitan's own loop (``PlainTrainer``) on a ``TokenData``
    dataloader: the plain baseline of the oracle (``--config plain_NAME``)."""
    if type(base) is not Trainer.Config:
        raise ValueError(f"plain_config wraps torchtitan's base Trainer configs, not {type(base).__qualname__}")
    kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    if not isinstance(kw["dataloader"], TokenData.Config):
        kw["dataloader"] = TokenData.Config()
    return PlainTrainer.Config(**kw)


def registered(name: str) -> Callable[[], Trainer.Config] | None:
    """torchtitan's config function `name` from any model's registry (the model whose name
    prefixes `name` first)."""
    import importlib
    from torchtitan.models import _supported_models
    for model in sorted(_supported_models, key=lambda m: (not name.startswith(m), m)):
        try:
            mod = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn
    return None


def __getattr__(name: str) -> Callable[[], Trainer.Config]:
    """``--config NAME`` with ``--module p2pft.trainer.integrations.torchtitan``: torchtitan's
    registered config NAME, as a p2pft config; ``plain_NAME``: as a ``PlainTrainer`` config."""
    plain = name.startswith("plain_")
    fn = None if name.startswith("_") else registered(name.removeprefix("plain_"))
    if fn is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (and torchtitan registers no such config)")
    base = fn
    return (lambda: plain_config(base())) if plain else (lambda: p2pft_config(base()))


# ---------------------------------------------------------------------- a token file
def documents(dataset: str | None, dataset_path: str | None, n_bytes: int) -> list[str]:
    """About `n_bytes` of text documents: from torchtitan's dataset registry (its loader and
    text processor; `dataset_path` overrides the path), or p2pft's generated prose (no download)."""
    if dataset is None:
        from p2pft.trainer.data.text import generate_corpus
        return [d for d in generate_corpus(n_bytes).decode("ascii").split("\n") if d]
    from torchtitan.hf_datasets.text_datasets import DATASETS
    cfg = DATASETS[dataset]
    docs: list[str] = []
    size = 0
    for sample in cfg.loader(dataset_path or cfg.path):
        docs.append(cfg.sample_processor(sample))
        size += len(docs[-1])
        if size >= n_bytes:
            break
    return docs


def train_tokenizer(docs: list[str], out: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of `vocab_size` (BOS/EOS included) trained on `docs`, written
    as a Hugging Face tokenizer directory (what torchtitan's ``--hf_assets_path`` reads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[bos, eos],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos,
                                                           "add_bos_token": False, "add_eos_token": False}))


def prepare(out: str | os.PathLike[str], *, tokenizer: str | None = None, dataset: str | None = None,
            dataset_path: str | None = None, n_bytes: int = 2 << 20, vocab_size: int = 2048) -> tuple[Path, str]:
    """Write ``out/tokens.bin``: documents encoded by torchtitan's tokenizer with BOS and EOS
    (as its HF text dataset does), concatenated. `tokenizer`: a HF tokenizer directory; None:
    one trained here into `out` (then ``--hf_assets_path out``). Returns the file and its dtype."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    root = Path(out)
    docs = documents(dataset, dataset_path, n_bytes)
    if tokenizer is None:
        train_tokenizer(docs, root, vocab_size)
    tok = HuggingFaceTokenizer.Config().build(tokenizer_path=str(tokenizer or root))
    ids = [i for d in docs for i in tok.encode(d, add_bos=True, add_eos=True)]
    dtype = "uint16" if tok.get_vocab_size() <= 1 << 16 else "uint32"
    root.mkdir(parents=True, exist_ok=True)
    return write_tokens(root / "tokens.bin", ids, dtype), dtype


def prepare_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m p2pft.trainer.integrations.torchtitan prepare",
                                 description="write a token file (and a tokenizer) for TokenData")
    ap.add_argument("--out", required=True, help="directory: tokens.bin (+ tokenizer.json without --tokenizer)")
    ap.add_argument("--tokenizer", help="an existing HF tokenizer directory (torchtitan's --hf_assets_path)")
    ap.add_argument("--dataset", help="a dataset of torchtitan's registry (default: p2pft's generated prose)")
    ap.add_argument("--dataset-path", help="that dataset's path (overrides the registry's)")
    ap.add_argument("--bytes", type=int, default=2 << 20, help="text to encode (default 2 MiB)")
    ap.add_argument("--vocab-size", type=int, default=2048, help="of a trained tokenizer (llama3_debugmodel: 2048)")
    a = ap.parse_args(list(argv))
    path, dtype = prepare(a.out, tokenizer=a.tokenizer, dataset=a.dataset, dataset_path=a.dataset_path,
                          n_bytes=a.bytes, vocab_size=a.vocab_size)
    print(f"{path}: {len(TokenFile(path, 1, dtype).tokens)} tokens; train with --hf_assets_path "
          f"{a.tokenizer or a.out} --dataloader.dataset_path {path} --dataloader.token_dtype {dtype}")
    return 0


# ---------------------------------------------------------------------- the launcher
def main(argv: Sequence[str] | None = None) -> int:
    """One rank (under torchrun): torchtitan's ``train.py`` with the CPU shims applied first,
    ``--module`` defaulting to this one, and the job's exit code. ``prepare ...``: a token file;
    ``convert --to torchtitan|p2pft SRC DST``: a checkpoint in the other layout (torchtitan_checkpoint.py)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["prepare"]:
        return prepare_main(args[1:])
    if args[:1] == ["convert"]:
        from p2pft.trainer.integrations.torchtitan_checkpoint import main as convert_main
        return convert_main(args[1:])
    from torchtitan.config import ConfigManager
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger
    init_logger()
    if not any(a == "--module" or a.startswith("--module=") for a in args):
        args = ["--module", __name__, *args]
    config: Any = ConfigManager().parse_args(args)
    sl.init_structured_logger(source="training", output_dir=config.dump_folder,
                              enable=config.debug.enable_structured_logging)
    trainer: Trainer | None = None
    code = 0
    try:
        trainer = config.build()
        if isinstance(trainer, P2PFTTrainer):
            code = trainer.train()
        else:
            trainer.train()   # plain torchtitan, on CPU through the shims
    except JobError as exc:
        log.error("%s", exc)
        code = exc.exit_code
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return code


__all__ = ["P2PFT", "P2PFTTrainer", "PlainTrainer", "TokenData", "cpu_shims", "main", "p2pft_config",
           "plain_config", "prepare", "registered", "sdpa_attention", "sum_reduction"]
