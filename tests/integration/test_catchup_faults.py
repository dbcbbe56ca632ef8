"""Faults during catch-up, with real processes on loopback (SIGKILL).

Three replicas (+ two `p2pft peer` witnesses, the preferred voters) train a ~2M-parameter MLP
(~24 MB of model and AdamW state); one is SIGKILLed and restarted, and the restarted one pulls
its snapshot at a capped rate, so the transfer lasts several seconds. During that transfer:

1. the donor is SIGKILLed: the joiner's fetch fails, it pulls from the remaining participant,
   catches up and contributes; the surviving participant never stops committing;
2. the joiner is SIGKILLed: the participants never stop committing, the donor's stream ends,
   and the donor serves the next joiner (the same replica restarted once more).

Both check digests at equal steps, exactly-once samples, exit status 0 for every process left,
and that no participant fell back to a catch-up of its own.
"""
from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from replica_harness import Replicas, check_invariants, records, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RATE = 4_000_000  # bytes/s: ~24 MB of state takes ~6 s
# ~2M parameters (24 MB with AdamW); --step-delay overrides the harness's 0.05 (fewer logged steps)
EXTRA = ["--mlp-params", "2000000", "--state-rate-limit", str(RATE), "--step-delay", "0.1"]
# Only the first three wait for each other. A restarted replica is at step 0 too, and would sit in
# the --min-replicas wait (up to 30 s) while already in the view as a joiner: every allreduce of
# the others then waits for it (connect timeouts) until it starts its loop.
FIRST = EXTRA + ["--min-replicas", "3"]
GAP_MAX = 5.0  # s: the longest time between two commits of a participant that was never killed
FETCH = re.compile(r"fetching a snapshot of step >= \d+ from (r\d)")
# The donor's stream to a joiner that died: DataServer._run_stream logs it as "state stream N
# failed" with the traceback of a BrokenPipeError / ConnectionResetError (a peer gone, not a bug).
STREAM_END = re.compile(r"^(\S+ \S+) WARNING +\[.*state stream \d+ ended: the joiner at \S+ went away "
                        r"\((\w+)\)", re.M)


def log_time(stamp: str) -> float:
    return time.mktime(time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S")) + int(stamp.split(",")[1]) / 1e3


def log_text(rs: Replicas, name: str) -> str:
    return (rs.tmp / f"{name}.log").read_text(errors="replace")


def fetch_donors(rs: Replicas, name: str) -> list[str]:
    """Replica ids `name` asked for a snapshot, in order (one per attempt)."""
    return FETCH.findall(log_text(rs, name))


def served_after(rs: Replicas, name: str, t: float) -> int:
    """Snapshots `name` served after time `t` (the first participants' step-0 state counts not)."""
    return sum(1 for ln in log_text(rs, name).splitlines()
               if "served state snapshot" in ln and log_time(" ".join(ln.split()[:2])) > t)


def events(rs: Replicas, name: str, kind: str) -> list[dict]:
    return [r for r in records(rs.stats[name]) if r.get("kind") == "event" and r.get("event") == kind]


def contributed(rs: Replicas, name: str, n: int, since: float = 0.0) -> bool:
    return any(r.get("c") and r["role"] == "participant" and r["n"] == n and r.get("tr") and r["t"] > since
               for r in steps(rs.stats[name]))


def longest_gap(rs: Replicas, name: str, since: float) -> float:
    ts = [r["t"] for r in steps(rs.stats[name]) if r.get("c")]
    ts = [since] + [t for t in ts if t > since]
    assert len(ts) > 10, f"{name} committed only {len(ts) - 1} steps after {since}"
    return max(b - a for a, b in zip(ts, ts[1:]))


def kill(rs: Replicas, name: str) -> float:
    rs.procs[name].send_signal(signal.SIGKILL)
    rs.procs[name].wait(timeout=5)
    return time.time()


@pytest.fixture
def rs(tmp_path: Path):
    rs = Replicas(tmp_path, 3, FIRST, witnesses=2)
    yield rs
    rs.stop_all()


def rejoin_until_fetching(rs: Replicas, name: str) -> tuple[str, float]:
    """Start the cluster, SIGKILL r1 and restart it as `name`; once the joiner's snapshot
    transfer is under way, return the donor's process name and when all had 10 steps."""
    for k in range(2):
        rs.spawn_witness(k)
    for i in range(3):
        rs.spawn(i, f"r{i}-0")
    rs.wait(lambda: all(rs.last_step(f"r{i}-0") >= 10 for i in range(3)), 90, "10 steps on every replica")
    t0 = time.time()
    rs.extra = EXTRA
    kill(rs, "r1-0")
    rs.wait(lambda: rs.last_step("r0-0") >= rs.last_step("r1-0") + 3, 30, "the others to go on without r1")
    rs.spawn(1, name)
    rs.wait(lambda: fetch_donors(rs, name), 60, f"{name} to pull a snapshot")
    time.sleep(1.0)  # the donor answers at its next step boundary, then streams for ~6 s
    return fetch_donors(rs, name)[0] + "-0", t0


def finish(rs: Replicas, names: list[str]) -> dict[str, int | None]:
    target = max(rs.last_step(n) for n in names) + 5
    rs.wait(lambda: all(rs.last_step(n) >= target for n in names), 30, f"5 more steps on {names}")
    rcs = rs.stop_all()
    alive = names + ["w0", "w1"]
    assert all(rcs[n] == 0 for n in alive), f"exit statuses {rcs}"
    check_invariants(rs.stats)  # equal digests at equal steps, every sample trained once
    digest_steps = {n: {r["step"] for r in steps(rs.stats[n]) if "digest" in r} for n in names}
    assert digest_steps[names[-1]] & set().union(*(digest_steps[n] for n in names[:-1])), "no joiner digest to compare"
    for n in names:
        assert len([r for r in records(rs.stats[n]) if r.get("kind") == "start"]) == 1, f"{n} restarted"
    return rcs


def test_donor_killed_during_catchup(rs: Replicas) -> None:
    donor, t0 = rejoin_until_fetching(rs, "r1-1")
    survivor = next(n for n in ("r0-0", "r2-0") if n != donor)
    assert not events(rs, "r1-1", "catchup_done"), "the transfer ended before the donor could be killed"
    t_kill = kill(rs, donor)
    rs.wait(lambda: events(rs, "r1-1", "catchup_done"), 60, "the joiner to catch up from the survivor")
    rs.wait(lambda: contributed(rs, "r1-1", 2, t_kill), 30, "the joiner to contribute")
    done = events(rs, "r1-1", "catchup_done")
    assert "snapshot fetch failed" in log_text(rs, "r1-1"), "the fetch from the killed donor did not fail"
    assert fetch_donors(rs, "r1-1")[-1] == survivor[:2], fetch_donors(rs, "r1-1")
    assert len(done) == 1 and done[0]["t"] > t_kill, done
    assert not served_after(rs, donor, t0), "the killed donor had finished its transfer"
    finish(rs, [survivor, "r1-1"])
    gap = longest_gap(rs, survivor, t0)
    print(f"\nfetch from {survivor} {done[0]['fetch_s']:.2f} s; donor kill -> catch-up done "
          f"{done[0]['t'] - t_kill:.2f} s (replayed {done[0]['replayed']}); {survivor} longest gap {gap:.2f} s")
    assert gap < GAP_MAX, f"{survivor} stalled {gap:.2f} s"
    assert not events(rs, survivor, "catchup_start"), f"{survivor} fell back to a catch-up"


def test_joiner_killed_during_catchup(rs: Replicas) -> None:
    donor, t0 = rejoin_until_fetching(rs, "r1-1")
    t_kill = kill(rs, "r1-1")
    assert not events(rs, "r1-1", "catchup_done"), "the transfer ended before the joiner could be killed"
    at_kill = {n: rs.last_step(n) for n in ("r0-0", "r2-0")}
    rs.wait(lambda: all(rs.last_step(n) >= at_kill[n] + 10 for n in at_kill), 30,
            "the participants to commit 10 more steps")
    # The donor's stream to the dead joiner has ended; the donor serves the next joiner.
    rs.spawn(1, "r1-2")
    rs.wait(lambda: events(rs, "r1-2", "catchup_done"), 60, "the next joiner to catch up")
    rs.wait(lambda: contributed(rs, "r1-2", 3), 30, "the next joiner to contribute")
    done = events(rs, "r1-2", "catchup_done")
    assert fetch_donors(rs, "r1-2")[-1] == donor[:2], (donor, fetch_donors(rs, "r1-2"))
    finish(rs, ["r0-0", "r2-0", "r1-2"])
    gaps = {n: round(longest_gap(rs, n, t0), 2) for n in at_kill}
    counters = next(r for r in records(rs.stats[donor]) if r.get("kind") == "exit")["data_counters"]
    donor_log = log_text(rs, donor)
    ended = STREAM_END.findall(donor_log)
    print(f"\nparticipants' longest gaps {gaps}; next joiner's fetch {done[0]['fetch_s']:.2f} s; donor {donor}: "
          f"stream ended {[round(log_time(t) - t_kill, 2) for t, _ in ended]} s after the kill, counters {counters}")
    assert all(g < GAP_MAX for g in gaps.values()), gaps
    for n in at_kill:
        assert not events(rs, n, "catchup_start"), f"{n} fell back to a catch-up"
    assert served_after(rs, donor, t_kill), "the donor did not serve the next joiner"
    # The stream to the killed joiner ended at once, on the joiner's disconnection: one warning
    # line and a counter, no traceback, nothing else.
    assert len(ended) == 1 and log_time(ended[0][0]) - t_kill < 5.0, ended
    assert counters.get("state_stream_lost", 0) == 1, counters
    assert "Traceback" not in donor_log and counters.get("state_stream_failed", 0) == 0, counters
