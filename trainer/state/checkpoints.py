"""Disk checkpoints in the ecosystem's format: ``torch.distributed.checkpoint`` (DCP).

Peers are the first source of state; a checkpoint is the last resort, for when every replica
of the job died at once. So writing costs the loop one copy to host memory: DCP's
``async_save`` stages the state and writes it on a thread of its own (for an FSDP replica over
a process group of its own, every rank its shard). A checkpoint is a directory
``step-000000000040`` that a plain PyTorch script loads with ``dcp.load`` (into a whole,
unsharded model too: DCP reshards); it is written as ``.step-...tmp`` and renamed once DCP's
coordinator has written its metadata, so a directory with the final name is complete.

What it holds, under the keys a script reads:
- ``model``, ``optim``: ``get_state_dict(model, optimizer)`` (FQN keys; DTensors for FSDP2);
- ``p2pft.rank{r}``: rank r's replicated extras: ``meta`` (msgpack bytes: step, data cursor,
  learning-rate factors, registered state's trees, and the digest of rank r's state when
  written) and ``tensors`` (registered state's tensors).
On resume every rank loads its part and compares its digest with the one written: a
checkpoint that does not reproduce it on every rank is skipped, loudly, for the next older one.
DCP stores non-tensor values with pickle: load checkpoints only from directories you trust.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol, TypedDict, cast

import msgpack
import torch

from ..kernel.options import CheckpointOptions
from ..kernel.ports import ReplicaState, StateMeta

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.state_dict import DictValueType, OptimizerStateType

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{12})$")
SAVE_WAIT_S = 120.0     # close() waits this long for the write in flight


class CheckpointPort(ReplicaState, Protocol):
    """What checkpoints read and load: the replica's extras besides model and optimizer."""

    def extras(self) -> tuple[StateMeta, dict[str, torch.Tensor]]:
        """(msgpack-able meta, tensors) of the replicated state that is not model or optimizer."""

    def load_extras(self, meta: StateMeta, tensors: dict[str, torch.Tensor]) -> None: ...


class _Dist(TypedDict, total=False):
    """DCP's keywords for where a save or load runs: its own process group, or no group at all."""

    process_group: ProcessGroup
    no_dist: bool


# A replica of one rank saves without a process group on purpose; DCP says so on its writer
# thread, where a catch_warnings around the call does not reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _checkpoint_exception() -> type[BaseException]:
    """DCP's error (a BaseException, which ``except Exception`` would not catch)."""
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException


def model_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[DictValueType, OptimizerStateType]:
    """torch's distributed state dicts (FQN keys; one flat ``optim`` dict over the members of an
    ``Optimizers``, as ``get_state_dict`` writes several optimizers)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    with _quiet():
        return get_state_dict(model, members(opt))


def members(opt: torch.optim.Optimizer) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """The optimizers torch's state-dict API should see: an ``Optimizers``' members, else `opt`."""
    inner = getattr(opt, "optimizers", None)
    return list(inner) if isinstance(inner, list) else opt


def checkpoint_steps(directory: str | os.PathLike[str]) -> list[int]:
    """Steps of the complete checkpoints in `directory`, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for e in d.iterdir() if (m := _NAME.match(e.name)) and (e / ".metadata").exists())


class Checkpoints:
    """One rank's checkpoints: written every ``options.every`` committed steps, resumed from
    at construction. Collective: every rank of a replica saves and resumes together."""

    def __init__(self, port: CheckpointPort, options: CheckpointOptions) -> None:
        self.port = port
        self.options = options
        self.directory = Path(options.directory)
        self.last_error: BaseException | None = None
        self.saved: list[int] = []
        self._inflight: threading.Event | None = None   # set once the write in flight ended
        self._lock = threading.Lock()
        group = port.group
        if port.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(".step-*.tmp"):   # left by a writer that died
                shutil.rmtree(stale, ignore_errors=True)
        group.agree(None)    # the directory exists for every rank from here on
        # Its own group: DCP's collectives run on the writer thread, beside the loop's.
        self._pg: ProcessGroup | None = group.side_group()

    def _dist(self) -> _Dist:
        return {"process_group": self._pg} if self._pg is not None else {"no_dist": True}

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:012d}"

    # ------------------------------------------------------------------ writing
    def on_step(self) -> None:
        every = self.options.every
        if every and self.port.step % every == 0:
            self.save()

    def save(self) -> bool:
        """Collective: stage this step's state and write it in the background. Skipped (False)
        on every rank when a rank's previous write is still running: the newest state is the
        one worth writing, and the next one comes soon."""
        p = self.port
        step = p.step
        busy = self._inflight is not None and not self._inflight.is_set()
        if any(p.group.agree(busy)):
            log.info("checkpoint of step %d skipped: the previous one is still being written", step)
            return False
        msd, osd = model_state(p.model, p.opt)
        meta, tensors = p.extras()
        meta = {**meta, "step": step, "digest": p.digest(), "world": p.group.world}
        state = {"model": msd, "optim": osd,
                 "p2pft": {f"rank{p.rank}": {"meta": msgpack.packb(meta, use_bin_type=True), "tensors": tensors}}}
        tmp = self.directory / f".step-{step:012d}.tmp"
        t0 = time.monotonic()
        with _quiet():
            from torch.distributed.checkpoint import async_save
            fut = async_save(state, checkpoint_id=str(tmp), **self._dist())
        if not isinstance(fut, Future):     # an AsyncSaveResponse: staging and upload
            fut = fut.upload_completion
        ended = threading.Event()
        self._inflight = ended

        def written(f: Future[None]) -> None:
            try:
                self._written(f, step, tmp, t0)
            finally:
                ended.set()
        fut.add_done_callback(written)
        return True

    def _written(self, fut: Future[None], step: int, tmp: Path, t0: float) -> None:
        """DCP's writer thread: on rank 0 (the coordinator, whose save ends after every rank's
        data and the metadata are written) the checkpoint gets its final name."""
        err = fut.exception()
        if err is not None:   # a full disk must not kill training; the next save tries again
            self.last_error = err
            log.error("checkpoint of step %d failed: %s", step, err)
            return
        if self.port.rank != 0:
            return
        try:
            final = self.path_for(step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
            with self._lock:
                self.saved.append(step)
                self._prune()
            log.info("checkpoint of step %d written to %s in %.2f s", step, final, time.monotonic() - t0)
        except OSError as exc:
            self.last_error = exc
            log.error("checkpoint of step %d could not be named: %s", step, exc)

    def _prune(self) -> None:
        for step in checkpoint_steps(self.directory)[: -self.options.keep]:
            shutil.rmtree(self.path_for(step), ignore_errors=True)

    def wait(self, timeout: float = SAVE_WAIT_S) -> bool:
        """Until the write in flight (if any) ended; False if `timeout` ran out first."""
        ended = self._inflight
        return ended is None or ended.wait(timeout)

    def close(self) -> None:
        if not self.wait():
            log.warning("a checkpoint was still being written at close; it is left incomplete")

    # ------------------------------------------------------------------ resuming
    def resume(self) -> int | None:
        """Collective: load the newest checkpoint that reproduces its digest on every rank.
        Returns its step (None: none found, the state is unchanged)."""
        p = self.port
        steps = p.group.broadcast(checkpoint_steps(self.directory) if p.rank == 0 else None)
        for step in reversed(steps):
            ok, why = self._try_load(step)
            if all(p.group.agree(ok)):
                log.info("resumed from the checkpoint of step %d (%s)", step, self.path_for(step))
                p.events.append({"t": time.time(), "kind": "resumed", "step": step})
                return step
            log.warning("ignoring the checkpoint of step %d: %s", step, why or "another rank could not load it")
        return None

    def _try_load(self, step: int) -> tuple[bool, str]:
        p = self.port
        path = str(self.path_for(step))
        from torch.distributed.checkpoint import load
        try:
            key = f"rank{p.rank}"
            head: dict[str, dict[str, dict[str, bytes]]] = {"p2pft": {key: {"meta": b""}}}
            with _quiet():
                load(head, checkpoint_id=path, **self._dist())   # in place: DCP fills in the values
                meta = cast(StateMeta, msgpack.unpackb(head["p2pft"][key]["meta"], raw=False))
                if meta.get("world") != p.group.world or meta.get("step") != step:
                    return False, f"written by {meta.get('world')} rank(s) at step {meta.get('step')}"
                _, tensors = p.extras()
                msd, osd = model_state(p.model, p.opt)
                state: dict[str, object] = {
                    "model": msd, "optim": osd,
                    "p2pft": {key: {"tensors": {k: torch.empty_like(v) for k, v in tensors.items()}}}}
                load(state, checkpoint_id=path, **self._dist())
                from torch.distributed.checkpoint.state_dict import set_state_dict
                set_state_dict(p.model, members(p.opt), model_state_dict=cast("DictValueType", state["model"]),
                               optim_state_dict=cast("OptimizerStateType", state["optim"]))
            loaded = cast("dict[str, dict[str, dict[str, torch.Tensor]]]", state["p2pft"])
            p.load_extras(meta, loaded[key]["tensors"])
        except (Exception, _checkpoint_exception()) as exc:  # damaged, foreign, another model: the next older one
            return False, f"{type(exc).__name__}: {str(exc)[:300]}"
        mine = p.digest()
        if mine != meta.get("digest"):
            return False, f"digest {mine[:12]} after loading, {str(meta.get('digest'))[:12]} when written"
        return True, ""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP's warnings that say nothing here: a replica of one rank saves without a process
    group on purpose, and ``get_state_dict``'s deprecation notes are PyTorch's own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["CheckpointPort", "Checkpoints", "checkpoint_steps", "model_state"]
