"""One torchft replica training the chaos workload (what ``TorchftCluster`` launches).

It trains the same model, optimizer, data and emulated step time as
``p2pft.trainer.examples.replica`` but through torchft 0.2.0: a ``torchft.Manager`` per replica
group talking to a lighthouse, ``ProcessGroupGloo`` across replicas, gradients averaged by one
``manager.allreduce`` (default) or by torchft's ``DistributedDataParallel`` comm hook as in
torchft's DDP example (``--grads ddp``), and the Manager's step protocol (``start_quorum`` before the forward pass, ``should_commit``
before the optimizer step, which is what torchft's ``Optimizer`` wrapper does).
A restarted replica heals by pulling model and optimizer state from a peer through the
checkpoint transport. The stats file has the same JSON-lines records as p2pft's replica, so the
chaos harness measures both systems with one code path; the step is torchft's committed step
(``manager.current_step()``), so progress lost by a restart shows up as the step going back.

The replica group has one rank, so the process itself hosts the group's TCPStore (torchrun
would otherwise provide it) and the Manager connects to it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

T_START = time.time()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica", type=int, default=int(os.environ.get("REPLICA_GROUP_ID", "0")),
                   help="replica group index (env REPLICA_GROUP_ID)")
    p.add_argument("--replicas", type=int, default=int(os.environ.get("NUM_REPLICA_GROUPS", "3")),
                   help="nominal number of replica groups, for the data layout (env NUM_REPLICA_GROUPS)")
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                   help="lighthouse URL, e.g. http://127.0.0.1:29510 (env TORCHFT_LIGHTHOUSE)")
    p.add_argument("--host", default="127.0.0.1", help="address this replica's manager advertises")
    p.add_argument("--model", default="tiny", choices=["tiny", "small"])
    p.add_argument("--batch", type=int, default=8, help="samples per replica per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--step-delay", type=float, default=0.0, help="emulated accelerator seconds per step")
    p.add_argument("--steps", type=int, default=0, help="stop after this many committed steps (0: no limit)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: no limit)")
    p.add_argument("--stats", default=None, help="JSON-lines file for per-step records")
    p.add_argument("--digest-every", type=int, default=10)
    p.add_argument("--loss-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=0, help="log the loss on a fixed held-out batch every N steps")
    p.add_argument("--go-file", default=None, help="wait until this file exists before training (a harness "
                   "starts every replica first, then says go)")
    p.add_argument("--seed", type=int, default=0, help="model init seed (the same on every replica)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--transport", choices=["pg", "http"], default="pg",
                   help="checkpoint transport for healing: pg (over the Gloo group, as torchft's DDP example) "
                   "or http (the Manager's default HTTPTransport)")
    p.add_argument("--grads", choices=["manual", "ddp"], default="manual",
                   help="manual (default): one manager.allreduce over the flattened gradients after backward, "
                   "which survives a killed peer; ddp: torchft.DistributedDataParallel, the path torchft's README "
                   "and DDP example use, whose comm hook crashes on a killed peer in torchft 0.2.0")
    p.add_argument("--pg-timeout", type=float, default=5.0, help="Gloo collective timeout, seconds")
    p.add_argument("--timeout", type=float, default=30.0, help="Manager timeout (should_commit, healing), seconds")
    p.add_argument("--quorum-timeout", type=float, default=60.0, help="Manager quorum timeout, seconds")
    p.add_argument("--world-size-mode", choices=["dynamic", "fixed_with_spares"], default="dynamic",
                   help="torchft's WorldSizeMode: dynamic (every replica in the quorum trains) or fixed_with_spares "
                   "(min_replica_size participants train; the others allreduce zeros and stay current)")
    p.add_argument("--min-replica-size", type=int, default=1,
                   help="the Manager's min_replica_size: a step commits only with this many participants")
    # The chaos harness passes the same extra flags to every system's replicas; options that only
    # p2pft's replica has are reported and ignored rather than fatal.
    args, unknown = p.parse_known_args(argv)
    if unknown:
        print(f"torchft_worker: ignoring options for p2pft's replica: {' '.join(unknown)}", file=sys.stderr)
    if not args.lighthouse:
        p.error("--lighthouse is required (or set TORCHFT_LIGHTHOUSE)")
    if args.min_replica_size < 1:
        p.error("--min-replica-size must be at least 1")
    return args


class Stats:
    """JSON-lines writer flushed at least every 0.1 s by a background thread.

    The process may be SIGKILLed, or blocked for seconds inside torchft, at any moment: a
    record written just before a long block must still reach the file.
    """

    def __init__(self, path: str | None) -> None:
        self.fh = open(path, "a", buffering=1 << 16) if path else None
        self.lock = threading.Lock()
        if self.fh is not None:
            threading.Thread(target=self._flusher, name="stats-flush", daemon=True).start()

    def write(self, rec: dict[str, Any]) -> None:
        if self.fh is None:
            return
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        with self.lock:
            self.fh.write(line)

    def _flusher(self) -> None:
        while True:
            time.sleep(0.05)
            with self.lock:
                if self.fh is None or self.fh.closed:
                    return
                self.fh.flush()

    def close(self) -> None:
        with self.lock:
            if self.fh is not None:
                self.fh.close()


def allreduce_grads(manager: Any, params: list[Any]) -> None:
    """Average gradients across the quorum with one fault-tolerant allreduce.

    On a failure the Manager swallows the error, records it and returns; ``should_commit`` then
    answers False and the step is skipped, which is torchft's intended recovery path.
    """
    import torch
    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params])
    manager.allreduce(flat).wait()
    off = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            p.grad = flat[off:off + n].view_as(p).clone()
        else:
            p.grad.copy_(flat[off:off + n].view_as(p))
        off += n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.manager import WorldSizeMode
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport

    from p2pft.trainer.data import TextDataset
    from p2pft.trainer.model import model_config_for
    from p2pft.trainer.state.whole import state_digest

    torch.set_num_threads(args.threads)
    stats = Stats(args.stats)
    t_imported = time.time()

    torch.manual_seed(args.seed)
    mcfg = model_config_for(args.model)
    model = mcfg.build()
    data = TextDataset(mcfg.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    held_out = data.batch(list(range(len(data) - 32, len(data))))  # the same batch p2pft's replica uses

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    # One rank per replica group: this process hosts the group's store (torchrun's job otherwise).
    # The manager tells the other replicas this store's address (for their process group): it
    # must be the one they reach, --host, not loopback, once replicas are on separate hosts.
    store = TCPStore(args.host, 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))
    timeout = timedelta(seconds=args.timeout)
    transport = (PGTransport(pg, timeout=timeout, device=torch.device("cpu")) if args.transport == "pg"
                 else HTTPTransport(timeout=timeout, num_chunks=0))
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replica_size,
        world_size_mode=WorldSizeMode[args.world_size_mode.upper()],
        timeout=timeout,
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        rank=0,
        world_size=1,
        store_addr=args.host,
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"p2pft_chaos_{args.replica}",
        hostname=args.host,
        checkpoint_transport=transport,
        # Every replica seeds its model identically, as torchft's docs advise for init_sync=False.
        init_sync=False,
    )
    net = DistributedDataParallel(manager, model) if args.grads == "ddp" else model
    grads = [p for p in model.parameters() if p.requires_grad]

    spares = args.world_size_mode == "fixed_with_spares"
    stop = {"flag": False}

    def on_term(signum: int, frame: object) -> None:
        stop["flag"] = True
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    stats.write({"t": time.time(), "kind": "start", "t_process": T_START, "t_imported": t_imported,
                 "node": f"p2pft_chaos_{args.replica}.{os.getpid()}", "step": manager.current_step(),
                 "pid": os.getpid()})
    if args.go_file:
        go_deadline = time.monotonic() + 600
        while not os.path.exists(args.go_file) and time.monotonic() < go_deadline and not stop["flag"]:
            time.sleep(0.02)
    deadline = time.monotonic() + args.duration if args.duration else float("inf")
    while not stop["flag"] and time.monotonic() < deadline and (not args.steps or manager.current_step() < args.steps):
        manager.start_quorum()  # asynchronous: the quorum (and any healing) overlaps the forward pass
        opt.zero_grad()
        if spares and args.step_delay:
            time.sleep(args.step_delay)  # overlaps the quorum, which the data slot below waits for
        step0 = manager.current_step()
        # With spares a participant trains the slot of its rank in the quorum (a spare that took a
        # lost replica's place takes its slot; a spare's own gradients are zeroed by allreduce).
        rank = manager.participating_rank() if spares else None  # waits for the quorum
        slot = rank if rank is not None else args.replica
        base = (step0 * args.replicas + slot) * args.batch
        tokens = data.batch(list(range(base, base + args.batch)))
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        if args.step_delay and not spares:
            # Emulated accelerator time comes before the gradient exchange, as in p2pft's replica,
            # so a kill lands inside an exchange about as often in both systems.
            time.sleep(args.step_delay)
        loss.backward()  # ddp: the comm hook allreduces bucket by bucket through the manager
        if args.grads == "manual":
            allreduce_grads(manager, grads)
        participating = manager.is_participating()
        n = manager.num_participants()
        # A spare is reported as p2pft's hot spares are: a joiner (current, no data slot).
        role = "participant" if participating else "joiner"
        committed = manager.should_commit()  # every replica in the quorum must agree, else skip
        if committed:
            opt.step()
        step = manager.current_step()
        rec: dict[str, Any] = {"t": time.time(), "step": step, "c": int(committed),
                               "role": role, "n": n, "r": 0,
                               "e": int(getattr(manager, "_quorum_id", -1))}
        if manager.errored() is not None:
            rec["err"] = str(manager.errored())[:200]
        if committed and args.loss_every and step % args.loss_every == 0:
            rec["loss"] = float(loss.detach())
        if committed and args.eval_every and step % args.eval_every == 0:
            with torch.no_grad():
                rec["eval"] = float(model.loss(held_out))
        if committed and args.digest_every and step % args.digest_every == 0:
            rec["digest"] = state_digest(model, opt)
        stats.write(rec)
    stats.write({"t": time.time(), "kind": "exit", "step": manager.current_step()})
    stats.close()
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
