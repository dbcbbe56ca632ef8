"""A majority of the voters SIGKILLed at once, with real `p2pft peer` processes.

Five peers, all voters: two without a data directory (they live on) and three with one. The
three are SIGKILLed together: the two survivors each log one ERROR naming the three missing
voters within ``ERROR_BOUND`` and ``admin.members`` reports them; the same three commands
started again come back as the same voters (their data directories), and a new view is
committed. On the code before durable voters the survivors stayed at their epoch for good.
A peer whose data directory was lost comes back as a new voter identity instead, and one whose
directory is in use by another process refuses to start.
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from p2pft.net import aio

pytestmark = pytest.mark.slow

FORM_BOUND = 30.0
ERROR_BOUND = 5.0      # s from SIGKILL to the ERROR on every survivor (quorum_loss_grace 2 s + detection)
HEAL_BOUND = 10.0      # s from restarting the three to a new view at every peer (includes interpreter start)
ERROR_RE = re.compile(r"ERROR .*3 of the 5 voters are unreachable \((.*)\) for [0-9.]+ s: a majority is lost")


class Peers:
    def __init__(self, tmp: Path, ctl: Any) -> None:
        self.tmp, self.ctl = tmp, ctl
        self.addrs = [f"127.0.0.1:{p}" for p in ctl.free_ports(5)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, list[Path]] = {}

    def data_dir(self, i: int) -> Path:
        return self.tmp / f"data-p{i}"

    def spawn(self, i: int, durable: bool) -> None:
        log = self.tmp / f"p{i}-{len(self.logs.get(i, []))}.log"
        cmd = self.ctl.p2pft_command() + ["--log-level", "INFO", "peer", "--listen", self.addrs[i],
                                          "--seeds", ",".join(self.addrs), "--replica-id", f"p{i}"]
        if durable:
            cmd += ["--data-dir", str(self.data_dir(i))]
        with open(log, "wb") as fh:
            self.procs[i] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                             env=self.ctl.child_env())
        self.logs.setdefault(i, []).append(log)

    def log(self, i: int) -> str:
        return self.logs[i][-1].read_text(errors="replace")

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)

    def kill_all(self) -> None:
        for i in list(self.procs):
            self.kill(i)

    async def reports(self, which: list[int]) -> dict[int, dict[str, Any] | None]:
        got = await self.ctl.reports([self.addrs[i] for i in which])
        return {i: got[self.addrs[i]] for i in which}


async def _formed(ps: Peers) -> dict[str, Any]:
    async def ok() -> bool:
        reps = await ps.reports(list(range(5)))
        return all(r is not None and len(r["members"]) == 5 and sum(m["voter"] for m in r["members"]) == 5
                   and len({m["state"] for m in r["members"]}) == 1 for r in reps.values()) \
            and len({r["epoch"] for r in reps.values() if r}) == 1
    await ps.ctl.wait_until(ok, FORM_BOUND, interval=0.1, what="5 peers, 5 voters, one view")
    rep = (await ps.reports([0]))[0]
    assert rep is not None
    return rep


@pytest.fixture
def ps(tmp_path: Path, ctl: Any) -> Any:
    p = Peers(tmp_path, ctl)
    try:
        yield p
    finally:
        p.kill_all()


def test_majority_killed_logs_one_error_and_the_restart_with_data_dirs_heals(ps: Peers) -> None:
    for i in range(5):
        ps.spawn(i, durable=i >= 2)
    before = aio.run(_formed(ps))
    voter_ids = {m["replica_id"]: m["node"] for m in before["members"]}
    for i in (2, 3, 4):
        ps.kill(i)
    t_kill = time.monotonic()

    # Each survivor logs the ERROR once, naming the three voters, within the bound.
    deadline = t_kill + ERROR_BOUND + 5
    found: dict[int, float] = {}
    while len(found) < 2 and time.monotonic() < deadline:
        for i in (0, 1):
            if i not in found and ERROR_RE.search(ps.log(i)):
                found[i] = time.monotonic() - t_kill
        time.sleep(0.05)
    assert len(found) == 2, f"no ERROR within {ERROR_BOUND + 5} s: {ps.log(0)[-2000:]}"
    assert max(found.values()) <= ERROR_BOUND, f"ERROR after {found} s (bound {ERROR_BOUND} s)"
    for i in (0, 1):
        named = ERROR_RE.search(ps.log(i)).group(1)   # type: ignore[union-attr]
        for r in ("p2", "p3", "p4"):
            assert voter_ids[r] in named, named
    reps = aio.run(ps.reports([0, 1]))
    for rep in reps.values():
        assert rep is not None
        assert {v["replica_id"] for v in rep["quorum_lost"]} == {"p2", "p3", "p4"}
        assert rep["epoch"] == before["epoch"]          # nothing could be committed
    # Held down longer: still one ERROR per survivor, not one per tick.
    time.sleep(2.0)
    for i in (0, 1):
        assert len(ERROR_RE.findall(ps.log(i))) == 1, ps.log(i)[-3000:]
    # `p2pft members` prints it.
    out = subprocess.run(ps.ctl.p2pft_command() + ["members", "--peer", ps.addrs[0]], capture_output=True,
                         text=True, timeout=20, env=ps.ctl.child_env())
    assert "MAJORITY OF VOTERS LOST" in out.stdout and "p2" in out.stdout, out.stdout + out.stderr

    # The same commands again: the same voters come back, and the cluster commits again.
    t_restart = time.monotonic()
    for i in (2, 3, 4):
        ps.spawn(i, durable=True)

    async def healed() -> bool:
        reps = await ps.reports(list(range(5)))
        if any(r is None for r in reps.values()):
            return False
        epochs = {r["epoch"] for r in reps.values()}   # type: ignore[index]
        r0 = reps[0]
        assert r0 is not None
        alive = [m for m in r0["members"] if m["state"] == "alive"]
        # The restarted three counted as voters again (under load the view that takes them back
        # can come a round before the one that counts them).
        voters = {m["replica_id"] for m in r0["members"] if m.get("voter")}
        return (len(epochs) == 1 and min(epochs) > before["epoch"] and len(r0["members"]) == 5
                and len(alive) == 5 and {"p2", "p3", "p4"} <= voters
                and not any(r["quorum_lost"] for r in reps.values()))   # type: ignore[index]
    took = aio.run(ps.ctl.wait_until(healed, HEAL_BOUND, interval=0.1, what="a new view with the restarted voters"))
    rep = aio.run(ps.reports([0]))[0]
    assert rep is not None
    by_rid = {m["replica_id"]: m for m in rep["members"]}
    # New incarnations (node ids), the old voter identities: the voter set did not change.
    for r in ("p2", "p3", "p4"):
        assert by_rid[r]["node"] != voter_ids[r]
        assert by_rid[r]["voter"]
    assert sum(m["voter"] for m in rep["members"]) == 5
    for i in (2, 3, 4):
        assert f"restored voter {voter_ids[f'p{i}']} from disk" in ps.log(i), ps.log(i)[-2000:]
    for i in (0, 1):
        assert "a majority of the voters is reachable again" in ps.log(i)
    print(f"ERROR after {max(found.values()):.2f} s; healed {took:.2f} s after the restart "
          f"({time.monotonic() - t_restart:.2f} s)")


def test_lost_data_dir_is_a_new_voter_and_a_shared_one_is_refused(ps: Peers) -> None:
    for i in range(5):
        ps.spawn(i, durable=i >= 2)
    before = aio.run(_formed(ps))
    old = {m["replica_id"]: m["node"] for m in before["members"]}
    # A second process on p2's data directory refuses to start, naming it.
    clash = subprocess.run(ps.ctl.p2pft_command() + ["peer", "--listen", f"127.0.0.1:{ps.ctl.free_ports(1)[0]}",
                                                     "--replica-id", "p2", "--data-dir", str(ps.data_dir(2))],
                           capture_output=True, text=True, timeout=20, env=ps.ctl.child_env())
    assert clash.returncode != 0 and "in use by another process" in clash.stderr, clash.stderr
    # p2 loses its data directory, p3 and p4 keep theirs: all three killed and restarted.
    for i in (2, 3, 4):
        ps.kill(i)
    shutil.rmtree(ps.data_dir(2))
    for i in (2, 3, 4):
        ps.spawn(i, durable=True)

    async def settled() -> bool:
        reps = await ps.reports(list(range(5)))
        if any(r is None for r in reps.values()):
            return False
        r0 = reps[0]
        assert r0 is not None
        return (len({r["epoch"] for r in reps.values()}) == 1 and len(r0["members"]) == 5   # type: ignore[index]
                and all(m["state"] == "alive" for m in r0["members"])
                and sum(m["voter"] for m in r0["members"]) == 5)
    aio.run(ps.ctl.wait_until(settled, 20.0, interval=0.1, what="five live members, five voters"))
    rep = aio.run(ps.reports([0, 2, 3]))
    assert "restored voter" not in ps.log(2)                       # nothing to restore: a new identity
    assert f"restored voter {old['p3']}" in ps.log(3) and f"restored voter {old['p4']}" in ps.log(4)
    assert rep[2] is not None and rep[2]["voter_id"] == rep[2]["node"] != old["p2"]
    assert rep[3] is not None and rep[3]["voter_id"] == old["p3"] != rep[3]["node"]


RESUME_BOUND = 45.0    # s from restarting the three replicas to their first commit (torch import, heal, resume grace)


def test_three_replica_voters_killed_together_resume_from_their_checkpoints(tmp_path: Path, ctl: Any) -> None:
    """2 witnesses + 3 replicas, 5 voters; the 3 replicas SIGKILLed at once (a majority of the
    voters) and started again with the same commands: they return as the same voters, the
    cluster commits views again and the job goes on from the step of their checkpoints."""
    from tests.integration.replica_harness import Replicas, check_invariants, records, steps

    rs = Replicas(tmp_path, 3, witnesses=2)

    def spawn(i: int, life: int) -> None:
        rs.extra = ["--checkpoint-every", "5", "--min-replicas", "3", "--checkpoint-dir", str(tmp_path / f"ckpt-r{i}"),
                    "--data-dir", str(tmp_path / f"data-r{i}")]
        rs.spawn(i, f"r{i}-{life}")

    rs.spawn_witness(0)
    rs.spawn_witness(1)
    for i in range(3):
        spawn(i, 0)
    try:
        rs.wait(lambda: all(rs.last_step(f"r{i}-0") >= 12 for i in range(3)), 60, "12 steps on all three")

        def five_voters() -> bool:
            rep = aio.run(ctl.report(rs.witness_addrs[0]))
            return rep is not None and sum(1 for m in rep["members"] if m["voter"] and m["role"] != "witness") == 3
        rs.wait(five_voters, 20, "the three replicas to be voters")
        for i in range(3):
            rs.procs[f"r{i}-0"].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        for i in range(3):
            rs.procs[f"r{i}-0"].wait(timeout=5)
        before = max(rs.last_step(f"r{i}-0") for i in range(3))
        w_log = tmp_path / "w0.log"
        rs.wait(lambda: "a majority is lost" in w_log.read_text(errors="replace"), ERROR_BOUND + 5, "the ERROR")
        error_after = time.monotonic() - t_kill
        assert error_after <= ERROR_BOUND + 0.5, error_after
        t_restart = time.monotonic()
        for i in range(3):
            spawn(i, 1)
        took = rs.wait(lambda: all(any(r.get("c") for r in steps(rs.stats[f"r{i}-1"])) for i in range(3)),
                       RESUME_BOUND + 30, "the three restarted replicas to commit")
        took = time.monotonic() - t_restart
    finally:
        rcs = rs.stop_all()
    assert all(rc == 0 for name, rc in rcs.items() if not name.endswith("-0")), rcs
    assert took <= RESUME_BOUND, f"resumed {took:.1f} s after the restart (bound {RESUME_BOUND} s)"
    logs = {i: (tmp_path / f"r{i}-1.log").read_text(errors="replace") for i in range(3)}
    for i in range(3):
        assert "restored voter" in logs[i], logs[i][-2000:]
    starts = [next(r for r in records(rs.stats[f"r{i}-1"]) if r.get("kind") == "start") for i in range(3)]
    best = max(int(s["step"]) for s in starts)
    assert best >= 10 and best >= before - 6, f"not resumed from the checkpoints: {before=} {starts=}"
    first = min(int(next(r for r in steps(rs.stats[f"r{i}-1"]) if r.get("c"))["step"]) for i in range(3))
    assert first == best + 1, (before, best, first)     # from the checkpoint's step: not 0, nothing redone
    check_invariants({k: v for k, v in rs.stats.items() if k.endswith("-1")})
    # The witnesses saw the step the replicas reached; a resume below it is announced, never silent.
    leader_logs = "".join((tmp_path / f"{n}.log").read_text(errors="replace")
                          for n in ("w0", "w1", "r0-1", "r1-1", "r2-1"))
    if best < before - 1:   # the last step or so may not have been gossiped before the kill
        assert f"resuming from step {best}" in leader_logs, "a resume below the job's step was not announced"
    print(f"killed at step {before}; ERROR after {error_after:.2f} s; resumed at step {first} "
          f"{took:.1f} s after the restart")
