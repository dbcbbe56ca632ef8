"""One replica of a Lightning Fabric program whose training loop is p2pft's (docs/lightning.md).

One Fabric process (``devices=1``) is one replica. Fabric keeps what it does on a device: placement,
precision (the forward's autocast, ``fabric.backward``). p2pft owns what crosses replicas: which
samples each trains (``begin()``), the mean gradient, the optimizer step, catching a restarted
replica up. So p2pft gets the module and optimizer inside Fabric's wrappers (``model.module``,
``optimizer.optimizer``: the same parameters); clipping runs in its gradient hook, on the mean, and a
replay of logged steps runs it again. Two witnesses, two replicas::

    python -m p2pft peer --listen 127.0.0.1:7300 --seeds 127.0.0.1:7310,127.0.0.1:7311 --replica-id w0 &
    python -m p2pft peer --listen 127.0.0.1:7301 --seeds 127.0.0.1:7300,127.0.0.1:7310 --replica-id w1 &
    python -m p2pft.trainer.examples.fabric_replica --replica-id r0 --listen 127.0.0.1:7310 \\
        --seeds 127.0.0.1:7300,127.0.0.1:7301,127.0.0.1:7311 --stats r0.jsonl &
    python -m p2pft.trainer.examples.fabric_replica --replica-id r1 --listen 127.0.0.1:7311 \\
        --seeds 127.0.0.1:7300,127.0.0.1:7301,127.0.0.1:7310 --stats r1.jsonl &

``--stats``: a JSON line per commit (step, loss, the samples trained), then an exit line with the
final digest. Exit codes: 0 done or stopped (SIGTERM), 2 a misdeclared job, 3 the job's state is lost.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

WIDTH = 16


def build(lr: float, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model and AdamW on every replica and in the replay oracle (the test's)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.Tanh(), torch.nn.Linear(64, WIDTH))
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def batch(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i: a fixed input and target, a function of i alone (any replica can train it)."""
    xs = [torch.randn(WIDTH, generator=torch.Generator().manual_seed(i)) for i in idx]
    x = torch.stack(xs)
    return x, torch.tanh(x.flip(1) * 2)


def spans(idx: list[int]) -> list[list[int]]:
    """Sample indices as [start, end) runs: what the stats record and the replay oracle reads."""
    out: list[list[int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, i + 1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica-id", required=True)
    p.add_argument("--listen", required=True, help="HOST:PORT of this replica's control port")
    p.add_argument("--seeds", default="", help="comma-separated HOST:PORT of the other replicas and witnesses")
    p.add_argument("--steps", type=int, default=100, help="the job's end (total_steps)")
    p.add_argument("--batch", type=int, default=8, help="samples per replica per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="max global norm of the mean gradient")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    p.add_argument("--min-replicas", type=int, default=1, help="participants the first step waits for")
    p.add_argument("--step-delay", type=float, default=0.0, help="emulated accelerator time per step (s)")
    p.add_argument("--stats", default=None, help="JSON-lines file: one line per commit, an exit line")
    p.add_argument("--final-weights", default=None, help="torch.save the parameters here at the end")
    a = p.parse_args(argv)
    from lightning.fabric import Fabric   # ~5 s of imports: after the arguments parse

    from p2pft import Runtime
    from p2pft.trainer import FaultTolerant, JobError

    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=1, precision=a.precision)
    fabric.launch()
    model, optimizer = fabric.setup(*build(a.lr))
    rt = Runtime(replica_id=a.replica_id, listen=a.listen, seeds=[s for s in a.seeds.split(",") if s]).start()
    ft = FaultTolerant(rt, model.module, optimizer.optimizer, batch_per_replica=a.batch, total_steps=a.steps,
                       min_replicas=a.min_replicas,
                       grad_hook=lambda: fabric.clip_gradients(model, optimizer, max_norm=a.clip))
    signal.signal(signal.SIGTERM, lambda *_: ft.request_stop())
    out = open(a.stats or os.devnull, "a", buffering=1)   # line-buffered: a SIGKILL loses no line

    def write(rec: dict[str, object]) -> None:
        out.write(json.dumps({"t": time.time(), **rec}) + "\n")

    write({"kind": "start", "recipe": {"lr": a.lr, "batch": a.batch, "clip": a.clip, "precision": a.precision}})
    code = 0
    try:
        while not ft.done:
            idx = ft.begin()                 # [] while this replica catches up
            ft.zero_grad()
            loss = None
            if idx:
                x, y = fabric.to_device(batch(idx))
                loss = torch.nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)
                write({"kind": "begin", "step": ft.step, "tr": spans(idx)})   # for a kill after the commit
            time.sleep(a.step_delay)
            res = ft.commit()                # mean gradient, clip (the hook), AdamW: the same on every replica
            rec: dict[str, object] = {"step": res.step, "c": int(res.committed), "n": res.contributors,
                                      "role": res.role}
            if res.trained:
                rec.update(tr=[list(r) for r in res.trained], ts=res.trained_step)
            if res.committed:
                rec.update(digest=ft.digest(), **({"loss": float(loss)} if loss is not None else {}))
            write(rec)
        ft.finish()                          # the end barrier: every replica at --steps
        if a.final_weights:
            torch.save({n: w.detach().clone() for n, w in model.module.named_parameters()}, a.final_weights)
        write({"kind": "exit", "step": ft.step, "digest": ft.digest()})
    except JobError as exc:                  # Stopped / JobFinished: 0; lost state: 3; misdeclared: 2
        print(a.replica_id, exc, file=sys.stderr, flush=True)
        code = exc.exit_code
    out.close()
    ft.close()
    rt.close(leave=True)
    return code


if __name__ == "__main__":
    from p2pft.deploy.procs import exit_now
    exit_now(main())   # without the interpreter's teardown of torch and lightning (seconds on a busy machine)
