"""Several optimizers and schedulers stepped as one (``Optimizers``, ``Schedulers``): the same
weights as stepping each on its own, through the optimizer step's lr policy and a GradScaler;
snapshots, digests and DCP checkpoints carry every member's state."""
from __future__ import annotations

import copy

import pytest
import torch

from p2pft.trainer.kernel.optimizers import Optimizers, Schedulers
from p2pft.trainer.kernel.optstep import OptimizerStep
from p2pft.trainer.state.checkpoints import members, model_state
from p2pft.trainer.state.whole import capture, restore, state_digest


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(8, 3))


def _pair(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """AdamW for the body, SGD with momentum for the embedding (two groups, two classes)."""
    emb, body = model[0], model[2]
    return (torch.optim.AdamW([{"params": [body.weight], "weight_decay": 0.1}, {"params": [body.bias]}], lr=1e-2),
            torch.optim.SGD(emb.parameters(), lr=0.5, momentum=0.9))


def _backward(model: torch.nn.Module, i: int) -> None:
    x = torch.randint(0, 10, (4, 2), generator=torch.Generator().manual_seed(i))
    model(x).pow(2).sum().backward()


def _decay(step: int) -> float:
    return 1.0 / (1 + step)


def test_stepped_as_one_equals_each_on_its_own_with_the_lr_factor() -> None:
    ours, ref = _model(), _model()
    a, b = _pair(ours)
    ra, rb = _pair(ref)
    sched = Schedulers([torch.optim.lr_scheduler.LambdaLR(a, _decay), torch.optim.lr_scheduler.LambdaLR(b, _decay)])
    ref_scheds = [torch.optim.lr_scheduler.LambdaLR(ra, _decay), torch.optim.lr_scheduler.LambdaLR(rb, _decay)]
    step = OptimizerStep(Optimizers([a, b]), lr_policy="linear", nominal_replicas=2, lr_scheduler=sched)
    for i in range(3):
        for m, opts in ((ours, (a, b)), (ref, (ra, rb))):
            for o in opts:
                o.zero_grad()
            _backward(m, i)
        step(1)                                   # 1 of 2 replicas: every group's lr halved for this step
        for o in (ra, rb):
            saved = [g["lr"] for g in o.param_groups]
            for g in o.param_groups:
                g["lr"] *= 0.5
            o.step()
            for g, lr in zip(o.param_groups, saved):
                g["lr"] = lr
        for s in ref_scheds:
            s.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    # the rates the last step ran with: half of each group's scheduled rate at step 2
    assert step.last_lrs == pytest.approx([0.5 * g["initial_lr"] * _decay(2) for o in (a, b) for g in o.param_groups])


def test_a_grad_scaler_skips_every_member_alike() -> None:
    model = _model()
    opts = Optimizers(_pair(model))
    before = copy.deepcopy(model.state_dict())
    _backward(model, 0)
    model[0].weight.grad[0, 0] = float("inf")
    step = OptimizerStep(opts, lr_policy="none", grad_scaler=torch.amp.GradScaler("cpu", init_scale=8.0))
    step(1)
    assert step.last_skipped
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_snapshot_carries_every_members_state() -> None:
    src = _model()
    opts = Optimizers(_pair(src))
    for i in range(2):
        opts.zero_grad()
        _backward(src, i)
        opts.step()
    meta, tensors = capture(src, opts)
    dst = _model()
    dst_opts = Optimizers(_pair(dst))
    restore(dst, dst_opts, meta, tensors)
    assert state_digest(dst, dst_opts) == state_digest(src, opts)
    for m, o in ((src, opts), (dst, dst_opts)):   # and they go on alike
        o.zero_grad()
        _backward(m, 5)
        o.step()
    assert state_digest(dst, dst_opts) == state_digest(src, opts)
    assert torch.equal(dst_opts.optimizers[1].state[dst[0].weight]["momentum_buffer"],
                       opts.optimizers[1].state[src[0].weight]["momentum_buffer"])


def test_a_checkpoint_state_dict_has_every_member() -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict
    src = _model()
    opts = Optimizers(_pair(src))
    opts.zero_grad()
    _backward(src, 0)
    opts.step()
    msd, osd = model_state(src, opts)
    dst = _model()
    dst_opts = Optimizers(_pair(dst))
    set_state_dict(dst, members(dst_opts), model_state_dict=msd, optim_state_dict=osd)
    assert state_digest(dst, dst_opts) == state_digest(src, opts)


def test_misuse_is_one_clear_error() -> None:
    model = _model()
    a, b = _pair(model)
    with pytest.raises(ValueError, match="two of the optimizers"):
        Optimizers([a, torch.optim.SGD(model[2].parameters(), lr=0.1)])
    with pytest.raises(TypeError):
        Optimizers([])
    other = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="another optimizer"):
        OptimizerStep(Optimizers([a, b]), lr_scheduler=Schedulers([torch.optim.lr_scheduler.LambdaLR(other, _decay)]))
    s = Schedulers([torch.optim.lr_scheduler.LambdaLR(a, _decay), torch.optim.lr_scheduler.LambdaLR(b, _decay)])
    s.step()
    t = Schedulers([torch.optim.lr_scheduler.LambdaLR(a, _decay), torch.optim.lr_scheduler.LambdaLR(b, _decay)])
    t.load_state_dict(s.state_dict())
    assert [x.last_epoch for x in t.schedulers] == [1, 1]
