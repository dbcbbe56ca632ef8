"""Snapshots of model + optimizer state for catch-up streaming and checkpoints, and a digest.

A snapshot is split into msgpack-able `meta` (names, hyperparameters, small scalars) and a flat
`dict[str, Tensor]` of CPU copies, so it can be streamed tensor by tensor while training goes on
and written by a background checkpointer. Optimizer state is keyed by parameter *name*, not by
position, so it restores into a freshly built optimizer whose groups list the same parameters.
`state_digest` hashes the exact bytes, which is how tests and replicas check "same step, same
weights" bitwise.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import TypedDict, cast

import msgpack
import torch
from torch import nn

from ...transport.buffers import dtype_name, host_empty

FORMAT_VERSION = 1
_GROUP_SKIP = ("params", "param_names")

# The optimizer part of a snapshot's meta: per group its hyperparameters (plain values) and
# "params" (the parameter names); per parameter name the plain (non-tensor) state values.
OptimizerMeta = TypedDict("OptimizerMeta", {
    "class": str,
    "param_groups": list[dict[str, object]],
    "state": dict[str, dict[str, object]],
    "step": int,
})


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that later in-place updates of `t` cannot touch."""
    out = host_empty(torch, dtype_name(t), tuple(t.shape))
    out.copy_(t.detach())
    return out


def _msgpack_check(what: str, value: object) -> None:
    try:
        msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{what} is not msgpack-able: {exc}") from None


def _plain(value: object) -> object:
    """Tuples become lists (as they come back out of msgpack)."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Parameter names of each optimizer group, in the optimizer's order."""
    names = _param_names(model)
    out: list[list[str]] = []
    for g, group in enumerate(optimizer.param_groups):
        row = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"optimizer group {g} holds a parameter that is not in the model")
            row.append(names[id(p)])
        out.append(row)
    return out


def _optimizer_step(optimizer: torch.optim.Optimizer) -> int:
    """The largest per-parameter step count (AdamW keeps it as a tensor); 0 before the first step."""
    steps = [int(st["step"]) for st in optimizer.state.values() if "step" in st]
    return max(steps, default=0)


def capture(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, extra_meta: dict[str, object] | None = None
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Copy parameters, buffers and optimizer state to CPU; call it at a step boundary.

    Tensor keys: "param/<name>", "buffer/<name>", "optim/<param name>/<state key>",
    "group/<group index>/<hyperparameter>" (for tensor-valued hyperparameters such as a tensor lr).
    """
    if extra_meta is None:
        extra_meta = {}
    if not isinstance(extra_meta, dict):
        raise ValueError(f"extra_meta must be a dict, got {type(extra_meta).__name__}")
    _msgpack_check("extra_meta", extra_meta)
    tensors: dict[str, torch.Tensor] = {}
    param_names = [name for name, _ in model.named_parameters()]
    buffer_names = [name for name, _ in model.named_buffers()]
    for name, p in model.named_parameters():
        tensors[f"param/{name}"] = _cpu_copy(p)
    for name, b in model.named_buffers():
        tensors[f"buffer/{name}"] = _cpu_copy(b)
    optim_meta: OptimizerMeta | None = None
    if optimizer is not None:
        groups_meta: list[dict[str, object]] = []
        state_meta: dict[str, dict[str, object]] = {}
        for g, (group, names) in enumerate(zip(optimizer.param_groups, _group_names(model, optimizer))):
            hyper: dict[str, object] = {"params": names}
            for key, value in group.items():
                if key in _GROUP_SKIP:
                    continue
                if isinstance(value, torch.Tensor):
                    tensors[f"group/{g}/{key}"] = _cpu_copy(value)
                else:
                    hyper[key] = _plain(value)
            groups_meta.append(hyper)
            for p, name in zip(group["params"], names):
                plain: dict[str, object] = {}
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"optim/{name}/{key}"] = _cpu_copy(value)
                    else:
                        plain[key] = _plain(value)
                state_meta[name] = plain
        optim_meta = {
            "class": type(optimizer).__name__,
            "param_groups": groups_meta,
            "state": state_meta,
            "step": _optimizer_step(optimizer),
        }
    meta: dict[str, object] = {
        "format": FORMAT_VERSION,
        "params": param_names,
        "buffers": buffer_names,
        "optimizer": optim_meta,
        "extra": extra_meta,
    }
    _msgpack_check("optimizer hyperparameters or state", meta)
    return meta, tensors


def _take(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise ValueError(f"snapshot has no tensor {key!r}") from None


def _check_same(key: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(
            f"snapshot tensor {key!r} is {src.dtype}{list(src.shape)}, the model has {dst.dtype}{list(dst.shape)}"
        )


def _tuples(value: object) -> object:
    """Lists back to tuples for hyperparameters (torch keeps e.g. betas as a tuple)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def restore(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, meta: Mapping[str, object],
    tensors: dict[str, torch.Tensor]
) -> None:
    """Load a `capture` snapshot so that params and optimizer state are bitwise equal to the source."""
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"snapshot format {meta.get('format')!r} is not supported (expected {FORMAT_VERSION})")
    for kind, own in (("params", [n for n, _ in model.named_parameters()]),
                      ("buffers", [n for n, _ in model.named_buffers()])):
        theirs = list(cast("Iterable[str]", meta.get(kind, [])))
        if sorted(theirs) != sorted(own):
            missing = sorted(set(own) - set(theirs))
            unexpected = sorted(set(theirs) - set(own))
            raise ValueError(f"snapshot {kind} do not match the model: missing {missing}, unexpected {unexpected}")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, p in model.named_parameters():
        src = _take(tensors, f"param/{name}")
        _check_same(f"param/{name}", src, p)
        pairs.append((p, src))
    for name, b in model.named_buffers():
        src = _take(tensors, f"buffer/{name}")
        _check_same(f"buffer/{name}", src, b)
        pairs.append((b, src))
    optim_sd = _optimizer_state_dict(model, optimizer, meta, tensors) if optimizer is not None else None
    # Everything is validated; only now change the model, so a bad snapshot leaves it untouched.
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
    if optimizer is not None and optim_sd is not None:
        optimizer.load_state_dict(optim_sd)


def _optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, meta: Mapping[str, object], tensors: dict[str, torch.Tensor]
) -> dict[str, object]:
    """Build a positional torch optimizer state_dict for `optimizer` from the name-keyed snapshot."""
    om = cast("OptimizerMeta | None", meta.get("optimizer"))   # as capture wrote it, read back off the wire
    if om is None:
        raise ValueError("snapshot has no optimizer state but an optimizer was given")
    if om.get("class") != type(optimizer).__name__:
        raise ValueError(f"snapshot optimizer is {om.get('class')!r}, target is {type(optimizer).__name__!r}")
    own_groups = _group_names(model, optimizer)
    saved_groups = om["param_groups"]
    if [list(cast("list[str]", g["params"])) for g in saved_groups] != own_groups:
        raise ValueError("optimizer param groups do not list the same parameters in the same order as the snapshot")
    params_by_name = dict(model.named_parameters())
    index: dict[str, int] = {name: i for i, name in enumerate(n for row in own_groups for n in row)}
    groups: list[dict[str, object]] = []
    prefix_state = "optim/"
    for g, saved in enumerate(saved_groups):
        group = {k: _tuples(v) for k, v in saved.items() if k != "params"}
        for key, t in tensors.items():
            if key.startswith(f"group/{g}/"):
                group[key[len(f"group/{g}/"):]] = t.clone()
        group["params"] = [index[n] for n in cast("list[str]", saved["params"])]
        groups.append(group)
    state: dict[int, dict[str, object]] = {}
    for name, plain in om["state"].items():
        entry: dict[str, object] = {k: _tuples(v) for k, v in plain.items()}
        state[index[name]] = entry
    for key, t in tensors.items():
        if not key.startswith(prefix_state):
            continue
        name, _, skey = key[len(prefix_state):].rpartition("/")
        if name not in index:
            raise ValueError(f"snapshot has optimizer state for unknown parameter {name!r}")
        device = params_by_name[name].device
        state.setdefault(index[name], {})[skey] = t.to(device=device, copy=True)
    state = {i: s for i, s in state.items() if s}
    return {"state": state, "param_groups": groups}


def _hash_tensor(h: hashlib.blake2b, label: str, t: torch.Tensor) -> None:
    h.update(f"{label}|{t.dtype}|{list(t.shape)}|".encode())
    data = t.detach().reshape(-1).contiguous()
    if data.device.type != "cpu":
        data = data.cpu()
    h.update(data.view(torch.uint8).numpy().data)


def params_digest(params: dict[str, torch.Tensor]) -> str:
    """Hex blake2b over the named whole tensors `params` (in name order): what an unsharded
    model and the gathered shards of an FSDP model agree on at the same step."""
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(params):
        _hash_tensor(h, f"param/{name}", params[name].detach().cpu().contiguous())
    return h.hexdigest()


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 view: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, buffers: bool = True) -> str:
    """Hex blake2b over names, dtypes, shapes and raw bytes of params, buffers and optimizer state.

    `view` picks the bytes hashed from each tensor (an HSDP rank hashes its local shards)."""
    h = hashlib.blake2b(digest_size=32)
    for name, p in model.named_parameters():
        _hash_tensor(h, f"param/{name}", view(p))
    if buffers:
        for name, b in model.named_buffers():
            _hash_tensor(h, f"buffer/{name}", b)
    if optimizer is not None:
        for g, (group, names) in enumerate(zip(optimizer.param_groups, _group_names(model, optimizer))):
            for key in sorted(k for k in group if k not in _GROUP_SKIP):
                value = group[key]
                if isinstance(value, torch.Tensor):
                    _hash_tensor(h, f"group/{g}/{key}", value)
                else:
                    h.update(f"group/{g}/{key}={_plain(value)!r}|".encode())
            for p, name in zip(group["params"], names):
                entry = optimizer.state.get(p, {})
                for key in sorted(entry):
                    value = entry[key]
                    if isinstance(value, torch.Tensor):
                        _hash_tensor(h, f"optim/{name}/{key}", view(value))
                    else:
                        h.update(f"optim/{name}/{key}={_plain(value)!r}|".encode())
    return h.hexdigest()
