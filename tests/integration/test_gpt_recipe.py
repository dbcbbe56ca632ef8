"""The GPT recipe (trainer/examples/gpt.py) end to end, and the replay oracle on a run with a kill.

Real processes, real SIGKILL, real DataLoader workers; the oracle replays in this process.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2pft.chaos.oracle import check_run, rebuild, replay
from p2pft.trainer.examples.gpt import Recipe, lr_factor

from replica_harness import ProcessSet, ports, steps

pytestmark = pytest.mark.slow

TINY = ["--model", "tiny", "--batch", "4", "--accum", "2", "--warmup", "4", "--progress", "off",
        "--log-level", "INFO"]


def _gpt(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2pft.trainer.examples.gpt", *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_plain_and_one_replica_train_bitwise_the_same(tmp_path: Path) -> None:
    """One replica of p2pft is the plain loop: the same batches, lr, clip and AdamW, bit for bit."""
    plain = _gpt("--no-p2pft", "--steps", "8", "--final-weights", str(tmp_path / "plain.pt"),
                 "--stats", str(tmp_path / "plain.jsonl"), *TINY)
    assert plain.returncode == 0, plain.stderr[-3000:]
    ft = _gpt("--replica-id", "r0", "--replicas", "1", "--steps", "8", "--final-weights", str(tmp_path / "ft.pt"),
              "--stats", str(tmp_path / "ft.jsonl"), *TINY)
    assert ft.returncode == 0, ft.stderr[-3000:]
    assert "stopped at step 8" in ft.stdout
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "ft.pt")
    assert a["step"] == b["step"] == 8
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), name
    recs = steps(tmp_path / "ft.jsonl")
    r = Recipe(warmup=4, schedule_steps=8)
    assert [x["step"] for x in recs] == list(range(1, 9))
    for x, y in zip(recs, steps(tmp_path / "plain.jsonl")):
        assert x["tr"] == y["tr"] == [[(x["step"] - 1) * 4, x["step"] * 4]]
        assert math.isclose(x["lr"], 3e-3 * lr_factor(r, x["step"] - 1), rel_tol=1e-12) and x["lr"] == y["lr"]
        assert x["loss"] == y["loss"] and x["n"] == 1


class GptReplicas(ProcessSet):
    tolerate_sigkill = True

    def __init__(self, tmp: Path, n: int) -> None:
        super().__init__(tmp)
        all_ports = ports(n + 1)
        self.addrs = [f"127.0.0.1:{p}" for p in all_ports[:n]]
        self.witness = f"127.0.0.1:{all_ports[n]}"
        self.n = n

    def spawn(self, i: int, inc: int) -> str:
        name = f"r{i}-{inc}"
        seeds = ",".join([a for j, a in enumerate(self.addrs) if j != i] + [self.witness])
        cmd = [sys.executable, "-m", "p2pft.trainer.examples.gpt", "--replica-id", f"r{i}", "--listen",
               self.addrs[i], "--seeds", seeds, "--stats", str(self.tmp / f"{name}.jsonl"), "--final-weights",
               str(self.tmp / f"{name}.pt"), "--replicas", str(self.n), "--step-delay", "0.03",
               "--min-replicas", str(self.n) if inc == 0 else "1", "--digest-every", "5", *TINY]
        log = open(self.tmp / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                            env=dict(os.environ, OMP_NUM_THREADS="1"))
        log.close()
        self.stats[name] = self.tmp / f"{name}.jsonl"
        return name

    def spawn_witness(self) -> None:
        log = open(self.tmp / "w0.log", "wb")
        self.procs["w0"] = subprocess.Popen(
            [sys.executable, "-m", "p2pft", "--log-level", "INFO", "peer", "--listen", self.witness, "--seeds",
             ",".join(self.addrs), "--replica-id", "w0"], stdout=subprocess.DEVNULL, stderr=log)
        log.close()


def test_oracle_replays_a_two_replica_run_with_a_kill_exactly(tmp_path: Path) -> None:
    """Two replicas, one SIGKILLed mid-run and restarted: a survivor's final weights equal the
    committed steps replayed in one plain process, bitwise (two contributors sum the same in any
    order; the ring order is replayed anyway). A lost contribution would show."""
    ps = GptReplicas(tmp_path, 2)
    try:
        ps.spawn_witness()
        a, b = ps.spawn(0, 0), ps.spawn(1, 0)
        ps.wait(lambda: ps.last_step(a) >= 8 and ps.last_step(b) >= 8, 90, "both replicas training")
        os.kill(ps.procs[b].pid, signal.SIGKILL)
        ps.procs[b].wait(timeout=10)
        at_kill = ps.last_step(a)
        ps.wait(lambda: ps.last_step(a) >= at_kill + 6, 60, "the survivor training alone")
        b2 = ps.spawn(1, 1)
        ps.wait(lambda: any(r.get("c") and r.get("tr") for r in steps(ps.stats[b2])), 90,
                "the restarted replica contributing")
        rejoined = ps.last_step(a)
        ps.wait(lambda: ps.last_step(a) >= rejoined + 4, 60, "both training again")
    finally:
        rcs = ps.stop_all()
    assert rcs[a] == 0 and rcs[b2] == 0, rcs
    result = check_run(tmp_path)
    assert {"r0-0.pt", "r1-1.pt"} <= set(result.compared)
    assert result.steps >= rejoined + 4
    assert result.unresolved_steps == 0 and result.cursor_mismatches == 0
    counts = [s.count for s in rebuild(sorted(tmp_path.glob("r*-*.jsonl"))).steps]
    assert 1 in counts and 2 in counts          # steps with the dead replica missing, and with both
    assert result.lr_max_abs_diff == 0.0
    assert result.max_abs_diff == 0.0 and result.max_rel_diff == 0.0
    # The same replay with one contribution dropped from one two-contributor step must differ.
    history = rebuild(sorted(tmp_path.glob("r*-*.jsonl")))
    k = next(i for i, s in enumerate(history.steps) if s.count == 2)
    history.steps[k].contributions = history.steps[k].contributions[:1]
    saved = torch.load(tmp_path / "r0-0.pt")
    assert replay(history, {"r0-0.pt": (saved["step"], saved["params"])}).max_abs_diff > 0
