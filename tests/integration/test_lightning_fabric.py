"""The Lightning Fabric recipe (trainer/examples/fabric_replica.py) under a real SIGKILL, and the
replay oracle on the run (docs/lightning.md).

2 witnesses and 2 Fabric replicas as real processes on loopback; r1 is SIGKILLed mid-run and
started again under the same id, catches up from r0 and trains on; both end at ``--steps`` with
one digest and exit 0. The committed steps, replayed here in plain PyTorch (no Fabric, no p2pft),
give the replicas' final weights bit for bit.

The restarted process is started with the others and has done its imports (lightning alone is ~5 s
of CPU) before the kill; it waits for a file the test writes after the kill, then runs the recipe's
``main`` from the start: Fabric, the runtime, the catch-up. Without that, on a loaded machine the
survivor could reach the job's end before the restart is back, and the test would time a Python
import instead of p2pft.

Skips when lightning (the ``lightning`` extra) is not installed.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from p2pft.chaos.oracle import rebuild
from p2pft.chaos.oracle_types import ring_sum, set_mean_grads
from replica_harness import Replicas, check_invariants, records, steps

# Not pytest.importorskip: importing lightning here would cost every collecting worker ~5 s of CPU.
if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed (pip install -e '.[lightning]')", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.xdist_group("cpu-heavy")]

STEPS, BATCH, LR, CLIP = 60, 4, 3e-3, 0.5
RECIPE = "p2pft.trainer.examples.fabric_replica"
# A restarted replica with its imports done: it waits for the go file, then runs the recipe as is.
WARM = """import os, sys, time
import lightning.fabric, p2pft.trainer  # noqa: F401  (the imports a restart pays)
from p2pft.deploy.procs import exit_now
from p2pft.trainer.examples.fabric_replica import main
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
exit_now(main(sys.argv[2:]))
"""


class FabricReplicas(Replicas):
    def cmd(self, i: int, name: str) -> list[str]:
        self.stats[name] = self.tmp / f"{name}.jsonl"
        return ["--replica-id", f"r{i}", "--listen", self.addrs[i], "--seeds", self._seeds(self.addrs[i]),
                "--stats", str(self.stats[name]), "--final-weights", str(self.tmp / f"{name}.pt"),
                "--steps", str(STEPS), "--batch", str(BATCH), "--lr", str(LR), "--clip", str(CLIP),
                "--min-replicas", "2", "--step-delay", "0.1"]

    def spawn(self, i: int, name: str, prefix: list[str] | None = None) -> None:
        args = self.cmd(i, name)
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen([sys.executable, *(prefix or ["-m", RECIPE]), *args],
                                                stdout=subprocess.DEVNULL, stderr=log,
                                                env=dict(os.environ, OMP_NUM_THREADS="1"))


def exit_record(path: Path) -> dict[str, Any]:
    ends = [r for r in records(path) if r.get("kind") == "exit"]
    assert ends, f"{path.name}: no exit record"
    return ends[-1]


def replay(tmp: Path, upto: int) -> tuple[dict[str, torch.Tensor], int]:
    """The committed history (rebuilt from every process's stats) trained in plain PyTorch: each
    contributor's batch, the mean gradient, clipping, the sqrt learning-rate policy, AdamW.
    Returns the weights and how many steps the clip bit."""
    from p2pft.trainer.examples.fabric_replica import batch, build
    history = rebuild(sorted(tmp.glob("r*-*.jsonl")))
    assert not [s for s in history.unresolved if s < upto], f"steps with unknown contributors: {history.unresolved}"
    torch.set_num_threads(1)   # as the replicas: the same kernels, the same sums
    model, opt = build(LR)
    params = list(model.parameters())
    peak, clipped = 0, 0
    for st in history.steps[:upto]:
        grads = []
        for c in st.contributions:
            opt.zero_grad(set_to_none=True)
            x, y = batch([i for a, b in c.ranges for i in range(a, b)])
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]))
        total, _ = ring_sum(grads, None, 0)   # two contributors add alike in either order
        set_mean_grads(params, total, st.count)
        clipped += float(torch.nn.utils.clip_grad_norm_(params, CLIP)) > CLIP   # what fabric.clip_gradients runs
        peak = max(peak, st.count)
        lr = LR * (st.count / peak) ** 0.5    # lr_policy "sqrt", planned = the peak contributor count
        opt.param_groups[0]["lr"] = lr
        opt.step()
        opt.param_groups[0]["lr"] = LR
    return {n: p.detach() for n, p in model.named_parameters()}, clipped


def test_fabric_replicas_survive_a_kill_and_match_the_replay_oracle(tmp_path: Path) -> None:
    t0 = time.time()
    rs = FabricReplicas(tmp_path, 2, witnesses=2)
    go = tmp_path / "go"
    try:
        for k in range(2):
            rs.spawn_witness(k)
        rs.spawn(0, "r0-0")
        rs.spawn(1, "r1-0")
        rs.spawn(1, "r1-1", prefix=["-c", WARM, str(go)])   # waits for `go`
        rs.wait(lambda: rs.last_step("r0-0") >= 10 and rs.last_step("r1-0") >= 10, 150, "10 steps on both")
        rs.procs["r1-0"].send_signal(signal.SIGKILL)
        rs.procs["r1-0"].wait(timeout=10)
        at_kill = rs.last_step("r0-0")
        go.touch()
        rs.wait(lambda: all(rs.procs[n].poll() is not None for n in ("r0-0", "r1-1")), 150,
                "both replicas to finish", allow_exit=("r0-0", "r1-0", "r1-1"))
    finally:
        rcs = rs.stop_all()
    assert rcs["r0-0"] == 0 and rcs["r1-1"] == 0, rcs
    e0, e1 = exit_record(rs.stats["r0-0"]), exit_record(rs.stats["r1-1"])
    assert e0["step"] == e1["step"] == STEPS and e0["digest"] == e1["digest"], (e0, e1)
    check_invariants(rs.stats)   # every sample trained once; equal digests at equal steps
    r0 = [r for r in steps(rs.stats["r0-0"]) if r["c"]]
    assert [r["step"] for r in r0] == list(range(1, STEPS + 1)), "r0's commits are not 1..N once each"
    assert any(r["n"] == 1 for r in r0 if r["step"] > at_kill), "r0 never committed alone after the kill"
    back = [r for r in steps(rs.stats["r1-1"]) if r["c"] and r["n"] == 2 and r.get("tr")]
    assert back, "the restarted r1 never contributed"
    assert all("loss" in r for r in back)
    # The oracle: the committed steps in plain PyTorch are the replicas' final weights, bitwise.
    want, clipped = replay(tmp_path, STEPS)
    for name in ("r0-0", "r1-1"):
        got = torch.load(tmp_path / f"{name}.pt")
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), f"{name}: weights differ from the replay"
    assert clipped > 0, "the clip never bit: the gradient hook's placement was not exercised"
    counts = [s.count for s in rebuild(sorted(tmp_path.glob("r*-*.jsonl"))).steps[:STEPS]]
    print(f"\nfabric: killed at r0's step {at_kill}; r1 contributes again at step {back[0]['step']}; "
          f"{counts.count(1)} steps alone, {counts.count(2)} with both, the clip bit {clipped} times; "
          f"{time.time() - t0:.1f} s")
