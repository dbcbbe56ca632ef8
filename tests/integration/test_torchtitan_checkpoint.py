"""Checkpoints both ways between torchtitan and p2pft (``p2pft.trainer.integrations.torchtitan_checkpoint``).

One chain of real runs of ``llama3_debugmodel`` on CPU (module-scoped, so both tests share it):
1. torchtitan's own training (``--config plain_llama3_debugmodel``, 1 rank, 2 steps) writes its
   checkpoint with its ``CheckpointManager`` (full state at step 2);
2. a p2pft job (1 replica x 2 FSDP ranks) starts from it through torchtitan's own flags
   (``--checkpoint.initial_load_path``, ``--checkpoint.no-initial-load-model-only``), trains to
   torchtitan's step 4 and writes a p2pft checkpoint (``--p2pft.checkpoint_dir``);
3. ``convert --to torchtitan`` turns that into torchtitan's layout, and a 1-rank run loads it with
   torchtitan's ``CheckpointManager`` (the ``step-N`` folder under ``--checkpoint.folder``).
States are compared by digest of every model and optimizer tensor in torchtitan's names
(``checkpoint_digests`` of a checkpoint, ``--p2pft.digest_every``'s ``tt_model`` / ``tt_optim``
of a live replica): equal digests are equal bits.
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import importlib.util

import pytest

pytest.importorskip("torchtitan", minversion="0.3.0",
                    reason="torchtitan is not installed (pip install -e '.[torchtitan]')")
if importlib.util.find_spec("triton") is None:
    pytest.skip("torchtitan 0.3.0 imports triton, which is not installed (pip install -e '.[torchtitan]')",
                allow_module_level=True)

from replica_harness import records  # noqa: E402
from test_torchtitan import MODULE, Cluster, _exit  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), pytest.mark.xdist_group("cpu-heavy")]

TT_STEPS = 2      # torchtitan's own run: its checkpoint is at this step
P2PFT_STEPS = 4   # the p2pft job ends at torchtitan's step 4 (2 p2pft steps)
SAMPLES = 2       # per rank and step (local_batch_size)
COMMON = ["--parallelism.spmd_backend", "partial_dtensor", "--training.mixed_precision_param", "float32",
          "--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1"]


class Runs(Cluster):
    """The chain's torchruns, one at a time, each logging to ``<name>.log``."""

    def torchrun(self, name: str, nproc: int, config: str, *args: str, timeout: float = 180) -> float:
        data = self.tmp / "data"
        t0 = time.time()
        self._popen(name, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), "-m", MODULE, "--config", config, "--hf_assets_path", str(data),
                           "--dataloader.dataset_path", str(data / "tokens.bin"),
                           "--dump_folder", str(self.tmp / f"out-{name}"), *COMMON, *args])
        self.wait(lambda: self.procs[name].poll() is not None, timeout, f"{name} to finish",
                  allow_exit=tuple(self.procs))   # the earlier runs have ended
        rc = self.procs[name].returncode
        assert rc == 0, f"{name} exited {rc}: {(self.tmp / f'{name}.log').read_text()[-3000:]}"
        return time.time() - t0

    def p2pft(self, name: str, nproc: int, *args: str, addr: str) -> dict[str, Any]:
        """A p2pft replica of `nproc` ranks; its start record (``base``, ``sample``, digests)."""
        self.stats[name] = self.tmp / f"{name}.jsonl"
        self.torchrun(name, nproc, "llama3_debugmodel", "--p2pft.replica_id", name, "--p2pft.listen", addr,
                      "--p2pft.digest_every", "2", "--p2pft.stats", str(self.stats[name]), *args)
        return [r for r in records(self.stats[name]) if r.get("kind") == "start"][-1]


@dataclass
class Chain:
    runs: Runs
    titan: Path            # torchtitan's own checkpoint (step-2)
    start: dict[str, Any]  # the p2pft job's start record
    steps: list[dict[str, Any]]
    end: dict[str, Any]    # its exit record
    p2pft_ckpt: Path       # its p2pft checkpoint directory
    took: dict[str, float]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    tmp = tmp_path_factory.mktemp("tt_ckpt")
    took: dict[str, float] = {}
    t0 = time.time()
    prep = subprocess.run([sys.executable, "-m", MODULE, "prepare", "--out", str(tmp / "data"),
                           "--bytes", str(64 << 10)], capture_output=True, text=True, timeout=180)
    assert prep.returncode == 0, prep.stderr[-3000:]
    took["prepare"] = time.time() - t0
    runs = Runs(tmp)
    try:
        took["torchtitan"] = runs.torchrun("titan", 1, "plain_llama3_debugmodel", "--training.steps", str(TT_STEPS),
                                           "--checkpoint.enable", "--checkpoint.interval", str(TT_STEPS),
                                           "--checkpoint.no-last-save-model-only")
        titan = tmp / "out-titan" / "checkpoint" / f"step-{TT_STEPS}"
        t1 = time.time()
        start = runs.p2pft("a", 2, "--training.steps", str(P2PFT_STEPS), "--checkpoint.enable",
                           "--checkpoint.initial_load_path", str(titan), "--checkpoint.no-initial-load-model-only",
                           "--p2pft.checkpoint_dir", str(tmp / "ck-a"),
                           "--p2pft.checkpoint_every", str(P2PFT_STEPS - TT_STEPS), addr=runs.addr["a"])
        took["p2pft"] = time.time() - t1
        steps = [r for r in records(runs.stats["a"]) if r.get("kind") is None and r.get("c")]
        yield Chain(runs, titan, start, steps, _exit(runs.stats["a"]), tmp / "ck-a", took)
    finally:
        runs.stop_all()


def test_a_torchtitan_checkpoint_starts_a_p2pft_job(chain: Chain) -> None:
    """torchtitan's checkpoint (1 rank) is the p2pft job's step 0 (2 ranks): weights and AdamW
    state bit for bit, torchtitan's step and data position, the scheduler's learning rate."""
    from p2pft.trainer.integrations.torchtitan_checkpoint import checkpoint_digests, read
    want = checkpoint_digests(chain.titan)
    s = chain.start
    assert (s["tt_model"], s["tt_optim"]) == (want.model, want.optim), "step 0 is not the checkpoint's state"
    assert s["base"] == TT_STEPS, s
    # torchtitan's dataloader consumed 2 batches of 1 rank x 2 samples: p2pft's step 0 starts at sample 4
    assert s["sample"] == TT_STEPS * SAMPLES, s
    lr = read(chain.titan, ["optimizer.param_groups.norm.weight.lr"])["optimizer.param_groups.norm.weight.lr"]
    assert chain.steps[0]["lr"] == lr, "p2pft's first step did not run at the scheduler's learning rate"
    assert [r["step"] for r in chain.steps] == list(range(1, P2PFT_STEPS - TT_STEPS + 1))
    assert chain.end["code"] == 0 and chain.end["step"] == P2PFT_STEPS - TT_STEPS
    print("\ntorchtitan -> p2pft: " + ", ".join(f"{k} {v:.1f} s" for k, v in chain.took.items()))


def test_b_p2pft_checkpoint_loads_in_torchtitan(chain: Chain) -> None:
    """p2pft's checkpoint of the job's end, converted, is what torchtitan's CheckpointManager
    loads: the replica's final weights and AdamW state bit for bit (at another rank count), its
    step, scheduler and data position; and converting back and forth changes nothing."""
    from p2pft.trainer.integrations.torchtitan_checkpoint import (checkpoint_digests, from_torchtitan, keys_of,
                                                                  read, to_torchtitan)
    import torch
    runs, end = chain.runs, chain.end
    assert (checkpoint_digests(chain.p2pft_ckpt).model, checkpoint_digests(chain.p2pft_ckpt).optim) == \
        (end["tt_model"], end["tt_optim"]), "the p2pft checkpoint does not hold the replica's final state"
    folder = runs.tmp / "converted"
    dst = folder / f"step-{P2PFT_STEPS}"
    t0 = time.time()
    conv = subprocess.run([sys.executable, "-m", MODULE, "convert", "--to", "torchtitan", str(chain.p2pft_ckpt),
                           str(dst)], capture_output=True, text=True, timeout=180)
    took = time.time() - t0
    assert conv.returncode == 0, conv.stderr[-3000:]
    got = checkpoint_digests(dst)
    assert (got.model, got.optim) == (end["tt_model"], end["tt_optim"]), "the conversion changed the state"
    states = read(dst, ["train_state.step", "lr_scheduler.last_epoch", "dataloader.sample", "dataloader.next"])
    # 2 p2pft steps of 2 ranks x 2 samples after sample 4; torchtitan's batches of the p2pft run: 4 samples
    sample = TT_STEPS * SAMPLES + (P2PFT_STEPS - TT_STEPS) * 2 * SAMPLES
    assert states == {"train_state.step": P2PFT_STEPS, "lr_scheduler.last_epoch": P2PFT_STEPS,
                      "dataloader.sample": sample, "dataloader.next": sample // (2 * SAMPLES)}, states

    # torchtitan's CheckpointManager loads it (the newest step-N under --checkpoint.folder), 1 rank
    t1 = time.time()
    start = runs.p2pft("b", 1, "--training.steps", str(P2PFT_STEPS + 1), "--checkpoint.enable",
                       "--checkpoint.folder", str(folder), addr=runs.addr["b"])
    assert (start["tt_model"], start["tt_optim"]) == (end["tt_model"], end["tt_optim"]), \
        "torchtitan's checkpointer did not load the p2pft replica's final state"
    assert start["base"] == P2PFT_STEPS and start["sample"] == sample, start
    assert _exit(runs.stats["b"])["code"] == 0
    loaded = time.time() - t1

    # --to p2pft and back: the same keys and bits
    back = runs.tmp / "back"
    from_torchtitan(dst, back / "p2pft")
    to_torchtitan(back / "p2pft", back / "titan")
    a, b = keys_of(dst), keys_of(back / "titan")
    assert set(a) == set(b)
    va, vb = read(dst, list(a)), read(back / "titan", list(b))
    differ = [k for k in a if not (torch.equal(va[k], vb[k]) if isinstance(va[k], torch.Tensor) else va[k] == vb[k])]
    assert not differ, differ[:5]
    print(f"\np2pft -> torchtitan: convert {took:.1f} s (the CLI, with its imports), "
          f"the run that loads it {loaded:.1f} s")
