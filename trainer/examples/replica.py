"""One replica of the example language-model job (what ``p2pft chaos`` launches).

Run it as it is, e.g. three replicas on one machine::

    python -m p2pft.trainer.examples.replica --replica-id r0 --listen 127.0.0.1:7100 &
    python -m p2pft.trainer.examples.replica --replica-id r1 --listen 127.0.0.1:7101 --seeds 127.0.0.1:7100 &
    python -m p2pft.trainer.examples.replica --replica-id r2 --listen 127.0.0.1:7102 --seeds 127.0.0.1:7100 &

Each commit is appended to ``--stats`` as one JSON line (time, step, role, contributors,
epoch), plus a state digest every ``--digest-every`` steps, so a harness can check that
replicas at the same step hold bitwise-identical weights.

``--steps N`` declares the job's end (``total_steps``): the replicas meet at the end barrier
and exit together, and a replica started after that exits 0 at once, saying so. Exit codes: 0
done (or stopped by SIGTERM/SIGINT), 2 a bad option or a job declared otherwise, 3 the job's
progress is lost (no peer and no checkpoint holds its high-water step; see
``--allow-restart-from-scratch``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Callable, cast

from p2pft.trainer.job.cli import add_job_args, job_kwargs
from p2pft.deploy.replica_args import add_replica_args, require_replica_id
from p2pft.trainer.examples.signals import StopOnSignal

if TYPE_CHECKING:  # imported in main(), after the arguments parse (torch takes seconds)
    import torch

    from p2pft import Runtime
    from p2pft.trainer import FaultTolerant
    from p2pft.trainer.metrics import StepMetrics
    from p2pft.trainer.progress import Progress

T_START = time.time()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_replica_args(p, replicas=3, digest_every=10)
    add_job_args(p)
    p.add_argument("--advertise", default=os.environ.get("P2PFT_ADVERTISE"),
                   help="HOST:PORT peers use for the control port, if not --listen (env P2PFT_ADVERTISE)")
    p.add_argument("--data-listen", default=os.environ.get("P2PFT_DATA_LISTEN"),
                   help="HOST:PORT of the data port (default: the --listen host, any port; env P2PFT_DATA_LISTEN)")
    p.add_argument("--advertise-data", default=os.environ.get("P2PFT_ADVERTISE_DATA"),
                   help="HOST:PORT peers use for the data port, if not its own (env P2PFT_ADVERTISE_DATA)")
    p.add_argument("--mlp-params", type=int, default=0, help="use a plain MLP of about this many parameters")
    p.add_argument("--batch", type=int, default=8, help="samples per replica per step")
    p.add_argument("--stats", default=None, help="JSON-lines file for per-step records")
    p.add_argument("--loss-every", type=int, default=0, help="log the training loss every N steps")
    p.add_argument("--eval-every", type=int, default=0, help="log the loss on a fixed held-out batch every N steps")
    p.add_argument("--state-rate-limit", type=float, default=0.0,
                   help="bytes/s cap for snapshot transfers this replica pulls as a joiner (0: no cap)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default=os.environ.get("P2PFT_DEVICE", "cpu"),
                   help="torch device of the model and step buffer, e.g. cuda or cuda:1 (env P2PFT_DEVICE)")
    p.add_argument("--data-plane", default=None, choices=["auto", "nccl", "tcp"],
                   help="backend across replicas (default: $P2PFT_DATA_PLANE, else auto: nccl for CUDA "
                        "tensors when CuPy+NCCL work, tcp otherwise)")
    p.add_argument("--comm-timeout", type=float, default=10.0, help="data-plane operation timeout (s)")
    p.add_argument("--loop-timeout", type=float, default=60.0,
                   help="the leader leaves this replica out when its training loop stalls this long (s)")
    p.add_argument("--step-timeout", type=float, default=120.0,
                   help="a commit that finds no view to commit in for this long raises StepTimeout (s)")
    p.add_argument("--pause-at-step", type=int, default=0,
                   help="at this committed step, step out for --pause-s seconds (ft.pause): the others go on")
    p.add_argument("--pause-s", type=float, default=0.0, help="length of the pause of --pause-at-step (s)")
    p.add_argument("--leader-eval-every", type=int, default=0,
                   help="the leader of every N-th committed step evaluates inside ft.pause('eval') for "
                        "--leader-eval-s seconds (a nanoGPT-style loop; 0: never)")
    p.add_argument("--leader-eval-s", type=float, default=0.5, help="length of each leader evaluation (s)")
    p.add_argument("--pause-until-file", default=None,
                   help="the pause of --pause-at-step also ends once this file exists (a test ends it as soon "
                        "as it has seen what happens during the pause)")
    p.add_argument("--recent-keep", type=int, default=2,
                   help="committed steps kept for peers that missed them and fast-forward (FaultTolerant's "
                        "recent_keep)")
    p.add_argument("--hang-at-step", type=int, default=0,
                   help="fault injection: at this committed step the training loop hangs (the process "
                        "keeps gossiping) until SIGTERM")
    args = p.parse_args(argv)
    require_replica_id(p, args)
    if args.comm_timeout <= 0:
        p.error("--comm-timeout must be positive")
    if args.loop_timeout and args.loop_timeout <= args.comm_timeout:
        p.error(f"--loop-timeout ({args.loop_timeout:g} s) must exceed --comm-timeout ({args.comm_timeout:g} s): "
                "an allreduce may block that long without the loop beating")
    return args


class Stats:
    """Buffered JSON-lines writer, flushed often: the process may be SIGKILLed at any moment."""

    def __init__(self, path: str | None) -> None:
        self.fh = open(path, "a", buffering=1 << 16) if path else None
        self.last_flush = time.monotonic()

    def write(self, rec: dict[str, object]) -> None:
        if self.fh is None:
            return
        self.fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        if time.monotonic() - self.last_flush > 0.1:
            self.fh.flush()
            self.last_flush = time.monotonic()

    def flush(self) -> None:
        if self.fh:
            self.fh.flush()

    def close(self) -> None:
        if self.fh:
            self.fh.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch._dynamo  # noqa: F401  (imported lazily by the first optimizer: a torch import, ~2 s)

    from p2pft import Runtime
    from p2pft.ops.log import setup_logging
    from p2pft.trainer.metrics import StepMetrics
    from p2pft.trainer import FaultTolerant
    from p2pft.trainer.algorithms.ft import (InitialStateMismatch, JobConfigError, MissingStateError, StepTimeout,
                                             Stopped)
    from p2pft.trainer.progress import Progress
    from p2pft.trainer.data import TextDataset
    from p2pft.trainer.model import build_mlp_for_params, model_config_for
    from p2pft.net.wire import load_secret

    setup_logging(args.log_level)
    torch.set_num_threads(args.threads)
    stats = Stats(args.stats)
    t_imported = time.time()
    from p2pft.transport.backend import DataPlaneError, choose_backend, data_plane_from
    device = torch.device(args.device)
    try:  # an impossible data plane is one line, before anything is bound
        choose_backend(data_plane_from(args.data_plane), device.type)
    except DataPlaneError as exc:
        print(f"replica: {exc}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    eval_loss: Callable[[], float] | None = None
    model: torch.nn.Module
    if args.mlp_params:
        mlp = build_mlp_for_params(args.mlp_params).to(device)
        model = mlp
        width = cast(torch.nn.Linear, mlp[0]).in_features

        def loss_fn(idx: list[int]) -> torch.Tensor:
            g = torch.Generator().manual_seed(idx[0])
            x = torch.randn(len(idx), width, generator=g).to(device)
            out: torch.Tensor = mlp(x)
            return (out - x).pow(2).mean()
    else:
        cfg = model_config_for(args.model)
        lm = cfg.build().to(device)
        model = lm
        data = TextDataset(cfg.seq_len)

        def loss_fn(idx: list[int]) -> torch.Tensor:
            return lm.loss(data.batch(idx).to(device))

        held_out = data.batch(list(range(len(data) - 32, len(data)))).to(device)

        def held_out_loss() -> float:
            with torch.no_grad():
                return float(lm.loss(held_out))
        eval_loss = held_out_loss
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    seeds = [s for s in args.seeds.split(",") if s]
    t_model = time.time()
    rt = Runtime(replica_id=args.replica_id, listen=args.listen, seeds=seeds,
                 secret=load_secret(args.secret_file), advertise=args.advertise, data_listen=args.data_listen,
                 advertise_data=args.advertise_data, comm_timeout=args.comm_timeout,
                 metrics_port=args.metrics_port, data_plane=args.data_plane,
                 max_participants=args.max_participants).start()
    t_runtime = time.time()
    stop = StopOnSignal()   # SIGTERM/SIGINT: the loop ends, the trainer's current call raises Stopped

    ft = FaultTolerant(rt, model, opt, batch_per_replica=args.batch, nominal_replicas=args.replicas,
                       lr_policy=args.lr_policy, state_rate_limit=args.state_rate_limit or None,
                       loop_timeout=args.loop_timeout or None, start_timeout=30.0, step_timeout=args.step_timeout,
                       recent_keep=args.recent_keep, **job_kwargs(args))
    t_engine = time.time()
    stop.attach(ft)
    steps = StepMetrics.attach(rt, ft.kernel)   # per-step metrics; a no-op without --metrics-port
    progress = Progress(args.replica_id, mode=args.progress)
    try:
        # The group forms before the start record, as a torch job's rendezvous does before its
        # first step (the harness measures training from the start records); a restart the view
        # makes a joiner does not wait. The job's state is checked here (finished, progress lost).
        ft.start()
    except Stopped as exc:  # SIGTERM while forming, or the job already finished (JobFinished)
        print(f"replica {args.replica_id}: {exc}", file=sys.stderr)
        return _close(ft, rt, stats, 0)
    except MissingStateError:  # logged as one ERROR naming the step
        return _close(ft, rt, stats, 3)
    except (JobConfigError, InitialStateMismatch):  # logged as one ERROR
        return _close(ft, rt, stats, 2)
    except DataPlaneError:  # e.g. nccl with two replicas on one GPU: logged as one ERROR
        stats.write({"t": time.time(), "kind": "exit", "step": ft.step, "error": "data_plane"})
        return _close(ft, rt, stats, 2)
    except StepTimeout as exc:  # no group within the start timeout
        print(f"replica {args.replica_id}: {exc}", file=sys.stderr)
        return _close(ft, rt, stats, 3)
    stats.write({"t": time.time(), "kind": "start", "t_process": T_START, "t_imported": t_imported,
                 "t_model": t_model, "t_runtime": t_runtime, "t_engine": t_engine,
                 "node": rt.node_id, "step": ft.step, "pid": os.getpid(), "digest": ft.digest()})
    stats.flush()
    if args.go_file:
        go_deadline = time.monotonic() + 600
        while not os.path.exists(args.go_file) and time.monotonic() < go_deadline and not stop.flag:
            time.sleep(0.02)
    deadline = time.monotonic() + args.duration if args.duration else float("inf")
    try:
        _train(args, ft, rt, stats, progress, steps, loss_fn, eval_loss, stop, deadline)
        if args.steps and ft.done and not stop.flag:
            end = ft.finish()
            stats.write({"t": time.time(), "kind": "event", "event": "finished", "step": end})
    except Stopped:  # SIGTERM at begin(), commit() or finish(), or the job finished meanwhile
        pass
    except JobConfigError:  # logged as one ERROR
        return _close(ft, rt, stats, 2)
    except MissingStateError:  # every participant died while this one was behind them
        return _close(ft, rt, stats, 3)
    except DataPlaneError:  # e.g. nccl with two replicas on one GPU: the engine logged it at ERROR
        stats.write({"t": time.time(), "kind": "exit", "step": ft.step, "error": "data_plane"})
        return _close(ft, rt, stats, 2)
    except StepTimeout as exc:  # nothing to commit for --step-timeout (e.g. a lone joiner)
        print(f"replica {args.replica_id}: {exc}", file=sys.stderr)
        stats.write({"t": time.time(), "kind": "exit", "step": ft.step, "error": "step_timeout"})
        return _close(ft, rt, stats, 3)
    progress.summary(ft.step)
    # Mid catch-up the weights are neither the old step's nor the snapshot's: no digest then.
    stats.write({"t": time.time(), "kind": "exit", "step": ft.step, "cursor": ft.kernel.cursor.state_dict(),
                 **({"digest": ft.digest()} if ft.synced else {}), "data_counters": dict(rt.data.counters)})
    return _close(ft, rt, stats, 0)


def _train(args: argparse.Namespace, ft: FaultTolerant, rt: Runtime, stats: Stats, progress: Progress,
           steps: StepMetrics, loss_fn: Callable[[list[int]], torch.Tensor], eval_loss: Callable[[], float] | None,
           stop: StopOnSignal, deadline: float) -> None:
    """The training loop: until the job's end (``--steps``), ``--duration``, or a stop."""
    last_epoch = -1
    paused = False
    first_view_written = False

    def write_events() -> None:
        while ft.events:  # popleft: the catch-up worker appends concurrently
            ev = ft.events.popleft()
            stats.write({**ev, "kind": "event", "event": ev["kind"]})
            progress.event(ev)
        stats.flush()
    while not stop.flag and time.monotonic() < deadline and not (args.steps and ft.done):
        if args.hang_at_step and ft.step >= args.hang_at_step:
            stats.write({"t": time.time(), "kind": "event", "event": "hang", "step": ft.step})
            stats.flush()
            while not stop.flag:  # a wedged loop: the runtime thread keeps gossiping
                time.sleep(0.05)
            break
        if args.pause_at_step and not paused and ft.step >= args.pause_at_step:
            paused = True
            with ft.pause("eval"):  # evaluation on this replica only: the others commit meanwhile
                write_events()
                pause_end = time.monotonic() + args.pause_s
                while (time.monotonic() < pause_end and not stop.flag
                       and not (args.pause_until_file and os.path.exists(args.pause_until_file))):
                    time.sleep(0.05)
            write_events()
            continue
        idx = ft.begin()
        ft.zero_grad()
        loss_val = None
        if idx:
            loss = loss_fn(idx)
            if args.step_delay:
                # Emulated accelerator time between forward and backward, where the DDP and
                # torchft baselines put it (their backward starts the exchange).
                time.sleep(args.step_delay)
            loss.backward()
            loss_val = float(loss.detach())
        elif args.step_delay:
            time.sleep(args.step_delay)
        res = ft.commit()
        if rt.view_log and not first_view_written:  # start-up phases (bench/startup.py)
            first_view_written = True
            stats.write({"t": time.time(), "kind": "first_view", "t_view": rt.view_log[0][0]})
        steps.observe_step(res)
        view = rt.view
        progress.step(res, view.epoch if view else None, loss_val)
        rec = {"t": time.time(), "step": res.step, "c": int(res.committed), "role": res.role,
               "n": res.contributors, "r": res.retries, "e": view.epoch if view else 0}
        if ft.is_leader:
            rec["lead"] = 1
        if res.fast_forwarded:
            rec["ff"] = res.fast_forwarded
        if res.trained:
            rec["tr"] = res.trained
        if loss_val is not None and args.loss_every and res.committed and res.step % args.loss_every == 0:
            rec["loss"] = loss_val
        if res.committed and args.eval_every and eval_loss is not None and res.step % args.eval_every == 0:
            rec["eval"] = eval_loss()
        if res.committed and args.digest_every and res.step % args.digest_every == 0:
            rec["digest"] = ft.digest()
        if view is not None and view.epoch != last_epoch:
            last_epoch = view.epoch
            rec["view"] = [[m.replica_id, m.role.value[0]] for m in view.members]
        stats.write(rec)
        if (args.leader_eval_every and res.committed and res.step % args.leader_eval_every == 0
                and ft.is_leader and not stop.flag):
            stats.write({"t": time.time(), "kind": "event", "event": "leader_eval", "step": res.step})
            with ft.pause("eval"):   # one replica per step evaluates; the others train on
                pause_end = time.monotonic() + args.leader_eval_s
                while time.monotonic() < pause_end and not stop.flag:
                    time.sleep(0.02)
        while ft.events:  # popleft: the catch-up worker appends concurrently
            ev = ft.events.popleft()
            stats.write({**ev, "kind": "event", "event": ev["kind"]})
            progress.event(ev)


def _close(ft: FaultTolerant, rt: Runtime, stats: Stats, code: int) -> int:
    stats.close()
    ft.close()
    rt.close(leave=True)
    return code


if __name__ == "__main__":
    from p2pft.deploy.procs import exit_now
    exit_now(main())
