"""Disk checkpoints through torch.distributed.checkpoint, on one real replica (a Runtime that
forms a cluster of one, a real model and optimizer, registered state): written off the
training thread, renamed only once complete, the newest that reproduces its digest is resumed
from, damaged or foreign ones are skipped, and a plain ``dcp.load`` reads them."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from p2pft import Runtime
from p2pft.trainer import FaultTolerant
from p2pft.trainer.state.checkpoints import checkpoint_steps
from p2pft.trainer.state.whole import params_digest


class Counter:
    """Registered user state: part of every checkpoint and of the digest."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.n = int(d["n"])

    def step(self) -> None:   # per-step user state changes in the step (after_step)
        self.n += 1


def _replica(directory: Path, every: int = 2, seed: int = 0) -> tuple[Runtime, FaultTolerant, torch.nn.Module, Counter]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    counter = Counter()
    rt = Runtime(replica_id="r0", data_plane="tcp").start()
    ft = FaultTolerant(rt, model, opt, batch_per_replica=4, checkpoint_dir=str(directory), checkpoint_every=every,
                       state={"counter": counter}, after_step=counter.step, start_timeout=20.0,
                       allow_restart_from_scratch=True)
    return rt, ft, model, counter


def _train(ft: FaultTolerant, model: torch.nn.Module, counter: Counter, n: int) -> None:
    for _ in range(n):
        idx = ft.begin()
        ft.zero_grad()
        if idx:
            x = torch.tensor(idx, dtype=torch.float32).unsqueeze(1).repeat(1, 8) / 100
            model(x).pow(2).mean().backward()
        ft.commit()
        if ft.kernel.checkpoints is not None:   # a write still running when the next is due skips that one
            assert ft.kernel.checkpoints.wait(30)


def test_resume_from_the_newest_checkpoint_with_its_digest(tmp_path: Path) -> None:
    rt, ft, model, counter = _replica(tmp_path)
    _train(ft, model, counter, 6)
    assert ft.kernel.checkpoints is not None and ft.kernel.checkpoints.wait(30)
    digest, cursor = ft.digest(), ft.kernel.cursor.state_dict()
    sig = ft.kernel.recent.signature(5)     # step 5's contributors: what a resume checks against the others'
    assert sig is not None
    ft.close()
    rt.close()
    assert checkpoint_steps(tmp_path) == [4, 6]          # keep=2, complete ones only
    assert not list(tmp_path.glob(".step-*"))           # no temporary left behind

    rt, ft, model, counter = _replica(tmp_path, seed=99)   # other initial weights: all replaced
    try:
        assert ft.step == 6 and ft.digest() == digest and counter.n == 6
        assert ft.kernel.cursor.state_dict() == cursor
        assert ft.kernel.recent.signature(5) == sig, "the checkpoint lost its last step's signature"
        assert any(e["kind"] == "resumed" and e["step"] == 6 for e in ft.events)
    finally:
        ft.close()
        rt.close()


def test_damaged_or_incomplete_checkpoints_are_skipped_for_an_older_one(tmp_path: Path) -> None:
    rt, ft, model, counter = _replica(tmp_path)
    _train(ft, model, counter, 4)
    assert ft.kernel.checkpoints is not None and ft.kernel.checkpoints.wait(30)
    at_2 = None
    ft.close()
    rt.close()
    steps = checkpoint_steps(tmp_path)
    assert steps == [2, 4]
    # The newest is damaged (a data file truncated); one more is incomplete (no metadata).
    newest = tmp_path / "step-000000000004"
    for f in newest.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:10])
    shutil.copytree(newest, tmp_path / "step-000000000006")
    (tmp_path / "step-000000000006" / ".metadata").unlink()
    assert checkpoint_steps(tmp_path) == [2, 4]
    rt, ft, model, counter = _replica(tmp_path, seed=5)
    try:
        assert ft.step == 2 and counter.n == 2
        at_2 = ft.digest()
    finally:
        ft.close()
        rt.close()
    assert at_2 is not None


def test_a_checkpoint_is_plain_dcp(tmp_path: Path) -> None:
    """A plain PyTorch process reads the model (and the optimizer) back with dcp.load."""
    rt, ft, model, counter = _replica(tmp_path)
    _train(ft, model, counter, 2)
    assert ft.kernel.checkpoints is not None and ft.kernel.checkpoints.wait(30)
    want = params_digest(dict(model.named_parameters()))
    ft.close()
    rt.close()
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    sd = {"model": plain.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "step-000000000002"), no_dist=True)
    plain.load_state_dict(sd["model"])
    assert params_digest(dict(plain.named_parameters())) == want


def test_bad_checkpoint_options_are_one_error(tmp_path: Path) -> None:
    rt = Runtime(replica_id="r0", data_plane="tcp").start()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with pytest.raises(ValueError, match="checkpoint_every needs a checkpoint_dir"):
            FaultTolerant(rt, model, opt, batch_per_replica=2, checkpoint_every=5)
        with pytest.raises(ValueError, match="checkpoint_every must be"):
            FaultTolerant(rt, model, opt, batch_per_replica=2, checkpoint_dir=str(tmp_path), checkpoint_every=-1)
    finally:
        rt.close()
