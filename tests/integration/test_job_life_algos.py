"""The job's life on HSDP (2 replicas x 2 FSDP ranks) and DiLoCo, real processes on loopback
with 2 witnesses: the same lifecycle as FaultTolerant's, from the same component.

One cluster per algorithm goes through a whole job's life:
1. two replicas started with different seeds hold one digest (per shard for HSDP) at step 0;
2. both are SIGKILLed at once; a fresh replica without a checkpoint then refuses to train the
   job from step 0 (MissingStateError, exit 3, one ERROR line);
3. the two restart with their checkpoint directories (torch.distributed.checkpoint) and resume
   from their newest checkpoint's step, train to ``--steps`` and meet at the end barrier: exit
   0, equal digests;
4. a replica started after the end trains nothing and exits 0 at once with the JobFinished line.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from replica_harness import ProcessSet, ports, records

from p2pft.trainer.state.checkpoints import checkpoint_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
HSDP = str(ROOT / "trainer" / "examples" / "hsdp_replica.py")
DILOCO = str(Path(__file__).resolve().parent / "diloco_replica.py")
STEPS = {"hsdp": 40, "diloco": 96}          # diloco: inner steps (24 syncs of 4)
EVERY = {"hsdp": 4, "diloco": 2}            # checkpoint every N kernel steps (syncs for DiLoCo)


class Job(ProcessSet):
    tolerate_sigkill = True

    def __init__(self, tmp: Path, algo: str) -> None:
        super().__init__(tmp)
        self.algo = algo
        self.env = dict(os.environ, OMP_NUM_THREADS="1")
        a, b, c, w0, w1 = (f"127.0.0.1:{p}" for p in ports(5))
        self.addr = {"a": a, "b": b, "c": c}
        self.witnesses = [w0, w1]

    def _popen(self, name: str, cmd: list[str]) -> None:
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=self.env,
                                                start_new_session=True)

    def spawn_witnesses(self) -> None:
        everyone = list(self.addr.values()) + self.witnesses
        for k, addr in enumerate(self.witnesses):
            self._popen(f"w{k}", [sys.executable, "-m", "p2pft", "peer", "--listen", addr,
                                  "--seeds", ",".join(a for a in everyone if a != addr), "--replica-id", f"w{k}"])

    def spawn(self, rid: str, name: str, seed: int, checkpoints: bool = True, extra: tuple[str, ...] = ()) -> None:
        seeds = [a for r, a in self.addr.items() if r != rid] + self.witnesses
        self.stats[name] = self.tmp / f"{name}.jsonl"
        common = ["--replica-id", rid, "--listen", self.addr[rid], "--seeds", ",".join(seeds),
                  "--stats", str(self.stats[name]), "--min-replicas", "2", "--steps", str(STEPS[self.algo]),
                  "--seed", str(seed), "--log-level", "INFO", "--resume-grace", "3", *extra]
        if checkpoints:
            common += ["--checkpoint-dir", str(self.tmp / f"ckpt-{rid}"), "--checkpoint-every", str(EVERY[self.algo])]
        if self.algo == "hsdp":
            cmd = [sys.executable, HSDP, "--nproc-per-node", "2", "--batch", "4", "--step-delay", "0.1",
                   "--digest-every", "0", *common]
        else:
            cmd = [sys.executable, DILOCO, "--sync-every", "4", "--step-delay", "0.03", *common]
        self._popen(name, cmd)

    def kind(self, name: str, kind: str) -> list[dict[str, Any]]:
        return [r for r in records(self.stats[name]) if r.get("kind") == kind]

    def committed(self, name: str) -> int:
        """The last committed step (kernel steps: syncs for DiLoCo) in `name`'s records."""
        st = [r for r in records(self.stats[name]) if r.get("kind") is None and r.get("c")]
        return int(st[-1]["step"]) if st else 0

    def kill(self, *names: str) -> None:
        for n in names:   # the whole process group: an HSDP launcher and its ranks
            os.killpg(self.procs[n].pid, signal.SIGKILL)
        for n in names:
            self.procs[n].wait(10)


@pytest.mark.parametrize("algo", ["hsdp", "diloco"])
def test_a_whole_job_life(tmp_path: Path, algo: str) -> None:
    job = Job(tmp_path, algo)
    job.spawn_witnesses()
    job.spawn("a", "a0", seed=0)
    job.spawn("b", "b0", seed=7)
    try:
        # 1. Different seeds, one state at step 0.
        job.wait(lambda: bool(job.kind("a0", "begin") and job.kind("b0", "begin")), 90, "both replicas in the group")
        da, db = job.kind("a0", "begin")[0], job.kind("b0", "begin")[0]
        assert da["step"] == db["step"] == 0
        assert da["digest"] == db["digest"], "replicas started with different seeds train from different states"
        if algo == "hsdp":
            assert len(da["digest"].split(",")) == 2 and da["full"] == db["full"]

        # 2. Both die at once after a few checkpoints; no replica holds the job's state.
        job.wait(lambda: min(job.committed("a0"), job.committed("b0")) >= 3 * EVERY[algo] + 1, 90,
                 "a few checkpoints")
        job.kill("a0", "b0")
        ck = {r: checkpoint_steps(tmp_path / f"ckpt-{r}") for r in "ab"}
        assert ck["a"] and ck["b"], ck
        job.spawn("c", "fresh", seed=3, checkpoints=False)
        job.wait(lambda: job.procs["fresh"].poll() is not None, 60, "a fresh replica to refuse",
                 allow_exit=("a0", "b0", "fresh"))
        assert job.procs["fresh"].returncode == 3, (tmp_path / "fresh.log").read_text()[-2000:]
        log = (tmp_path / "fresh.log").read_text()
        assert "refusing to train from step 0" in log
        assert not [r for r in records(job.stats["fresh"]) if r.get("kind") is None and r.get("c")]

        # 3. Restarted with their checkpoints: resume from the newest, train to the end together.
        job.spawn("a", "a1", seed=0)
        job.spawn("b", "b1", seed=7)
        done = ("a0", "b0", "fresh", "a1", "b1")
        job.wait(lambda: all(job.procs[n].poll() is not None for n in ("a1", "b1")), 150, "the job to finish",
                 allow_exit=done)
        for n, r in (("a1", "a"), ("b1", "b")):
            assert job.procs[n].returncode == 0, (tmp_path / f"{n}.log").read_text()[-3000:]
            resumed = [e for e in records(job.stats[n]) if e.get("event") == "resumed"] or [
                {"step": job.kind(n, "begin")[0]["step"]}]
            assert resumed[0]["step"] == ck[r][-1], (n, resumed, ck)
        ends = [job.kind(n, "exit")[-1] for n in ("a1", "b1")]
        kernel_end = STEPS[algo] // (4 if algo == "diloco" else 1)
        assert all(e["step"] == kernel_end for e in ends), ends
        assert ends[0]["digest"] == ends[1]["digest"], "the replicas ended the job with different weights"
        assert all(job.kind(n, "begin")[0]["step"] > 0 for n in ("a1", "b1")), "a restart trained from step 0"
        if algo == "hsdp":
            # The checkpoint of the last step is a DCP directory a plain PyTorch process loads
            # into an unsharded model: it holds the job's final weights.
            last = checkpoint_steps(tmp_path / "ckpt-a")[-1]
            assert last == kernel_end
            assert _plain_load_digest(tmp_path / "ckpt-a" / f"step-{last:012d}") == ends[0]["full"]

        # 4. A replica started after the end trains nothing and says so.
        t0 = time.time()
        job.spawn("c", "late", seed=5, checkpoints=False)
        job.wait(lambda: job.procs["late"].poll() is not None, 40, "the late replica to exit",
                 allow_exit=done + ("late",))
        assert job.procs["late"].returncode == 0
        assert time.time() - t0 < 30
        assert "the job already finished at step" in (tmp_path / "late.log").read_text()
        assert not [r for r in records(job.stats["late"]) if r.get("kind") is None and r.get("c")]
    finally:
        job.stop_all()


def _plain_load_digest(path: Path) -> str:
    """What a plain PyTorch script does with an HSDP checkpoint: build the model unsharded,
    ``dcp.load`` its state dict (DCP reshards), hash the whole parameters."""
    code = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "from p2pft.trainer.model import model_config_for\n"
        "from p2pft.trainer.state.whole import params_digest\n"
        "model = model_config_for('tiny').build()\n"
        "sd = {'model': model.state_dict()}\n"
        "dcp.load(sd, checkpoint_id=sys.argv[1], no_dist=True)\n"
        "model.load_state_dict(sd['model'])\n"
        "print(params_digest(dict(model.named_parameters())))\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_fourth_algorithm_from_the_kernel_alone(tmp_path: Path) -> None:
    """Local SGD (``trainer/examples/local_sgd.py``, a composition of kernel pieces): replicas seeded
    differently start from one state, a SIGKILL mid-run costs the survivors nothing, they end
    the job together with one digest, and the killed replica restarted after the end trains
    nothing and exits 0 saying so."""
    names = ("a", "b", "c")
    addrs = {n: f"127.0.0.1:{p}" for n, p in zip(names + ("w",), ports(4))}
    procs = ProcessSet(tmp_path)
    procs.tolerate_sigkill = True

    def spawn(name: str, rid: str, seed: int) -> None:
        procs.stats[name] = tmp_path / f"{name}.jsonl"
        seeds = ",".join(a for n, a in addrs.items() if n != rid)
        cmd = [sys.executable, "-m", "p2pft.trainer.examples.local_sgd_replica", "--replica-id", rid,
               "--listen", addrs[rid], "--seeds", seeds, "--stats", str(procs.stats[name]), "--steps", "120",
               "--sync-every", "4", "--min-replicas", "3", "--seed", str(seed), "--step-delay", "0.04"]
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)

    with open(tmp_path / "w.log", "wb") as log:
        procs.procs["w"] = subprocess.Popen(
            [sys.executable, "-m", "p2pft", "peer", "--listen", addrs["w"], "--replica-id", "w",
             "--seeds", ",".join(a for n, a in addrs.items() if n != "w")], stdout=subprocess.DEVNULL, stderr=log)
    for k, n in enumerate(names):
        spawn(n, n, seed=k)
    try:
        procs.wait(lambda: procs.last_step("b") >= 8, 60, "8 syncs on b")
        procs.procs["b"].kill()
        procs.procs["b"].wait(10)
        t_kill = time.time()
        procs.wait(lambda: all(procs.procs[n].poll() is not None for n in ("a", "c")), 90, "the job to finish",
                   allow_exit=names)
        spawn("b-late", "b", seed=1)
        procs.wait(lambda: procs.procs["b-late"].poll() is not None, 40, "the late restart to exit",
                   allow_exit=names + ("b-late",))
    finally:
        procs.stop_all()
    assert procs.procs["a"].returncode == 0 and procs.procs["c"].returncode == 0
    ends = [[r for r in records(procs.stats[n]) if r.get("kind") == "exit"][-1] for n in ("a", "c")]
    assert ends[0]["step"] == ends[1]["step"] == 30 and ends[0]["digest"] == ends[1]["digest"], ends
    alone = [r for r in records(procs.stats["a"]) if r.get("c") and r["t"] > t_kill]
    assert alone and alone[0]["n"] == 2, "the survivors did not sync without the killed replica"
    assert procs.procs["b-late"].returncode == 0
    assert "the job already finished at step 30" in (tmp_path / "b-late.log").read_text()
    assert not [r for r in records(procs.stats["b-late"]) if r.get("c")]
