"""The optimizer step as one deterministic function: lr factor on the scheduler, hooks, scaler."""
from __future__ import annotations

import math

import pytest
import torch

from p2pft.trainer.kernel.optstep import OptimizerStep
from p2pft.trainer.kernel.user_state import UserState


def _setup(lr: float | torch.Tensor = 0.1):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return model, opt


def _grads(model: torch.nn.Module, value: float = 1.0) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


def test_factor_scales_the_schedulers_lr_for_one_step_and_gives_it_back() -> None:
    model, opt = _setup()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    step = OptimizerStep(opt, lr_policy="sqrt", lr_scheduler=sched)
    for s, n in enumerate([3, 3, 2, 1, 3]):
        _grads(model)
        sched_lr = opt.param_groups[0]["lr"]
        assert sched_lr == pytest.approx(0.1 / (s + 1))          # the scheduler's value, untouched
        before = model.weight.detach().clone()
        step(n)
        want = sched_lr * math.sqrt(n / 3)                        # planned = peak = 3
        assert step.last_lrs[0] == pytest.approx(want)
        assert (before - model.weight).flatten()[0].item() == pytest.approx(want, rel=1e-5)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / (s + 2))  # stepped by p2pft, not scaled


def test_planned_count_defaults_to_the_peak_and_nominal_overrides() -> None:
    _, opt = _setup()
    step = OptimizerStep(opt, lr_policy="linear")
    assert step.scale(2) == 1.0                # first step: nothing to compare with
    step.peak = 4
    assert step.scale(2) == pytest.approx(0.5)
    assert OptimizerStep(opt, lr_policy="linear", nominal_replicas=8).scale(2) == pytest.approx(0.25)
    assert OptimizerStep(opt, lr_policy="none").scale(1) == 1.0


def test_tensor_lr_is_scaled_in_place_and_restored() -> None:
    model, opt = _setup(lr=torch.tensor(0.1))
    lr = opt.param_groups[0]["lr"]
    step = OptimizerStep(opt, lr_policy="linear", nominal_replicas=4)
    _grads(model)
    step(1)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.1)
    assert step.last_lrs[0] == pytest.approx(0.025)


def test_hooks_run_in_order_on_the_unscaled_mean() -> None:
    model, opt = _setup()
    seen: list[str] = []
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

    def hook() -> None:
        seen.append("hook")
        assert model.weight.grad.flatten()[0].item() == pytest.approx(0.5)   # 2.0 / scale 4
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    step = OptimizerStep(opt, grad_scaler=scaler, grad_hook=hook, after_step=lambda: seen.append("after"))
    _grads(model, 2.0)
    step(1)
    assert seen == ["hook", "after"] and not step.last_skipped


def test_an_inf_gradient_is_skipped_and_the_scale_backs_off() -> None:
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    step = OptimizerStep(opt, grad_scaler=scaler)
    _grads(model)
    model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    step(2)
    assert step.last_skipped and float(scaler.get_scale()) == 4.0
    assert torch.equal(before, model.weight)


@pytest.mark.parametrize("kw, err", [({"nominal_replicas": 0}, ValueError), ({"grad_hook": 3}, TypeError),
                                     ({"after_step": "x"}, TypeError), ({"lr_policy": "cubic"}, ValueError)])
def test_bad_arguments_fail_at_construction(kw: dict, err: type) -> None:
    _, opt = _setup()
    with pytest.raises(err):
        OptimizerStep(opt, **kw)


def test_a_scheduler_of_another_optimizer_is_refused() -> None:
    _, opt = _setup()
    _, other = _setup()
    with pytest.raises(ValueError, match="another optimizer"):
        OptimizerStep(opt, lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))


def test_user_state_round_trips_nested_tensors_and_changes_the_digest() -> None:
    class Thing:
        def __init__(self) -> None:
            self.s = {"n": 1, "w": [torch.ones(2), {"b": torch.zeros(3)}], "t": (1.5, None)}

        def state_dict(self):
            return self.s

        def load_state_dict(self, s):
            self.s = s
    a, b = Thing(), Thing()
    ua, ub = UserState(), UserState()
    ua.register("thing", a)
    ub.register("thing", b)
    a.s["w"][0] += 1
    a.s["n"] = 7
    assert ua.digest() != ub.digest()
    trees, tensors = ua.capture()
    assert set(tensors) == {"user/thing/w/0", "user/thing/w/1/b"}
    ub.restore(trees, tensors)
    assert ua.digest() == ub.digest() and b.s["n"] == 7 and torch.equal(b.s["w"][0], torch.full((2,), 2.0))


def test_user_state_registration_errors_are_clear() -> None:
    u = UserState()
    with pytest.raises(TypeError, match="state_dict"):
        u.register("x", object())
    with pytest.raises(ValueError, match="without '/'"):
        u.register("a/b", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1))
    u.register("opt", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1))
    with pytest.raises(ValueError, match="already registered"):
        u.register("opt", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1))
    with pytest.raises(ValueError, match="no state for"):
        u.restore({}, {})


# ---------------------------------------------------------------------------------- clipping
def _clipped_pair(clip: float, scaler: bool) -> tuple[torch.nn.Module, torch.nn.Module, OptimizerStep]:
    """The same gradients through p2pft's clip and through torch's own recipe."""
    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    ref.load_state_dict(ours.state_dict())
    opt_o, opt_r = torch.optim.SGD(ours.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    sc_o = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    sc_r = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    x = torch.randn(5, 6) * 10
    for m, sc in ((ours, sc_o), (ref, sc_r)):
        loss = m(x).pow(2).sum()
        (sc.scale(loss) if sc is not None else loss).backward()
    step = OptimizerStep(opt_o, lr_policy="none", grad_scaler=sc_o, clip_norm=clip)
    step(1)
    if sc_r is not None:
        sc_r.unscale_(opt_r)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    (sc_r.step(opt_r) if sc_r is not None else opt_r.step())
    return ours, ref, step


@pytest.mark.parametrize("scaler", [False, True])
def test_clipping_is_torchs_global_norm_clip(scaler: bool) -> None:
    ours, ref, step = _clipped_pair(1.0, scaler)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert step.last_norm is not None and step.last_norm > 1.0 and step.last_clip < 1.0


def test_a_norm_under_the_limit_is_left_alone() -> None:
    ours, ref, step = _clipped_pair(1e9, False)
    assert step.last_clip == 1.0
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_a_measured_norm_is_used_as_given() -> None:
    """The kernel hands the norm measured over every shard: the step clips by it, not by the
    (partial) gradients it sees."""
    m = torch.nn.Linear(2, 1)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in m.parameters()]
    OptimizerStep(torch.optim.SGD(m.parameters(), lr=1.0), lr_policy="none", clip_norm=1.0)(1, norm=10.0)
    for p, b in zip(m.parameters(), before):
        torch.testing.assert_close(b - p.detach(), torch.full_like(b, 0.1), rtol=1e-5, atol=1e-6)
