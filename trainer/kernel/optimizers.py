"""Several optimizers and schedulers stepped as one (an LLM recipe's: AdamW beside an embedding
optimizer, one optimizer per model part as torchtitan's containers hold them).

``Optimizers`` is a ``torch.optim.Optimizer`` whose parameter groups are its members' own group
dicts (not copies: the learning-rate factor p2pft sets for a step reaches the optimizer that uses
it) and whose per-parameter state is routed to the member that owns the parameter. So everything
that takes one optimizer takes it as it is: the optimizer step (a ``GradScaler`` unscales and
skips all members alike), snapshots and digests, replays, DCP checkpoints. ``Schedulers`` steps
several schedulers as one and keeps their states as a list.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import cast

import torch

from .optstep import LRSchedulerLike


class _States(MutableMapping[torch.Tensor, dict[str, object]]):
    """The members' ``state`` dicts as one, keyed by parameter; a write goes to the owner."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}
        self._opts = optimizers

    def _of(self, p: torch.Tensor) -> torch.optim.Optimizer:
        try:
            return self._owner[id(p)]
        except KeyError:
            raise KeyError("not a parameter of these optimizers") from None

    def __getitem__(self, p: torch.Tensor) -> dict[str, object]:
        return cast("dict[str, object]", self._of(p).state[p])

    def __setitem__(self, p: torch.Tensor, value: dict[str, object]) -> None:
        self._of(p).state[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._of(p).state[p]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for o in self._opts:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._opts)


class Optimizers(torch.optim.Optimizer):
    """Several optimizers as one: ``step()`` and ``zero_grad()`` each, their groups and state
    seen as this one's. A parameter may belong to one member only."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        opts = list(optimizers)
        if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
            raise TypeError("Optimizers takes one or more torch.optim.Optimizer")
        params = [p for o in opts for g in o.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter belongs to two of the optimizers")
        super().__init__(params, {})    # torch's hooks and bookkeeping; the groups are replaced below
        self.optimizers = opts
        self.param_groups = [g for o in opts for g in o.param_groups]   # the members' own dicts
        self.state = _States(opts)      # type: ignore[assignment]  # a routing view, not a defaultdict

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("Optimizers.step takes no closure")
        for o in self.optimizers:
            o.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, object]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        """Each member's own state dict (``state_dict()``), or one positional state dict over the
        groups of all members in order (what a snapshot restores), split among them."""
        if "optimizers" in state_dict:
            for o, sd in zip(self.optimizers, cast("list[dict[str, object]]", state_dict["optimizers"]), strict=True):
                o.load_state_dict(sd)
            return
        groups = cast("list[dict[str, object]]", state_dict["param_groups"])
        state = cast("dict[int, object]", state_dict.get("state", {}))
        if len(groups) != len(self.param_groups):
            raise ValueError(f"a state dict of {len(groups)} groups for optimizers of {len(self.param_groups)}")
        at = 0
        for o in self.optimizers:
            mine = groups[at:at + len(o.param_groups)]
            at += len(mine)
            ids = [i for g in mine for i in cast("list[int]", g["params"])]
            renum = {old: new for new, old in enumerate(ids)}
            o.load_state_dict({
                "state": {renum[i]: s for i, s in state.items() if i in renum},
                "param_groups": [{**g, "params": [renum[i] for i in cast("list[int]", g["params"])]} for g in mine]})


class Schedulers:
    """Several learning-rate schedulers stepped as one (one per member of ``Optimizers``)."""

    def __init__(self, schedulers: Iterable[LRSchedulerLike]) -> None:
        self.schedulers = list(schedulers)
        if not self.schedulers:
            raise ValueError("Schedulers takes one or more schedulers")

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict[str, object]:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        for s, sd in zip(self.schedulers, cast("list[object]", state["schedulers"]), strict=True):
            s.load_state_dict(sd)


__all__ = ["Optimizers", "Schedulers"]
