"""The GPT recipe trained with DiLoCo (``gpt.py --sync-every H``): the same model, data, inner
AdamW with its schedule, clipping and AMP, and an outer Nesterov SGD every H inner steps.

The stats hold one line per sync in ``gpt.py``'s format (the step is the sync count, ``tr`` the
span's ranges when its pseudo-gradient is in the committed mean, ``lr`` the outer lr), and a
``begin`` line with the span's ranges just before the inner step that syncs, so the replay
oracle (``p2pft.chaos.oracle``) knows every span a process ran, committed or not. The final
weights saved are the global ones.
"""
from __future__ import annotations

import argparse
import functools
from types import SimpleNamespace
from typing import Any


def train_diloco(args: argparse.Namespace, r: Any, mon: Any, recipe: SimpleNamespace) -> None:
    """`r` is gpt.py's Recipe, `mon` its Monitor; `recipe` holds its build, clip,
    forward_backward and start_runtime (handed in: gpt.py imports this module)."""
    import torch

    from p2pft.trainer import DiLoCo, Stopped
    from p2pft.trainer.algorithms.outer import outer_sgd
    model, opt, sched, scaler, data = recipe.build(r, args.token_dir)
    rt = recipe.start_runtime(args)
    dl = DiLoCo(rt, model, opt, sync_every=r.sync_every, batch_per_replica=r.batch,
                outer_optimizer=functools.partial(outer_sgd, lr=r.outer_lr, momentum=r.outer_momentum),
                lr_policy=r.lr_policy, nominal_replicas=r.replicas, lr_scheduler=sched, grad_scaler=scaler,
                grad_hook=lambda: recipe.clip(model, r), loop_timeout=args.loop_timeout or None)
    span = dl.schedule.span
    mon.start(dl.global_model, dl.kernel, rt)   # the global weights are the ones saved and compared
    loss: Any = None
    while mon.running(dl.step):
        try:
            idx = dl.begin()
            dl.zero_grad()
            if idx:
                batch = torch.stack([data[i % len(data)] for i in idx])
                loss = recipe.forward_backward(model, batch, r, scaler)
                mon.before_commit(record=dl.inner_step % span == span - 1)
            res = dl.commit()
        except Stopped:
            break
        if res.outer is not None:
            mon.ft_step(res.outer, loss)
    mon.stop(dl.step)
