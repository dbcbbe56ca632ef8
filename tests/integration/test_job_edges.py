"""A job's edges with real processes on loopback: a failed initial-state check stops the lead
too, and a whole cluster killed at once, witnesses included, restarted on its data directories.

- ``initial_state="check"`` with one replica seeded otherwise: every replica, the lead
  included, exits 2 before step 0 with one ERROR (before, the non-leaders raised and the lead
  trained on alone), on FaultTolerant, HSDP and DiLoCo; a peer that dies while the lead waits
  for its check is not waited for.
- Total loss: every member SIGKILLed, then the same commands again (same ``--data-dir``): the
  voters' persisted views hold the job's step, so the replicas without a checkpoint refuse to
  train a new model from step 0 (exit 3, one ERROR each); with checkpoints they resume.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from replica_harness import Replicas, check_invariants, records, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

FAST = ["--comm-timeout", "2", "--loop-timeout", "3"]


def _errors(tmp: Path, name: str) -> list[str]:
    return [ln for ln in (tmp / f"{name}.log").read_text(errors="replace").splitlines() if " ERROR " in ln]


def test_a_failed_initial_check_stops_the_lead_too(tmp_path: Path) -> None:
    """Three replicas with initial_state='check', r2 seeded otherwise: r2's check fails, it tells
    the lead, and the lead's verdict stops every replica (the lead and the one that matched as
    well) with exit 2 before any step; each says so in one ERROR."""
    base = ["--min-replicas", "3", "--initial-state", "check", "--steps", "20", *FAST]
    rs = Replicas(tmp_path, 3, base, witnesses=1)
    rs.spawn_witness(0)
    for i in range(3):
        rs.extra = base + (["--seed", "7"] if i == 2 else [])
        rs.spawn(i, f"r{i}")
    t0 = time.time()
    try:
        rs.wait(lambda: all(rs.procs[f"r{i}"].poll() is not None for i in range(3)), 90, "every replica to stop",
                allow_exit=("r0", "r1", "r2"))
    finally:
        rcs = rs.stop_all()
    took = time.time() - t0
    assert all(rcs[f"r{i}"] == 2 for i in range(3)), rcs
    for i in range(3):
        assert not steps(rs.stats[f"r{i}"]), f"r{i} trained although the initial states differ"
        errs = _errors(tmp_path, f"r{i}")
        assert len(errs) == 1 and "initial state" in errs[0], errs
        assert i == 2 or "r2" in errs[0], errs      # the others name the replica that differs
    leads = [i for i in range(3) if "holding the initial state for the group" in
             (tmp_path / f"r{i}.log").read_text(errors="replace")]
    assert len(leads) == 1, leads
    assert "differs from this leader's" in _errors(tmp_path, f"r{leads[0]}")[0]
    print(f"\ninitial check: every replica stopped with exit 2 within {took:.1f} s (lead r{leads[0]})")


class DurableCluster(Replicas):
    """Witnesses and replicas that all keep their voter state in a data directory of their own
    (``--data-dir``), restartable under the same name with the same command."""

    def spawn_witness(self, k: int) -> None:
        addr = self.witness_addrs[k]
        log = open(self.tmp / f"w{k}-{len([n for n in self.procs if n.startswith(f'w{k}')])}.log", "wb")
        name = f"w{k}-{len([n for n in self.procs if n.startswith(f'w{k}')])}"
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "p2pft", "--log-level", "INFO", "peer", "--listen", addr,
             "--seeds", ",".join(a for a in self.addrs + self.witness_addrs if a != addr), "--replica-id", f"w{k}",
             "--data-dir", str(self.tmp / f"data-w{k}")], stdout=subprocess.DEVNULL, stderr=log)
        log.close()

    def spawn_replica(self, i: int, life: int, extra: list[str]) -> None:
        self.extra = [*FAST, "--data-dir", str(self.tmp / f"data-r{i}"), *extra]
        self.spawn(i, f"r{i}-{life}")

    def kill_everyone(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs.values():
            p.wait(timeout=10)


def _total_loss(tmp: Path, extra: list[str]) -> tuple[DurableCluster, int]:
    """2 witnesses + 3 replicas, every one with a data directory, train past step 12; then all
    five are SIGKILLed at once and started again with the same commands. Returns the cluster
    (running its second lives) and the step the first lives reached."""
    cl = DurableCluster(tmp, 3, witnesses=2)
    for k in range(2):
        cl.spawn_witness(k)
    for i in range(3):
        cl.spawn_replica(i, 0, extra)
    cl.wait(lambda: all(cl.last_step(f"r{i}-0") >= 12 for i in range(3)), 60, "12 steps on all three")
    cl.kill_everyone()
    before = max(cl.last_step(f"r{i}-0") for i in range(3))
    for k in range(2):
        cl.spawn_witness(k)
    for i in range(3):
        cl.spawn_replica(i, 1, extra)
    return cl, before


def test_total_loss_without_checkpoints_refuses_a_new_model(tmp_path: Path) -> None:
    """Every member killed, then restarted on its data directory with no checkpoint: the
    voters' persisted views hold the job's step, so no replica trains a new model from step 0;
    each stops with MissingStateError (exit 3) and one ERROR naming the step."""
    extra = ["--min-replicas", "3", "--resume-grace", "4", "--steps", "400"]
    cl, before = _total_loss(tmp_path, extra)
    t0 = time.time()
    try:
        cl.wait(lambda: all(cl.procs[f"r{i}-1"].poll() is not None for i in range(3)), 60,
                "the restarted replicas to refuse", allow_exit=tuple(f"r{i}-1" for i in range(3)))
    finally:
        rcs = cl.stop_all()
    took = time.time() - t0
    assert all(rcs[f"r{i}-1"] == 3 for i in range(3)), rcs
    for i in range(3):
        assert not steps(cl.stats[f"r{i}-1"]), f"r{i} trained a new model from step 0 under the job's name"
        errs = _errors(tmp_path, f"r{i}-1")
        assert len(errs) == 1 and "refusing to train from step 0" in errs[0], errs
        hw = int(re.search(r"the job reached step (\d+)", errs[0]).group(1))   # type: ignore[union-attr]
        # The record is written at most every 0.2 s: it may miss the last few steps, never more.
        assert 0 < hw <= before + 1 and hw >= before - 12, (hw, before)
    print(f"\ntotal loss at step {before}: every restarted replica refused within {took:.1f} s")


def test_total_loss_with_checkpoints_resumes_from_them(tmp_path: Path) -> None:
    """The same total loss with checkpoints: the restarted replicas resume from them, not from
    step 0, and agree."""
    extra = ["--min-replicas", "3", "--steps", "400", "--checkpoint-every", "5"]
    cl = DurableCluster(tmp_path, 3, witnesses=2)
    try:
        for k in range(2):
            cl.spawn_witness(k)
        for i in range(3):
            cl.spawn_replica(i, 0, [*extra, "--checkpoint-dir", str(tmp_path / f"ckpt-r{i}")])
        cl.wait(lambda: all(cl.last_step(f"r{i}-0") >= 12 for i in range(3)), 60, "12 steps on all three")
        cl.kill_everyone()
        before = max(cl.last_step(f"r{i}-0") for i in range(3))
        for k in range(2):
            cl.spawn_witness(k)
        for i in range(3):
            cl.spawn_replica(i, 1, [*extra, "--checkpoint-dir", str(tmp_path / f"ckpt-r{i}")])
        cl.wait(lambda: all(any(r.get("c") for r in steps(cl.stats[f"r{i}-1"])) for i in range(3)), 60,
                "the restarted replicas to commit")
    finally:
        rcs = cl.stop_all()
    assert all(rc == 0 for name, rc in rcs.items() if name.endswith("-1")), rcs
    starts = [next(r for r in records(cl.stats[f"r{i}-1"]) if r.get("kind") == "start") for i in range(3)]
    best = max(int(s["step"]) for s in starts)
    assert best >= 10 and best >= before - 6, (before, starts)
    first = min(int(next(r for r in steps(cl.stats[f"r{i}-1"]) if r.get("c"))["step"]) for i in range(3))
    assert first == best + 1, (before, best, first)
    check_invariants({k: v for k, v in cl.stats.items() if k.endswith("-1")})
    print(f"\ntotal loss at step {before}: resumed from the checkpoints of step {best}, first commit {first}")


@pytest.mark.parametrize("algo", ["hsdp", "diloco"])
def test_a_failed_initial_check_stops_every_replica_of_every_algorithm(tmp_path: Path, algo: str) -> None:
    """The same check on HSDP (2 ranks per replica: the verdict reaches every rank) and DiLoCo:
    both replicas, the lead included, exit 2 before step 0."""
    from test_job_life_algos import Job

    job = Job(tmp_path, algo)
    job.spawn_witnesses()
    job.spawn("a", "a0", seed=0, checkpoints=False, extra=("--initial-state", "check"))
    job.spawn("b", "b0", seed=7, checkpoints=False, extra=("--initial-state", "check"))
    try:
        job.wait(lambda: all(job.procs[n].poll() is not None for n in ("a0", "b0")), 120, "both replicas to stop",
                 allow_exit=("a0", "b0"))
    finally:
        rcs = job.stop_all()
    assert rcs["a0"] == 2 and rcs["b0"] == 2, rcs
    assert not job.committed("a0") and not job.committed("b0"), "a replica trained past different initial states"


def test_the_lead_waiting_for_checks_does_not_wait_for_a_dead_peer(tmp_path: Path) -> None:
    """The lead waits for every participant's check before step 0; one that dies meanwhile (here
    r1, which never checks: initial_state='off') is not waited for once it is out of the view:
    the lead goes on within seconds of the kill, not after the 30 s bound."""
    rs = Replicas(tmp_path, 2, witnesses=1, running_seeds=True)
    rs.extra = ["--min-replicas", "2", "--initial-state", "check", "--steps", "400", *FAST]
    rs.spawn(0, "r0")      # started first: it bootstraps the cluster and takes slot 0, the lead
    lead_log = tmp_path / "r0.log"
    rs.wait(lambda: "listening on" in lead_log.read_text(errors="replace"), 30, "r0 to start")
    rs.spawn_witness(0)
    rs.extra = ["--min-replicas", "2", "--initial-state", "off", "--steps", "400", *FAST]
    rs.spawn(1, "r1")
    try:
        rs.wait(lambda: "holding the initial state" in lead_log.read_text(errors="replace"), 60,
                "r0 to hold the initial state")
        time.sleep(1.0)    # r0 waits for r1's check, which never comes
        assert "in the group at step 0" not in lead_log.read_text(errors="replace"), "the lead did not wait"
        rs.procs["r1"].send_signal(signal.SIGKILL)
        t_kill = time.time()
        rs.wait(lambda: "in the group at step 0" in lead_log.read_text(errors="replace"), 25,
                "the lead to go on without the dead peer")
        went_on = time.time() - t_kill
        rs.wait(lambda: rs.last_step("r0") >= 3, 30, "the lead to train")
    finally:
        rcs = rs.stop_all()
    assert rcs["r0"] == 0, rcs
    assert went_on < 15.0, went_on
    print(f"\nlead waiting for checks: went on {went_on:.1f} s after its peer's SIGKILL")
