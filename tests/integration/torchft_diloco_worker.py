"""One torchft 0.2.0 DiLoCo replica, replaying a p2pft DiLoCo replica's record.

The record (JSON) holds what p2pft's replica started from and trained: ``init`` (the file of its
initial weights), ``ranges`` (per sync, the sample ranges it trained in that sync's span, as its
``res.outer.trained`` said), ``sync_every``, ``batch`` and ``lr``. The model, samples and loss
are those of ``diloco_replica.py``; the inner optimizer is AdamW, the outer one p2pft's default
(SGD, lr 0.7, Nesterov momentum 0.9). It saves the global weights after the last sync.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--record", required=True, help="JSON: init, ranges, sync_every, batch, lr")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from diloco_replica import build, sample

    rec = json.loads(Path(a.record).read_text())
    h, batch = int(rec["sync_every"]), int(rec["batch"])
    torch.set_num_threads(1)
    model = build()
    with torch.no_grad():
        for p_, w in zip(model.parameters(), torch.load(rec["init"])):
            p_.copy_(w)
    inner = torch.optim.AdamW(model.parameters(), lr=float(rec["lr"]))
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
                      load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
                      state_dict=lambda: {"model": model.state_dict()}, min_replica_size=a.replicas,
                      timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=60), rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=a.lighthouse,
                      replica_id=f"diloco_{a.replica}", hostname="127.0.0.1", init_sync=False,
                      use_async_quorum=False)
    with DiLoCo(manager, [model], inner, outer, sync_every=h):
        for ranges in rec["ranges"]:
            idx = [i for lo, hi in ranges for i in range(lo, hi)]
            if len(idx) != h * batch:
                raise SystemExit(f"a span of {len(idx)} samples in the record, not H x batch = {h * batch}")
            for k in range(h):
                x, y = torch.utils.data.default_collate([sample(i) for i in idx[k * batch:(k + 1) * batch]])
                inner.zero_grad()
                (model(x) - y).pow(2).mean().backward()
                inner.step()   # torchft's hook syncs after every h-th
    torch.save([p_.detach().clone() for p_ in model.parameters()], a.out)
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
