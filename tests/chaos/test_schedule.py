"""Failure targets: training replicas, never the last copy of the model state."""
from __future__ import annotations

import pytest

from p2pft.chaos.cluster import ChaosConfig, Schedule


def test_victims_are_training_replicas() -> None:
    s = Schedule(ChaosConfig(seed=3))
    for _ in range(50):
        (victim,) = s.targets(training=[0, 2], live=[0, 1, 2], leader=None)
        assert victim in (0, 2)


def test_the_last_replica_holding_the_state_is_spared() -> None:
    for fault in ("kill", "leader", "two"):
        s = Schedule(ChaosConfig(replicas=4, fault=fault))
        for _ in range(20):
            victims = s.targets(training=[1], live=[0, 1, 3], leader=1)
            assert victims and 1 not in victims and set(victims) <= {0, 3}
        assert s.targets(training=[1], live=[1], leader=1) == []  # nobody else alive: no failure


def test_two_leaves_a_training_replica() -> None:
    s = Schedule(ChaosConfig(replicas=4, fault="two"))
    for _ in range(20):
        victims = s.targets(training=[0, 1, 2], live=[0, 1, 2, 3], leader=None)
        assert len(victims) == 2 and len(set([0, 1, 2]) - set(victims)) >= 1


def test_a_pause_may_hit_the_only_training_replica() -> None:
    s = Schedule(ChaosConfig(fault="pause"))
    assert s.targets(training=[1], live=[0, 1, 2], leader=None) == [1]  # the state survives a pause


def test_leader_fault_hits_the_leader() -> None:
    s = Schedule(ChaosConfig(fault="leader"))
    assert s.targets(training=[0, 1, 2], live=[0, 1, 2], leader=2) == [2]


def test_host_options_are_checked() -> None:
    ChaosConfig(hosts="netns", fault="host", link_mbit=100).validate()
    for kw, needle in (({"fault": "host"}, "--fault host needs --hosts netns"),
                       ({"hosts": "vm"}, "--hosts must be one of"),
                       ({"link_mbit": 10.0}, "--link-mbit needs --hosts netns"),
                       ({"hosts": "netns", "link_mbit": 0.0}, "--link-mbit needs")):
        with pytest.raises(ValueError, match=needle):
            ChaosConfig(**kw).validate()
