"""A replica process with a full training recipe, for tests that kill and restart it.

Warm-up + cosine LambdaLR stepped by p2pft, global-norm clipping in the gradient hook, optional
fp16 autocast + GradScaler (with an injected inf on one replica at one step), bf16 autocast,
gradient accumulation, an EMA of the weights as registered user state updated in ``after_step``,
and a StepLoader with DataLoader workers. Every committed step is one JSON line: the lr it ran
with, the averaged gradient's norm before clipping, whether the scaler skipped it, digests.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal
import sys
import time

import torch

from p2pft import Runtime
from p2pft.ops.log import setup_logging
from p2pft.trainer import FaultTolerant, Stopped
from p2pft.trainer.examples.signals import StopOnSignal
from p2pft.trainer.data.loader import StepLoader

WIDTH = 16
BASE_LR = 0.05
WARMUP, TOTAL = 5, 200


def schedule(step: int) -> float:
    """Warm-up then cosine: the factor on BASE_LR at `step` (what LambdaLR gives)."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / (TOTAL - WARMUP))))


class Samples:
    """Sample i: a fixed random input and target, the same on every replica and in every worker."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(WIDTH, generator=g)
        return x, torch.tanh(x.flip(0) * 2)


class EMA:
    """Exponential moving average of the weights: registered state, updated in after_step."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9) -> None:
        self.model, self.decay, self.updates = model, decay, 0
        self.shadow = [p.detach().clone() for p in model.parameters()]

    def update(self) -> None:
        self.updates += 1
        with torch.no_grad():
            for s, p in zip(self.shadow, self.model.parameters()):
                s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        for s, t in zip(self.shadow, state["shadow"]):
            s.copy_(t)

    def digest(self) -> str:
        h = hashlib.blake2b(str(self.updates).encode(), digest_size=16)
        for s in self.shadow:
            h.update(s.numpy().tobytes())
        return h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replica-id", required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--seeds", default="")
    p.add_argument("--stats", required=True)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--amp", choices=("none", "fp16", "bf16"), default="none")
    p.add_argument("--poison-step", type=int, default=-1,
                   help="r0 puts an inf in its gradient at the first step >= this one that it trains")
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.03)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--min-replicas", type=int, default=1, help="participants the first begin() waits for")
    a = p.parse_args()
    setup_logging(a.log_level)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.Tanh(), torch.nn.Linear(32, WIDTH))
    opt = torch.optim.AdamW(model.parameters(), lr=BASE_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if a.amp == "fp16" else None
    ema = EMA(model)
    norm: list[float] = []
    poisoned: list[int] = []

    def clip() -> None:
        params = list(model.parameters())
        total = torch.nn.utils.clip_grad_norm_(params, a.clip if a.clip > 0 else float("inf"))
        norm.append(float(total))

    rt = Runtime(replica_id=a.replica_id, listen=a.listen, seeds=[s for s in a.seeds.split(",") if s]).start()
    ft = FaultTolerant(rt, model, opt, batch_per_replica=a.batch, lr_scheduler=sched, grad_scaler=scaler,
                       grad_hook=clip, after_step=ema.update, state={"ema": ema}, loop_timeout=None,
                       min_replicas=a.min_replicas)
    data = Samples()
    loader = StepLoader(ft, data, num_workers=a.loader_workers) if a.loader_workers else None
    stop = StopOnSignal((signal.SIGTERM,))   # SIGTERM: the loop ends, the trainer's call raises Stopped
    stop.attach(ft)
    out = open(a.stats, "a", buffering=1)
    out.write(json.dumps({"kind": "start", "t": time.time(), "node": rt.node_id}) + "\n")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(a.amp)
    while not stop.flag:
        try:
            if loader is not None:
                batch = loader.next_batch()
            else:
                idx = ft.begin()
                batch = torch.utils.data.default_collate([data[i] for i in idx]) if idx else None
            ft.zero_grad()
            if batch is not None:
                x, y = batch
                for xs, ys in zip(x.chunk(a.accum), y.chunk(a.accum)):
                    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                        loss = (model(xs).float() - ys).pow(2).mean() / a.accum
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                if a.replica_id == "r0" and 0 <= a.poison_step <= ft.step and not poisoned:
                    next(model.parameters()).grad[0, 0] = float("inf")
                    poisoned.append(ft.step)
                    out.write(json.dumps({"kind": "poisoned", "step": ft.step}) + "\n")
            time.sleep(a.step_delay)
            norm.clear()
            res = ft.commit()
        except Stopped:
            break
        rec = {"t": time.time(), "step": res.step, "c": int(res.committed), "role": res.role,
               "n": res.contributors, "r": res.retries}
        if res.trained:
            rec["tr"] = res.trained
        if res.committed:
            rec.update(lr=ft.kernel.optimizer_step.last_lrs[0], norm=norm[-1] if norm else None,
                       skipped=ft.kernel.optimizer_step.last_skipped, digest=ft.digest(), ema=ema.digest(),
                       peak=ft.kernel.optimizer_step.peak)
            if scaler is not None:
                rec["scale"] = float(scaler.get_scale())
        out.write(json.dumps(rec) + "\n")
        while ft.events:
            ev = ft.events.popleft()
            out.write(json.dumps({**ev, "kind": "event", "event": ev["kind"]}) + "\n")
    if loader is not None:
        out.write(json.dumps({"kind": "loader", "hits": loader.hits, "misses": loader.misses,
                              "dropped": loader.dropped}) + "\n")
        loader.close()
    out.close()
    ft.close()
    rt.close(leave=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
