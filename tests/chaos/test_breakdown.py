"""The time breakdown and the divergence check of a chaos row, from hand-written stats records with known answers."""
from __future__ import annotations

from typing import Any

from p2pft.chaos.breakdown import commit_series, contributor_seconds, phase_windows, step_time_by_phase
from p2pft.chaos.metrics import digests_by_step


def _steps(replica_t0: float, first: int, n: int, count: int, dt: float = 0.1) -> list[dict[str, Any]]:
    return [{"t": replica_t0 + k * dt, "step": first + k, "c": 1, "n": n, "role": "participant"}
            for k in range(count)]


def test_contributor_seconds_splits_the_run_by_contributors_and_stalls() -> None:
    # 3 contributors for 1 s (steps 1-10), a failure: 2 s without a step, then 2 for 1 s.
    recs = {(0, 0): _steps(0.1, 1, 3, 10) + _steps(3.0, 11, 2, 11),
            (1, 0): _steps(0.1, 1, 3, 10)}  # a second replica records the same steps: counted once
    series = commit_series(recs, 0.0, 5.0)
    assert [c.step for c in series] == list(range(1, 22))
    out = contributor_seconds(series, 0.0, 5.0, step_p50=0.1, replicas=3)
    assert abs(out["3"] - 1.0) < 1e-6
    assert abs(out["2"] - 1.1) < 1e-6       # the first step after the stall took one normal step
    assert out["1"] == 0.0
    assert abs(out["0"] - 2.9) < 1e-6       # 1.9 s of stall and 1.0 s after the last step
    assert abs(sum(out.values()) - 5.0) < 1e-6


def test_step_time_by_phase_follows_the_restarted_replica() -> None:
    survivor = _steps(0.0, 1, 2, 60)                      # step k + 1 at t = k * 0.1 s
    restarted = [{"t": 1.5, "kind": "start", "step": 0},
                 {"t": 2.0, "kind": "event", "event": "catchup_start"},
                 {"t": 3.0, "kind": "event", "event": "catchup_done"},
                 {"t": 3.5, "step": 36, "c": 1, "n": 2, "role": "joiner"},
                 {"t": 4.0, "step": 41, "c": 1, "n": 3, "role": "participant"}]
    recs = {(0, 0): survivor, (1, 1): restarted}
    windows = phase_windows(recs, step_p50=0.1)
    assert sorted(w[2] for w in windows) == ["catching_up", "joiner_present", "just_promoted"]
    out = step_time_by_phase(commit_series(recs, 0.0, 6.0), windows, failures=[], step_p50=0.1)
    assert out["catching_up"]["steps"] == 10 and out["joiner_present"]["steps"] == 10
    assert out["just_promoted"]["steps"] == 10            # 10 steps of 0.1 s after the promotion
    assert out["normal"]["steps"] == 59 - 30
    assert abs(out["normal"]["step_p50_s"] - 0.1) < 1e-6


def test_a_gap_holding_a_failure_is_no_step_time() -> None:
    recs = {(0, 0): _steps(0.0, 1, 3, 5) + _steps(2.0, 6, 2, 5)}
    out = step_time_by_phase(commit_series(recs, 0.0, 3.0), [], failures=[1.0], step_p50=0.5)
    assert out["normal"]["steps"] == 8  # 9 gaps, the one across the failure left out


def _digest(step: int, d: str) -> dict[str, Any]:
    return {"t": float(step), "step": step, "c": 1, "n": 3, "digest": d}


def test_a_rejoined_replica_is_compared_with_the_survivors_at_every_step() -> None:
    recs = {(0, 0): [_digest(10, "a"), _digest(20, "b")],
            (1, 0): [_digest(10, "a")],                  # killed after step 10
            (1, 1): [_digest(20, "c")]}                  # rejoined, but holds other weights at 20
    digests = digests_by_step(recs, restarts_all=False)
    assert {k: len(v) for k, v in digests.items()} == {(0, 10): 1, (0, 20): 2}


def test_a_job_restarted_as_a_whole_is_compared_within_each_start() -> None:
    # Start 0 reached step 20 and was killed; start 1 resumed from a checkpoint at 10 and
    # trained step 20 again with other bits (DDP lays its buckets out again): not a divergence.
    recs = {(0, 0): [_digest(10, "a"), _digest(20, "b")], (1, 0): [_digest(10, "a"), _digest(20, "b")],
            (0, 1): [_digest(20, "c")], (1, 1): [_digest(20, "c")]}
    assert all(len(v) == 1 for v in digests_by_step(recs, restarts_all=True).values())
    recs[(1, 1)] = [_digest(20, "d")]                    # two ranks of one start disagree: counted
    assert sorted(len(v) for v in digests_by_step(recs, restarts_all=True).values()) == [1, 1, 2]
