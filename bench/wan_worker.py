"""One replica of a ``bench/wan.py`` run: synchronous p2pft, DiLoCo, Streaming DiLoCo or torchft's DiLoCo.

The same transformer LM, data, inner optimizer and batch for every system. One JSON line per
committed step (synchronous) or sync (DiLoCo): time, committed samples, contributors, the work
this replica ran and kept, a digest (``ff``: commits it applied from a peer's log instead). r0
also saves the weights every system is judged by (the synchronous model; DiLoCo's global
weights) after every commit (at most every ``--eval-every`` seconds, 0: every commit) to
``<stats>.<n>.pt``, with an ``eval`` record of its time and samples; the benchmark computes
their validation losses after the run, so evaluating costs no system training time and every
curve has a point at every commit.

torchft's DiLoCo (``torchft.local_sgd.DiLoCo``, torchft 0.2.0) runs the same inner AdamW, outer
SGD and H around a lighthouse on a host of its own (``--fragments N``: its Streaming DiLoCo, the
model split into N fragments as p2pft splits it, ``--overlap`` its ``fragment_sync_delay``,
``--alpha`` its ``fragment_update_alpha``); replica r's k-th inner step of round s
(torchft's committed step count; a round is a fragment's sync when streaming, H its span) trains
samples ``[(s R + r) H B + k B, +B)``: round s's samples are the ones p2pft's cursor hands out for
sync s, and each replica trains a contiguous span of them, as a p2pft replica trains the span its
begin took (an earlier layout interleaved the replicas per inner step; a plain-PyTorch replay of
three replicas gives exactly the benchmark's curve for either layout, and at outer momentum 0.9
the two layouts end 0.25 apart after 5 syncs: the loss gap between the torchft and p2pft rows
was the layout, not the systems). A discarded round's samples are trained again. A round counts
as committed when torchft's ``should_commit`` said so (the verdict its DiLoCo hook got).
torchft heals a restarted replica through its PG transport (the checkpoint goes over the Gloo
group, which reaches every namespace host; the default HTTP transport advertises the machine's
hostname, which no namespace resolves). A round in which this replica healed is recorded with
``healed``: its weights were replaced by the donor's before the sync, so its pseudo-gradient is
a copy of the donor's and its own inner steps are not kept.

Every system writes ``phase`` records (``mid``: half of a span done; ``sync``: the span's last
inner step is done and its sync starts), so the benchmark can kill a replica mid-span or during
a sync. ``--step-delay`` emulates accelerator time per inner (or synchronous) step.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable

import torch

from p2pft.trainer.examples.signals import StopOnSignal


def parser() -> argparse.ArgumentParser:
    """The worker's flags (``wan_island.py`` takes the same, a comma list per rank where it has ranks)."""
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=["sync", "diloco", "streaming", "torchft", "torchft-streaming"], required=True)
    p.add_argument("--replica-id", required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--seeds", default="")
    p.add_argument("--data-listen", required=True)
    p.add_argument("--advertise-data", required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--until", type=float, required=True, help="wall-clock time to stop at")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--overlap", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.0)
    p.add_argument("--compression", default="none")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--eval-every", type=float, default=0.0,
                   help="r0: least seconds between saved weights for evaluation (0: after every commit)")
    p.add_argument("--comm-timeout", type=float, default=30.0)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov momentum of the outer SGD (0: none)")
    p.add_argument("--lighthouse", default=None, help="torchft: the lighthouse's URL")
    p.add_argument("--go-file", default=None, help="torchft: start training once this file exists")
    p.add_argument("--quorum-timeout", type=float, default=3600.0,
                   help="torchft: the Manager's quorum timeout (its docs: ~1 h or longer for DiLoCo)")
    p.add_argument("--step-delay", type=float, default=0.0, help="emulated accelerator seconds per (inner) step")
    return p


def main() -> int:
    p = parser()
    a = p.parse_args()
    if a.system.startswith("torchft"):
        return torchft_main(a)

    from p2pft import Runtime
    from p2pft.ops.log import setup_logging
    from p2pft.trainer import DiLoCo, FaultTolerant, Stopped
    from p2pft.trainer.data import TextDataset
    from p2pft.trainer.model import ModelConfig

    setup_logging("WARNING")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=a.d_model, n_layers=a.layers, n_heads=4, seq_len=64)
    model = cfg.build()
    data = TextDataset(cfg.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    rt = Runtime(replica_id=a.replica_id, listen=a.listen, seeds=[s for s in a.seeds.split(",") if s],
                 data_listen=a.data_listen, advertise_data=a.advertise_data, comm_timeout=a.comm_timeout).start()
    if a.system == "sync":
        eng: FaultTolerant | DiLoCo = FaultTolerant(rt, model, opt, batch_per_replica=a.batch, lr_policy="none",
                                                    loop_timeout=None)
        weights = model
    else:
        eng = DiLoCo(rt, model, opt, sync_every=a.sync_every, batch_per_replica=a.batch, fragments=a.fragments,
                     outer_optimizer=lambda ps: outer_sgd(ps, a),
                     overlap=a.overlap, alpha=a.alpha, compression=a.compression, loop_timeout=None)
        weights = eng.global_model
    stop = StopOnSignal((signal.SIGTERM,))   # SIGTERM: the loop ends, the trainer's call raises Stopped
    stop.attach(eng)
    out = open(a.stats, "a", buffering=1)

    def write(rec: dict) -> None:
        out.write(json.dumps(rec) + "\n")

    snaps = [0]

    def evaluate() -> None:
        write(save_weights(a.stats, snaps, weights.state_dict(), committed(), eng.step))

    def committed() -> int:
        return eng.kernel.cursor.frontier - eng.kernel.cursor.hole_samples

    write({"kind": "start", "t": time.time()})
    if a.min_replicas > 1 and eng.step == 0:
        # The group forms first; a restarted replica (a joiner) must not wait: it is in the view,
        # and the others' allreduce waits for it to answer.
        rt.wait_view(lambda v: len(v.participants) >= a.min_replicas or v.role_of(rt.node_id) == "joiner"
                     or stop.flag, timeout=60)
    write({"kind": "ready", "t": time.time()})   # the benchmark's clock starts here, for every system
    evaluator = a.replica_id == "r0"
    last_eval = 0.0
    ran = 0
    # A sync every H inner steps (Streaming DiLoCo: one fragment's every H / fragments).
    h = a.sync_every // max(1, a.fragments) if a.system == "streaming" else a.sync_every
    while not stop.flag and time.time() < a.until:
        try:
            idx = eng.begin()
            eng.zero_grad()
            if idx:
                model.loss(data.batch(idx)).backward()
                if a.step_delay:
                    time.sleep(a.step_delay)
                ran += 1
                if a.system != "sync" and ran in (h // 2, h):
                    write({"kind": "phase", "phase": "mid" if ran < h else "sync", "t": time.time()})
            res = eng.commit()
        except Stopped:
            break
        outer = res if a.system == "sync" else res.outer
        if outer is None:
            continue
        rec = {"t": time.time(), "step": outer.step, "c": int(outer.committed), "n": outer.contributors,
               "r": outer.retries, "role": outer.role, "ran": ran, "kept": ran if outer.trained is not None else 0,
               "samples": committed()}
        if outer.fast_forwarded:   # commits applied from a peer's log (this replica's attempt failed)
            rec["ff"] = outer.fast_forwarded
        ran = 0
        if outer.committed and (a.system != "sync" or outer.step % 10 == 0):
            rec["digest"] = eng.digest()
        write(rec)
        if evaluator and outer.committed and time.time() - last_eval >= a.eval_every:
            evaluate()
            last_eval = time.time()
    write({"kind": "end", "t": time.time(), "inner_steps_run": getattr(eng, "inner_steps_run", None)})
    out.close()
    # The benchmark does not time a graceful leave: the records are written, end the process.
    logging.shutdown()
    os._exit(0)


def save_weights(stats: str, counter: list[int], state: dict[str, torch.Tensor], samples: int,
                 step: int) -> dict[str, object]:
    """Save the weights a validation loss is computed from later; the record that names them."""
    path = f"{stats}.{counter[0]}.pt"
    counter[0] += 1
    torch.save(state, path)
    return {"kind": "eval", "t": time.time(), "samples": samples, "step": step, "file": path}


class _Fragment(torch.nn.Module):
    """A torchft model fragment: a module holding some of the model's parameters (the same objects)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(params)


def outer_sgd(params: Iterable[torch.nn.Parameter], a: argparse.Namespace) -> torch.optim.Optimizer:
    """The outer SGD of every DiLoCo system in a run (Nesterov when it has momentum)."""
    return torch.optim.SGD(list(params), lr=a.outer_lr, momentum=a.outer_momentum, nesterov=a.outer_momentum > 0)


def torchft_main(a: argparse.Namespace) -> int:
    """torchft 0.2.0's DiLoCo: one replica group of one rank, its store on this host."""
    import hashlib
    import threading
    from datetime import timedelta
    from pathlib import Path

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from p2pft.trainer.algorithms.outer import split_fragments
    from p2pft.trainer.data import TextDataset
    from p2pft.trainer.model import ModelConfig

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # torchft's own account of quorums, healing and commits: the benchmark reads it back
    # (``recovery_check`` in bench/wan.py) to tell whether a restarted replica really healed.
    logging.getLogger("torchft.manager").setLevel(logging.INFO)
    torch.set_num_threads(1)
    torch.manual_seed(0)   # identical initial weights on every replica (init_sync=False)
    cfg = ModelConfig(vocab_size=256, d_model=a.d_model, n_layers=a.layers, n_heads=4, seq_len=64)
    model = cfg.build()
    data = TextDataset(cfg.seq_len)
    inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    # torchft's fragments are modules: the same contiguous parameter groups p2pft's DiLoCo syncs
    # (``split_fragments``), each held by a module of its own (the parameters themselves, shared).
    names, params = zip(*model.named_parameters())
    if a.fragments > 1:
        groups = split_fragments(list(params), a.fragments)
        fragments: list[torch.nn.Module] = [_Fragment([params[i] for i in g]) for g in groups]
        frag_names = [{f"params.{j}": names[i] for j, i in enumerate(g)} for g in groups]
    else:
        fragments, frag_names = [model], [{nm: nm for nm in names}]
    # One outer optimizer per fragment (torchft takes a list): a fragment's sync sets the gradients
    # of its own parameters only, and one optimizer over the whole model would also step the other
    # fragments with the last inner step's gradients still in their .grad.
    outer: torch.optim.Optimizer | list[torch.optim.Optimizer] = (
        [outer_sgd(f.parameters(), a) for f in fragments] if a.fragments > 1 else outer_sgd(model.parameters(), a))
    host = a.listen.rsplit(":", 1)[0]
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    healed = {"round": False}

    # The model and the inner AdamW; torchft's DiLoCo registers the global weights and the outer
    # optimizer itself (its fragment's state dict), as its DiLoCo example relies on.
    def load(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])
        healed["round"] = True

    timeout = timedelta(seconds=a.comm_timeout)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg=pg, load_state_dict=load,
                      state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
                      min_replica_size=1, timeout=timeout, quorum_timeout=timedelta(seconds=a.quorum_timeout),
                      rank=0, world_size=1, store_addr=host, store_port=store.port, lighthouse_addr=a.lighthouse,
                      replica_id=f"wan_{a.replica_id}", hostname=host, init_sync=False,
                      checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
                      use_async_quorum=False)   # torchft's DiLoCo requires it
    # The sync's verdict, as torchft's DiLoCo hook got it (the step count alone misleads after a
    # heal: healing sets it to the donor's, whether or not the round then commits).
    verdict = {"commit": None}
    should_commit = manager.should_commit

    def recorded_should_commit(*args: object, **kw: object) -> bool:
        verdict["commit"] = should_commit(*args, **kw)
        return verdict["commit"]
    manager.should_commit = recorded_should_commit   # type: ignore[method-assign]
    stop = {"flag": False}

    def on_term(*_: object) -> None:
        # A replica may sit in a quorum for up to --quorum-timeout: the records are flushed per
        # line, so end the process if the loop has not ended 3 s after the signal.
        stop["flag"] = True
        threading.Timer(3.0, lambda: os._exit(0)).start()
    signal.signal(signal.SIGTERM, on_term)
    out = open(a.stats, "a", buffering=1)

    def write(rec: dict) -> None:
        out.write(json.dumps(rec) + "\n")

    r, n, b = int(a.replica_id.lstrip("r")), a.min_replicas, a.batch
    write({"kind": "start", "t": time.time()})
    t_wait = time.time() + 120
    while a.go_file and not Path(a.go_file).exists() and time.time() < t_wait and not stop["flag"]:
        time.sleep(0.1)
    write({"kind": "ready", "t": time.time()})
    evaluator = a.replica_id == "r0"
    committed = 0          # samples in committed rounds (this replica's view: participants x H x B)
    last_eval = 0.0
    ran = 0
    snaps = [0]
    # Rounds: torchft syncs one fragment every sync_every / fragments inner steps.
    h = a.sync_every // max(1, a.fragments)
    diloco = TorchftDiLoCo(manager, fragments, inner, outer, sync_every=a.sync_every,
                           fragment_sync_delay=a.overlap, fragment_update_alpha=a.alpha)

    def global_weights() -> dict[str, torch.Tensor]:
        """The global weights: torchft keeps them per fragment (its backup of the last sync's)."""
        return {frag_names[f][nm]: t for f, frag in enumerate(diloco._fragments)
                for nm, t in frag.original_parameters.items()}

    with diloco:
        k = 0
        while not stop["flag"] and time.time() < a.until:
            s = manager.current_step()
            first = (s * n + r) * h * b + k * b
            inner.zero_grad()
            model.loss(data.batch(list(range(first, first + b)))).backward()
            if a.step_delay:
                time.sleep(a.step_delay)
            ran += 1
            k += 1
            if k in (h // 2, h):
                write({"kind": "phase", "phase": "mid" if k < h else "sync", "t": time.time()})
            inner.step()   # torchft's hook syncs after every H-th (its quorum may heal this replica)
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
            # The round's heal (at its quorum, which streaming takes before the last inner step)
            # and verdict are read: the next round's start afresh.
            healed["round"], verdict["commit"] = False, None
            if ok:
                g = global_weights()
                rec["digest"] = hashlib.sha256(b"".join(g[nm].numpy().tobytes() for nm in names)).hexdigest()[:16]
            write(rec)
            if ok and evaluator and time.time() - last_eval >= a.eval_every:
                write(save_weights(a.stats, snaps, global_weights(), committed, after))
                last_eval = time.time()
    write({"kind": "end", "t": time.time()})
    out.close()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
