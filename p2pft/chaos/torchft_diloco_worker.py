"""One torchft 0.2.0 DiLoCo replica training the GPT recipe (``p2pft chaos --algo diloco``'s torchft row).

The same model, data, inner AdamW with its warm-up/cosine ``LambdaLR``, clipping and AMP as
``gpt.py --sync-every H`` (``p2pft.trainer.examples.gpt``), and the same outer Nesterov SGD
every H inner steps, but through ``torchft.local_sgd.DiLoCo`` around a lighthouse, as torchft's
DiLoCo example runs it: ``use_async_quorum=False``, its PG checkpoint transport (a restarted
replica heals over the Gloo group, so it works on any host that can reach the others), the
quorum timeout its Manager's docs ask for DiLoCo (an hour: a replica at its sync waits in the
quorum for the others' spans). Replica r's k-th inner step of round s (torchft's committed step
count) trains the samples ``[((s H + k) R + r) B, +B)`` of the shuffled token file.

The stats file has the chaos records (``torchft_worker.py``'s format): one line per sync, its
step torchft's committed step count. A round in which this replica healed has role ``joiner``
and ``healed`` 1: torchft replaced its weights by the donor's before the sync, so its
pseudo-gradient was the donor's and none of its own inner steps are in the mean.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

T_START = time.time()
QUORUM_TIMEOUT_S = 3600.0   # torchft's Manager docstring: "~1h or longer" for LocalSGD/DiLoCo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica", type=int, required=True, help="replica group index")
    p.add_argument("--replicas", type=int, default=3, help="nominal number of replica groups (the data layout)")
    p.add_argument("--lighthouse", required=True, help="lighthouse URL, e.g. http://127.0.0.1:29510")
    p.add_argument("--host", default="127.0.0.1", help="address this replica's manager and store advertise")
    p.add_argument("--model", default="tiny", choices=["tiny", "small"])
    p.add_argument("--batch", type=int, default=8, help="samples per replica per inner step")
    p.add_argument("--sync-every", type=int, default=5, help="H, inner steps between syncs")
    p.add_argument("--step-delay", type=float, default=0.0, help="emulated accelerator seconds per inner step")
    p.add_argument("--stats", default=None)
    p.add_argument("--digest-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--go-file", default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--pg-timeout", type=float, default=10.0, help="Gloo collective timeout, seconds")
    p.add_argument("--timeout", type=float, default=30.0, help="Manager timeout (should_commit, healing), seconds")
    p.add_argument("--quorum-timeout", type=float, default=QUORUM_TIMEOUT_S)
    args, unknown = p.parse_known_args(argv)
    if unknown:   # the chaos harness passes every system the same extra flags
        print(f"torchft_diloco_worker: ignoring options for p2pft's replica: {' '.join(unknown)}", file=sys.stderr)
    if args.sync_every < 1 or args.batch < 1:
        p.error("--sync-every and --batch must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.local_sgd import DiLoCo

    from ..trainer.examples.gpt import SIZES, Recipe, build, clip, forward_backward
    from ..trainer.algorithms.outer import outer_sgd
    from .torchft_worker import Stats

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("torchft.manager").setLevel(logging.INFO)   # quorums, healing, commits: read back by tests
    torch.set_num_threads(1)
    stats = Stats(args.stats)
    t_imported = time.time()
    d, layers, heads, seq = SIZES[args.model]
    r = Recipe(d_model=d, n_layers=layers, n_heads=heads, seq_len=seq, batch=args.batch, seed=args.seed,
               replicas=args.replicas, sync_every=args.sync_every)
    model, inner, sched, scaler, data = build(r, args.data_dir)   # seeded: identical on every replica
    outer = outer_sgd(list(model.parameters()), lr=r.outer_lr, momentum=r.outer_momentum)
    healed = {"round": False}

    # The model, the inner AdamW and its schedule; torchft's DiLoCo adds the global weights and
    # the outer optimizer (its fragment's state dict).
    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])
        sched.load_state_dict(sd["sched"])
        healed["round"] = True

    store = TCPStore(args.host, 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))
    timeout = timedelta(seconds=args.timeout)
    manager = Manager(pg=pg, load_state_dict=load,
                      state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict(),
                                          "sched": sched.state_dict()},
                      min_replica_size=1, timeout=timeout, quorum_timeout=timedelta(seconds=args.quorum_timeout),
                      rank=0, world_size=1, store_addr=args.host, store_port=store.port,
                      lighthouse_addr=args.lighthouse, replica_id=f"p2pft_chaos_diloco_{args.replica}",
                      hostname=args.host, init_sync=False, use_async_quorum=False,
                      checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")))
    verdict: dict[str, bool | None] = {"commit": None}
    should_commit = manager.should_commit

    def recorded_should_commit(*a: Any, **kw: Any) -> bool:
        """The sync's verdict as torchft's DiLoCo hook got it (after a heal the step count is the
        donor's whether or not the round commits)."""
        verdict["commit"] = should_commit(*a, **kw)
        return bool(verdict["commit"])
    manager.should_commit = recorded_should_commit

    stop = {"flag": False}

    def on_term(signum: int, frame: object) -> None:
        # A replica may wait in a quorum for up to the quorum timeout: records are flushed within
        # 0.1 s, so the process ends 3 s after the signal whatever it is doing.
        stop["flag"] = True
        threading.Timer(3.0, lambda: os._exit(0)).start()
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    stats.write({"t": time.time(), "kind": "start", "t_process": T_START, "t_imported": t_imported,
                 "node": f"p2pft_chaos_diloco_{args.replica}.{os.getpid()}", "step": 0, "pid": os.getpid()})
    if args.go_file:
        go_deadline = time.monotonic() + 600
        while not os.path.exists(args.go_file) and time.monotonic() < go_deadline and not stop["flag"]:
            time.sleep(0.02)
    h, n, b = args.sync_every, args.replicas, args.batch
    with DiLoCo(manager, [model], inner, outer, sync_every=h):
        k = 0
        loss: float | None = None
        while not stop["flag"]:
            s = manager.current_step()
            first = ((s * h + k) * n + args.replica) * b
            batch = torch.stack([data[i % len(data)] for i in range(first, first + b)])
            inner.zero_grad(set_to_none=True)
            loss = forward_backward(model, batch, r, scaler)
            clip(model, r)
            if args.step_delay:
                time.sleep(args.step_delay)
            k += 1
            healed["round"], verdict["commit"] = False, None
            inner.step()   # torchft's hook: at the H-th, the quorum (maybe a heal) and the sync
            sched.step()
            if k < h:
                continue
            k = 0
            ok = bool(verdict["commit"])
            step = manager.current_step()
            rec: dict[str, Any] = {"t": time.time(), "step": step, "c": int(ok),
                                   "role": "joiner" if healed["round"] else "participant",
                                   "n": manager.num_participants() if ok else 0, "r": 0,
                                   "e": int(getattr(manager, "_quorum_id", -1)), "healed": int(healed["round"]),
                                   "lr": sched.get_last_lr()[0]}
            if manager.errored() is not None:
                rec["err"] = str(manager.errored())[:200]
            if ok and loss is not None:
                rec["loss"] = loss
            if ok and args.digest_every and step % args.digest_every == 0:
                # After a committed sync (alpha 0) the local weights are the global ones.
                rec["digest"] = hashlib.sha256(b"".join(p.detach().float().numpy().tobytes()
                                                        for p in model.parameters())).hexdigest()[:16]
            stats.write(rec)
    stats.write({"t": time.time(), "kind": "exit", "step": manager.current_step()})
    stats.close()
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
