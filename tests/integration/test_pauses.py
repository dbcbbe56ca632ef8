"""Pauses that are not failures, with real processes on loopback (``ft.pause()``).

- One replica evaluates for twice its loop timeout inside ``with ft.pause("eval")``: it is not
  left out as a stalled loop, the others commit without it meanwhile (no waiting on its data),
  and it comes back with the same weights as theirs.
- A joiner starts while every participant sits in a pause: it catches up from a paused donor
  and is ready before they come back.
- A lone joiner that can make no progress (its only peer's loop is wedged and out of the view)
  backs off and raises ``StepTimeout`` after its bound instead of spinning, and the leader says
  once, not at every tick, that it would resume below the high-water step.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from replica_harness import Replicas, check_invariants, records, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FAST = ["--comm-timeout", "2", "--loop-timeout", "3"]


def _event(rs: Replicas, name: str, kind: str) -> dict | None:
    return next((r for r in records(rs.stats[name]) if r.get("event") == kind), None)


def test_pause_longer_than_loop_timeout_is_not_a_failure(tmp_path: Path) -> None:
    base = ["--min-replicas", "3", *FAST]
    rs = Replicas(tmp_path, 3, base, witnesses=1)
    # The lowest address bootstraps the cluster and leads it; a leader never leaves itself
    # out, so the replica that pauses is another one.
    lowest = min(rs.addrs + rs.witness_addrs)
    p = next(i for i, a in enumerate(rs.addrs) if a != lowest)
    name = f"r{p}"
    others = [f"r{i}" for i in range(3) if i != p]
    rs.spawn_witness(0)
    for i in range(3):
        rs.extra = base + (["--pause-at-step", "8", "--pause-s", "6"] if i == p else [])
        rs.spawn(i, f"r{i}")
    try:
        rs.wait(lambda: _event(rs, name, "pause") is not None, 50, f"{name} to pause")
        t_pause = _event(rs, name, "pause")["t"]  # type: ignore[index]
        rs.wait(lambda: any(r["c"] and r["n"] == 2 and r["t"] > t_pause for r in steps(rs.stats[others[0]])), 10,
                f"{others} to commit without the paused {name}")
        t_alone = min(r["t"] for r in steps(rs.stats[others[0]]) if r["c"] and r["n"] == 2 and r["t"] > t_pause)
        rs.wait(lambda: _event(rs, name, "resume") is not None, 15, f"{name} to come back")
        resume = _event(rs, name, "resume")
        assert resume is not None
        rs.wait(lambda: any(r["c"] and r["n"] == 3 and r["t"] > resume["t"] for r in steps(rs.stats[name])), 30,
                f"{name} to contribute again")
        target = max(rs.last_step(f"r{i}") for i in range(3)) + 6
        rs.wait(lambda: all(rs.last_step(f"r{i}") >= target for i in range(3)), 30, "6 more steps everywhere")
    finally:
        rcs = rs.stop_all()
    assert all(rc == 0 for rc in rcs.values()), rcs
    digests = check_invariants(rs.stats)
    during = [r for r in steps(rs.stats[others[0]]) if r["c"] and t_pause < r["t"] < resume["t"]]
    assert len(during) >= 5, f"the others committed only {len(during)} steps during {name}'s 6 s pause"
    assert all(r["n"] == 2 for r in during[1:]), f"a step during the pause counted {name}"
    logs = "".join((tmp_path / f"{n}.log").read_text() for n in ("w0", "r0", "r1", "r2"))
    assert "has not run for" not in logs, "the paused replica was treated as a stalled loop"
    assert "no data from rank" not in logs, "a replica waited for the paused one's data"
    assert _event(rs, name, "excluded") is None
    assert any(s > int(resume["step"]) for s in digests), f"no digest compared after {name} came back"
    print(f"\npause: the others committed without {name} {t_alone - t_pause:.2f} s after the pause began; "
          f"{len(during)} steps during the 6 s pause")


def test_joiner_catches_up_while_the_others_are_paused(tmp_path: Path) -> None:
    base = ["--min-replicas", "2", *FAST]
    rs = Replicas(tmp_path, 3, base, witnesses=1, running_seeds=True)   # r2 starts later
    rs.spawn_witness(0)
    # The pause lasts until the test has seen the catch-up (the file), at most 40 s.
    resume_file = tmp_path / "resume"
    for i in range(2):
        rs.extra = base + ["--pause-at-step", "8", "--pause-s", "40", "--pause-until-file", str(resume_file)]
        rs.spawn(i, f"r{i}")
    try:
        rs.wait(lambda: all(_event(rs, f"r{i}", "pause") for i in range(2)), 50, "r0 and r1 to pause")
        t_paused = max(_event(rs, f"r{i}", "pause")["t"] for i in range(2))  # type: ignore[index]
        rs.extra = list(FAST)
        rs.spawn(2, "r2")
        rs.wait(lambda: _event(rs, "r2", "catchup_done") is not None, 30, "r2 to catch up during the pause")
        done = _event(rs, "r2", "catchup_done")
        assert done is not None and done["snapshot_step"] >= 8, done
        assert all(_event(rs, f"r{i}", "resume") is None for i in range(2)), "the pause ended before the catch-up"
        resume_file.touch()
        rs.wait(lambda: all(_event(rs, f"r{i}", "resume") for i in range(2)), 25, "r0 and r1 to come back")
        t_back = max(_event(rs, f"r{i}", "resume")["t"] for i in range(2))  # type: ignore[index]
        rs.wait(lambda: all(any(r["c"] and r["n"] == 3 and r["t"] > t_back for r in steps(rs.stats[f"r{i}"]))
                            for i in range(3)), 40, "all three to commit together")
    finally:
        rcs = rs.stop_all()
    assert all(rc == 0 for rc in rcs.values()), rcs
    check_invariants(rs.stats)
    print(f"\njoiner during a pause: caught up {done['t'] - t_paused:.2f} s after the others paused "
          f"(snapshot of step {done['snapshot_step']})")


def test_lone_joiner_whose_only_holder_is_wedged_gives_up_without_spinning(tmp_path: Path) -> None:
    """The only replica holding the job's state has a wedged loop (left out, still gossiping):
    a fresh replica cannot train from it and must not train a new model from step 0. It waits
    its bounded grace without spinning, then refuses with one ERROR naming the step (exit 3);
    the leader neither resumes from the wedged replica nor repeats its warning at every tick."""
    # Voters enough to elect a leader without r0; r1 starts later.
    rs = Replicas(tmp_path, 2, list(FAST), witnesses=2, running_seeds=True)
    rs.spawn_witness(0)
    rs.spawn_witness(1)
    rs.extra = [*FAST, "--hang-at-step", "5"]
    rs.spawn(0, "r0")
    rs.wait(lambda: _event(rs, "r0", "hang") is not None, 50, "r0's loop to hang")
    rs.wait(lambda: any("has not run for" in (tmp_path / f"w{k}.log").read_text() for k in range(2)), 20,
            "the leader to leave r0 out")
    rs.extra = [*FAST, "--step-timeout", "8", "--resume-grace", "6"]
    t0 = time.time()
    rs.spawn(1, "r1")
    try:
        rs.wait(lambda: rs.procs["r1"].poll() is not None, 45, "the lone joiner to give up", allow_exit=("r1",))
    finally:
        rcs = rs.stop_all()
    alive = time.time() - t0
    assert rcs["r1"] == 3, rcs
    assert alive <= 40.0, alive
    assert not steps(rs.stats["r1"]), "the lone replica trained a step: a new model under the job's name"
    log = (tmp_path / "r1.log").read_text()
    errors = [ln for ln in log.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and "refusing to train from step 0" in errors[0], errors
    leaders = "".join((tmp_path / f"w{k}.log").read_text() for k in range(2))
    assert "resuming from step" not in leaders, "the leader resumed from a replica whose loop is wedged"
    assert leaders.count("none has a checkpoint") <= 2, "the leader repeated its refusal at every tick"
    print(f"\nlone joiner: refused after {alive:.1f} s: {errors[0].split(': ', 1)[-1][:120]}")


def test_a_pause_across_the_end_comes_back_to_the_final_state(tmp_path: Path) -> None:
    """A replica pauses a few steps before the job's end for longer than the others need to
    get there: the end barrier waits for it (a paused member counts), it comes back, catches
    up to the last step and every replica leaves with the same step and digest (before, the
    others finished without it and it left at its stale step, exit 0)."""
    base = ["--min-replicas", "3", "--steps", "30", *FAST]
    rs = Replicas(tmp_path, 3, base, witnesses=1)
    rs.spawn_witness(0)
    for i in range(3):
        rs.extra = base + (["--pause-at-step", "24", "--pause-s", "8"] if i == 0 else [])
        rs.spawn(i, f"r{i}")
    try:
        rs.wait(lambda: all(rs.procs[f"r{i}"].poll() is not None for i in range(3)), 90, "the job to finish",
                allow_exit=("r0", "r1", "r2"))
    finally:
        rcs = rs.stop_all()
    assert all(rcs[f"r{i}"] == 0 for i in range(3)), rcs
    pause, resume = _event(rs, "r0", "pause"), _event(rs, "r0", "resume")
    assert pause is not None and resume is not None
    others_done = [max(r["t"] for r in steps(rs.stats[f"r{i}"]) if r["c"]) for i in (1, 2)]
    assert min(others_done) < resume["t"], "the others did not reach the end during the pause"
    ends = {n: [r for r in records(rs.stats[n]) if r.get("kind") == "exit"][-1] for n in ("r0", "r1", "r2")}
    assert all(e["step"] == 30 for e in ends.values()), ends
    assert len({e.get("digest") for e in ends.values()}) == 1, "a replica left the job with other weights"


def test_one_leader_per_step_over_many_leader_pauses(tmp_path: Path) -> None:
    """The leader evaluates inside a pause every 4 committed steps (others train on and one of
    them leads the next steps): over the whole run no committed step has two leaders."""
    base = ["--min-replicas", "3", "--steps", "60", "--leader-eval-every", "4", "--leader-eval-s", "0.4", *FAST]
    rs = Replicas(tmp_path, 3, base, witnesses=1)
    rs.spawn_witness(0)
    for i in range(3):
        rs.spawn(i, f"r{i}")
    try:
        rs.wait(lambda: all(rs.procs[f"r{i}"].poll() is not None for i in range(3)), 100, "the job to finish",
                allow_exit=("r0", "r1", "r2"))
    finally:
        rcs = rs.stop_all()
    assert all(rcs[f"r{i}"] == 0 for i in range(3)), rcs
    leaders: dict[int, list[str]] = {}
    for n in ("r0", "r1", "r2"):
        for r in steps(rs.stats[n]):
            if r.get("c") and r.get("lead"):
                leaders.setdefault(r["step"], []).append(n)
    evals = [r for n in ("r0", "r1", "r2") for r in records(rs.stats[n]) if r.get("event") == "leader_eval"]
    assert len(evals) >= 8, f"only {len(evals)} evaluations"
    assert len({e["step"] for e in evals}) == len(evals), "two replicas evaluated the same step"
    double = {s: ns for s, ns in leaders.items() if len(ns) > 1}
    assert not double, f"steps with two leaders: {double}"
    ends = {n: [r for r in records(rs.stats[n]) if r.get("kind") == "exit"][-1] for n in ("r0", "r1", "r2")}
    assert len({e.get("digest") for e in ends.values()}) == 1, ends


def test_a_lone_participant_pausing_at_the_last_step_finishes(tmp_path: Path) -> None:
    """The only participant evaluates in a pause every 10 steps, the last one at the job's last
    step: it comes back as the participant, the end barrier counts it, and it exits 0 at the
    job's end (before, it came back as a joiner and finish() ran into its timeout)."""
    base = ["--steps", "20", "--leader-eval-every", "10", "--leader-eval-s", "1", "--initial-state", "check", *FAST]
    rs = Replicas(tmp_path, 1, base, witnesses=1)
    rs.spawn_witness(0)
    rs.spawn(0, "r0")
    try:
        rs.wait(lambda: rs.procs["r0"].poll() is not None, 60, "the job to finish", allow_exit=("r0",))
    finally:
        rcs = rs.stop_all()
    assert rcs["r0"] == 0, (tmp_path / "r0.log").read_text()[-2000:]
    evals = [r["step"] for r in records(rs.stats["r0"]) if r.get("event") == "leader_eval"]
    assert evals == [10, 20], evals
    assert [r for r in records(rs.stats["r0"]) if r.get("event") == "finished"][0]["step"] == 20


def _short_pause_run(tmp_path: Path, extra: list[str]) -> dict[str, float | int | bool]:
    """Three replicas; one pauses 1.5 s at step 8. What it costs the paused one:
    the steps the others commit from its pause to its first contribution after it, and the
    path it came back by (its engine's events)."""
    base = ["--min-replicas", "3", *FAST, *extra]
    rs = Replicas(tmp_path, 3, base, witnesses=1)
    lowest = min(rs.addrs + rs.witness_addrs)
    p = next(i for i, a in enumerate(rs.addrs) if a != lowest)   # not the cluster's leader
    name, other = f"r{p}", f"r{(p + 1) % 3}"
    rs.spawn_witness(0)
    for i in range(3):
        rs.extra = base + (["--pause-at-step", "8", "--pause-s", "1.5"] if i == p else [])
        rs.spawn(i, f"r{i}")
    try:
        rs.wait(lambda: _event(rs, name, "resume") is not None, 60, f"{name} to pause and come back")
        resume = _event(rs, name, "resume")
        assert resume is not None
        rs.wait(lambda: any(r["c"] and r["n"] == 3 and r["t"] > resume["t"] for r in steps(rs.stats[name])), 30,
                f"{name} to contribute again")
        target = max(rs.last_step(f"r{i}") for i in range(3)) + 4
        rs.wait(lambda: all(rs.last_step(f"r{i}") >= target for i in range(3)), 30, "4 more steps everywhere")
    finally:
        rcs = rs.stop_all()
    assert all(rc == 0 for rc in rcs.values()), rcs
    check_invariants(rs.stats)
    pause = _event(rs, name, "pause")
    assert pause is not None
    back_rec = min((r for r in steps(rs.stats[name]) if r["c"] and r["n"] == 3 and r["t"] > resume["t"]),
                   key=lambda r: r["t"])
    back = back_rec["step"]
    evs = [r for r in records(rs.stats[name]) if r.get("kind") == "event" and r["t"] >= pause["t"]]
    return {"lost": int(back) - 1 - int(pause["step"]),
            "others": sum(1 for r in steps(rs.stats[other]) if r["c"] and pause["t"] < r["t"] < resume["t"]),
            "back_s": round(back_rec["t"] - resume["t"], 2),
            "ff": any(e["event"] == "fast_forward" for e in evs),
            "snapshot": any(e["event"] == "catchup_start" for e in evs)}


def test_a_short_pause_comes_back_by_fast_forward(tmp_path: Path) -> None:
    """A replica pauses 1.5 s (an evaluation) while the others commit a few steps without it:
    the others keep the log from its step on while it is paused, so it comes back by
    fast-forwarding those steps from a peer's log, not by pulling a snapshot, and contributes
    again at once."""
    # The pace (0.25 s per step), and a model whose snapshot is not free (1M parameters).
    got = _short_pause_run(tmp_path, ["--step-delay", "0.25", "--mlp-params", "1000000"])
    print(f"\nshort pause: {got}")
    assert got["others"] >= 3, f"the others committed only {got['others']} steps during the pause"
    assert got["ff"] and not got["snapshot"], got
    # Back in the step after the ones it missed (a snapshot cost 4-5 more: docs/runtime.md).
    assert got["lost"] <= got["others"] + 2, got
