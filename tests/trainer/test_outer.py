"""The pure parts of DiLoCo: outer step, fragment schedule, split, merge, pseudo-gradient."""
from __future__ import annotations

import pytest
import torch

from p2pft.trainer.algorithms.outer import FragmentSchedule, merge, outer_sgd, pseudo_gradient, split_fragments


def test_outer_sgd_is_nesterov_on_the_pseudo_gradient() -> None:
    """Two outer steps by hand: v = mu*v + g; w -= lr * (g + mu*v) (torch's Nesterov form)."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = outer_sgd([w])
    assert opt.param_groups[0]["lr"] == 0.7 and opt.param_groups[0]["momentum"] == 0.9
    assert opt.param_groups[0]["nesterov"]
    expect = w.detach().clone()
    v = torch.zeros(2)
    for g in (torch.tensor([0.5, 0.25]), torch.tensor([-1.0, 0.125])):
        w.grad = g.clone()
        opt.step()
        v = 0.9 * v + g
        expect -= 0.7 * (g + 0.9 * v)
        assert torch.allclose(w.detach(), expect, atol=1e-7)


def test_outer_step_with_lr_one_no_momentum_is_averaging() -> None:
    """lr 1, no momentum: the outer step lands on the mean of the local weights (FedAvg)."""
    glob = torch.nn.Parameter(torch.zeros(3))
    locals_ = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])]
    grads = []
    for lw in locals_:
        out = torch.empty(3)
        pseudo_gradient([glob.detach()], [lw], [out])
        grads.append(out)
    glob.grad = sum(grads) / 2
    torch.optim.SGD([glob], lr=1.0).step()
    assert torch.equal(glob.detach(), torch.tensor([2.0, 2.0, 2.0]))


def test_schedule_staggers_fragments_and_overlap() -> None:
    s = FragmentSchedule(sync_every=12, fragments=3, overlap=2, alpha=0.5)
    assert s.span == 4 and s.send_at == 2
    assert [s.fragment(i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    # every fragment is synced once every H inner steps, the three H/N apart
    assert s.sync_points(0, 36) == [4, 16, 28]
    assert s.sync_points(1, 36) == [8, 20, 32]
    assert s.sync_points(2, 36) == [12, 24, 36]
    assert s.inner_steps(5) == 20
    plain = FragmentSchedule(sync_every=8)
    assert plain.span == 8 and plain.send_at == 8 and plain.sync_points(0, 24) == [8, 16, 24]


@pytest.mark.parametrize("kw", [dict(sync_every=0), dict(sync_every=10, fragments=3), dict(sync_every=8, overlap=8),
                                dict(sync_every=8, fragments=2, overlap=-1), dict(sync_every=8, alpha=1.0),
                                dict(sync_every=8, fragments=True)])
def test_schedule_rejects_bad_input(kw: dict) -> None:
    with pytest.raises(ValueError):
        FragmentSchedule(**kw)


def test_split_fragments_contiguous_balanced_nonempty() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 10, 10, 80, 50, 50, 1)]
    for n in range(1, len(params) + 1):
        groups = split_fragments(params, n)
        assert len(groups) == n and all(groups)
        assert [i for g in groups for i in g] == list(range(len(params)))
    two = split_fragments(params, 2)
    sizes = [sum(params[i].numel() for i in g) for g in two]
    assert max(sizes) - min(sizes) <= 100  # about half each
    with pytest.raises(ValueError):
        split_fragments(params, len(params) + 1)


def test_merge_alpha() -> None:
    lw, gw = torch.tensor([2.0, 4.0]), torch.tensor([0.0, 8.0])
    merge([lw], [gw], 0.5)
    assert torch.equal(lw, torch.tensor([1.0, 6.0]))
    merge([lw], [gw], 0.0)
    assert torch.equal(lw, gw)
