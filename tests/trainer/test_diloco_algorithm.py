"""DiLoCo against the algorithm written out in plain PyTorch.

Two replicas in one process (real Runtimes, real sockets, one thread each) train a few syncs;
from what each one's results say it trained, a plain PyTorch loop replays the paper's
algorithm (inner AdamW per replica with its own state, pseudo-gradient = global - local, mean
over the contributors, outer Nesterov SGD, restart or merge of the local weights) and must
land on the same global weights.
"""
from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch

from p2pft import Runtime
from p2pft.deploy.ports import free_ports
from p2pft.trainer import DiLoCo
from p2pft.trainer.algorithms.outer import outer_sgd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]
B = 2


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(4, generator=g)
    return x, torch.sin(x[:3] * 2)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def loss(model: torch.nn.Module, idx: list[int]) -> torch.Tensor:
    x, y = torch.utils.data.default_collate([sample(i) for i in idx])
    return (model(x) - y).pow(2).mean()


def run_replicas(syncs: int, kw: dict[str, Any]) -> tuple[list[list[list[tuple[int, int]]]], list[torch.Tensor]]:
    """Each replica's trained ranges per sync, and the final global weights (equal on both)."""
    ports = free_ports(2)
    addrs = [f"127.0.0.1:{p}" for p in ports]
    rts = [Runtime(replica_id=f"r{i}", listen=addrs[i], seeds=[addrs[1 - i]]).start() for i in range(2)]
    out: list[Any] = [None, None]
    models = [net(), net()]   # here, not in the threads: torch's seed is global to the process

    def replica(i: int) -> None:
        try:
            rt = rts[i]
            model = models[i]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            dl = DiLoCo(rt, model, opt, batch_per_replica=B, loop_timeout=None, **kw)
            assert rt.wait_view(lambda v: len(v.participants) == 2, 20) is not None
            trained: list[list[tuple[int, int]]] = []
            while dl.step < syncs:
                idx = dl.begin()
                dl.zero_grad()
                if idx:
                    loss(model, idx).backward()
                res = dl.commit()
                if res.outer is not None:
                    assert res.outer.committed and res.outer.contributors == 2, res.outer
                    trained.append([tuple(r) for r in res.outer.trained])
            out[i] = (trained, [p.detach().clone() for p in dl.global_model.parameters()], dl.digest())
            dl.close()
        except BaseException as exc:
            out[i] = exc
    threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for rt in rts:
            rt.close()
    for o in out:
        if isinstance(o, BaseException):
            raise o
        assert o is not None, "a replica did not finish"
    assert out[0][2] == out[1][2], "replicas differ after the same syncs"
    return [out[0][0], out[1][0]], out[0][1]


def reference(trained: list[list[list[tuple[int, int]]]], h: int, fragments: int, overlap: int,
              alpha: float, bf16: bool = False) -> list[torch.Tensor]:
    """The paper's algorithm, from the ranges each replica trained at each sync."""
    glob = net()
    params = list(glob.parameters())
    outer = outer_sgd(params)
    from p2pft.trainer.algorithms.outer import split_fragments
    groups = split_fragments(params, fragments)
    span = h // fragments
    local = [copy.deepcopy(glob) for _ in trained]
    inner = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in local]
    for s in range(len(trained[0])):
        f = s % fragments
        pseudo = []
        for r, m in enumerate(local):
            idx = [i for a, b in trained[r][s] for i in range(a, b)]
            lp = list(m.parameters())
            for k in range(span):
                inner[r].zero_grad()
                loss(m, idx[k * B:(k + 1) * B]).backward()
                inner[r].step()
                if k + 1 == span - overlap:
                    pseudo.append([params[j].detach() - lp[j].detach() for j in groups[f]])
        for p in params:
            p.grad = None
        for n, j in enumerate(groups[f]):
            if bf16:  # what crosses the ring: each pseudo-gradient in bf16, summed in bf16
                params[j].grad = (pseudo[0][n].bfloat16() + pseudo[1][n].bfloat16()).float() / 2
            else:
                params[j].grad = (pseudo[0][n] + pseudo[1][n]) / 2
        outer.step()
        with torch.no_grad():
            for m in local:
                lp = list(m.parameters())
                for j in groups[f]:
                    lp[j].mul_(alpha).add_(params[j], alpha=1 - alpha) if alpha else lp[j].copy_(params[j])
    return [p.detach() for p in params]


@pytest.mark.parametrize("kw", [dict(sync_every=3), dict(sync_every=4, fragments=2, overlap=1, alpha=0.5),
                                dict(sync_every=3, compression="bf16")],
                         ids=["diloco", "streaming", "bf16"])
def test_diloco_matches_the_algorithm_in_plain_pytorch(kw: dict[str, Any]) -> None:
    syncs = 4
    trained, got = run_replicas(syncs, kw)
    assert all(len(t) == syncs for t in trained)
    flat = sorted(r for t in trained for rs in t for r in rs)
    assert flat[0][0] == 0 and all(a[1] == b[0] for a, b in zip(flat, flat[1:])), "samples not exactly once"
    want = reference(trained, kw["sync_every"], kw.get("fragments", 1), kw.get("overlap", 0), kw.get("alpha", 0.0),
                     kw.get("compression") == "bf16")
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    # bitwise: with two replicas the ring's sum a + b is the reference's, whatever the order
    assert diff == 0.0, f"global weights differ from the plain PyTorch algorithm by {diff}"
