"""torchtitan through a SIGKILL: p2pft's integration against torchtitan's own torchft path.

One command runs the same kill shape on both paths, one after the other, on loopback, and
reports a row per path (docs/results.md, "torchtitan: p2pft vs torchtitan's torchft path"):

* **p2pft**: 2 witnesses + 2 replicas, each one torchrun of ``--ranks`` FSDP ranks of
  ``llama3_debugmodel`` through ``p2pft.trainer.integrations.torchtitan`` (the commands of
  docs/torchtitan.md, smaller: ``--seq-len`` 64, ``--steps`` 60, as its test);
* **torchft**: torchtitan's own fault-tolerance path (``torchtitan.experiments.torchft``: its
  ``FaultTolerantTrainer``, ``TorchFTOptimizersContainer``, ``TorchFTCheckpointManager``;
  ``--fault_tolerance.enable`` and ``--checkpoint.enable``) under one torchft lighthouse, 2
  replica groups of the same model, data file and batch shape, run by ``--python-torchft``
  (an interpreter with torchft 0.2.0, so the bench's own environment stays without it).

In both, replica B's torchrun is SIGKILLed once both replicas have committed ``--kill-at``
steps (its ranks die with it) and is restarted under the same id at once (``--restart-delay``).
Per path: the steps the survivor A committed (and how many of them alone), A's longest gap
between commits after the kill, the restarted B's time from its restart to its first step as a
contributor, the final loss, whether both replicas ended with equal weights, and the wall time;
or, where the path fails, the exception line from the failing process's log and the phase.

**What torchft's path needs on CPU** (all applied by ``torchft-rank`` below, in the rank
processes, without touching torchtitan's or torchft's source):

1. p2pft's ``cpu_shims()`` before torchtitan is imported, and its two CPU settings (plain SDPA
   attention, FSDP2 sum reduction) as for p2pft;
2. ``set_pg_timeouts`` without ``device_ids`` (torchtitan's barrier passes ``['cpu']``, which
   gloo's ``BarrierOptions`` refuses);
3. torchft's config pieces in place of the base ones, and the loss without
   ``ChunkedLossWrapper`` (``FaultTolerantTrainer`` never sets its ``lm_head``; torchtitan's own
   torchft llama3 config uses plain ``CrossEntropyLoss`` too); ``--checkpoint.enable``, since only
   the checkpointer registers the state-dict functions torchft heals from;
4. QKV projections unfused: ``FusedQKVLinear``'s state-dict hook all-gathers ``wqkv``, and
   torchft calls the state dict from its quorum thread, so at the first heal (step 0) the ranks
   of one replica, one serving and one healing, issue different collectives and gloo aborts
   (``op.preamble.length <= op.nbytes``). The unfused layout computes the same function from
   bit-identical initial weights (``_fused_qkv_param_init`` draws the fused ones as the separate
   ones); the p2pft path keeps torchtitan's fused layout (docs/torchtitan.md's command as it is);
5. the quorum waited for before the forward (``--torchft-overlap-quorum`` leaves it as torchtitan
   runs it): a replica serving a heal calls the state dict from the quorum thread, and FSDP2's
   state-dict pre-hook reshards the parameters under the running forward (a gloo abort or a
   segfault, intermittently);
6. ``socket.gethostname`` answering 127.0.0.1 (torchft advertises the hostname to its peers).

Items 4 and 5 are not specific to CPU. The lighthouse runs with ``--min_replicas 2`` by default
(``--torchft-min-replicas``): a majority of the two replicas, as ``p2pft chaos`` runs torchft; with
1 the survivor trains alone, and a restarted replica may form a quorum of its own.
``--torchft-heal-lr`` corrects what a heal sends (the optimizer's ``lr`` as cached at build time),
which otherwise leaves the replicas with different weights; it is off by default, so the row is
torchtitan's path as it is.

Usage::

    python bench/torchtitan_ft.py --python-torchft PATH --json out.json
        [--paths p2pft,torchft] [--steps 60] [--kill-at 10] [--ranks 2] [--keep DIR]
        [--torchft-min-replicas 2] [--torchft-overlap-quorum] [--torchft-heal-lr]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from p2pft.chaos.records import read_stats

MODULE = "p2pft.trainer.integrations.torchtitan"
RANK_CMD = "torchft-rank"
TORCHFT_CONFIG = "llama3_debugmodel_torchft"
HOST = "127.0.0.1"


# ============================================================================ rank side
def unfused_qkv(model_config: Any) -> int:
    """Every ``FusedQKVLinear`` of a torchtitan model config as separate ``wq``/``wk``/``wv``
    (``QKVLinear``): the same function and, by ``_fused_qkv_param_init``'s construction, the same
    initial weights, without the fused module's collective in ``state_dict``. Returns the count."""
    from torchtitan.models.common.attention import FusedQKVLinear, QKVLinear
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.llama3 import _LINEAR_INIT
    n = 0
    for layer in model_config.layers:
        att = layer.attention
        q = att.qkv_linear
        if isinstance(q, FusedQKVLinear.Config):
            dim = q.wqkv.in_features
            att.qkv_linear = QKVLinear.Config(
                head_dim=q.head_dim,
                wq=Linear.Config(in_features=dim, out_features=q.n_heads * q.head_dim, param_init=_LINEAR_INIT),
                wkv=Linear.Config(in_features=dim, out_features=q.n_kv_heads * q.head_dim, param_init=_LINEAR_INIT))
            n += 1
    return n


def llama3_debugmodel_torchft() -> Any:
    """``--config`` of the torchft path: torchtitan's ``llama3_debugmodel`` (model, optimizer,
    scheduler, training fields) as a ``FaultTolerantTrainer`` config with torchft's optimizer
    container and checkpointer, p2pft's ``TokenData`` file (iterated: global batch k is samples
    ``[k*B*W, (k+1)*B*W)``, split over the groups by torchtitan's ``get_dp_info``), the plain
    cross-entropy of the ``ChunkedLossWrapper``, and QKV unfused."""
    import dataclasses

    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager
    from torchtitan.experiments.torchft.config.job_config import FaultTolerance
    from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
    from torchtitan.trainer import Trainer

    import p2pft.trainer.integrations.torchtitan as tt

    def fields_of(obj: Any) -> dict[str, Any]:
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}

    fn = tt.registered("llama3_debugmodel")
    assert fn is not None
    base = fn()
    assert base.model_spec is not None
    unfused_qkv(base.model_spec.model)
    kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    kw["dataloader"] = tt.TokenData.Config()
    if isinstance(base.loss, ChunkedLossWrapper.Config):   # FaultTolerantTrainer never sets its lm_head
        kw["loss"] = base.loss.loss_fn
    kw["optimizer"] = TorchFTOptimizersContainer.Config(**fields_of(base.optimizer))
    kw["checkpoint"] = TorchFTCheckpointManager.Config(**fields_of(base.checkpoint))
    return FaultTolerantTrainer.Config(**kw, fault_tolerance=FaultTolerance(process_group="gloo"))


def shard_digest(model_parts: Sequence[Any]) -> str:
    """sha256 of this rank's parameter shards (names and bytes, in module order)."""
    import torch
    from torch.distributed.tensor import DTensor
    h = hashlib.sha256()
    for part in model_parts:
        for name, p in part.named_parameters():
            t = p.to_local() if isinstance(p, DTensor) else p
            h.update(name.encode())
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class JsonLines:
    """Rank 0's JSON lines for the driver (one record a line, flushed at once)."""

    def __init__(self, path: str) -> None:
        self.fh = open(path, "a", buffering=1) if path else None

    def write(self, **rec: Any) -> None:
        if self.fh is not None:
            self.fh.write(json.dumps({"t": time.time(), **rec}, separators=(",", ":")) + "\n")


def torchft_rank(argv: list[str]) -> int:
    """One rank of torchtitan's torchft path on CPU (run under ``torch.distributed.run``):
    ``--stats FILE`` (rank 0's records) then torchtitan's CLI."""
    from p2pft.deploy.procs import die_with_parent
    die_with_parent(os.getppid())   # torchrun starts ranks in sessions of their own
    stats_path, digest_every, overlap, heal_lr = "", 0, False, False
    while argv[:1] in (["--stats"], ["--digest-every"], ["--overlap-quorum"], ["--heal-lr"]):
        if argv[0] in ("--overlap-quorum", "--heal-lr"):
            overlap, heal_lr = overlap or argv[0] == "--overlap-quorum", heal_lr or argv[0] == "--heal-lr"
            argv = argv[1:]
            continue
        if argv[0] == "--stats":
            stats_path = argv[1]
        else:
            digest_every = int(argv[1])
        argv = argv[2:]
    # torchft advertises socket.gethostname() (manager and checkpoint server) to its peers; the
    # Manager binds it as a default argument when torchft is imported, so this comes first.
    socket.gethostname = lambda: HOST
    import p2pft.trainer.integrations.torchtitan as tt   # cpu_shims() before torchtitan
    import torch.distributed as dist
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    if tt.on_cpu():
        from datetime import timedelta

        def set_pg_timeouts(timeout: timedelta, parallel_dims: Any) -> None:
            """torchtitan's, with a plain barrier (its ``device_ids=['cpu']`` fails on gloo)."""
            dist.barrier()
            groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
            for g in groups:
                dist.distributed_c10d._set_pg_timeout(timeout, g)

        dist_utils.set_pg_timeouts = set_pg_timeouts
    init_logger()
    config: Any = ConfigManager().parse_args(["--module", "__main__", "--config", TORCHFT_CONFIG, *argv])
    if tt.on_cpu():
        tt.sdpa_attention(config.model_spec.model)
    rank0 = os.environ.get("RANK", "0") == "0"
    out = JsonLines(stats_path if rank0 else "")
    trainer: Any = None
    try:
        trainer = config.build()
        if tt.on_cpu():
            tt.sum_reduction(trainer.model_parts)
        pids: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
        out.write(kind="start", pids=pids)
        mgr = trainer.ft_manager.manager
        if not overlap:
            start_quorum = mgr.start_quorum

            def blocking_quorum(*a: Any, **kw: Any) -> None:
                """torchft's quorum, waited for before the forward: a replica that serves a heal
                calls the state dict from the quorum thread, and FSDP2's state-dict pre-hook
                reshards the parameters under a running forward (one rank then all-gathers a
                group again, the other does not, and gloo aborts)."""
                start_quorum(*a, **kw)
                mgr.wait_quorum()

            mgr.start_quorum = blocking_quorum
        if heal_lr:
            apply_heal = mgr._apply_pending_state_dict

            def heal_with_lr(*a: Any, **kw: Any) -> Any:
                """torchft's heal, then the learning rate the loaded scheduler gives: the optimizer
                state torchft sends is ``TorchFTOptimizersContainer``'s cache, taken at build
                time, so its ``lr`` is the first step's and the healed replica would step with it."""
                out_ = apply_heal(*a, **kw)
                for sched in trainer.lr_schedulers.schedulers:
                    for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
                        group["lr"] = lr
                return out_

            mgr._apply_pending_state_dict = heal_with_lr
        commit = mgr.should_commit

        def should_commit(timeout: Any = None) -> bool:
            """torchft's, recording the step (a heal is applied inside it, before the optimizer
            step; ``p``: this replica's gradients were part of the step)."""
            participating = mgr.is_participating()
            ok = bool(commit(timeout))
            rec: dict[str, Any] = dict(step=trainer.step, c=int(ok), n=mgr.num_participants(), p=int(participating),
                                       commits=mgr.current_step(),
                                       lr=trainer.optimizers.optimizers[0].param_groups[0]["lr"])
            if digest_every and trainer.step % digest_every == 0:   # the weights this step updates
                digests: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(digests, shard_digest(trainer.model_parts))
                rec["digest"] = ",".join(digests)
            out.write(**rec)
            return ok

        mgr.should_commit = should_commit
        log = trainer.metrics_processor.log

        def log_loss(step: int, loss: float, *a: Any, **kw: Any) -> Any:
            # torchtitan sums the replicas' losses over the torchft group: the mean is / n
            out.write(kind="loss", step=step, loss_sum=float(loss), n=mgr.num_participants())
            return log(step, loss, *a, **kw)

        trainer.metrics_processor.log = log_loss
        trainer.train()
        digests: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(digests, shard_digest(trainer.model_parts))
        out.write(kind="exit", step=trainer.step, commits=mgr.current_step(), digest=",".join(digests), code=0)
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ============================================================================ driver side
@dataclass
class PathResult:
    """One path's row (``error`` / ``phase`` set where it failed)."""

    path: str
    ok: bool = False
    steps: int = 0
    survivor_commits: int | None = None
    survivor_alone: int | None = None
    first_commit_after_kill_s: float | None = None
    longest_gap_after_kill_s: float | None = None
    normal_step_s: float | None = None
    restart_to_contribute_s: float | None = None
    final_loss: float | None = None
    equal_weights: bool | None = None
    wall_s: float | None = None
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    error: str | None = None
    phase: str | None = None
    error_log: str | None = None
    digests: str | None = None
    t_kill: float | None = None
    t_restart: float | None = None
    notes: list[str] = field(default_factory=list)


class Failed(Exception):
    def __init__(self, phase: str, name: str, line: str) -> None:
        super().__init__(f"{phase}: {name}: {line}")
        self.phase, self.name, self.line = phase, name, line


_EXC = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s*)?((?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|"
                  r"Interrupt|NotMet|Failure))(?::\s.*|$)")


def error_line(log: Path) -> str:
    """The error a process's log ends with: a C++ exception's ``what():`` line first, then a
    ``Fatal Python error:`` (an abort or a segfault; the ``Connection reset`` errors of the
    other ranks follow from it), then the first ``XxxError: ...`` line of a traceback
    (torchrun's own ``ChildFailedError`` skipped), else the log's last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()]
    except OSError:
        return f"(no log {log.name})"
    for pick in ([ln for ln in lines if "what():" in ln],
                 [ln for ln in lines if ln.startswith("Fatal Python error:")],
                 [ln for ln in lines if _EXC.match(ln) and "ChildFailedError" not in ln],
                 [ln for ln in reversed(lines) if ln]):
        if pick:
            return pick[0][:400]
    return "(empty log)"


def alive(pid: int) -> bool:
    """Running (a zombie is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class Cluster:
    """The processes of one path: one process group (witnesses, lighthouse, torchruns), each with
    a log ``<name>.log``; ranks, which torchrun puts in sessions of their own, are tracked by pid
    from their start records. ``stop()`` ends everything, on every exit path."""

    def __init__(self, work: Path, env: dict[str, str]) -> None:
        from p2pft.deploy.procs import ProcGroup
        self.work, self.env = work, env
        self.group = ProcGroup()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.rank_pids: set[int] = set()
        self.killed: set[str] = set()

    def spawn(self, name: str, cmd: list[str]) -> None:
        with open(self.work / f"{name}.log", "wb") as log:
            self.procs[name] = self.group.spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                cwd=self.work)

    def check(self, phase: str, done: Callable[[], bool], timeout: float, what: str,
              may_exit: Sequence[str] = ()) -> None:
        """Wait for ``done()``; raise ``Failed`` when a process not in ``may_exit`` exits (any
        status: a replica that ends early is a failure too) or ``timeout`` passes."""
        end = time.monotonic() + timeout
        while True:
            if done():
                return
            for name, p in self.procs.items():
                rc = p.poll()
                if rc is not None and name not in self.killed and (name not in may_exit or rc != 0):
                    why = f": {error_line(self.work / f'{name}.log')}" if rc else " (a clean exit, too early)"
                    raise Failed(phase, name, f"exit {rc} before {what}{why}")
            if time.monotonic() > end:
                raise Failed(phase, "-", f"timeout after {timeout:.0f} s waiting for {what}")
            time.sleep(0.2)

    def sigkill(self, name: str) -> None:
        self.killed.add(name)
        os.kill(self.procs[name].pid, signal.SIGKILL)

    def stop(self, grace: float = 10.0) -> dict[str, int | None]:
        """SIGTERM to whatever runs, SIGKILL after ``grace`` s (the group and every rank pid)."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace
        while time.monotonic() < end and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.2)
        self.group.kill()
        for pid in self.rank_pids:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        codes: dict[str, int | None] = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes


@dataclass
class Shape:
    """What both paths run."""

    steps: int
    kill_at: int
    ranks: int
    seq_len: int
    batch: int
    restart_delay: float
    timeout: float
    data: Path
    digest_every: int = 10
    torchft_min_replicas: int = 2
    overlap_quorum: bool = False
    heal_lr: bool = False


def titan_args(shape: Shape, dump: Path) -> list[str]:
    """torchtitan's CLI common to both paths (docs/torchtitan.md's, smaller)."""
    return ["--hf_assets_path", str(shape.data), "--dataloader.dataset_path", str(shape.data / "tokens.bin"),
            "--parallelism.spmd_backend", "partial_dtensor", "--training.mixed_precision_param", "float32",
            "--training.steps", str(shape.steps), "--training.seq_len", str(shape.seq_len),
            "--training.local_batch_size", str(shape.batch), "--dump_folder", str(dump)]


def committed(path: Path) -> list[dict[str, Any]]:
    return [r for r in read_stats(path) if r.get("kind") is None and r.get("c")]


def gaps_after(commits: list[dict[str, Any]], t_kill: float) -> tuple[float | None, float | None, float | None]:
    """(first commit after the kill - kill, longest gap between commits from the last commit
    before the kill to the end, median gap before the kill)."""
    before = [r["t"] for r in commits if r["t"] <= t_kill]
    after = [r["t"] for r in commits if r["t"] > t_kill]
    if not before or not after:
        return None, None, None
    ts = [before[-1], *after]
    longest = max(b - a for a, b in zip(ts, ts[1:]))
    pre = sorted(b - a for a, b in zip(before, before[1:]))
    return after[0] - t_kill, longest, (pre[len(pre) // 2] if pre else None)


def run_kill(cluster: Cluster, shape: Shape, spawn: Callable[[str, str], None], stats: Callable[[str], Path],
             contributes: Callable[[dict[str, Any]], bool], res: PathResult) -> None:
    """The kill shape: A and B up; both at ``kill_at`` committed steps with both contributing;
    SIGKILL B's torchrun; its ranks gone; B restarted as ``b1``; wait until both exit (fills
    ``res`` and raises ``Failed`` on the way)."""
    t_end = time.monotonic() + shape.timeout
    left = lambda: max(1.0, t_end - time.monotonic())   # noqa: E731
    spawn("a", "a")
    spawn("b", "b")

    def both_at_kill() -> bool:
        return all(sum(1 for r in committed(stats(n)) if contributes(r)) >= shape.kill_at for n in ("a", "b"))

    cluster.check("start (both replicas to commit --kill-at steps together)", both_at_kill, left(),
                  f"{shape.kill_at} steps on both replicas")
    starts = [r for r in read_stats(stats("b")) if r.get("kind") == "start"]
    b_pids = [int(p) for p in starts[-1]["pids"]] if starts else []
    for n in ("a", "b"):
        for r in read_stats(stats(n)):
            if r.get("kind") == "start":
                cluster.rank_pids.update(int(p) for p in r["pids"])
    cluster.sigkill("b")
    res.t_kill = time.time()
    cluster.check("kill (B's ranks to die with their torchrun)", lambda: not any(alive(p) for p in b_pids),
                  min(15.0, left()), "B's ranks to die")
    time.sleep(shape.restart_delay)
    t_restart = res.t_restart = time.time()
    spawn("b", "b1")

    def b1_contributes() -> bool:
        return any(contributes(r) and r["t"] > t_restart for r in committed(stats("b1")))

    cluster.check("rejoin (the restarted B to contribute)", b1_contributes, left(), "B to contribute again",
                  may_exit=("a",))
    for r in read_stats(stats("b1")):
        if r.get("kind") == "start":
            cluster.rank_pids.update(int(p) for p in r["pids"])
    back = [r for r in committed(stats("b1")) if contributes(r)]
    res.restart_to_contribute_s = back[0]["t"] - t_restart
    cluster.check("finish (both replicas to exit)",
                  lambda: all(cluster.procs[n].poll() is not None for n in ("a", "b1")), left(),
                  "both replicas to finish", may_exit=("a", "b1"))


def fill_common(res: PathResult, stats: Callable[[str], Path]) -> None:
    """The survivor's commits and gaps, and the shard digests A and the restarted B recorded at
    the same steps."""
    recs = {n: [r for r in read_stats(stats(n)) if r.get("kind") is None and "step" in r] for n in ("a", "b1")}
    a_commits = [r for r in recs["a"] if r.get("c")]
    res.survivor_commits = len(a_commits)
    res.survivor_alone = sum(1 for r in a_commits if r.get("n") == 1)
    if res.t_kill is not None:
        res.first_commit_after_kill_s, res.longest_gap_after_kill_s, res.normal_step_s = gaps_after(
            a_commits, res.t_kill)
    da, db = ({r["step"]: r["digest"] for r in recs[n] if r.get("digest")} for n in ("a", "b1"))
    common = sorted(set(da) & set(db))
    if common:
        diff = [s for s in common if da[s] != db[s]]
        res.digests = (f"equal at all {len(common)} ({common[0]}-{common[-1]})" if not diff else
                       f"differ from step {diff[0]} ({len(diff)} of {len(common)}; "
                       f"last equal: {max((s for s in common if s < diff[0]), default='none')})")


def run_p2pft(shape: Shape, work: Path, python: str, env: dict[str, str]) -> PathResult:
    """2 witnesses + 2 replicas of ``--ranks`` FSDP ranks (docs/torchtitan.md's commands)."""
    from p2pft.deploy.ports import free_ports
    res = PathResult("p2pft", steps=shape.steps)
    work.mkdir(parents=True, exist_ok=True)
    w0, w1, a, b = (f"{HOST}:{p}" for p in free_ports(4))
    addr = {"a": a, "b": b}
    cluster = Cluster(work, env)
    t0 = time.time()

    def stats(name: str) -> Path:
        return work / f"{name}.jsonl"

    def spawn(rid: str, name: str) -> None:
        seeds = [w0, w1] + [x for r, x in addr.items() if r != rid]
        cluster.spawn(name, [
            python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(shape.ranks),
            "-m", MODULE, "--config", "llama3_debugmodel",
            *titan_args(shape, work / f"out-{name}"), "--metrics.log_freq", "10",
            "--p2pft.replica_id", rid, "--p2pft.listen", addr[rid], "--p2pft.seeds", ",".join(seeds),
            "--p2pft.min_replicas", "2", "--p2pft.digest_every", str(shape.digest_every),
            "--p2pft.stats", str(stats(name))])

    try:
        everyone = [w0, w1, a, b]
        for k, w in enumerate((w0, w1)):
            cluster.spawn(f"w{k}", [python, "-m", "p2pft", "peer", "--listen", w, "--replica-id", f"w{k}",
                                    "--seeds", ",".join(x for x in everyone if x != w)])
        run_kill(cluster, shape, spawn, stats, lambda r: r.get("n", 0) >= 2 and r.get("role") == "participant", res)
        res.wall_s = time.time() - t0
    except Failed as exc:
        res.error, res.phase, res.error_log = exc.line, exc.phase, exc.name
        res.wall_s = time.time() - t0
    finally:
        res.exit_codes = cluster.stop()
    fill_common(res, stats)
    a_steps = [r for r in read_stats(stats("a")) if r.get("kind") is None and "step" in r]
    losses = [r["loss"] for r in a_steps if r.get("c") and "loss" in r]
    res.final_loss = losses[-1] if losses else None
    ends = {n: [r for r in read_stats(stats(n)) if r.get("kind") == "exit"] for n in ("a", "b1")}
    if ends["a"] and ends["b1"]:
        ea, eb = ends["a"][-1], ends["b1"][-1]
        res.equal_weights = bool(ea.get("full")) and ea.get("full") == eb.get("full") and ea["step"] == eb["step"]
    res.ok = res.error is None and res.exit_codes.get("a") == 0 and res.exit_codes.get("b1") == 0
    if res.error is None and not res.ok:
        res.error, res.phase = f"exit codes {res.exit_codes}", "finish"
    return res


def lighthouse_cmd(python: str, bind: str, min_replicas: int) -> list[str]:
    """torchft's lighthouse next to ``python`` (a venv's bin), else its entry point through it,
    with the timeouts ``p2pft chaos`` gives it (its best failover on one machine)."""
    flags = ["--bind", bind, "--min_replicas", str(min_replicas), "--join_timeout_ms", "1000",
             "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", "1000"]
    exe = Path(python).parent / "torchft_lighthouse"
    if exe.exists():
        return [str(exe), *flags]
    return [python, "-c", "import sys; from torchft._torchft import lighthouse_main; "
            "sys.argv[0] = 'torchft_lighthouse'; lighthouse_main()", *flags]


def run_torchft(shape: Shape, work: Path, python: str, env: dict[str, str]) -> PathResult:
    """A torchft lighthouse + 2 replica groups of ``--ranks`` FSDP ranks, torchtitan's own
    ``FaultTolerantTrainer`` (``torchft-rank``: the CPU shims, then torchtitan's train)."""
    from p2pft.deploy.ports import free_ports
    res = PathResult("torchft", steps=shape.steps)
    work.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run([python, "-c", "import torchft, torch; print(torch.__version__)"], capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        res.error, res.phase = (probe.stderr.strip().splitlines() or ["import torchft failed"])[-1], "import"
        return res
    lh = f"{HOST}:{free_ports(1)[0]}"
    cluster = Cluster(work, {**env, "TORCHFT_LIGHTHOUSE": f"http://{lh}"})
    t0 = time.time()
    replica_id = {"a": 0, "b": 1}

    def stats(name: str) -> Path:
        return work / f"{name}.jsonl"

    def spawn(rid: str, name: str) -> None:
        cluster.spawn(name, [
            python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(shape.ranks),
            str(Path(__file__).resolve()), RANK_CMD, "--stats", str(stats(name)),
            "--digest-every", str(shape.digest_every),
            *(["--overlap-quorum"] if shape.overlap_quorum else []), *(["--heal-lr"] if shape.heal_lr else []),
            *titan_args(shape, work / f"out-{rid}"), "--metrics.log_freq", "1",
            "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(replica_id[rid]),
            "--fault_tolerance.group_size", "2", "--fault_tolerance.process_group", "gloo",
            # the state-dict functions torchft heals from exist only with the checkpointer; a full
            # checkpoint only at the last step (the per-step dataloader one is torchft's own)
            "--checkpoint.enable", "--checkpoint.interval", str(shape.steps + 1)])

    try:
        cluster.spawn("lighthouse", lighthouse_cmd(python, lh, shape.torchft_min_replicas))
        run_kill(cluster, shape, spawn, stats, lambda r: r.get("n", 0) >= 2 and bool(r.get("p")), res)
        res.wall_s = time.time() - t0
    except Failed as exc:
        res.error, res.phase, res.error_log = exc.line, exc.phase, exc.name
        res.wall_s = time.time() - t0
    finally:
        res.exit_codes = cluster.stop()
    res.notes.append(f"lighthouse --min_replicas {shape.torchft_min_replicas}; quorum "
                     f"{'overlapping the forward' if shape.overlap_quorum else 'waited for before the forward'}"
                     f"{'; lr re-applied after a heal' if shape.heal_lr else ''}")
    fill_common(res, stats)
    a_recs = read_stats(stats("a"))
    losses = [r for r in a_recs if r.get("kind") == "loss" and r.get("n")]
    res.final_loss = losses[-1]["loss_sum"] / losses[-1]["n"] if losses else None
    ends = {n: [r for r in read_stats(stats(n)) if r.get("kind") == "exit"] for n in ("a", "b1")}
    if ends["a"] and ends["b1"]:
        ea, eb = ends["a"][-1], ends["b1"][-1]
        res.equal_weights = ea["digest"] == eb["digest"] and ea["step"] == eb["step"]
    res.ok = res.error is None and res.exit_codes.get("a") == 0 and res.exit_codes.get("b1") == 0
    if res.error is None and not res.ok:
        res.error, res.phase = f"exit codes {res.exit_codes}", "finish"
    res.notes.append("final loss: the replicas' sum torchtitan logs over the torchft group / participants")
    return res


# ============================================================================ report
def fmt(x: float | None, unit: str = " s", nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


ROWS: list[tuple[str, Callable[[PathResult], str]]] = [
    ("survivor A: steps committed (alone)",
     lambda r: "-" if r.survivor_commits is None else f"{r.survivor_commits} / {r.steps} ({r.survivor_alone})"),
    ("A's first commit after the SIGKILL", lambda r: fmt(r.first_commit_after_kill_s)),
    ("A's longest commit gap after the kill", lambda r: fmt(r.longest_gap_after_kill_s)),
    ("A's median step before the kill", lambda r: fmt(r.normal_step_s)),
    ("restart -> B contributes again", lambda r: fmt(r.restart_to_contribute_s, nd=1)),
    ("final loss (A)", lambda r: fmt(r.final_loss, "", 4)),
    ("equal weights at the end", lambda r: "-" if r.equal_weights is None else ("yes" if r.equal_weights else "NO")),
    ("A's and B's shard digests at common steps", lambda r: r.digests or "-"),
    ("wall", lambda r: fmt(r.wall_s, nd=1)),
    ("exit codes", lambda r: ", ".join(f"{k} {v}" for k, v in r.exit_codes.items() if k in ("a", "b", "b1"))),
    ("error (phase; process: exception line)",
     lambda r: "-" if r.error is None else f"{r.phase}; {r.error_log}: {r.error}"),
]


def print_table(results: Sequence[PathResult], title: str) -> None:
    """A rich table when rich is installed, plain text otherwise (as bench/fleet.py)."""
    header = ["", *(r.path for r in results)]
    rows = [[name, *(f(r) for r in results)] for name, f in ROWS]
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        print(f"\n{title}")
        for row in [header, *rows]:
            print(" | ".join(row))
        return
    table = Table(title=escape(title))
    for i, h in enumerate(header):
        table.add_column(escape(h), justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        table.add_row(*(escape(c) for c in row))
    Console(width=160).print(table)


def versions(python: str) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; out = {}\n"
            "for p in ('torch', 'torchtitan', 'torchft'):\n"
            "    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: out[p] = 'not installed'\n"
            "print(json.dumps(out))")
    try:
        p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        return dict(json.loads(p.stdout))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [RANK_CMD]:
        return torchft_rank(args[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--python-torchft", default=sys.executable,
                    help="interpreter with torchft 0.2.0 for torchft's processes (default: this one)")
    ap.add_argument("--paths", default="p2pft,torchft", help="which paths to run, in order")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=10, help="SIGKILL B once both committed this many steps")
    ap.add_argument("--ranks", type=int, default=2, help="FSDP ranks per replica")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="training.local_batch_size")
    ap.add_argument("--restart-delay", type=float, default=0.0, help="seconds between the kill and the restart")
    ap.add_argument("--timeout", type=float, default=170.0, help="seconds per path, start to both exits")
    ap.add_argument("--digest-every", type=int, default=10, help="record every rank's shard digest every N steps")
    ap.add_argument("--torchft-min-replicas", type=int, default=2,
                    help="the lighthouse's --min_replicas: 2 (a majority of the two replicas, as p2pft chaos "
                         "runs torchft: the survivor waits for B) or 1 (the survivor trains alone, and a "
                         "restarted replica may form a quorum of its own)")
    ap.add_argument("--torchft-overlap-quorum", action="store_true",
                    help="leave torchft's quorum overlapping the forward, as torchtitan runs it (a heal then "
                         "races FSDP2's state-dict hook; see torchft-rank)")
    ap.add_argument("--torchft-heal-lr", action="store_true",
                    help="after a torchft heal, set the optimizer's lr from the loaded scheduler (torchtitan's "
                         "torchft path sends the lr cached at build time; without this the healed replica's "
                         "heal step uses it and the replicas' weights differ from then on)")
    ap.add_argument("--keep", help="keep the work directory here (logs, stats) instead of a temporary one")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(args)
    paths = [p for p in a.paths.split(",") if p]
    if not set(paths) <= {"p2pft", "torchft"}:
        ap.error("--paths: p2pft, torchft")

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")   # unwinds through every path's finally

    signal.signal(signal.SIGTERM, on_signal)
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="tt_ft_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("P2PFT_", "TORCHFT_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    t0 = time.time()
    results: list[PathResult] = []
    try:
        prep = subprocess.run([sys.executable, "-m", MODULE, "prepare", "--out", str(work / "data"),
                               "--bytes", str(256 << 10)], capture_output=True, text=True, timeout=120, env=env)
        if prep.returncode != 0:
            print(prep.stderr[-3000:], file=sys.stderr)
            return 1
        shape = Shape(a.steps, a.kill_at, a.ranks, a.seq_len, a.batch, a.restart_delay, a.timeout, work / "data",
                      a.digest_every, a.torchft_min_replicas, a.torchft_overlap_quorum,
                      a.torchft_heal_lr)
        for p in paths:
            if p == "p2pft":
                results.append(run_p2pft(shape, work / "p2pft", sys.executable, env))
            else:
                results.append(run_torchft(shape, work / "torchft", a.python_torchft, env))
            print(f"{p}: {'ok' if results[-1].ok else 'FAILED'} in {fmt(results[-1].wall_s, nd=1)}", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    vers = {"p2pft": versions(sys.executable), "torchft": versions(a.python_torchft)}
    title = (f"llama3_debugmodel, 2 replicas x {a.ranks} FSDP ranks (gloo, CPU), {a.steps} steps of "
             f"{a.batch}x{a.seq_len} tokens per rank; B SIGKILLed after {a.kill_at} steps, restarted "
             f"{a.restart_delay:g} s later")
    print_table(results, title)
    print(f"versions: {json.dumps(vers)}; total {time.time() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "shape": {"steps": a.steps, "kill_at": a.kill_at, "ranks": a.ranks, "seq_len": a.seq_len,
                      "local_batch_size": a.batch, "restart_delay_s": a.restart_delay},
            "versions": vers, "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
            "total_s": time.time() - t0, "results": [asdict(r) for r in results]}, indent=2))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
