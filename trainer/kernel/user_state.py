"""Objects a user registers (``state_dict``/``load_state_dict``) as part of the replica state.

A learning-rate scheduler, a ``GradScaler``, EMA weights, a step counter: replicas at one step
must hold them equal, so they travel in catch-up snapshots, are written in checkpoints and are
part of the digest. A ``state_dict`` may nest dicts, lists and tensors; it is split into a
msgpack-able tree (each tensor replaced by a reference) and a flat dict of tensors, the same
split the model's snapshot uses, so it streams and checkpoints with it.
"""
from __future__ import annotations

import hashlib
from typing import Any, Protocol

import msgpack
import torch

_TENSOR = "__p2pft_tensor__"
PREFIX = "user/"


class Stateful(Protocol):
    """An object with torch's two methods (a scheduler, a GradScaler, a user class). The argument
    stays ``Any``: implementations take their own ``state_dict()``'s type."""

    def state_dict(self) -> object: ...

    def load_state_dict(self, state: Any) -> object: ...


class UserState:
    """The registered objects of one replica, by name (the same names on every replica)."""

    def __init__(self) -> None:
        self._objs: dict[str, Stateful] = {}

    def register(self, name: str, obj: Stateful) -> None:
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"a state name must be a non-empty string without '/', got {name!r}")
        if name in self._objs:
            raise ValueError(f"state {name!r} is already registered")
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"{type(obj).__name__} has no state_dict()/load_state_dict(): it cannot be registered")
        tree, _ = _split(obj.state_dict(), f"{PREFIX}{name}")
        try:
            msgpack.packb(tree, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"state_dict() of {name!r} holds something that cannot travel: {exc}") from None
        self._objs[name] = obj

    def __bool__(self) -> bool:
        return bool(self._objs)

    def names(self) -> list[str]:
        return sorted(self._objs)

    def capture(self) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        """(msgpack-able trees by name, CPU copies of their tensors by key)."""
        trees: dict[str, object] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name in self.names():
            tree, ts = _split(self._objs[name].state_dict(), f"{PREFIX}{name}")
            trees[name] = tree
            tensors.update({k: v.detach().to("cpu", copy=True).contiguous() for k, v in ts.items()})
        return trees, tensors

    def restore(self, trees: dict[str, object], tensors: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names() if n not in trees]
        if missing:
            raise ValueError(f"the snapshot has no state for registered {missing}")
        for name in self.names():
            self._objs[name].load_state_dict(_join(trees[name], tensors))

    def digest(self) -> str:
        trees, tensors = self.capture()
        h = hashlib.blake2b(digest_size=32)
        h.update(msgpack.packb(trees, use_bin_type=True))
        for key in sorted(tensors):
            t = tensors[key]
            h.update(f"{key}|{t.dtype}|{list(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        return h.hexdigest()


def _split(value: object, path: str) -> tuple[object, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}

    def walk(v: object, p: str) -> object:
        if isinstance(v, torch.Tensor):
            tensors[p] = v
            return {_TENSOR: p}
        if isinstance(v, dict):
            return {str(k) if not isinstance(k, (int, str)) else k: walk(x, f"{p}/{k}") for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{p}/{i}") for i, x in enumerate(v)]
        return v
    return walk(value, path), tensors


def _join(tree: object, tensors: dict[str, torch.Tensor]) -> object:
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            return tensors[tree[_TENSOR]]
        return {k: _join(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_join(v, tensors) for v in tree]
    return tree


__all__ = ["Stateful", "UserState"]
