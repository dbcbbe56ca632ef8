"""A DiLoCo replica process for tests that kill and restart it.

A small MLP on deterministic samples, inner AdamW, the default outer Nesterov SGD. One JSON line
per sync (the call that ended a span): syncs, contributors, retries, the sample ranges it
trained, the inner steps it ran in that span and whether they are in the committed mean, and the
digest of the global weights + outer optimizer. The initial weights go to ``<stats>.init.pt``, the
global weights at the last committed sync to ``<stats>.final.pt`` (for replays). A line
``{"kind": "syncing"}`` goes out just before the call that will sync, so a test can kill a peer while
this one is in the allreduce.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import torch

from p2pft import Runtime
from p2pft.ops.log import setup_logging
from p2pft.trainer.job.cli import add_job_args, job_kwargs
from p2pft.trainer import DiLoCo, JobError, Stopped
from p2pft.trainer.examples.signals import StopOnSignal

WIDTH = 16
LR = 1e-2


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(WIDTH, generator=g)
    return x, torch.tanh(x.flip(0) * 2)


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.Tanh(), torch.nn.Linear(32, WIDTH))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replica-id", required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--seeds", default="")
    p.add_argument("--stats", required=True)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--overlap", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.0)
    p.add_argument("--compression", default="none")
    p.add_argument("--step-delay", type=float, default=0.02, help="seconds per inner step (emulated compute)")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--syncs", type=int, default=0, help="stop after this many committed syncs (0: at SIGTERM)")
    p.add_argument("--steps", type=int, default=0, help="the job's end in inner steps (total_steps; 0: none)")
    p.add_argument("--seed", type=int, default=0, help="model init seed")
    add_job_args(p)
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args()
    setup_logging(a.log_level)
    torch.set_num_threads(1)
    model = build(a.seed)
    torch.save([p.detach().clone() for p in model.parameters()], a.stats + ".init.pt")   # the run's record
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rt = Runtime(replica_id=a.replica_id, listen=a.listen, seeds=[s for s in a.seeds.split(",") if s]).start()
    dl = DiLoCo(rt, model, opt, sync_every=a.sync_every, batch_per_replica=a.batch, fragments=a.fragments,
                overlap=a.overlap, alpha=a.alpha, compression=a.compression, loop_timeout=None, **job_kwargs(a))
    stop = StopOnSignal((signal.SIGTERM,))   # SIGTERM: the loop ends, the trainer's call raises Stopped
    stop.attach(dl)
    out = open(a.stats, "a", buffering=1)
    out.write(json.dumps({"kind": "start", "t": time.time(), "node": rt.node_id}) + "\n")
    code = 0
    refused = False    # the job would not take this replica (finished, lost, misdeclared)
    try:
        dl.start()    # the group forms; the job's state is checked; at sync 0 all take the lead's weights
    except JobError as exc:
        print(f"replica {a.replica_id}: {exc}", file=sys.stderr, flush=True)
        code, refused = exc.exit_code, True
    out.write(json.dumps({"kind": "begin", "t": time.time(), "step": dl.step, "digest": dl.digest()}) + "\n")
    span = dl.schedule.span
    ran = 0
    while not code and not stop.flag and not dl.done and not (a.syncs and dl.step >= a.syncs):
        try:
            idx = dl.begin()
            dl.zero_grad()
            if idx:
                x, y = torch.utils.data.default_collate([sample(i) for i in idx])
                (model(x) - y).pow(2).mean().backward()
                ran += 1
                time.sleep(a.step_delay)
                if dl.inner_step % span == span - 1:
                    out.write(json.dumps({"kind": "syncing", "t": time.time(), "sync": dl.step}) + "\n")
            res = dl.commit()
        except Stopped:
            break
        except JobError as exc:
            print(f"replica {a.replica_id}: {exc}", file=sys.stderr, flush=True)
            code = exc.exit_code
            break
        if res.outer is None:
            continue
        o = res.outer
        rec = {"t": time.time(), "step": res.syncs, "c": int(o.committed), "role": o.role, "n": o.contributors,
               "r": o.retries, "ran": ran, "kept": ran if o.trained is not None else 0, "ff": o.fast_forwarded}
        ran = 0
        if o.trained:
            rec["tr"] = o.trained
        if o.committed:
            rec["digest"] = dl.digest()
        out.write(json.dumps(rec) + "\n")
        while dl.events:
            ev = dl.events.popleft()
            out.write(json.dumps({**ev, "kind": "event", "event": ev["kind"]}) + "\n")
    if not refused and not code and dl.done and not stop.flag:
        try:
            end = dl.finish()
            out.write(json.dumps({"kind": "event", "event": "finished", "step": end, "t": time.time()}) + "\n")
        except JobError as exc:
            print(f"replica {a.replica_id}: {exc}", file=sys.stderr, flush=True)
            code = exc.exit_code
    out.write(json.dumps({"kind": "exit", "t": time.time(), "step": dl.step, "code": code,
                          **({"digest": dl.digest()} if dl.synced else {})}) + "\n")
    if dl.synced:   # the global weights at the last committed sync, for the oracle
        torch.save({"syncs": dl.step, "weights": [p.detach() for p in dl.global_model.parameters()]},
                   a.stats + ".final.pt")
    out.close()
    dl.close()
    rt.close(leave=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
