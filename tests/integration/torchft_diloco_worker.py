"""One torchft 0.2.0 DiLoCo replica: the model, data and optimizers of the DiLoCo algorithm test.

Replica r trains, at sync s, on samples [(2s + r) H B, (2s + r + 1) H B), B at a time (what
p2pft's cursor hands slot r of two); it saves the global weights after the last sync.
"""
from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--syncs", type=int, required=True)
    p.add_argument("--sync-every", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "trainer"))
    from test_diloco_algorithm import B, loss, net

    torch.set_num_threads(1)
    model = net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
                      load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
                      state_dict=lambda: {"model": model.state_dict()}, min_replica_size=2,
                      timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=60), rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=a.lighthouse,
                      replica_id=f"diloco_{a.replica}", hostname="127.0.0.1", init_sync=False,
                      use_async_quorum=False)
    h = a.sync_every
    with DiLoCo(manager, [model], inner, outer, sync_every=h):
        for s in range(a.syncs):
            first = (2 * s + a.replica) * h * B
            for k in range(h):
                inner.zero_grad()
                loss(model, list(range(first + k * B, first + (k + 1) * B))).backward()
                inner.step()   # torchft's hook syncs after every h-th
    torch.save([p.detach().clone() for p in model.parameters()], a.out)
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
