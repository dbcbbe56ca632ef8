"""A GPT-style byte-level language model on real English text: the reference training recipe.

The recipe is what a real job has: AdamW with weight-decay groups, linear warm-up then cosine
decay (``LambdaLR``), gradient clipping at 1.0, mixed precision (bf16 autocast, or fp16 with a
``GradScaler``), gradient accumulation, a ``DataLoader`` with worker processes. The corpus is
Python's own documentation (``pydoc_data.topics``, ~466 KB of English, no download), byte-level
tokenized once into a token file read through a memory map.

The same script trains with or without p2pft; ``train_plain`` and ``train_ft`` differ only in
the lines that make the loop fault tolerant (docs/recipes.md shows the diff)::

    python -m p2pft.trainer.examples.gpt --no-p2pft --steps 200          # plain PyTorch
    python -m p2pft.trainer.examples.gpt --replica-id r0 --listen 127.0.0.1:7100 &
    python -m p2pft.trainer.examples.gpt --replica-id r1 --listen 127.0.0.1:7101 --seeds 127.0.0.1:7100 &

Each step is appended to ``--stats`` as one JSON line, in the format of ``replica.py`` plus
``lr`` and ``loss``; ``--final-weights`` saves the parameters at exit (for the replay oracle,
``p2pft.chaos.oracle``). ``--sync-every H`` trains the same recipe with DiLoCo instead
(``gpt_diloco.py``: this AdamW inside, an outer Nesterov SGD every H inner steps).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol, cast

from p2pft.deploy.replica_args import add_replica_args, require_replica_id

if TYPE_CHECKING:  # imported where used: the arguments parse before torch loads (seconds)
    from collections import deque

    import torch

    from p2pft.runtime import Runtime
    from p2pft.trainer.kernel.attempt import StepResult
    from p2pft.trainer.model import TinyLM
    from p2pft.trainer.data.tokens import TokenFile

T_START = time.time()
CORPUS_VERSION = 1
SIZES = {"tiny": (64, 2, 4, 64), "small": (192, 4, 6, 128)}   # d_model, layers, heads, seq_len


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights after a step, besides the data order (the cursor).
    Written in the stats' start record, so the replay oracle rebuilds the same job."""

    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 6
    seq_len: int = 128
    batch: int = 8                 # samples per replica per step
    accum: int = 1                 # micro-batches per step (each backward on loss / accum)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    schedule_steps: int = 1000     # cosine length; the lr stays at the floor after it
    weight_decay: float = 0.1
    clip: float = 1.0
    amp: str = "bf16"              # bf16 | fp16 (GradScaler) | off
    seed: int = 0
    replicas: int = 3              # nominal replica count (the lr policy's plan)
    lr_policy: str = "sqrt"
    sync_every: int = 0            # DiLoCo: inner steps per sync (0: FaultTolerant, a step per allreduce)
    outer_lr: float = 0.7          # DiLoCo's outer Nesterov SGD (the paper's values)
    outer_momentum: float = 0.9

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_replica_args(p, replicas=3, digest_every=10)
    p.set_defaults(model="small", lr=3e-3)
    p.add_argument("--no-p2pft", action="store_true", help="plain single-process training, no fault tolerance")
    for name in ("d-model", "n-layers", "n-heads", "seq-len"):
        p.add_argument(f"--{name}", type=int, default=0, help=f"override the --model size's {name}")
    p.add_argument("--batch", type=int, default=8, help="samples per replica per step")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (batch must divide)")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--schedule-steps", type=int, default=0, help="cosine length (default: --steps, else 1000)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--amp", choices=["bf16", "fp16", "off"], default="bf16")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--token-dir", default=None,
                   help="where the token file is written once (default: the cache; --data-dir is the node's state)")
    p.add_argument("--stats", default=None, help="JSON-lines file for per-step records")
    p.add_argument("--loss-every", type=int, default=1, help="write the training loss every N steps")
    p.add_argument("--final-weights", default=None, help="torch.save the parameters here at exit")
    p.add_argument("--weights-every", type=int, default=0,
                   help="also save them every N committed steps, next to --final-weights (NAME.stepN.pt)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--comm-timeout", type=float, default=10.0, help="data-plane operation timeout (s)")
    p.add_argument("--loop-timeout", type=float, default=60.0, help="stalled-loop exclusion (s)")
    p.add_argument("--sync-every", type=int, default=0,
                   help="DiLoCo: inner steps between syncs (0: FaultTolerant, an allreduce every step)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo: the outer Nesterov SGD's lr")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo: the outer SGD's momentum")
    args = p.parse_args(argv)
    if not args.no_p2pft:
        require_replica_id(p, args)
    if args.batch < 1 or args.accum < 1 or args.batch % args.accum:
        p.error(f"--batch ({args.batch}) must be a positive multiple of --accum ({args.accum})")
    if args.warmup < 0 or args.steps < 0 or args.workers < 0 or not 0 <= args.min_lr_ratio <= 1:
        p.error("--warmup, --steps and --workers must be >= 0 and --min-lr-ratio in [0, 1]")
    if args.sync_every < 0 or (args.sync_every and (args.no_p2pft or args.checkpoint_dir)):
        p.error("--sync-every must be >= 0, and DiLoCo (--sync-every > 0) runs with p2pft and no --checkpoint-dir")
    if args.comm_timeout <= 0 or (args.loop_timeout and args.loop_timeout <= args.comm_timeout):
        p.error("--comm-timeout must be positive and --loop-timeout (0: off) must exceed it")
    return args


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    d, layers, heads, seq = SIZES[args.model]
    return Recipe(d_model=args.d_model or d, n_layers=args.n_layers or layers, n_heads=args.n_heads or heads,
                  seq_len=args.seq_len or seq, batch=args.batch, accum=args.accum, lr=args.lr,
                  min_lr_ratio=args.min_lr_ratio, warmup=args.warmup,
                  schedule_steps=args.schedule_steps or args.steps or 1000, weight_decay=args.weight_decay,
                  amp=args.amp, seed=args.seed, replicas=1 if args.no_p2pft else args.replicas,
                  lr_policy=args.lr_policy, sync_every=args.sync_every, outer_lr=args.outer_lr,
                  outer_momentum=args.outer_momentum)


# ---------------------------------------------------------------------- data
def corpus_text() -> str:
    """Python's topic help texts, concatenated in sorted key order (real English, no download)."""
    from pydoc_data.topics import topics
    return "".join(topics[k] for k in sorted(topics))


def token_file(data_dir: str | None = None) -> Path:
    """The corpus as a uint16 token file, written once (each writer its own temporary file, so
    replicas starting together never see a half-written file)."""
    import numpy as np

    from p2pft.trainer.data.tokens import write_tokens
    root = Path(data_dir or os.environ.get("P2PFT_CACHE") or Path.home() / ".cache" / "p2pft")
    path = root / f"pydoc-topics-v{CORPUS_VERSION}.u16"
    data = corpus_text().encode("utf-8")
    if path.is_file() and path.stat().st_size == 2 * len(data):
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = write_tokens(root / f".{path.name}.{os.getpid()}", np.frombuffer(data, dtype=np.uint8))
    os.replace(tmp, path)
    return path


class Shuffled:
    """A fixed seeded permutation of a dataset's samples, so contiguous index ranges (what the
    data cursor hands out) give well-mixed batches. Picklable for DataLoader workers."""

    def __init__(self, dataset: TokenFile, seed: int) -> None:
        import torch
        self.dataset = dataset
        self.order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.dataset[self.order[i]]


class Endless:
    """Sample indices 0, 1, 2, ... modulo the dataset, as the cursor's stream is (no epoch seam)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return (i % self.n for i in itertools.count())


# ---------------------------------------------------------------------- model, optimizer, schedule
def build(r: Recipe, data_dir: str | None = None) -> tuple[TinyLM, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR,
                                                           torch.amp.GradScaler | None, Shuffled]:
    """(model, AdamW, LambdaLR, GradScaler or None, dataset), identical for one recipe."""
    import torch

    from p2pft.trainer.model import ModelConfig
    from p2pft.trainer.data.tokens import TokenFile
    torch.manual_seed(r.seed)
    model = ModelConfig(256, r.d_model, r.n_layers, r.n_heads, r.seq_len).build()
    opt, sched = optimizer(model, r)
    scaler = torch.amp.GradScaler("cpu") if r.amp == "fp16" else None
    data = Shuffled(TokenFile(token_file(data_dir), r.seq_len), r.seed)
    return model, opt, sched, scaler, data


def optimizer(model: torch.nn.Module, r: Recipe) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with weight-decay groups and its LambdaLR (DiLoCo: the inner optimizer; the replay
    oracle builds one per replica process)."""
    import torch
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": r.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=r.lr, betas=(0.9, 0.95))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(r, s))


def lr_factor(r: Recipe, step: int) -> float:
    """Linear warm-up to 1, then cosine down to min_lr_ratio at schedule_steps, then flat."""
    if step < r.warmup:
        return (step + 1) / r.warmup
    done = min(1.0, (step - r.warmup) / max(1, r.schedule_steps - r.warmup))
    return r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done))


def autocast(r: Recipe) -> AbstractContextManager[object]:
    import torch
    if r.amp == "off":
        return nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16 if r.amp == "bf16" else torch.float16)


def forward_backward(model: TinyLM, batch: torch.Tensor | None, r: Recipe, scaler: torch.amp.GradScaler | None
                     ) -> float | None:
    """Accumulate the gradient of one replica's batch over r.accum micro-batches; the mean loss
    (None for no batch: the replica contributes nothing to this step)."""
    if batch is None:
        return None
    total = 0.0
    for micro in batch.chunk(r.accum):
        with autocast(r):
            loss = model.loss(micro) / r.accum
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total += float(loss.detach())
    return total


def clip(model: torch.nn.Module, r: Recipe) -> torch.Tensor:
    import torch
    return torch.nn.utils.clip_grad_norm_(model.parameters(), r.clip)


# ---------------------------------------------------------------------- stats, progress, stop
class Cursor(Protocol):
    def assign(self, slot: int) -> list[tuple[int, int]]: ...

    def state_dict(self) -> dict[str, Any]: ...


class LastLrs(Protocol):
    @property
    def last_lrs(self) -> list[float]: ...


class Watched(Protocol):
    """What the monitor reads of the step kernel (``FaultTolerant``'s, or ``DiLoCo``'s in gpt_diloco.py)."""

    @property
    def step(self) -> int: ...

    @property
    def synced(self) -> bool: ...

    @property
    def current_slot(self) -> int | None: ...

    @property
    def cursor(self) -> Cursor: ...

    @property
    def optimizer_step(self) -> LastLrs: ...

    @property
    def events(self) -> deque[dict[str, Any]]: ...

    def digest(self) -> str: ...

    def request_stop(self) -> None: ...

    def close(self) -> None: ...


class Monitor:
    """Everything around the loop that is not training: the JSON-lines stats (flushed at every
    line: the process may be SIGKILLed at any moment), the progress line, stop conditions and
    signals, the summary, the weights files."""

    def __init__(self, args: argparse.Namespace, r: Recipe) -> None:
        self.args, self.r = args, r
        self.fh = open(args.stats, "a") if args.stats else None
        self.show = args.progress == "on" or (args.progress == "auto" and sys.stdout.isatty())
        self.stopped = False
        self.t0 = time.time()
        self.deadline = time.monotonic() + args.duration if args.duration else math.inf
        self.next_line = time.monotonic() + 3.0
        self.losses: list[float] = []
        self.counts = {"steps": 0, "retries": 0, "fast_forwarded": 0, "samples": 0}
        self.events: dict[str, int] = {}
        self.last: dict[str, Any] = {}
        self.last_epoch = -1
        self.model: torch.nn.Module | None = None
        self.ft: Watched | None = None
        self.rt: Runtime | None = None
        self.slot: int | None = None
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopped = True
        if self.ft is not None:
            self.ft.request_stop()   # a commit in flight raises Stopped instead of retrying

    def start(self, model: torch.nn.Module, ft: Watched | None = None, rt: Runtime | None = None) -> None:
        """Wait for the peers (the group forms), announce the start (the harness waits for it),
        then wait for the go file."""
        self.model, self.ft, self.rt = model, ft, rt
        # (A restarted replica must not wait.)
        if ft is not None and rt is not None and self.args.min_replicas > 1 and ft.step == 0:
            # The group forms before the start record, as a torch job's rendezvous does.
            rt.wait_view(lambda v: len(v.participants) >= self.args.min_replicas
                         or v.role_of(rt.node_id) == "joiner", timeout=30.0)
        self.write({"t": time.time(), "kind": "start", "t_process": T_START, "t_imported": self.t0,
                    "pid": os.getpid(), "recipe": dataclasses.asdict(self.r), "step": ft.step if ft else 0,
                    **({"node": rt.node_id} if rt else {})})
        if ft is None:
            return
        if self.args.go_file:
            deadline = time.monotonic() + 600
            while not os.path.exists(self.args.go_file) and time.monotonic() < deadline and not self.stopped:
                time.sleep(0.02)

    def running(self, step: int) -> bool:
        return not self.stopped and time.monotonic() < self.deadline and (not self.args.steps or step < self.args.steps)

    def before_commit(self, record: bool = True) -> None:
        """Write the ranges this step trains, before the commit: if this process dies after the
        commit applied but before its step line, the oracle still knows what it trained. Then
        the emulated accelerator time (--step-delay). DiLoCo records only before the inner step
        that ends a span (the call that syncs); the ranges are the span's."""
        ft, _ = self._started()
        self.slot = ft.current_slot
        if record and self.slot is not None:
            self.write({"t": time.time(), "kind": "begin", "step": ft.step, "slot": self.slot,
                        "tr": [list(x) for x in ft.cursor.assign(self.slot)]})
        if self.args.step_delay:
            time.sleep(self.args.step_delay)

    def _started(self) -> tuple[Watched, Runtime]:
        """The trainer and runtime ``start`` was given (the p2pft loops have both)."""
        if self.ft is None or self.rt is None:
            raise RuntimeError("the monitor was started without a trainer and a runtime")
        return self.ft, self.rt

    def write(self, rec: dict[str, Any]) -> None:
        if self.fh is not None:
            self.fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self.fh.flush()

    def plain_step(self, step: int, loss: float | None, lr: float) -> None:
        b = self.r.batch
        self._step({"step": step, "c": 1, "role": "plain", "n": 1, "r": 0, "e": 0, "lr": lr,
                    "tr": [[(step - 1) * b, step * b]]}, loss)

    def ft_step(self, res: StepResult, loss: float | None) -> None:
        """One commit's line (replica.py's format, plus lr, the slot, the step our ranges were
        trained for, and the committed step's ring)."""
        ft, rt = self._started()
        view = rt.view
        rec: dict[str, Any] = {"step": res.step, "c": int(res.committed), "role": res.role,
                               "n": res.contributors, "r": res.retries, "e": view.epoch if view else 0}
        if res.committed or res.fast_forwarded:
            rec["lr"] = ft.optimizer_step.last_lrs[0]
        if res.fast_forwarded:
            rec["ff"] = res.fast_forwarded
        if res.trained:
            rec.update(tr=[list(x) for x in res.trained], slot=res.slot if res.slot is not None else self.slot,
                       ts=res.trained_step)
        if res.committed and res.slot_ranks:  # the committed step's ring: its summation order
            rec.update(sr=sorted([k, r] for k, r in res.slot_ranks.items()), dw=res.data_world)
        if res.committed and self.args.digest_every and res.step % self.args.digest_every == 0:
            rec["digest"] = ft.digest()
        if view is not None and view.epoch != self.last_epoch:
            self.last_epoch = view.epoch
            rec["view"] = [[m.replica_id, m.role.value[0]] for m in view.members]
        self._step(rec, loss)
        while ft.events:  # popleft: the catch-up worker appends concurrently
            ev = ft.events.popleft()
            self.events[ev["kind"]] = self.events.get(ev["kind"], 0) + 1
            self.write({**ev, "kind": "event", "event": ev["kind"]})

    def _step(self, rec: dict[str, Any], loss: float | None) -> None:
        rec = {"t": time.time(), **rec}
        if loss is not None:
            self.losses.append(loss)
            if self.args.loss_every and rec["step"] % self.args.loss_every == 0:
                rec["loss"] = loss
        c = self.counts
        c["steps"] += rec["c"]
        c["retries"] += rec.get("r", 0)
        c["fast_forwarded"] += rec.get("ff", 0)
        c["samples"] += sum(b - a for a, b in rec.get("tr", []))
        self.last = rec
        self.write(rec)
        if rec["c"] and self.args.weights_every and rec["step"] % self.args.weights_every == 0:
            save_weights(self.args.final_weights, self.model, rec["step"], suffix=f".step{rec['step']}")
        if self.show and time.monotonic() >= self.next_line:
            self.next_line = time.monotonic() + 3.0
            ev = " ".join(f"{k} {v}" for k, v in sorted(self.events.items()))
            print(f"step {rec['step']:6d}  loss {self._loss():.3f}  lr {rec.get('lr', 0.0):.2e}  contributors "
                  f"{rec.get('n', 1)}/{self.r.replicas}  view {rec.get('e', '-')}  {rec.get('role', '')}  {ev}",
                  flush=True)

    def _loss(self) -> float:
        tail = self.losses[-20:]
        return sum(tail) / len(tail) if tail else math.nan

    def stop(self, step: int) -> None:
        """The exit line, the final weights, the summary; then leave the cluster."""
        ft, wall, c = self.ft, time.time() - self.t0, self.counts
        synced = ft is None or ft.synced   # mid catch-up the weights are neither the old step's nor the new
        if synced:
            save_weights(self.args.final_weights, self.model, step)
        extra = {"cursor": ft.cursor.state_dict(), **({"digest": ft.digest()} if synced else {})} if ft else {}
        self.write({"t": time.time(), "kind": "exit", "step": step, **extra})
        if self.fh is not None:
            self.fh.close()
        print(f"stopped at step {step} after {wall:.1f} s ({c['steps'] / max(wall, 1e-9):.2f} steps/s): "
              f"loss {self._loss():.3f} (mean of the last 20), {c['samples']} samples trained here, "
              f"{c['retries']} retries, {c['fast_forwarded']} fast-forwarded, events "
              f"{json.dumps(self.events, sort_keys=True)}", flush=True)
        if ft is not None:
            ft.close()
        if self.rt is not None:
            self.rt.close(leave=True)


def save_weights(path: str | None, model: torch.nn.Module | None, step: int, suffix: str = "") -> None:
    """torch.save {"step", "params"} to PATH (with `suffix` before its .pt), atomically."""
    if not path or model is None:
        return
    import torch
    if suffix:
        path = f"{path[:-3] if path.endswith('.pt') else path}{suffix}.pt"
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save({"step": step, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}, tmp)
    os.replace(tmp, path)


def start_runtime(args: argparse.Namespace) -> Runtime:
    """This replica's control plane: addresses and secret from the command line."""
    from p2pft import Runtime
    from p2pft.net.wire import load_secret
    return Runtime(replica_id=args.replica_id, listen=args.listen, seeds=[s for s in args.seeds.split(",") if s],
                   secret=load_secret(args.secret_file), comm_timeout=args.comm_timeout,
                   max_participants=args.max_participants).start()


def ft_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every,
            "loop_timeout": args.loop_timeout or None}


# ---------------------------------------------------------------------- the two loops
def train_plain(args: argparse.Namespace, r: Recipe, mon: Monitor) -> None:
    import torch
    model, opt, sched, scaler, data = build(r, args.token_dir)
    # (A map-style dataset: the DataLoader needs __len__/__getitem__, not the Dataset class.)
    dataset = cast("torch.utils.data.Dataset[torch.Tensor]", data)
    batches = iter(torch.utils.data.DataLoader(dataset, batch_size=r.batch, sampler=Endless(len(data)),
                                               num_workers=args.workers))
    mon.start(model)
    step = 0
    while mon.running(step):
        batch = next(batches)
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(model, batch, r, scaler)
        if scaler is not None:
            scaler.unscale_(opt)
        clip(model, r)
        lr = opt.param_groups[0]["lr"]
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        step += 1
        mon.plain_step(step, loss, lr)
    mon.stop(step)


def train_ft(args: argparse.Namespace, r: Recipe, mon: Monitor) -> None:
    from p2pft.trainer import FaultTolerant, Stopped
    from p2pft.trainer.data.loader import StepLoader
    model, opt, sched, scaler, data = build(r, args.token_dir)
    rt = start_runtime(args)
    ft = FaultTolerant(rt, model, opt, batch_per_replica=r.batch, nominal_replicas=r.replicas, lr_policy=r.lr_policy,
                       lr_scheduler=sched, grad_scaler=scaler, grad_hook=lambda: clip(model, r), **ft_options(args))
    batches = StepLoader(ft, data, num_workers=args.workers)
    mon.start(model, ft.kernel, rt)
    while mon.running(ft.step):
        batch = batches.next_batch()
        ft.zero_grad()
        loss = forward_backward(model, batch, r, scaler)
        mon.before_commit()
        try:
            res = ft.commit()
        except Stopped:
            break
        mon.ft_step(res, loss)
    mon.stop(ft.step)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch._dynamo  # noqa: F401  (imported lazily by the first optimizer step: ~2 s)

    from p2pft.ops.log import setup_logging
    setup_logging(args.log_level)
    torch.set_num_threads(args.threads)
    r = recipe_from_args(args)
    mon = Monitor(args, r)
    if r.sync_every:
        from p2pft.trainer.examples.gpt_diloco import train_diloco
        train_diloco(args, r, mon, SimpleNamespace(build=build, clip=clip, forward_backward=forward_backward,
                                                   start_runtime=start_runtime))
    else:
        (train_plain if args.no_p2pft else train_ft)(args, r, mon)
    return 0


if __name__ == "__main__":
    from p2pft.deploy.procs import exit_now
    exit_now(main())
