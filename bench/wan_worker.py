"""One replica of a ``bench/wan.py`` run: synchronous p2pft, DiLoCo or Streaming DiLoCo.

The same transformer LM, data, inner optimizer and batch for every system. One JSON line per
committed step (synchronous) or sync (DiLoCo): time, committed samples, contributors, the work
this replica ran and kept, a digest; r0 also evaluates the validation loss on a fixed held-out
set every ``--eval-every`` seconds and once at the end.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=["sync", "diloco", "streaming"], required=True)
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
    p.add_argument("--eval-every", type=float, default=2.0)
    p.add_argument("--comm-timeout", type=float, default=30.0)
    a = p.parse_args()

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
    held = TextDataset(cfg.seq_len, n_samples=64, seed=1).batch(list(range(64)))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    rt = Runtime(replica_id=a.replica_id, listen=a.listen, seeds=[s for s in a.seeds.split(",") if s],
                 data_listen=a.data_listen, advertise_data=a.advertise_data, comm_timeout=a.comm_timeout).start()
    if a.system == "sync":
        eng: FaultTolerant | DiLoCo = FaultTolerant(rt, model, opt, batch_per_replica=a.batch, lr_policy="none",
                                                    loop_timeout=None)
        weights = model
    else:
        eng = DiLoCo(rt, model, opt, sync_every=a.sync_every, batch_per_replica=a.batch, fragments=a.fragments,
                     overlap=a.overlap, alpha=a.alpha, compression=a.compression, loop_timeout=None)
        weights = eng.global_model
    stop = {"flag": False}

    def on_signal(*_: object) -> None:
        stop["flag"] = True
        eng.request_stop()
    signal.signal(signal.SIGTERM, on_signal)
    out = open(a.stats, "a", buffering=1)

    def write(rec: dict) -> None:
        out.write(json.dumps(rec) + "\n")

    def evaluate() -> None:
        with torch.no_grad():
            val = float(weights.loss(held))
        write({"kind": "eval", "t": time.time(), "samples": committed(), "val": val, "step": eng.step})

    def committed() -> int:
        return eng.cursor.frontier - eng.cursor.hole_samples

    write({"kind": "start", "t": time.time()})
    if a.min_replicas > 1 and eng.step == 0:
        rt.wait_view(lambda v: len(v.participants) >= a.min_replicas or stop["flag"], timeout=60)
    evaluator = a.replica_id == "r0"
    last_eval = 0.0
    ran = 0
    while not stop["flag"] and time.time() < a.until:
        try:
            idx = eng.begin()
            eng.zero_grad()
            if idx:
                model.loss(data.batch(idx)).backward()
                ran += 1
            res = eng.commit()
        except Stopped:
            break
        outer = res if a.system == "sync" else res.outer
        if outer is None:
            continue
        rec = {"t": time.time(), "step": outer.step, "c": int(outer.committed), "n": outer.contributors,
               "r": outer.retries, "role": outer.role, "ran": ran, "kept": ran if outer.trained is not None else 0,
               "samples": committed()}
        ran = 0
        if outer.committed and (a.system != "sync" or outer.step % 10 == 0):
            rec["digest"] = eng.digest()
        write(rec)
        if evaluator and time.time() - last_eval >= a.eval_every:
            evaluate()
            last_eval = time.time()
    if evaluator:
        evaluate()
    write({"kind": "end", "t": time.time(), "inner_steps_run": getattr(eng, "inner_steps_run", None)})
    out.close()
    # The benchmark does not time a graceful leave: the records are written, end the process.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
