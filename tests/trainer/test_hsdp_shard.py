"""Shard-local pieces of HSDP without extra processes: a 1-rank gloo group and FSDP2 give real
DTensor parameters, gradients and optimizer state, the same code paths as R ranks."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from p2pft.deploy.ports import free_ports
from p2pft.trainer.model import ModelConfig
from p2pft.trainer.state.shard import capture_shard, restore_shard, shard_digest
from p2pft.trainer.kernel.stepbuf import StepBuffer, local

CFG = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, seq_len=8)


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    (port,) = free_ports(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = CFG.build()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, buf: StepBuffer, steps: int) -> None:
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=torch.Generator().manual_seed(s))
        model.loss(tokens).backward()
        buf.pack(0, s)
        buf.unpack(1.0)
        opt.step()


def test_buffer_packs_local_grad_shards_and_step_metadata(group: None) -> None:
    model, opt = _sharded()
    params = list(model.parameters())
    assert type(params[0]).__name__ == "DTensor"
    buf = StepBuffer(params, max_slots=4)
    model.loss(torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))).backward()
    want = torch.cat([local(p.grad).reshape(-1) for p in params])
    buf.pack(2, 7)
    assert torch.equal(buf.flat[:buf.grad_numel], want)
    assert buf.slot_steps() == {2: 7} and buf.contributors() == 1
    buf.flat[:buf.grad_numel] *= 4
    buf.unpack(2.0)
    assert torch.equal(torch.cat([local(p.grad).reshape(-1) for p in params]), want * 2)
    opt.zero_grad(set_to_none=True)
    buf.unpack(1.0)  # grads that are None are created as DTensors of the parameter's layout
    assert all(type(p.grad).__name__ == "DTensor" for p in params)


def test_shard_snapshot_restores_bitwise_into_a_fresh_replica(group: None) -> None:
    model, opt = _sharded(0)
    _train(model, opt, StepBuffer(list(model.parameters())), 3)
    meta, tensors = capture_shard(model, opt, {"x": 1})
    fresh, fresh_opt = _sharded(1)  # other weights, no optimizer state yet
    assert shard_digest(fresh, fresh_opt) != shard_digest(model, opt)
    restore_shard(fresh, fresh_opt, meta, tensors)
    assert shard_digest(fresh, fresh_opt) == shard_digest(model, opt)
    # Both keep training identically after the restore (the state is live, not a copy).
    bufs = StepBuffer(list(model.parameters())), StepBuffer(list(fresh.parameters()))
    _train(model, opt, bufs[0], 2)
    _train(fresh, fresh_opt, bufs[1], 2)
    assert shard_digest(fresh, fresh_opt) == shard_digest(model, opt)


def test_restore_rejects_a_snapshot_of_another_shape(group: None) -> None:
    model, opt = _sharded()
    meta, tensors = capture_shard(model, opt, {})
    tensors["param/ln_f.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="ln_f.weight"):
        restore_shard(model, opt, meta, tensors)
