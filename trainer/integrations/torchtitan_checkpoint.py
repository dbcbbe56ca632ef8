"""Checkpoints both ways between p2pft and torchtitan: one DCP layout renamed to the other, offline.

Why a converter and not one layout: p2pft writes the same checkpoint for every trainer
(``trainer/state/checkpoints.py``: ``model`` and ``optim`` as torch's ``get_state_dict`` gives
them, ``p2pft.rank<r>`` with each rank's replicated extras and the digest its resume checks), and
torchtitan's ``CheckpointManager`` has its own (the model's state dict flat at the top,
``optimizer`` flattened by parameter name, ``lr_scheduler``, ``dataloader``, ``train_state``, in
``step-N`` folders). Both hold the same tensors under other names, so a conversion reads the
source's metadata, loads what it carries into empty tensors with ``dcp.load`` (one process,
``no_dist``) and writes it under the other names with ``dcp.save``: no model is built, every
tensor is in memory once, and the result holds whole tensors, which DCP reshards when it loads
them, so it loads at any rank count.

p2pft -> torchtitan (``to_torchtitan``) carries:
- the model: ``model.<key>`` -> ``<key>``; the keys are torchtitan's own (``P2PFTTrainer`` makes
  p2pft's checkpoint hold them: ``alias_state_keys``);
- the optimizer: ``optim.state.<param>.<name>`` -> ``optimizer.state.<param>.<name>`` (AdamW's
  ``exp_avg``, ``exp_avg_sq``, ``step``), and group i's hyperparameters
  ``optim.param_groups.<i>.<key>`` -> ``optimizer.param_groups.<param>.<key>`` for each of its
  parameters (``lr``, ``initial_lr``, ``betas``, ``weight_decay``...), as torchtitan flattens them;
- the step: ``train_state.step`` = torchtitan's step at the p2pft job's step 0 (``StartPoint``)
  plus p2pft's step; ``lr_scheduler.last_epoch`` = the scheduler's own (p2pft steps it once per
  committed step, so the two agree);
- the data position: ``dataloader.sample`` = the sample p2pft's step 0 started at plus the
  cursor's frontier; ``dataloader.next`` = that in batches of the p2pft run's
  ``local_batch_size`` x ranks (rounded down); ``train_state.ntokens_seen`` = one rank's tokens
  over those batches, as torchtitan counts them.
It cannot carry: the cursor's holes (samples below the frontier whose slot did not contribute,
which p2pft hands out again; torchtitan keeps a position only: they are skipped), the contributor
peak of p2pft's learning-rate factor, the last step's contributor signature, registered state
other than the scheduler and ``StartPoint``. ``Converted.notes`` says what applied.

torchtitan -> p2pft (``from_torchtitan``) renames model and optimizer back (parameter groups are
rebuilt from runs of parameters with equal hyperparameters) and keeps ``lr_scheduler``,
``dataloader`` and ``train_state`` as ``p2pft.torchtitan.*``, so converting back gives the same
checkpoint. It is p2pft's layout for what reads it (``dcp.load({"model": ..., "optim": ...})``),
not a checkpoint a p2pft replica resumes from: a resume checks every rank's digest of its state at
its rank count, which only running ranks compute. A p2pft job starts from a torchtitan checkpoint
through torchtitan's own flags instead (``P2PFTTrainer``, docs/torchtitan.md "Checkpoints").

DCP stores non-tensor values with pickle: convert only checkpoints you trust.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, cast

import msgpack
import torch

MODEL, OPTIM, EXTRAS = "model.", "optim.", "p2pft.rank"        # p2pft's layout (state/checkpoints.py)
CARRIED = "p2pft.torchtitan."     # torchtitan's non-model states inside p2pft's layout (from_torchtitan)
TITAN_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")   # torchtitan's top-level non-model keys
START = "torchtitan"              # the name P2PFTTrainer registers its StartPoint under

_AC_PREFIX = "_checkpoint_wrapped_module."   # torch's activation-checkpoint wrapper, absent from state dicts

PathLike = str | os.PathLike[str]


# ---------------------------------------------------------------------- what crosses modules
@dataclass(slots=True)
class StartPoint:
    """Where a p2pft job started in torchtitan's terms, registered as p2pft replica state
    (``HSDP.launch(state=...)``) so that it travels in snapshots and p2pft checkpoints: the
    trainer offsets p2pft's sample indices by ``sample``, and ``to_torchtitan`` turns p2pft's
    step and cursor back into torchtitan's step and data position."""

    step: int = 0
    """torchtitan's ``train_state.step`` at the p2pft job's step 0 (0: a fresh start)"""
    sample: int = 0
    """the first sample of p2pft's step 0: sample i of the job is sample ``sample + i`` of the file"""
    local_batch: int = 1
    """``training.local_batch_size`` of the run (torchtitan's dataloader batches of it per rank)"""
    ranks: int = 1
    """ranks of one replica (torchtitan's data-parallel degree for this layout)"""
    seq_len: int = 0
    """``training.seq_len`` (tokens per sample, for ``ntokens_seen``)"""

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for f in fields(self):
            setattr(self, f.name, int(state.get(f.name, getattr(self, f.name))))


@dataclass(frozen=True, slots=True)
class Converted:
    """What one conversion wrote, and what it could not carry (the CLI prints it)."""

    src: str
    dst: str
    step: int | None
    """torchtitan's step of the checkpoint (p2pft's where no torchtitan step is known; None: a
    model-only checkpoint, which has none)"""
    tensors: int
    nbytes: int
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Digests:
    """Digests of a state in torchtitan's names: the model's state dict (torchtitan's keys), and
    the optimizer's per-parameter tensors (``<param>.<name>``). Equal digests: equal bits."""

    model: str
    optim: str


# ---------------------------------------------------------------------- reading and writing DCP
def step_dir(path: PathLike) -> Path:
    """`path` if it is a checkpoint (holds ``.metadata``), else its newest complete ``step-N``
    subfolder (p2pft's ``step-000000000040``, torchtitan's ``step-40``)."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    steps = sorted((int(e.name.split("-", 1)[1]), e) for e in p.glob("step-*")
                   if e.name.split("-", 1)[1].isdigit() and (e / ".metadata").is_file()) if p.is_dir() else []
    if not steps:
        raise FileNotFoundError(f"{p} is no DCP checkpoint and holds no step-N checkpoint")
    return steps[-1][1]


def keys_of(path: PathLike) -> dict[str, object]:
    """The checkpoint's flat keys and their storage metadata (read from ``.metadata`` only)."""
    from torch.distributed.checkpoint import FileSystemReader
    return dict(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def read(path: PathLike, keys: Iterable[str]) -> dict[str, Any]:
    """The values of `keys` of checkpoint `path`: tensors loaded into empty ones of their size
    and dtype, other values unpickled (DCP's bytes). One process, no process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = keys_of(path)
    state: dict[str, Any] = {}
    for k in keys:
        m = md[k]
        state[k] = (torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata)
                    else None)   # filled in by DCP
    if state:
        with _quiet():
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def write(path: PathLike, state: dict[str, Any]) -> tuple[int, int]:
    """``dcp.save`` a flat state (one process); returns (tensors, their bytes)."""
    import torch.distributed.checkpoint as dcp
    out = Path(path)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    with _quiet():
        dcp.save(state, checkpoint_id=str(out), no_dist=True)
    ts = [v for v in state.values() if isinstance(v, torch.Tensor)]
    return len(ts), sum(t.numel() * t.element_size() for t in ts)


def p2pft_meta(path: PathLike, md: Mapping[str, object] | None = None) -> dict[str, Any] | None:
    """Rank 0's replicated extras of a p2pft checkpoint (step, cursor, registered state), or None
    where there are none (a checkpoint ``from_torchtitan`` wrote)."""
    key = f"{EXTRAS}0.meta"
    if key not in (md if md is not None else keys_of(path)):
        return None
    return cast("dict[str, Any]", msgpack.unpackb(read(path, [key])[key], raw=False))


# ---------------------------------------------------------------------- p2pft -> torchtitan
def to_torchtitan(src: PathLike, dst: PathLike) -> Converted:
    """Write p2pft checkpoint `src` (a ``step-...`` folder, or a ``checkpoint_dir``: its newest)
    as torchtitan's ``CheckpointManager`` reads it, into `dst` (a ``step-N`` folder for
    ``--checkpoint.folder``, or any folder for ``--checkpoint.initial_load_path``)."""
    path = step_dir(src)
    md = keys_of(path)
    if not any(k.startswith(MODEL) for k in md):
        raise ValueError(f"{path}: no model.* keys: not a checkpoint in p2pft's layout")
    state = read(path, [k for k in md if k.startswith((MODEL, OPTIM, CARRIED))])
    out: dict[str, Any] = {}
    groups: dict[int, dict[str, Any]] = {}
    for k, v in state.items():
        if k.startswith(MODEL):
            out[k[len(MODEL):]] = v
        elif k.startswith(OPTIM + "state."):
            out["optimizer." + k[len(OPTIM):]] = v
        elif k.startswith(OPTIM + "param_groups."):
            index, key = k[len(OPTIM + "param_groups."):].split(".", 1)
            groups.setdefault(int(index), {})[key] = v
        elif k.startswith(CARRIED):
            out[k[len(CARRIED):]] = v
    for i in sorted(groups):
        g = dict(groups[i])
        params = cast("list[str]", g.pop("params"))
        g.pop("param_names", None)
        for fqn in params:
            out.update({f"optimizer.param_groups.{fqn}.{key}": v for key, v in g.items()})
    notes: list[str] = []
    meta = p2pft_meta(path, md)
    if meta is not None:
        out.update(_titan_states(meta, notes))
    elif "train_state.step" not in out:
        notes.append("model only (a model-only torchtitan checkpoint converted): load it with torchtitan's "
                     "default --checkpoint.initial-load-model-only")
    n, nbytes = write(dst, out)
    step = out.get("train_state.step")
    return Converted(str(path), str(dst), None if step is None else int(step), n, nbytes, notes)


def _titan_states(meta: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """torchtitan's ``train_state``, ``lr_scheduler`` and ``dataloader`` from p2pft's extras."""
    user = cast("dict[str, Any]", meta.get("user", {}))
    step = int(meta["step"])
    start = StartPoint()
    if START in user:
        start.load_state_dict(user[START])
    else:
        notes.append("no torchtitan start point (not written by P2PFTTrainer): the step is p2pft's")
    out: dict[str, Any] = {"train_state.step": start.step + step}
    sched = user.get("lr_scheduler")
    out["lr_scheduler.last_epoch"] = int(sched["last_epoch"]) if isinstance(sched, dict) else start.step + step
    cursor = cast("dict[str, Any]", meta.get("cursor", {}))
    if START in user and "frontier" in cursor:
        sample = start.sample + int(cursor["frontier"])
        per = start.local_batch * start.ranks
        nxt = sample // per
        out.update({"dataloader.next": nxt, "dataloader.sample": sample,
                    "train_state.ntokens_seen": nxt * start.local_batch * start.seq_len})
        holes = sum(e - s for s, e in cursor.get("holes", []))
        if holes:
            notes.append(f"{holes} sample(s) below the cursor's frontier were never trained (holes): "
                         "torchtitan keeps a position only, they are skipped")
        if sample % per:
            notes.append(f"sample {sample} is not a multiple of {per} (local_batch_size x ranks): "
                         f"torchtitan's dataloader resumes at batch {nxt}, sample {nxt * per}")
    else:
        out["train_state.ntokens_seen"] = 0
        notes.append("no data position: load with --checkpoint.exclude_from_loading dataloader")
    if int(cast("dict[str, Any]", meta.get("optstep", {})).get("peak", 0)) > 1:
        notes.append("p2pft's contributor peak (the learning-rate factor's planned replica count) is not carried")
    return out


# ---------------------------------------------------------------------- torchtitan -> p2pft
def from_torchtitan(src: PathLike, dst: PathLike) -> Converted:
    """Write torchtitan checkpoint `src` (a ``step-N`` folder, or a checkpoint folder: its
    newest) in p2pft's layout into `dst` (see the module docstring: not resumable by p2pft)."""
    path = step_dir(src)
    md = keys_of(path)
    if any(k.startswith(("p2pft.", OPTIM, MODEL)) for k in md):
        raise ValueError(f"{path}: p2pft's layout, not torchtitan's")
    state = read(path, list(md))
    out: dict[str, Any] = {}
    hyper: dict[str, dict[str, Any]] = {}    # parameter -> its group's hyperparameters, in order
    for k, v in state.items():
        head = k.split(".", 1)[0]
        if k.startswith("optimizer.state."):
            out[OPTIM + k[len("optimizer."):]] = v
        elif k.startswith("optimizer.param_groups."):
            fqn, key = k[len("optimizer.param_groups."):].rsplit(".", 1)
            hyper.setdefault(fqn, {})[key] = v
        elif head in TITAN_STATES:
            out[CARRIED + k] = v
        else:
            out[MODEL + k] = v
    for i, (params, hp) in enumerate(_runs(hyper)):
        out.update({f"{OPTIM}param_groups.{i}.{key}": v for key, v in hp.items()})
        out[f"{OPTIM}param_groups.{i}.params"] = params
    n, nbytes = write(dst, out)
    step = out.get(f"{CARRIED}train_state.step")
    notes = [] if step is not None else ["model only (torchtitan's final checkpoint unless "
                                         "--checkpoint.no-last-save-model-only): no step, optimizer or data position"]
    return Converted(str(path), str(dst), None if step is None else int(step), n, nbytes, notes)


def _runs(hyper: Mapping[str, Mapping[str, Any]]) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """Parameter groups back from torchtitan's per-parameter hyperparameters: each run of
    consecutive parameters with equal ones (torch matches groups by their parameters' names)."""
    run: list[str] = []
    hp: dict[str, Any] = {}
    for fqn, h in hyper.items():
        if run and not _same(h, hp):
            yield run, hp
            run = []
        if not run:
            hp = dict(h)
        run.append(fqn)
    if run:
        yield run, hp


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


# ---------------------------------------------------------------------- digests (tests, --p2pft.digest_every)
def _digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """blake2b over (name, dtype, shape, bytes) in the order given (callers sort by name)."""
    h = hashlib.blake2b(digest_size=32)
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checkpoint_digests(path: PathLike) -> Digests:
    """``Digests`` of a checkpoint of either layout (its model and optimizer-state tensors)."""
    p = step_dir(path)
    md = keys_of(p)
    p2pft = any(k.startswith(EXTRAS) or k.startswith(MODEL) for k in md)
    model: dict[str, str] = {}
    optim: dict[str, str] = {}
    for k in md:
        if p2pft and k.startswith(MODEL):
            model[k] = k[len(MODEL):]
        elif p2pft and k.startswith(OPTIM + "state."):
            optim[k] = k[len(OPTIM + "state."):]
        elif not p2pft and k.startswith("optimizer.state."):
            optim[k] = k[len("optimizer.state."):]
        elif not p2pft and k.split(".", 1)[0] not in TITAN_STATES:
            model[k] = k
    state = read(p, [*model, *optim])
    return Digests(_digest(sorted((n, state[k]) for k, n in model.items())),
                   _digest(sorted((n, state[k]) for k, n in optim.items())))


def live_digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Digests:
    """``Digests`` of a live FSDP model and its optimizer, as ``checkpoint_digests`` computes them
    from a checkpoint of it. Collective over the model's ranks (it gathers every tensor whole, one
    at a time): a test's and a debugging aid, not for every step of a large model."""
    def whole(t: torch.Tensor) -> torch.Tensor:
        full = getattr(t, "full_tensor", None)
        return cast("torch.Tensor", full()) if callable(full) else t

    sd = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for p, name in param_names(model, optimizer):
        for k, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                state[f"{name}.{k}"] = v
    return Digests(_digest((k, whole(sd[k])) for k in sorted(sd)),
                   _digest((k, whole(state[k])) for k in sorted(state)))


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, str]]:
    """Each parameter of `optimizer` with the name both layouts key its state by: the group's
    ``param_names`` (torchtitan builds its optimizers from named parameters), else the model's
    name without activation-checkpoint wrappers (as torch's ``get_state_dict`` writes it)."""
    by_id = {id(p): n.replace(_AC_PREFIX, "") for n, p in model.named_parameters()}
    out: list[tuple[torch.Tensor, str]] = []
    for g in optimizer.param_groups:
        names = g.get("param_names") or [by_id[id(p)] for p in g["params"]]
        out.extend(zip(g["params"], names))
    return out


# ---------------------------------------------------------------------- p2pft's checkpoints of torchtitan models
class _HookKey:
    """Stands for a module path that only a state-dict hook makes up (torchtitan's
    ``FusedQKVLinear`` writes its fused ``wqkv`` as ``wq``/``wk``/``wv``): any public attribute
    of it is itself, so the path resolves (private ones are absent: torch probes for hooks such
    as ``_fqn_modifiers``)."""

    def __getattr__(self, name: str) -> _HookKey:
        if name.startswith("_"):
            raise AttributeError(name)
        return self


def alias_state_keys(model: torch.nn.Module) -> list[str]:
    """Let torch's ``get_state_dict`` (what p2pft's checkpoints call) take `model`'s state dict
    as the model writes it. It resolves every key of ``model.state_dict()`` as an attribute path
    and fails on one a state-dict hook made up (``AttributeError: 'FusedQKVLinear' object has no
    attribute 'wq'`` at p2pft's first checkpoint of a torchtitan Llama); such paths get a
    ``_HookKey``, so the p2pft checkpoint holds torchtitan's own model keys and loads through the
    model's own load hooks (``load_state_dict``). Collective (state-dict hooks may gather);
    returns the aliased module paths."""
    added: list[str] = []
    missing = object()
    for key in model.state_dict():
        obj: object = model
        path: list[str] = []
        for name in key.split("."):
            if name == "_extra_state":   # torch does not look this one up
                break
            path.append(name)
            nxt = getattr(obj, name, missing)
            if nxt is missing:
                if isinstance(obj, torch.nn.Module):
                    object.__setattr__(obj, name, _HookKey())
                    added.append(".".join(path))
                break
            obj = nxt
    return added


# ---------------------------------------------------------------------- the CLI
def main(argv: Sequence[str]) -> int:
    """``convert --to torchtitan|p2pft SRC DST`` (``python -m p2pft.trainer.integrations.torchtitan convert``)."""
    ap = argparse.ArgumentParser(
        prog="python -m p2pft.trainer.integrations.torchtitan convert",
        description="convert a checkpoint between p2pft's and torchtitan's DCP layouts (docs/torchtitan.md)")
    ap.add_argument("--to", required=True, choices=["torchtitan", "p2pft"], help="the layout to write")
    ap.add_argument("src", help="a checkpoint (step folder), or a folder of step-N checkpoints: its newest")
    ap.add_argument("dst", help="the folder to write (new or empty); under torchtitan's --checkpoint.folder: step-N")
    a = ap.parse_args(list(argv))
    try:
        res = (to_torchtitan if a.to == "torchtitan" else from_torchtitan)(a.src, a.dst)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        ap.exit(2, f"convert: {exc}\n")
    print(f"{res.src} -> {res.dst}: {a.to} layout, step {'?' if res.step is None else res.step}, {res.tensors} tensors "
          f"({res.nbytes / 2**20:.1f} MiB)")
    for note in res.notes:
        print(f"  not carried: {note}")
    if a.to == "torchtitan":
        print(f"  load with --checkpoint.enable --checkpoint.initial_load_path {Path(a.dst).resolve()} "
              "--checkpoint.no-initial-load-model-only (or as step-N under --checkpoint.folder)")
    return 0


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP's warning that a single process saves or loads without a process group (on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


__all__ = ["Converted", "Digests", "StartPoint", "alias_state_keys", "checkpoint_digests", "from_torchtitan",
           "live_digests", "main", "p2pft_meta", "read", "step_dir", "to_torchtitan", "write"]
