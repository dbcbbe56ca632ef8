"""One rank of plain ``torch.nn.parallel.DistributedDataParallel`` over Gloo (the ``ddp`` system).

The job a torchrun user runs today: the same model, optimizer, data and emulated step time as
``p2pft.trainer.examples.replica``, gradients averaged by DDP's own allreduce, rank 0 writing a
disk checkpoint every ``--checkpoint-every`` steps. It has no fault tolerance of its own: when
any rank dies, the launcher (``DdpCluster``, as ``torchrun`` would) stops every rank and starts
them all again, and they resume from the last checkpoint. Its stats file has the records of
p2pft's replica, so the chaos harness measures both with one code path.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

T_START = time.time()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True, help="number of ranks (replicas)")
    p.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous store")
    p.add_argument("--model", default="tiny", choices=["tiny", "small"])
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--step-delay", type=float, default=0.0, help="emulated accelerator seconds per step")
    p.add_argument("--stats", required=True, help="JSON-lines file for per-step records")
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--digest-every", type=int, default=10)
    p.add_argument("--loss-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--go-file", default=None, help="wait until this file exists before training")
    p.add_argument("--generation", type=int, default=0, help="how many times the job was restarted")
    p.add_argument("--timeout", type=float, default=30.0, help="Gloo collective and rendezvous timeout, seconds")
    args, unknown = p.parse_known_args(argv)
    if unknown:  # the harness passes p2pft replica options to every system
        print(f"ddp_worker: ignoring options for p2pft's replica: {' '.join(unknown)}", file=sys.stderr)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from p2pft.transport.addr import parse_hostport
    from p2pft.trainer.data import TextDataset
    from p2pft.trainer.model import model_config_for
    from p2pft.trainer.state.whole import state_digest

    torch.set_num_threads(1)
    t_imported = time.time()
    stop = {"flag": False}

    def on_term(signum: int, frame: object) -> None:
        stop["flag"] = True
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    torch.manual_seed(args.seed)
    mcfg = model_config_for(args.model)
    model = mcfg.build()
    data = TextDataset(mcfg.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    ckpt = Path(args.checkpoint_dir) / "ckpt.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step = int(state["step"])
    master = parse_hostport(args.master, "--master")
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=args.timeout))
    net = DistributedDataParallel(model)
    fh = open(args.stats, "a", buffering=1)

    def write(rec: dict[str, Any]) -> None:
        fh.write(json.dumps(rec, separators=(",", ":")) + "\n")

    write({"t": time.time(), "kind": "start", "t_process": T_START, "t_imported": t_imported,
           "node": f"ddp{args.rank}.{os.getpid()}", "step": step, "pid": os.getpid()})
    if args.go_file:
        deadline = time.monotonic() + 600
        while not os.path.exists(args.go_file) and time.monotonic() < deadline and not stop["flag"]:
            time.sleep(0.02)
    n_data = len(data)
    while not stop["flag"]:
        base = (step * args.world + args.rank) * args.batch
        tokens = data.batch([(base + k) % n_data for k in range(args.batch)])
        opt.zero_grad()
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        if args.step_delay:
            time.sleep(args.step_delay)  # before the exchange, as in p2pft's replica
        loss.backward()  # DDP allreduces the gradients here; a dead rank makes it raise
        opt.step()
        step += 1
        rec: dict[str, Any] = {"t": time.time(), "step": step, "c": 1, "role": "participant", "n": args.world,
                               "r": 0, "e": args.generation}
        if args.loss_every and step % args.loss_every == 0:
            rec["loss"] = float(loss.detach())
        if args.digest_every and step % args.digest_every == 0:
            rec["digest"] = state_digest(model, opt)
        if args.rank == 0 and args.checkpoint_every and step % args.checkpoint_every == 0:
            tmp = ckpt.with_suffix(".tmp")
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)  # a rank killed mid-write leaves the previous checkpoint intact
            rec["ckpt"] = 1
        write(rec)
    write({"t": time.time(), "kind": "exit", "step": step})
    fh.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
