"""One HSDP replica of the example language-model job: R ranks, FSDP2 inside, p2pft across.

Start it with torchrun (one torchrun per replica; it restarts the replica as a whole)::

    torchrun --nproc-per-node 2 -m p2pft.trainer.examples.hsdp_replica --replica-id a --listen 127.0.0.1:7100
    torchrun --nproc-per-node 2 --master-port 29501 -m p2pft.trainer.examples.hsdp_replica \\
        --replica-id b --listen 127.0.0.1:7101 --seeds 127.0.0.1:7100

or with the small local launcher built in (``--nproc-per-node 2`` without torchrun's RANK
environment): it spawns the ranks with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set and, when any rank dies, kills the others and exits non-zero: the replica fails
and restarts as a whole (the test harness restarts it). Rank 0 appends one JSON line per step
to ``--stats``, with every rank's shard digest every ``--digest-every`` steps, and what a replay of
the run needs (``gpt.py``'s format: trained ranges, slot, the committed step's ring, the lr; with
``--clip-norm``, the norm and the clip coefficient applied; docs/hsdp.md).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from p2pft.trainer.job.cli import add_job_args, job_kwargs
from p2pft.deploy.replica_args import add_replica_args, require_replica_id
from p2pft.trainer.examples.signals import StopOnSignal

T_START = time.time()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_replica_args(p, replicas=2, digest_every=5)
    add_job_args(p)
    p.add_argument("--nproc-per-node", type=int, default=0, help="local launcher: spawn this many ranks")
    p.add_argument("--batch", type=int, default=8, help="samples per replica per step (split over the ranks)")
    p.add_argument("--stats", default=None, help="JSON-lines file for per-step records (rank 0)")
    p.add_argument("--intra-timeout", type=float, default=300.0,
                   help="seconds an in-replica collective may wait for a rank before this rank fails "
                        "(a stalled rank then takes its whole replica down, to be restarted); keep it "
                        "above the step timeout, since ranks also wait while rank 0 waits for a view")
    p.add_argument("--rank-timeout", type=float, default=10.0,
                   help="rank 0 takes the replica down when another rank has not answered its pings "
                        "for this long (a stopped or wedged rank)")
    p.add_argument("--clip-norm", type=float, default=None,
                   help="clip the mean gradient's global norm (over every shard) to this (default: off); "
                        "the stats record each committed step's norm and clip coefficient")
    p.add_argument("--pause-at-step", type=int, default=0,
                   help="at this committed step, step out for --pause-s seconds (rep.pause): the others go on")
    p.add_argument("--pause-s", type=float, default=0.0, help="length of the pause of --pause-at-step (s)")
    p.add_argument("--sync-every", type=int, default=0,
                   help="DiLoCo across islands: this FSDP replica trains on its own and syncs its pseudo-gradient "
                        "every N inner steps (0: HSDP, every step); --steps then counts inner steps, a record is "
                        "written per sync and the outer step takes DiLoCo's lr policy (none)")
    p.add_argument("--cold-steps", type=int, default=0,
                   help="a cold start: this process's first N (inner) steps each take --cold-delay seconds more "
                        "(caches, compilation; a restarted island's first span is then partial)")
    p.add_argument("--cold-delay", type=float, default=0.0, help="see --cold-steps")
    p.add_argument("--fragments", type=int, default=1, help="DiLoCo: Streaming DiLoCo's fragments")
    p.add_argument("--overlap", type=int, default=0, help="DiLoCo: inner steps a sync overlaps with training")
    args = p.parse_args(argv)
    require_replica_id(p, args)
    return args


# ---------------------------------------------------------------------- local launcher
def launch(nproc: int, argv: list[str]) -> int:
    """Spawn `nproc` ranks of this script; any rank dying kills the whole replica.

    The ranks share one process group and die with the launcher (``p2pft.deploy.procs``): SIGTERM,
    SIGINT and SIGHUP stop them in order, and a SIGKILLed launcher leaves no orphan rank.
    """
    from p2pft.deploy.ports import free_ports
    from p2pft.deploy.procs import ProcGroup
    (port,) = free_ports(1)
    procs = []
    group = ProcGroup()
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   P2PFT_T_LAUNCH=str(T_START))
        procs.append(group.spawn([sys.executable, "-m", "p2pft.trainer.examples.hsdp_replica", *argv], env=env))
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
        failed = [rc for rc in rcs if rc is not None and rc != 0]
        ended = [rc for rc in rcs if rc is not None]
        if len(ended) == len(rcs) and len(set(ended)) == 1:
            return ended[0]   # every rank left with the same word (0, or a job error's exit code)
        if failed and first_failure is None:
            first_failure = time.monotonic()
        # A job error reaches every rank at once (they exit alike, see above); a rank that
        # died alone takes the replica down after a moment.
        if (first_failure is not None and time.monotonic() - first_failure > 5.0) or (
                stopping["t"] is not None and time.monotonic() - stopping["t"] > 30):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            group.kill()
            print(f"hsdp launcher: a rank exited with {failed}; replica torn down", file=sys.stderr, flush=True)
            return 1
        time.sleep(0.02)


# ---------------------------------------------------------------------- one rank
def worker(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch
    import torch._dynamo  # noqa: F401  (imported lazily by the first optimizer step otherwise)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    from p2pft.ops.log import setup_logging
    from p2pft.trainer.metrics import StepMetrics
    from p2pft.trainer.data import TextDataset
    from p2pft.trainer.kernel.attempt import StepResult
    from p2pft.trainer.kernel.errors import JobError, Stopped
    from p2pft.trainer.algorithms.diloco import DiLoCo
    from p2pft.trainer.algorithms.hsdp import HSDP
    from p2pft.trainer.progress import Progress
    from p2pft.trainer.model import model_config_for
    from p2pft.net.wire import load_secret

    setup_logging(args.log_level)
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=args.intra_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    t_imported = time.time()
    torch.manual_seed(args.seed)
    cfg = model_config_for(args.model)
    model = cfg.build()
    data = TextDataset(cfg.seq_len)
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    stop = StopOnSignal()   # SIGTERM/SIGINT: the loop ends, the trainer's current call raises Stopped
    common = dict(replica_id=args.replica_id, listen=args.listen, seeds=[s for s in args.seeds.split(",") if s],
                  secret=load_secret(args.secret_file), batch_per_replica=args.batch, nominal_replicas=args.replicas,
                  rank_timeout=args.rank_timeout, clip_norm=args.clip_norm, **job_kwargs(args),
                  runtime_kw={"metrics_port": args.metrics_port, "max_participants": args.max_participants})
    rep: HSDP | DiLoCo
    if args.sync_every:   # islands: DiLoCo between FSDP replicas (the outer step's lr policy: DiLoCo's own)
        rep = DiLoCo.launch(model, opt, sync_every=args.sync_every, fragments=args.fragments, overlap=args.overlap,
                            lr_policy=None, **common)
    else:
        rep = HSDP.launch(model, opt, lr_policy=args.lr_policy, **common)
    stop.attach(rep)
    steps = StepMetrics.attach(rep.rt, rep.kernel)   # rank 0 with --metrics-port; a no-op otherwise
    pids: list[int | None] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    progress = Progress(f"{args.replica_id}", mode=args.progress if rank == 0 else "off")
    fh = open(args.stats, "a", buffering=1) if (args.stats and rank == 0) else None

    def write(rec: dict) -> None:
        if fh is not None:
            fh.write(json.dumps(rec, separators=(",", ":")) + "\n")

    if rep.rt is not None:
        write({"t": time.time(), "kind": "start", "t_process": T_START, "t_imported": t_imported,
               "node": rep.rt.node_id, "pids": pids, "step": rep.step,
               "t_launch": float(os.environ.get("P2PFT_T_LAUNCH", T_START))})
    if args.go_file:
        deadline = time.monotonic() + 600
        while not os.path.exists(args.go_file) and time.monotonic() < deadline and not stop.flag:
            time.sleep(0.02)
    code = 0
    refused = False    # the job would not take this replica (finished, lost, misdeclared)
    try:
        # The group forms (min_replicas), the job's state is checked (finished, progress lost),
        # and at step 0 every rank takes its shard of the lead replica's state.
        rep.start()
    except JobError as exc:
        print(f"replica {args.replica_id} rank {rank}: {exc}", file=sys.stderr, flush=True)
        code, refused = exc.exit_code, True
    if rank == 0:
        shard0 = rep.digests()
        write({"t": time.time(), "kind": "begin", "step": rep.step, "digest": ",".join(shard0),
               "full": rep.full_digest()})
    else:
        rep.digests()
        rep.full_digest()
    deadline = time.monotonic() + args.duration if args.duration else float("inf")
    last_epoch = -1
    paused = False
    trained = 0   # (inner) steps this process trained
    optstep = rep.kernel.optimizer_step
    while not code and not rep.done:
        if args.pause_at_step and not paused and rep.step >= args.pause_at_step:
            paused = True
            with rep.pause("eval"):   # collective: every rank steps out; the other replicas commit meanwhile
                pause_end = time.monotonic() + args.pause_s
                while time.monotonic() < pause_end and not stop.flag:
                    time.sleep(0.02)
        try:
            idx = rep.begin(stop=stop.flag or time.monotonic() > deadline)
            slot = rep.kernel.current_slot   # the slot this step trains for (commit() clears it)
            rep.zero_grad()
            if idx:
                model.loss(data.batch(idx).to("cuda" if cuda else "cpu")).backward()
                if trained < args.cold_steps:
                    time.sleep(args.cold_delay)
                trained += 1
            if args.step_delay:
                time.sleep(args.step_delay)
            got = rep.commit()
        except Stopped:
            break
        except JobError as exc:
            print(f"replica {args.replica_id} rank {rank}: {exc}", file=sys.stderr, flush=True)
            code = exc.exit_code
            break
        if isinstance(got, StepResult):
            res = got
        elif got.outer is not None:   # DiLoCo: a record per sync
            res = got.outer
        else:
            continue
        steps.observe_step(res)
        digests = rep.digests() if res.committed and args.digest_every and res.step % args.digest_every == 0 else None
        if rep.rt is not None:
            view = rep.rt.view
            rec = {"t": time.time(), "step": res.step, "c": int(res.committed), "role": res.role,
                   "n": res.contributors, "r": res.retries, "e": view.epoch if view else 0}
            # What a replay needs (gpt.py's format, p2pft/chaos/oracle.py): the ranges we trained,
            # our slot and the step they were in; the committed step's ring (slot -> data rank, its
            # size); the lr it ran with and, with clipping, the norm and the coefficient applied.
            if res.trained:
                rec.update(tr=[list(x) for x in res.trained], slot=res.slot if res.slot is not None else slot,
                           ts=res.trained_step)
            if res.fast_forwarded:
                rec["ff"] = res.fast_forwarded
            if res.committed and res.slot_ranks:
                rec.update(sr=sorted([k, r] for k, r in res.slot_ranks.items()), dw=res.data_world)
            if (res.committed or res.fast_forwarded) and optstep.last_lrs:
                rec["lr"] = optstep.last_lrs[0]
                if args.clip_norm is not None:
                    rec.update(norm=optstep.last_norm, clip=optstep.last_clip)
            if digests:
                rec["digest"] = ",".join(digests)  # shard digests in rank order
            if view is not None and view.epoch != last_epoch:
                last_epoch = view.epoch
                rec["view"] = [[m.replica_id, m.role.value[0]] for m in view.members]
            write(rec)
            progress.step(res, view.epoch if view else None)
            for ev in list(rep.events):
                write({**ev, "kind": "event", "event": ev["kind"]})
                progress.event(ev)
        rep.events.clear()
    if not refused and not code and rep.done and not stop.flag:
        try:
            end = rep.finish()    # the end barrier: every replica at the job's last step
            write({"t": time.time(), "kind": "event", "event": "finished", "step": end})
        except JobError as exc:
            print(f"replica {args.replica_id} rank {rank}: {exc}", file=sys.stderr, flush=True)
            code = exc.exit_code
    if rank == 0:
        progress.summary(rep.step)
    if rep.synced:
        digests = rep.digests()
        full = rep.full_digest()
        write({"t": time.time(), "kind": "exit", "step": rep.step, "digest": ",".join(digests), "full": full,
               "code": code})
    else:
        write({"t": time.time(), "kind": "exit", "step": rep.step, "code": code})
    if fh is not None:
        fh.close()
    rep.close()
    dist.destroy_process_group()
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.nproc_per_node and "RANK" not in os.environ:
        return launch(args.nproc_per_node, argv)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
