"""torchtitan on p2pft (``p2pft.trainer.integrations.torchtitan``), on CPU with a kill.

``llama3_debugmodel`` (6.2M parameters, sequences of 64 tokens) through torchtitan's own
``--config`` mechanism: 2 witnesses and 2 replicas, each one torchrun of 2 FSDP ranks over gloo.
Replica B is SIGKILLed whole mid-run (its torchrun; the ranks die with it), restarted under the
same id, and catches up from A. Checked from rank 0's records (``--p2pft.stats``):
- A never stops: it commits alone while B is away, with a bounded gap between commits;
- B's ranks are gone after the kill; the restarted B catches up and contributes again;
- both end at ``training.steps`` with one set of shard digests and one full digest, exit 0.

Skips when torchtitan (the ``torchtitan`` extra) is not installed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import importlib.util

import pytest
from replica_harness import ProcessSet, ports, records, steps

# Cheap checks here (importing torchtitan.trainer would load torch into the collecting process);
# the ranks import the rest.
pytest.importorskip("torchtitan", minversion="0.3.0",
                    reason="torchtitan is not installed (pip install -e '.[torchtitan]')")
if importlib.util.find_spec("triton") is None:
    pytest.skip("torchtitan 0.3.0 imports triton, which is not installed (pip install -e '.[torchtitan]')",
                allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.xdist_group("cpu-heavy")]

STEPS = 60
MODULE = "p2pft.trainer.integrations.torchtitan"


class Cluster(ProcessSet):
    tolerate_sigkill = True
    stop_timeout = 30.0

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("P2PFT_")}
        self.env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        w0, w1, a, b = (f"127.0.0.1:{p}" for p in ports(4))
        self.addr = {"a": a, "b": b}
        self.witnesses = [w0, w1]

    def _popen(self, name: str, cmd: list[str]) -> None:
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                cwd=self.tmp)

    def spawn_witnesses(self) -> None:
        everyone = self.witnesses + list(self.addr.values())
        for k, addr in enumerate(self.witnesses):
            self._popen(f"w{k}", [sys.executable, "-m", "p2pft", "peer", "--listen", addr, "--replica-id", f"w{k}",
                                  "--seeds", ",".join(x for x in everyone if x != addr)])

    def spawn(self, rid: str, name: str) -> None:
        data = self.tmp / "data"
        seeds = self.witnesses + [x for r, x in self.addr.items() if r != rid]
        self.stats[name] = self.tmp / f"{name}.jsonl"
        self._popen(name, [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", MODULE,
            "--config", "llama3_debugmodel", "--hf_assets_path", str(data),
            "--dataloader.dataset_path", str(data / "tokens.bin"), "--dump_folder", str(self.tmp / f"out-{name}"),
            "--parallelism.spmd_backend", "partial_dtensor", "--training.steps", str(STEPS),
            "--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "5",
            "--p2pft.replica_id", rid, "--p2pft.listen", self.addr[rid], "--p2pft.seeds", ",".join(seeds),
            "--p2pft.min_replicas", "2", "--p2pft.digest_every", "5", "--p2pft.stats", str(self.stats[name])])


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _exit(path: Path) -> dict[str, Any]:
    ends = [r for r in records(path) if r.get("kind") == "exit"]
    assert ends, f"{path.name}: no exit record"
    return ends[-1]


def test_torchtitan_two_fsdp_replicas_survive_a_kill(tmp_path: Path) -> None:
    t0 = time.time()
    prep = subprocess.run([sys.executable, "-m", MODULE, "prepare", "--out", str(tmp_path / "data"),
                           "--bytes", str(256 << 10)], capture_output=True, text=True, timeout=120)
    assert prep.returncode == 0, prep.stderr[-3000:]
    c = Cluster(tmp_path)
    c.spawn_witnesses()
    c.spawn("a", "a")
    c.spawn("b", "b0")
    b_pids: list[int] = []
    try:
        c.wait(lambda: c.last_step("a") >= 8 and c.last_step("b0") >= 8, 150, "8 steps on both replicas")
        start = [r for r in records(c.stats["b0"]) if r.get("kind") == "start"][0]
        b_pids = [int(p) for p in start["pids"]]
        os.kill(c.procs["b0"].pid, signal.SIGKILL)   # B's torchrun; its ranks die with it
        t_kill = time.time()
        c.wait(lambda: not any(_alive(p) for p in b_pids), 10, "B's ranks to die with their torchrun",
               allow_exit=("b0",))
        t_restart = time.time()
        c.spawn("b", "b1")   # at once: A commits alone while B's ranks start (most of a restart)
        c.wait(lambda: all(p.poll() is not None for n, p in c.procs.items() if n in ("a", "b1")), 200,
               "both replicas to finish", allow_exit=("a", "b0", "b1"))
    finally:
        rcs = c.stop_all()
        for p in b_pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    assert rcs["a"] == 0 and rcs["b1"] == 0, f"exit statuses {rcs}"
    ea, eb = _exit(c.stats["a"]), _exit(c.stats["b1"])
    assert ea["code"] == eb["code"] == 0
    assert ea["step"] == eb["step"] == STEPS, (ea["step"], eb["step"])
    assert ea["digest"] == eb["digest"] and ea["full"] == eb["full"], "the replicas end with different states"
    a_steps = [r for r in steps(c.stats["a"]) if r["c"]]
    assert [r["step"] for r in a_steps] == list(range(1, STEPS + 1)), "A's committed steps are not 1..N once each"
    before = max(r["t"] for r in a_steps if r["t"] <= t_kill)
    after = [r for r in a_steps if r["t"] > t_kill]
    gaps = [after[0]["t"] - before] + [y["t"] - x["t"] for x, y in zip(after, after[1:])]
    longest = max(gaps)
    alone = [r for r in after if r["n"] == 1]
    assert len(alone) >= 4, "A did not commit alone while B was away"
    pre = sorted(y["t"] - x["t"] for x, y in zip(a_steps, a_steps[1:]) if y["t"] < t_kill)
    normal = pre[len(pre) // 2]
    assert longest < 5.0, f"A's longest gap between commits after the kill: {longest:.2f} s"
    b1 = steps(c.stats["b1"])
    back = [r for r in b1 if r["c"] and r["n"] == 2 and r["role"] == "participant"]
    assert back, "the restarted B never contributed"
    events = [r for r in records(c.stats["b1"]) if r.get("kind") == "event"]
    caught = [e for e in events if e.get("event") == "catchup_done"]
    assert caught, "the restarted B did not catch up from a snapshot"
    db = {r["step"]: r["digest"] for r in b1 if "digest" in r}
    da = {r["step"]: r["digest"] for r in steps(c.stats["a"]) if "digest" in r}
    common = sorted(set(da) & set(db))
    assert common and all(da[s] == db[s] for s in common), "shard digests differ at equal steps"
    print(f"\ntorchtitan llama3_debugmodel, 2 replicas x 2 FSDP ranks: A's first commit after the kill "
          f"{after[0]['t'] - t_kill:.2f} s, longest gap {longest:.2f} s (a normal step ~{normal:.2f} s), "
          f"{len(alone)} steps alone; restart -> B contributes {back[0]['t'] - t_restart:.1f} s "
          f"(catch-up: snapshot {caught[0].get('fetch_s', 0):.2f} s, replayed {caught[0].get('replayed')}); "
          f"both at step {STEPS}, digests equal at steps {common}; total {time.time() - t0:.0f} s")
