"""A job's start and end with real replica processes of the example job (trainer/job/life.py):
different seeds at step 0 and a restart after the job finished (one job), a late joiner with another
seed, every replica dead with
no checkpoint, the side-work leader across a kill, and the end barrier with a replica that joined late."""
from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from tests.integration.replica_harness import Replicas, check_invariants, records, steps

pytestmark = pytest.mark.slow


def _log(tmp: Path, name: str) -> str:
    return (tmp / f"{name}.log").read_text(errors="replace")


def _exit(rs: Replicas, name: str, timeout: float) -> int:
    try:
        return rs.procs[name].wait(timeout=timeout)
    except Exception:
        raise AssertionError(f"{name} still running after {timeout} s: {_log(rs.tmp, name)[-3000:]}") from None


def _exit_record(rs: Replicas, name: str) -> dict:
    ex = [r for r in records(rs.stats[name]) if r.get("kind") == "exit"]
    assert ex, f"{name} wrote no exit record: {_log(rs.tmp, name)[-2000:]}"
    return ex[-1]


def _start_two(rs: Replicas, n: int) -> None:
    """Start r0 and r1 and wait until both have committed step `n`."""
    rs.spawn(0, "r0")
    rs.spawn(1, "r1")
    rs.wait(lambda: min(rs.last_step("r0"), rs.last_step("r1")) >= n, 45, f"step {n} on r0 and r1")


def test_different_seeds_then_a_late_restart_after_the_job_finished(tmp_path: Path) -> None:
    """One short job serves both: r1 starts with another seed, yet both start from the leader's
    state and end with one digest; then r0, restarted by its launcher after the job finished,
    exits 0 without training."""
    rs = Replicas(tmp_path, 2, ["--steps", "8", "--min-replicas", "2"], witnesses=1)
    rs.spawn_witness(0)   # one witness: the replicas leave together, the quorum with them
    try:
        rs.spawn(0, "r0")
        rs.extra = rs.extra + ["--seed", "7"]
        rs.spawn(1, "r1")
        assert _exit(rs, "r0", 50) == 0 and _exit(rs, "r1", 10) == 0
        assert _exit_record(rs, "r0")["step"] == _exit_record(rs, "r1")["step"] == 8
        # Different seeds at step 0: both start from the leader's state.
        starts = [next(r for r in records(rs.stats[n]) if r.get("kind") == "start") for n in ("r0", "r1")]
        assert starts[0]["digest"] == starts[1]["digest"], "different states at step 0"
        assert _exit_record(rs, "r0")["digest"] == _exit_record(rs, "r1")["digest"]
        assert all(r["n"] == 2 for n in ("r0", "r1") for r in steps(rs.stats[n]) if r["c"]), "a step ran without both"
        check_invariants(rs.stats)
        took = [n for n in ("r0", "r1") if "took the initial state of" in _log(tmp_path, n)]
        assert len(took) == 1, took
        # Restarted by its launcher after the others finished: the witness still knows.
        rs.extra = rs.extra[:-2]
        rs.spawn(0, "r0-late")
        assert _exit(rs, "r0-late", 40) == 0
        log = _log(tmp_path, "r0-late")
        assert "the job already finished at step 8 (target 8 steps): nothing to train" in log, log[-2000:]
        assert not steps(rs.stats["r0-late"]), "the late restart trained"
    finally:
        rs.stop_all()


def test_a_late_joiner_with_another_seed_catches_up_by_snapshot(tmp_path: Path) -> None:
    """r2 starts at step 0 with another seed after r0 and r1 trained a few steps, every step
    still in their short logs (--recent-keep): it must take a snapshot, not replay the steps
    since 0 onto its own initial weights (which gave it digests of its own from then on)."""
    rs = Replicas(tmp_path, 3, ["--min-replicas", "2", "--recent-keep", "1000", "--step-delay", "0.1",
                                "--digest-every", "1"], witnesses=1)
    rs.spawn_witness(0)
    try:
        _start_two(rs, 2)
        rs.extra = rs.extra + ["--seed", "9"]
        rs.spawn(2, "r2")

        def contributed_twice() -> bool:
            return sum(1 for r in steps(rs.stats["r2"]) if r["c"] and r["n"] == 3) >= 2
        rs.wait(contributed_twice, 60, "r2 to join and contribute")
    finally:
        rcs = rs.stop_all()
    assert all(rcs[n] == 0 for n in ("r0", "r1", "r2")), rcs
    digests = check_invariants(rs.stats)   # equal digests at every common step
    r2_steps = {r["step"] for r in steps(rs.stats["r2"]) if "digest" in r}
    assert len([s for s in r2_steps if s in digests]) >= 2
    log = _log(tmp_path, "r2")
    assert "the group started without this replica: catching up from a snapshot" in log, log[-3000:]
    assert "fast-forwarded" not in log.split("caught up at step")[0], log[-3000:]


def test_every_replica_dead_without_checkpoint_refuses_to_train_from_step_0(tmp_path: Path) -> None:
    # Two witnesses, started first: they are two of the three voters, so the cluster still
    # commits views (and adds the restarted replica) once both replicas are dead.
    rs = Replicas(tmp_path, 2, ["--min-replicas", "2", "--resume-grace", "3"], witnesses=2)
    rs.spawn_witness(0)
    rs.spawn_witness(1)
    try:
        _start_two(rs, 6)
        for n in ("r0", "r1"):
            rs.procs[n].send_signal(signal.SIGKILL)
        reached = max(rs.last_step("r0"), rs.last_step("r1"))
        rs.spawn(0, "r0-again")
        rc = _exit(rs, "r0-again", 45)
        log = _log(tmp_path, "r0-again")
        assert rc == 3, log[-3000:]
        errors = [ln for ln in log.splitlines() if " ERROR " in ln]
        assert len(errors) == 1, errors
        assert not [ln for ln in log.splitlines() if " WARNING " in ln], log[-2000:]
        m = re.search(r"the job reached step (\d+), but no running replica holds it and this replica has no "
                      r"checkpoint", errors[0])
        # The witnesses' high water trails the replicas by at most a loop beat (the step rides on it).
        assert m and 0 < int(m.group(1)) <= reached, (errors[0], reached)
        assert "refusing to train from step 0" in errors[0]
        assert not steps(rs.stats["r0-again"]), "it trained from step 0"
    finally:
        rs.stop_all()


def test_leader_moves_to_a_survivor_when_it_is_killed(tmp_path: Path) -> None:
    rs = Replicas(tmp_path, 3, ["--min-replicas", "3", "--duration", "50"])
    names = ["r0", "r1", "r2"]
    try:
        for i, n in enumerate(names):
            rs.spawn(i, n)
        rs.wait(lambda: min(rs.last_step(n) for n in names) >= 5, 45, "5 steps on every replica")

        def leaders(at_least: int, among: list[str]) -> set[str]:
            return {n for n in among for r in steps(rs.stats[n]) if r["step"] >= at_least and r.get("lead")}
        first = leaders(3, names)
        assert len(first) == 1, f"leaders {first}"
        dead = first.pop()
        rs.procs[dead].send_signal(signal.SIGKILL)
        rest = [n for n in names if n != dead]
        killed_at = max(rs.last_step(n) for n in rest)
        rs.wait(lambda: min(rs.last_step(n) for n in rest) >= killed_at + 15, 40, "15 steps after the kill")
        late = killed_at + 10
        new = leaders(late, rest)
        assert len(new) == 1, f"leaders after the kill: {new}"
        # Exactly one replica is the leader at each late step.
        for s in range(late, killed_at + 15):
            at = [n for n in rest for r in steps(rs.stats[n]) if r["step"] == s and r["c"] and r.get("lead")]
            assert len(at) == 1, (s, at)
    finally:
        rs.stop_all()


def test_end_barrier_waits_for_a_straggler_catching_up(tmp_path: Path) -> None:
    """r2 joins mid-run and pulls its snapshot slowly (a rate cap), so it is usually still
    catching up when the others reach the end: they wait at the barrier, serving it, and all
    three leave together with one state. (Its snapshot, ~1.4 MB at 200 kB/s, takes ~7 s; the
    others' 30 steps at 0.3 s take ~10 s, a few of which pass while r2 starts.)"""
    rs = Replicas(tmp_path, 3, ["--steps", "30", "--min-replicas", "2"], running_seeds=True)
    rs.extra = rs.extra + ["--step-delay", "0.3"]
    try:
        _start_two(rs, 1)
        rs.extra = rs.extra + ["--state-rate-limit", "200000"]
        rs.spawn(2, "r2")
        rcs = {n: _exit(rs, n, 58) for n in ("r0", "r1", "r2")}
        assert rcs == {"r0": 0, "r1": 0, "r2": 0}, rcs
        ends = {n: _exit_record(rs, n) for n in ("r0", "r1", "r2")}
        assert {e["step"] for e in ends.values()} == {30}, ends
        assert len({e.get("digest") for e in ends.values()}) == 1, "replicas ended with different states"
        fin = {n: [r for r in records(rs.stats[n]) if r.get("event") == "finished"] for n in ends}
        assert all(f and f[-1]["step"] == 30 for f in fin.values()), fin
        times = [e["t"] for e in ends.values()]
        assert max(times) - min(times) < 5.0, times
        check_invariants(rs.stats)
    finally:
        rs.stop_all()


def test_readme_loop_runs_as_written_with_two_replicas(tmp_path: Path) -> None:
    """trainer/examples/loop.py is the README's loop: no common seed, group formation, the
    leader's evaluation, the end barrier."""
    import os
    import subprocess
    import sys

    from p2pft.deploy.ports import free_ports

    a, b = (f"127.0.0.1:{p}" for p in free_ports(2))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "p2pft.trainer.examples.loop", rid, me, peer],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
             for rid, me, peer in (("r0", a, b), ("r1", b, a))]
    try:
        outs = [p.communicate(timeout=55)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    digests = {ln.split("digest ")[1] for out in outs for ln in out.splitlines() if " digest " in ln}
    assert len(digests) == 1, outs
    assert all("step 60 digest" in out for out in outs), outs
    evals = [ln for out in outs for ln in out.splitlines() if "eval loss" in ln]
    assert [ln.split()[2] for ln in evals] == ["20", "40", "60"], evals   # one leader evaluates


def test_sigterm_while_forming_and_while_training_exits_0(tmp_path: Path) -> None:
    rs = Replicas(tmp_path, 2, ["--min-replicas", "2", "--duration", "50"])
    try:
        rs.spawn(0, "r0")    # alone: waits in the group formation (the first begin / start)
        rs.wait(lambda: "listening on" in _log(tmp_path, "r0"), 40, "r0's runtime")
        time.sleep(0.5)
        rs.procs["r0"].send_signal(signal.SIGTERM)
        assert _exit(rs, "r0", 15) == 0
        assert "Traceback" not in _log(tmp_path, "r0")
        rs.spawn(0, "r0b")
        rs.spawn(1, "r1")
        rs.wait(lambda: min(rs.last_step("r0b"), rs.last_step("r1")) >= 3, 45, "3 steps", allow_exit=("r0",))
        for n in ("r0b", "r1"):
            rs.procs[n].send_signal(signal.SIGTERM)
        assert _exit(rs, "r0b", 20) == 0 and _exit(rs, "r1", 20) == 0
        for n in ("r0b", "r1"):
            assert "Traceback" not in _log(tmp_path, n), _log(tmp_path, n)[-2000:]
            assert _exit_record(rs, n)["step"] >= 3
    finally:
        rs.stop_all()


# The README's loop, in a process whose last allreduce finishes but is reported failed (as when
# the all-gather completed here while a peer's failed): the others commit the job's last step
# and wait at the end barrier, where they reduce no more. The engine is patched by this test only.
LOOP_LAST_STEP_FAILS = """
import logging, runpy
from p2pft.ops.log import setup_logging
from p2pft.trainer.kernel.engine import StepEngine
from p2pft.transport import PeerFailed
setup_logging('INFO')
_reduce, fired = StepEngine._reduce, []
def reduce_then_fail(self, comm, att):
    _reduce(self, comm, att)
    if self.step == 59 and not fired:
        fired.append(1)
        raise PeerFailed("injected: this rank's allreduce of the last step reported failed")
StepEngine._reduce = reduce_then_fail
runpy.run_module('p2pft.trainer.examples.loop', run_name='__main__')
"""


def test_last_step_committed_by_one_replica_only_ends_with_equal_digests(tmp_path: Path) -> None:
    """The job's last step commits at r0 but not at r1 (its allreduce reported failed): r0
    waits at the end barrier and reduces no more, so r1 takes the step from r0's log (r0 says
    'done' at step 60 in gossip) instead of waiting for a round that never comes; both end at
    step 60 with the same digest, well before r1's 120 s step timeout."""
    import os
    import subprocess
    import sys

    from p2pft.deploy.ports import free_ports

    a, b = (f"127.0.0.1:{p}" for p in free_ports(2))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [tmp_path / "r0.log", tmp_path / "r1.log"]
    cmds = [[sys.executable, "-m", "p2pft.trainer.examples.loop", "r0", a, b],
            [sys.executable, "-c", LOOP_LAST_STEP_FAILS, "r1", b, a]]
    procs = [subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
             for cmd, log in zip(cmds, logs)]
    try:
        for p in procs:
            p.wait(timeout=50)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = [log.read_text(errors="replace") for log in logs]
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    assert "injected" in outs[1], outs[1][-3000:]
    finals = [[ln for ln in o.splitlines() if " digest " in ln] for o in outs]
    assert all(len(f) == 1 and " step 60 digest " in f[0] for f in finals), finals
    assert len({f[0].split("digest ")[1] for f in finals}) == 1, f"digests differ: {finals}"
    assert "fast-forwarded 1 step(s) to 60" in outs[1], outs[1][-3000:]
