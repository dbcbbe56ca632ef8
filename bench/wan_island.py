"""One island of a ``bench/wan.py --ranks R`` run: an FSDP replica of R ranks on one host.

Started without ``RANK`` in its environment it is the island's launcher: it leads a process
group of its own (the benchmark kills the whole island, launcher and every rank, with one
``killpg``), dies with the benchmark, and spawns the R ranks (``p2pft.deploy.procs.ProcGroup``,
gloo between them on the host's loopback, ``OMP_NUM_THREADS=1``). A rank that dies takes the
island down: the others are killed and the launcher exits non-zero, as ``hsdp_replica.py``'s
launcher does, so a failure is always a whole island's.

Each rank trains one FSDP2 shard of the same model, data, inner AdamW and batch as
``wan_worker.py`` (the island's batch split over its ranks) and syncs its shard with the same
rank of the other islands: ``sync`` is synchronous HSDP across islands, ``diloco`` and
``streaming`` p2pft's DiLoCo over FSDP replicas (``DiLoCo`` on the sharded shape), ``torchft``
torchft 0.2.0's DiLoCo with FSDP inside (a Manager per rank, its replica group the island).
Every rank serves its shard's data port at the address the benchmark gave it, behind the
island's rate-limited link (the reason the bench builds the shape from ``DiLoCo``'s and
``HSDP``'s constructors rather than their ``launch``, which binds a port of its own choosing).

Rank 0 writes the records ``wan_worker.py`` writes (``start`` with every rank's pid, ``phase``,
one line per commit, ``eval`` weight files on r0, ``end``), with every rank's shard digest (in
rank order, comma-joined) at each committed sync (synchronous HSDP: every 10th step, as the
one-rank bench), and ``ready`` once the island holds the global weights (at the start, or once
a restarted p2pft island caught up) with the sync it holds and its digests; a torchft island
holds them from the round it healed in (``healed``). The eval weights are the global weights
gathered whole (``full_tensor`` of every shard): a collective of r0's ranks.

The ranks of an island stop together: a stop is handed to ``begin`` only at a span's start,
where the island agrees on it; a SIGTERM also interrupts a call blocked on the other islands,
and an error after it (a rank that left first, mid-span) is the stop, not a crash.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

STOP_GRACE_S = 30.0     # after a SIGTERM, how long the launcher waits for its ranks
RANK_DEATH_S = 2.0      # a rank that died alone takes the island down after this long


def main() -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--ranks", type=int, default=2)
    known, _ = pre.parse_known_args()
    if "RANK" not in os.environ:
        return launch(known.ranks, sys.argv[1:])
    return rank_main()


# ---------------------------------------------------------------------- the launcher
def launch(ranks: int, argv: list[str]) -> int:
    """Spawn the island's ranks in this process's own group; any rank dying ends the island."""
    from p2pft.deploy.ports import free_ports
    from p2pft.deploy.procs import ProcGroup, die_with_parent

    die_with_parent()
    os.setpgid(0, 0)          # the island's group: the benchmark's SIGKILL reaches every rank at once
    group = ProcGroup(pgid=os.getpgid(0))
    (port,) = free_ports(1)
    procs = [group.spawn([sys.executable, os.path.abspath(__file__), *argv],
                         env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks),
                                  LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                  OMP_NUM_THREADS="1"))
             for r in range(ranks)]
    stopping: dict[str, float | None] = {"t": None}

    def on_term(signum: int, frame: object) -> None:
        stopping["t"] = time.monotonic()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_term)
    first_failure: float | None = None
    while True:
        rcs = [p.poll() for p in procs]
        if all(rc is not None for rc in rcs):
            # After a stop, a rank still starting ends by the signal itself (no handler yet): a stop.
            ok = (0, -signal.SIGTERM) if stopping["t"] is not None else (0,)
            return 0 if all(rc in ok for rc in rcs) else 1
        if any(rc not in (None, 0) for rc in rcs) and first_failure is None:
            first_failure = time.monotonic()
        t = stopping["t"]
        if (first_failure is not None and time.monotonic() - first_failure > RANK_DEATH_S) or (
                t is not None and time.monotonic() - t > STOP_GRACE_S):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            print(f"island launcher: rank exit statuses {[p.returncode for p in procs]}; island torn down",
                  file=sys.stderr, flush=True)
            return 1
        time.sleep(0.02)


# ---------------------------------------------------------------------- one rank
def rank_main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from wan_worker import parser

    p = parser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--intra-timeout", type=float, default=120.0,
                   help="seconds an in-island collective waits for a rank (the island's gloo group)")
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.system.startswith("torchft"):
        return torchft_rank(a, rank, world)
    return p2pft_rank(a, rank, world)


class Island:
    """What every system's rank shares: the FSDP model, the records (rank 0 writes them), stop."""

    def __init__(self, a: argparse.Namespace, rank: int, world: int) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from p2pft.trainer.data import TextDataset
        from p2pft.trainer.model import ModelConfig

        self.a, self.rank, self.world = a, rank, world
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=a.intra_timeout))
        torch.manual_seed(0)    # identical initial weights on every island
        cfg = ModelConfig(vocab_size=256, d_model=a.d_model, n_layers=a.layers, n_heads=4, seq_len=64)
        self.model = cfg.build()
        self.mesh = init_device_mesh("cpu", (world,))
        for block in self.model.blocks:
            fully_shard(block, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        self.data = TextDataset(cfg.seq_len)
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=0.0)
        self.pids: list[object] = [None] * world
        dist.all_gather_object(self.pids, os.getpid())   # the start record names every rank
        self.out = open(a.stats, "a", buffering=1) if rank == 0 else None
        self.snaps = [0]
        self.last_eval = 0.0
        self.flag = False           # SIGTERM seen

        def on_term(signum: int, frame: object) -> None:
            self.flag = True
            if self.on_stop is not None:
                self.on_stop()
        self.on_stop: Callable[[], None] | None = None
        signal.signal(signal.SIGTERM, on_term)

    def write(self, rec: dict[str, Any]) -> None:
        if self.out is not None:
            self.out.write(json.dumps(rec) + "\n")

    def cpu_seconds(self) -> list[float]:
        """Collective: every rank's CPU seconds so far (its process: training, FSDP's collectives,
        p2pft's threads), in rank order. With each record, so that a run on shared cores also
        says what its islands would take on cores of their own (``bench/wan.py``, own_cores)."""
        import torch.distributed as dist
        got: list[object] = [None] * self.world
        dist.all_gather_object(got, round(time.process_time(), 4))
        return [float(g) for g in got]   # type: ignore[arg-type]

    def shard_digests(self, mine: str) -> str:
        """Collective: every rank's shard digest, in rank order, comma-joined."""
        import torch.distributed as dist
        got: list[object] = [None] * self.world
        dist.all_gather_object(got, mine)
        return ",".join(str(g) for g in got)

    def eval_due(self) -> bool:
        """Collective on r0: rank 0's word on whether to save the weights now (every rank gathers)."""
        if self.a.replica_id != "r0":
            return False
        due = [time.time() - self.last_eval >= self.a.eval_every]
        if self.a.eval_every > 0:
            import torch.distributed as dist
            dist.broadcast_object_list(due, src=0)
        return bool(due[0])

    def save_eval(self, whole: dict[str, torch.Tensor], samples: int, step: int) -> None:
        from wan_worker import save_weights
        self.last_eval = time.time()
        if self.rank == 0:
            self.write(save_weights(self.a.stats, self.snaps, whole, samples, step))

    def end(self, **extra: Any) -> None:
        """The last record, then leave without tearing torch down (the benchmark does not time it)."""
        import logging
        self.write({"kind": "end", "t": time.time(), **extra})
        if self.out is not None:
            self.out.close()
        logging.shutdown()
        os._exit(0)


def whole_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective over the island: every parameter gathered whole (FSDP shards are DTensors)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).detach().clone()
            for n, p in module.named_parameters()}


def p2pft_rank(a: argparse.Namespace, rank: int, world: int) -> int:
    """p2pft over an FSDP island: ``HSDP`` (sync) or ``DiLoCo`` on the sharded shape."""
    import torch.distributed as dist

    from p2pft import Runtime
    from p2pft.ops.log import setup_logging
    from p2pft.trainer import HSDP, DiLoCo, DiLoCoResult, Stopped
    from p2pft.transport import DataServer
    from p2pft.transport.addr import parse_hostport
    from wan_worker import outer_sgd

    setup_logging("WARNING")
    isl = Island(a, rank, world)
    listen = a.data_listen.split(",")[rank]
    host, port = parse_hostport(listen, "data listen address")
    # What Shape.launch does, at the data address this rank's link fronts: a data server per
    # rank, rank 0's Runtime announcing all of them (one per shard).
    ds = DataServer(host, port)
    addrs = a.advertise_data.split(",")
    rt = None
    if rank == 0:
        rt = Runtime(replica_id=a.replica_id, listen=a.listen, seeds=[s for s in a.seeds.split(",") if s],
                     data_addrs=addrs, shards=world, comm_timeout=a.comm_timeout).start()
    dist.barrier()
    # As wan_worker.py's replicas, plus the group the job waits for at its start (start()).
    common: dict[str, Any] = dict(batch_per_replica=a.batch, loop_timeout=None, comm_timeout=a.comm_timeout,
                                  min_replicas=a.min_replicas)
    rep: HSDP | DiLoCo
    weights: torch.nn.Module    # what r0 is judged by: the synchronous model, or DiLoCo's global weights
    if a.system == "sync":
        rep = HSDP(rt, isl.model, isl.inner, data_server=ds, lr_policy="none", **common)
        weights = isl.model
    else:
        rep = DiLoCo(rt, isl.model, isl.inner, data_server=ds, sync_every=a.sync_every, fragments=a.fragments,
                     overlap=a.overlap, alpha=a.alpha, compression=a.compression,
                     outer_optimizer=lambda ps: outer_sgd(ps, a), **common)
        weights = rep.global_model
    isl.on_stop = rep.request_stop   # a call blocked on the other islands (a sync, a view) ends too

    def committed() -> int:
        return rep.kernel.cursor.frontier - rep.kernel.cursor.hole_samples

    isl.write({"kind": "start", "t": time.time(), "pids": isl.pids})
    h = a.sync_every // max(1, a.fragments) if a.system == "streaming" else a.sync_every
    ran, k = 0, 0           # inner steps since the last sync record; into the current span
    ready = False
    try:
        rep.start()         # the group forms (min_replicas); at step 0 every rank takes its shard
        while True:
            if not ready and rep.synced:
                ready = True
                isl.write({"kind": "ready", "t": time.time(), "step": rep.step,
                           "digest": isl.shard_digests(rep.digest()), "cpu": isl.cpu_seconds()})
            idx = rep.begin(stop=(isl.flag or time.time() >= a.until) if k == 0 else False)
            rep.zero_grad()
            if idx:
                isl.model.loss(isl.data.batch(idx)).backward()
                if a.step_delay:
                    time.sleep(a.step_delay)
                ran += 1
                if a.system != "sync" and ran in (h // 2, h):
                    isl.write({"kind": "phase", "phase": "mid" if ran < h else "sync", "t": time.time()})
            got = rep.commit()
            outer = got.outer if isinstance(got, DiLoCoResult) else got
            k = 0 if outer is not None else k + 1
            if outer is None:
                continue
            rec = {"t": time.time(), "step": outer.step, "c": int(outer.committed), "n": outer.contributors,
                   "r": outer.retries, "role": outer.role, "ran": ran,
                   "kept": ran if outer.trained is not None else 0, "samples": committed(),
                   "cpu": isl.cpu_seconds()}
            if outer.fast_forwarded:   # commits applied from a peer's log (this replica's attempt failed)
                rec["ff"] = outer.fast_forwarded
            ran = 0
            if outer.committed and (a.system != "sync" or outer.step % 10 == 0):
                rec["digest"] = isl.shard_digests(rep.digest())
            isl.write(rec)
            if outer.committed and isl.eval_due():
                isl.save_eval(whole_params(weights), committed(), rep.step)
    except Stopped:
        pass
    except Exception:
        if not isl.flag:
            raise
    isl.end(inner_steps_run=getattr(rep, "inner_steps_run", None))
    return 0


def torchft_rank(a: argparse.Namespace, rank: int, world: int) -> int:
    """torchft 0.2.0's DiLoCo with FSDP inside: a Manager per rank, the island its replica group."""
    import hashlib
    import logging
    import threading
    from datetime import timedelta
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore
    from torch.distributed.tensor import DTensor
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from p2pft.trainer.algorithms.outer import split_fragments
    from wan_worker import _Fragment, outer_sgd

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("torchft.manager").setLevel(logging.INFO)
    isl = Island(a, rank, world)
    model, inner = isl.model, isl.inner
    names, params = zip(*model.named_parameters())
    if a.fragments > 1:
        groups = split_fragments(list(params), a.fragments)
        fragments: list[torch.nn.Module] = [_Fragment([params[i] for i in g]) for g in groups]
        frag_names = [{f"params.{j}": names[i] for j, i in enumerate(g)} for g in groups]
    else:
        fragments, frag_names = [model], [{nm: nm for nm in names}]
    outer: torch.optim.Optimizer | list[torch.optim.Optimizer] = (
        [outer_sgd(f.parameters(), a) for f in fragments] if a.fragments > 1 else outer_sgd(model.parameters(), a))
    host = a.listen.rsplit(":", 1)[0]
    # The island's store (rank 0's), reached by the other islands too: torchft's quorum hands it out.
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    box = [store.port if store is not None else 0]
    dist.broadcast_object_list(box, src=0)
    healed = {"round": False}

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])
        healed["round"] = True

    timeout = timedelta(seconds=a.comm_timeout)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg=pg, load_state_dict=load,
                      state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
                      min_replica_size=1, timeout=timeout, quorum_timeout=timedelta(seconds=a.quorum_timeout),
                      rank=rank, world_size=world, store_addr=host, store_port=int(box[0]),
                      lighthouse_addr=a.lighthouse, replica_id=f"wan_{a.replica_id}", hostname=host, init_sync=False,
                      checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
                      use_async_quorum=False)
    verdict: dict[str, bool | None] = {"commit": None}
    should_commit = manager.should_commit

    def recorded_should_commit(*args: Any, **kw: Any) -> bool:
        verdict["commit"] = should_commit(*args, **kw)
        return bool(verdict["commit"])
    manager.should_commit = recorded_should_commit   # type: ignore[method-assign]

    def hard_stop() -> None:   # a rank may sit in a quorum for up to --quorum-timeout
        threading.Timer(3.0, lambda: os._exit(0)).start()
    isl.on_stop = hard_stop
    r, n, b = int(a.replica_id.lstrip("r")), a.min_replicas, a.batch
    isl.write({"kind": "start", "t": time.time(), "pids": isl.pids})
    t_wait = time.time() + 120
    while a.go_file and not Path(a.go_file).exists() and time.time() < t_wait and not isl.flag:
        time.sleep(0.1)
    dist.barrier()
    isl.write({"kind": "ready", "t": time.time(), "step": manager.current_step()})
    committed, ran, k = 0, 0, 0
    h = a.sync_every // max(1, a.fragments)
    per = b // world
    diloco = TorchftDiLoCo(manager, fragments, inner, outer, sync_every=a.sync_every,
                           fragment_sync_delay=a.overlap, fragment_update_alpha=a.alpha)

    def global_local() -> dict[str, torch.Tensor]:
        """This rank's shards of the global weights (torchft's per-fragment backup of the last sync)."""
        return {frag_names[f][nm]: t for f, frag in enumerate(diloco._fragments)
                for nm, t in frag.original_parameters.items()}

    def global_whole() -> dict[str, torch.Tensor]:
        """Collective: the global weights gathered whole, each shard placed as its parameter's."""
        loc, ps = global_local(), dict(model.named_parameters())
        out = {}
        for nm in names:
            p = ps[nm]
            if isinstance(p, DTensor):
                out[nm] = DTensor.from_local(loc[nm], p.device_mesh, p.placements, shape=p.shape,
                                             stride=p.stride()).full_tensor()
            else:
                out[nm] = loc[nm].clone()
        return out

    try:
        with diloco:
            while not isl.flag and time.time() < a.until:
                s = manager.current_step()
                first = (s * n + r) * h * b + k * b + rank * per
                inner.zero_grad()
                model.loss(isl.data.batch(list(range(first, first + per)))).backward()
                if a.step_delay:
                    time.sleep(a.step_delay)
                ran += 1
                k += 1
                if k in (h // 2, h):
                    isl.write({"kind": "phase", "phase": "mid" if k < h else "sync", "t": time.time()})
                inner.step()
                if k < h:
                    continue
                k = 0
                after = manager.current_step()
                ok = bool(verdict["commit"])
                parts = manager.num_participants() if ok else 0
                committed += parts * h * b
                own = ok and not healed["round"]
                rec = {"t": time.time(), "step": after, "c": int(ok), "n": parts, "r": 0, "role": "torchft",
                       "ran": ran, "kept": ran if own else 0, "healed": int(healed["round"]), "samples": committed}
                ran = 0
                healed["round"], verdict["commit"] = False, None
                if ok:
                    g = global_local()
                    mine = hashlib.sha256(b"".join(g[nm].numpy().tobytes() for nm in names)).hexdigest()[:16]
                    rec["digest"] = isl.shard_digests(mine)
                isl.write(rec)
                if ok and isl.eval_due():
                    isl.save_eval(global_whole(), committed, after)
    except Exception:
        if not isl.flag:
            raise
    isl.end()
    return 0


if __name__ == "__main__":
    sys.exit(main())
