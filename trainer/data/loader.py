"""``StepLoader``: a ``torch.utils.data.DataLoader`` that yields this replica's batch of each step.

Which samples a replica trains on at step s is decided by the replicated data cursor when the
step begins (``begin()``), from the view of that moment. A ``DataLoader`` with workers fetches
batches ahead of time, before those steps begin. So the loader *predicts* the next steps'
indices (same slot, the last committed contribution mask, every step committing), lets the
workers load and collate them ahead (``num_workers``, ``prefetch_factor``, ``pin_memory`` as
usual), and at each step compares: a prefetched batch is used only when its indices are exactly
the ones the cursor assigned. On a miss (a view change, a failed step) the batch is built
in the calling process from the real indices and the prediction restarts from the current
state; prefetched batches of the old prediction are dropped unseen. The indices trained are
therefore always the cursor's, and exactly-once holds as it does for ``begin()``.

The cursor's index stream is the non-negative integers; sample ``i`` is ``dataset[i % len(dataset)]``
(epochs follow one another without a seam).
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypedDict, TypeVar, cast, overload

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import default_collate

from ...deploy.procs import die_with_parent
from ..kernel.cursor import DataCursor

if TYPE_CHECKING:
    from typing_extensions import Unpack

Key = tuple[int, int, int]   # (prediction generation, step, sample index)
S = TypeVar("S")                           # one sample of the user's dataset
S_co = TypeVar("S_co", covariant=True)
B = TypeVar("B")                           # one collated batch
T = TypeVar("T")


class Samples(Protocol[S_co]):
    """A map-style dataset: its length and sample ``i`` (a list of samples is one)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> S_co: ...


class LoaderOptions(TypedDict, total=False):
    """The ``DataLoader`` keywords that ``StepLoader`` passes on as they are."""

    timeout: float
    worker_init_fn: Callable[[int], None] | None
    multiprocessing_context: object
    generator: torch.Generator | None
    persistent_workers: bool
    pin_memory_device: str
    in_order: bool


class _DataLoaderKw(LoaderOptions, total=False):
    prefetch_factor: int


class _Tagged(Dataset[tuple[Key, S]]):
    """Map-style view of the user's dataset that keeps each sample's tag with it."""

    def __init__(self, dataset: Samples[S]) -> None:
        self.dataset = dataset
        self.n = len(dataset)

    def __getitem__(self, key: Key) -> tuple[Key, S]:
        return key, self.dataset[key[2] % self.n]

    def __len__(self) -> int:
        return self.n


class _Collate(Generic[S, B]):
    """Runs in the workers: the user's collate over the samples, plus the batch's tag."""

    def __init__(self, collate: Callable[[list[S]], B]) -> None:
        self.collate = collate

    def __call__(self, items: list[tuple[Key, S]]) -> tuple[int, int, list[int], B]:
        keys = [k for k, _ in items]
        return keys[0][0], keys[0][1], [k[2] for k in keys], self.collate([x for _, x in items])


class _WorkerInit:
    """Workers die with the replica: a forked worker holds copies of the replica's sockets (its
    control and data ports), so one outliving a SIGKILLed replica would keep those ports bound
    and its restart could not listen on them."""

    def __init__(self, parent: int, user: Callable[[int], object] | None) -> None:
        self.parent, self.user = parent, user

    def __call__(self, worker_id: int) -> None:
        die_with_parent(self.parent)
        if self.user is not None:
            self.user(worker_id)


class _Predictions:
    """The batch sampler: yields predicted index lists for the steps ahead, from a base the
    loader resets on every miss. Iterated lazily in the calling thread by the DataLoader."""

    def __init__(self, share: Callable[[DataCursor, int], list[int]]) -> None:
        self.share = share
        self.gen = 0
        self._base: tuple[int, DataCursor, int, list[bool]] | None = None

    def reset(self, step: int, cursor: DataCursor, slot: int, mask: Sequence[bool]) -> None:
        self.gen += 1
        self._base = (step, DataCursor.from_state_dict(cursor.state_dict()), slot, list(mask))

    def __iter__(self) -> Iterator[list[Key]]:
        gen, step, cur, slot, mask = -1, 0, None, 0, [False]
        while True:
            if self.gen != gen and self._base is not None:
                gen = self.gen
                step, cur, slot, mask = self._base[0], self._base[1], self._base[2], self._base[3]
                cur = DataCursor.from_state_dict(cur.state_dict())
            if cur is None:
                raise RuntimeError("StepLoader prediction used before its first reset")
            cur.commit(mask)           # predict: the current step commits with the same mask
            step += 1
            yield [(gen, step, i) for i in self.share(cur, slot)]


class SlotLog(Protocol):
    """The kernel's log of committed steps, as the loader reads it (``recent.RecentSteps``)."""

    @property
    def last_mask(self) -> list[bool] | None:
        """The contribution mask of the last committed step (None: none yet)."""


class LoaderKernel(Protocol):
    """What the loader reads of an algorithm's step kernel: the step begun last, this replica's
    slot in it, and the replicated data cursor with the samples it assigns a slot."""

    @property
    def step(self) -> int: ...

    @property
    def current_slot(self) -> int | None: ...

    @property
    def cursor(self) -> DataCursor: ...

    @property
    def recent(self) -> SlotLog: ...

    def rank_share(self, cursor: DataCursor, slot: int) -> list[int]: ...


class Trainer(Protocol):
    """What the loader reads of an algorithm (``FaultTolerant``, an ``HSDP`` rank): its
    ``begin()``, and its kernel's cursor and slot to predict the next steps' samples."""

    def begin(self, stop: bool = False) -> list[int]: ...

    @property
    def kernel(self) -> LoaderKernel: ...


class StepLoader(Generic[S, B]):
    """Per-step batches for ``trainer`` (``FaultTolerant`` or an ``HSDP`` rank) from a map-style
    dataset. ``next_batch()`` calls ``trainer.begin()`` and returns this step's collated batch,
    or None when the replica contributes nothing this step (catching up, or not on the data
    plane): then run no forward/backward, just ``commit()``."""

    # S: a sample, B: a batch, what `collate_fn` makes of a list of samples. torch's
    # default_collate stacks tensor samples into a tensor, and is untyped for other samples.
    @overload
    def __init__(self: StepLoader[torch.Tensor, torch.Tensor], trainer: Trainer, dataset: Samples[torch.Tensor], *,
                 collate_fn: None = None, num_workers: int = 0, prefetch_factor: int | None = None,
                 pin_memory: bool = False, **loader_kw: Unpack[LoaderOptions]) -> None: ...

    @overload
    def __init__(self: StepLoader[S, Any], trainer: Trainer, dataset: Samples[S], *,
                 collate_fn: None = None, num_workers: int = 0, prefetch_factor: int | None = None,
                 pin_memory: bool = False, **loader_kw: Unpack[LoaderOptions]) -> None: ...

    @overload
    def __init__(self: StepLoader[S, B], trainer: Trainer, dataset: Samples[S], *,
                 collate_fn: Callable[[list[S]], B], num_workers: int = 0, prefetch_factor: int | None = None,
                 pin_memory: bool = False, **loader_kw: Unpack[LoaderOptions]) -> None: ...

    def __init__(self, trainer: Trainer, dataset: Samples[object], *, collate_fn: Callable[[list[S]], B] | None = None,
                 num_workers: int = 0, prefetch_factor: int | None = None, pin_memory: bool = False,
                 **loader_kw: Unpack[LoaderOptions]) -> None:
        if len(dataset) < 1:
            raise ValueError("the dataset is empty")
        for bad in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if bad in loader_kw:
                raise TypeError(f"StepLoader chooses the samples itself: {bad}= is not accepted")
        self.trainer = trainer
        self.engine = engine = trainer.kernel
        self.dataset = cast("Samples[S]", dataset)   # the overloads tie S to the dataset's samples
        self.collate: Callable[[list[S]], B] = collate_fn or default_collate
        self.pin_memory = pin_memory
        self._pred = _Predictions(engine.rank_share)
        kw: _DataLoaderKw = {**loader_kw}
        if num_workers > 0:
            kw["worker_init_fn"] = _WorkerInit(os.getpid(), kw.get("worker_init_fn"))
            if prefetch_factor is not None:
                kw["prefetch_factor"] = prefetch_factor
        self._loader = DataLoader(_Tagged(dataset), batch_sampler=self._pred, collate_fn=_Collate(self.collate),
                                  num_workers=num_workers, pin_memory=pin_memory, **kw)
        self._it: Iterator[tuple[int, int, list[int], B]] | None = None
        self.hits = 0      # steps served from a prefetched batch
        self.misses = 0    # steps whose batch was built here (prediction wrong or not started)
        self.dropped = 0   # prefetched batches of an outdated prediction

    def next_batch(self, stop: bool = False) -> B | None:
        idx = self.trainer.begin(stop)
        if not idx:
            return None
        step, slot = self.engine.step, self.engine.current_slot
        assert slot is not None
        batch = self._take(step, idx)
        if batch is None:
            self.misses += 1
            batch = self.collate([self.dataset[i % len(self.dataset)] for i in idx])
            if self.pin_memory and torch.cuda.is_available():
                batch = _pin(batch)
            self._restart(step, slot)
        else:
            self.hits += 1
        return batch

    def __iter__(self) -> Iterator[B | None]:
        """One item per step, forever (the loop decides when to stop)."""
        return (self.next_batch() for _ in itertools.count())

    def close(self) -> None:
        """Stop the workers."""
        self._it = None

    def _take(self, step: int, idx: list[int]) -> B | None:
        """The prefetched batch for (step, idx) if the current prediction made it."""
        if self._it is None:
            return None
        while True:
            gen, pstep, pidx, batch = next(self._it)
            if gen != self._pred.gen or pstep < step:
                self.dropped += 1
                continue
            if pstep == step and pidx == idx:
                return batch
            self.dropped += 1   # predicted wrong: this and the rest of this prediction are useless
            return None

    def _restart(self, step: int, slot: int) -> None:
        recent = self.engine.recent.last_mask
        mask = recent if recent is not None else [i == slot for i in range(self.engine.cursor.max_slots)]
        self._pred.reset(step, self.engine.cursor, slot, mask)
        if self._it is None:
            self._it = iter(self._loader)


def _pin(batch: T) -> T:
    """`batch` with its tensors in pinned memory: the same structure, so the same type."""
    return cast(T, _pinned(batch))


def _pinned(batch: object) -> object:
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, (list, tuple)):
        return type(batch)(_pinned(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _pinned(v) for k, v in batch.items()}
    return batch


__all__ = ["LoaderKernel", "LoaderOptions", "Samples", "SlotLog", "StepLoader", "Trainer"]
