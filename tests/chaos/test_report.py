"""The chaos table's title and the contributor curve of the timeline."""
from __future__ import annotations

from p2pft.chaos.report import contributor_steps, title

CONFIG = {"replicas": 3, "duration": 60.0, "fault": "kill", "kill_every": 10.0, "restart_after": 2.0,
          "pause_for": 3.0}


def test_title_announces_failures_only_when_there_were_some() -> None:
    assert title(CONFIG, 5) == "p2pft chaos: 3 replicas, 60 s, a SIGKILL every 10 s, restart after 2 s"
    quiet = title(CONFIG, 0)
    assert "no failures" in quiet and "SIGKILL" not in quiet and "restart" not in quiet
    assert "SIGSTOP (3 s) every 10 s" in title({**CONFIG, "fault": "pause"}, 2)


def test_contributor_curve_drops_to_zero_over_a_stall() -> None:
    xs, ys = contributor_steps([[1.0, 3], [1.2, 3], [5.0, 2], [5.2, 2]], 0.2, 0.0, 6.0)
    # 3 until the last step before the stall, 0 during it, 2 after, 0 once the run ends.
    assert list(zip(xs, ys)) == [(0.0, 0), (0.8, 3), (1.0, 3), (1.2, 0), (4.8, 2), (5.0, 2), (5.2, 0), (6.0, 0)]
