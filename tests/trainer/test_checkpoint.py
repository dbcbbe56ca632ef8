"""AsyncCheckpointer: background, atomic, newest-wins, and damaged files are skipped."""
from __future__ import annotations


import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from p2pft.trainer.checkpoint import AsyncCheckpointer, CorruptCheckpointError, read_checkpoint, write_checkpoint
from p2pft.trainer.data import TextDataset
from p2pft.trainer.model import TinyLM
from p2pft.trainer.state import capture, restore, state_digest


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=gen),
        "half": torch.randn(7, generator=gen).to(torch.bfloat16),
        "ids": torch.arange(11, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(42.5),
        "empty": torch.empty(0, 4),
    }


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_round_trip_of_every_dtype(tmp_path: Path) -> None:
    meta = {"cursor": {"frontier": 10, "holes": [[2, 4]]}, "note": "x", "lr": 0.5}
    with AsyncCheckpointer(tmp_path) as ck:
        assert ck.latest() is None
        ck.save_async(7, meta, _tensors())
        assert ck.wait(timeout=10)
        step, got_meta, got = ck.latest()  # type: ignore[misc]
    assert step == 7 and got_meta == meta
    _assert_same(got, _tensors())
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000000007.p2ck"]  # no temp files left


def test_trained_model_survives_a_checkpoint_bitwise(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyLM(vocab_size=256, d_model=32, n_layers=1, n_heads=4, seq_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TextDataset(16, n_samples=32)
    for step in range(2):
        opt.zero_grad()
        model.loss(data.batch([step * 2, step * 2 + 1])).backward()
        opt.step()
    meta, tensors = capture(model, opt, {"step": 2})
    with AsyncCheckpointer(tmp_path) as ck:
        ck.save_async(2, meta, tensors)
        ck.wait(10)
        step, meta2, tensors2 = ck.latest()  # type: ignore[misc]
    torch.manual_seed(1)
    fresh = TinyLM(vocab_size=256, d_model=32, n_layers=1, n_heads=4, seq_len=16)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    restore(fresh, fresh_opt, meta2, tensors2)
    assert step == 2 and state_digest(fresh, fresh_opt) == state_digest(model, opt)


def test_keeps_only_the_newest(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, keep=2) as ck:
        for step in (1, 2, 3, 4):
            ck.save_async(step, {"s": step}, {"x": torch.full((2,), float(step))})
            assert ck.wait(10)
        assert ck.steps() == [3, 4]
        assert ck.latest()[1] == {"s": 4}  # type: ignore[index]


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_newest_file_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    with AsyncCheckpointer(tmp_path, keep=3) as ck:
        for step in (10, 20):
            ck.save_async(step, {"s": step}, _tensors())
            ck.wait(10)
        newest = ck.path_for(20)
        data = newest.read_bytes()
        if damage == "truncate":
            newest.write_bytes(data[: len(data) // 2])
        elif damage == "flip":
            newest.write_bytes(data[:200] + bytes([data[200] ^ 0x10]) + data[201:])
        else:
            newest.write_bytes(b"not a checkpoint")
        with caplog.at_level(logging.WARNING, logger="p2pft.trainer.checkpoint"):
            step, meta, tensors = ck.latest()  # type: ignore[misc]
    assert step == 10 and meta == {"s": 10}
    _assert_same(tensors, _tensors())
    assert any("ignoring checkpoint" in r.message and "000000000020" in r.message for r in caplog.records)


def test_read_checkpoint_raises_on_damage(tmp_path: Path) -> None:
    path = tmp_path / "one.p2ck"
    write_checkpoint(path, 3, {}, _tensors())
    assert read_checkpoint(path)[0] == 3
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CorruptCheckpointError, match="digest"):
        read_checkpoint(path)


class _GatedCheckpointer(AsyncCheckpointer):
    """Holds the first write until released, to observe what is queued meanwhile."""

    def __init__(self, directory: Path) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.written: list[int] = []
        super().__init__(directory, keep=10)

    def _write_file(self, path: Path, step: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.started.set()
        assert self.release.wait(10)
        super()._write_file(path, step, meta, tensors)
        self.written.append(step)


def test_newer_request_replaces_the_queued_one(tmp_path: Path) -> None:
    ck = _GatedCheckpointer(tmp_path)
    try:
        ck.save_async(1, {}, {"x": torch.ones(1)})
        assert ck.started.wait(10)  # step 1 is in flight
        ck.save_async(2, {}, {"x": torch.ones(1)})
        ck.save_async(3, {}, {"x": torch.ones(1)})  # replaces 2 in the queue
        assert not ck.wait(timeout=0.05)  # still busy
        ck.release.set()
        assert ck.wait(timeout=10)
        assert ck.written == [1, 3]
        assert ck.steps() == [1, 3]
    finally:
        ck.release.set()
        ck.close(10)


def test_write_error_is_recorded_and_training_goes_on(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path) as ck:
        ck.save_async(1, {}, {"x": torch.ones(1)})
        ck.wait(10)
        for p in tmp_path.iterdir():
            p.unlink()
        tmp_path.rmdir()  # the directory vanished (unmounted, deleted)
        ck.save_async(2, {}, {"x": torch.ones(1)})
        assert ck.wait(10)
        assert isinstance(ck.last_error, OSError)


def test_close_flushes_the_queue_and_refuses_more(tmp_path: Path) -> None:
    ck = AsyncCheckpointer(tmp_path)
    ck.save_async(5, {}, {"x": torch.ones(3)})
    ck.close(10)
    assert ck.steps() == [5]
    with pytest.raises(RuntimeError, match="closed"):
        ck.save_async(6, {}, {"x": torch.ones(3)})


@pytest.mark.parametrize(
    "args, message",
    [((-1, {}, {}), "step"), ((1, {"x": object()}, {}), "meta is not msgpack-able"),
     ((1, {}, {"x": [1.0]}), "tensors must map str"), ((1, [], {}), "meta must be a dict")],
)
def test_bad_requests_are_rejected(tmp_path: Path, args: tuple, message: str) -> None:
    with AsyncCheckpointer(tmp_path) as ck:
        with pytest.raises(ValueError, match=message):
            ck.save_async(*args)


def test_bad_keep_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        AsyncCheckpointer(tmp_path, keep=0)
