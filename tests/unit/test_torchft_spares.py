"""The torchft spare plumbing of ``p2pft chaos --spares N``: argument building only.

torchft itself is not needed (CI has none): the run gives torchft as many spares as p2pft, in
FIXED_WITH_SPARES with ``min_replica_size`` = the planned count, and without ``--spares``
nothing changes.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from p2pft.chaos.cluster import ChaosConfig, Cluster
from p2pft.chaos.torchft_system import TorchftCluster, lighthouse_min_replicas, spare_args, worker_command
from p2pft.chaos.torchft_worker import parse_args


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_no_spares_keeps_the_old_command() -> None:
    cfg = ChaosConfig(replicas=3)
    cmd = worker_command(cfg, 1, Path("s.jsonl"), "http://h:1", Path("go"), "manual")
    assert spare_args(3, 0) == []
    assert "--world-size-mode" not in cmd and "--min-replica-size" not in cmd
    args = parse_args(cmd[3:])
    assert (args.world_size_mode, args.min_replica_size, args.replicas, args.replica) == ("dynamic", 1, 3, 1)


def test_spares_run_fixed_with_spares_at_the_planned_count() -> None:
    cfg = ChaosConfig(replicas=3, spares=1)
    # The spare is replica 3: same data layout (--replicas 3), same mode and minimum as the others.
    for i in range(4):
        cmd = worker_command(cfg, i, Path(f"r{i}.jsonl"), "http://h:1", Path("go"), "manual", spares=1,
                             host="10.0.0.5")
        args = parse_args(cmd[3:])
        assert args.world_size_mode == "fixed_with_spares"
        assert args.min_replica_size == 3 and args.replicas == 3 and args.replica == i
        assert args.host == "10.0.0.5"


def test_torchft_gets_the_spares_p2pft_gets(tmp_path: Path) -> None:
    cfg = ChaosConfig(replicas=3, spares=1)
    tf = TorchftCluster("torchft", cfg, tmp_path / "torchft")
    assert (tf.spares, tf.size, len(tf.crash_restarts)) == (1, 4, 4)
    assert tf.lighthouse_host == 4   # --hosts netns: its own host, after the spare's
    cmd = tf.lighthouse_cmd()
    assert cmd[cmd.index("--min_replicas") + 1] == "3"   # no quorum below the planned count
    assert Cluster("p2pft", cfg, tmp_path / "p2pft").size == 4
    assert Cluster("ddp", cfg, tmp_path / "ddp").size == 3   # the baselines have no spare mode
    plain = TorchftCluster("torchft", ChaosConfig(replicas=3), tmp_path / "t0")
    assert (plain.size, plain.lighthouse_host) == (3, 3)
    cmd = plain.lighthouse_cmd()
    assert cmd[cmd.index("--min_replicas") + 1] == "2"   # a majority: no quorum of one


def test_the_lighthouse_never_forms_a_minority_quorum() -> None:
    # Two disjoint quorums would both need more than half of the planned replicas.
    assert [lighthouse_min_replicas(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]
    assert lighthouse_min_replicas(3, spares=1) == 3 and lighthouse_min_replicas(2, spares=2) == 2
    for n in range(1, 9):
        assert 2 * lighthouse_min_replicas(n) > n
    with pytest.raises(ValueError):
        lighthouse_min_replicas(0)


def test_bad_spare_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="spares"):
        spare_args(3, -1)
    with pytest.raises(SystemExit):
        parse_args(["--lighthouse", "http://h:1", "--min-replica-size", "0"])


def test_the_lighthouse_minimum_can_be_set_for_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PFT_TORCHFT_MIN_REPLICAS", "3")
    cmd = TorchftCluster("torchft", ChaosConfig(replicas=3), tmp_path / "a").lighthouse_cmd()
    assert cmd[cmd.index("--min_replicas") + 1] == "3"
    monkeypatch.setenv("P2PFT_TORCHFT_MIN_REPLICAS", "4")
    with pytest.raises(ValueError, match="P2PFT_TORCHFT_MIN_REPLICAS"):
        TorchftCluster("torchft", ChaosConfig(replicas=3), tmp_path / "b")
