"""A lost voter majority as operators see it: the members report, `p2pft members`, `p2pft top`.

The node's report (``quorum_lost``) comes from a simulated cluster that really lost three of
its five voters, so the text checked here is what a real node would answer.
"""
from __future__ import annotations

from p2pft.cli import format_members
from p2pft.core.node import TRAINER_KIND, WITNESS_KIND
from p2pft.net.admin import members_report
from p2pft.ops.top import build_frame, render_plain
from p2pft.sim.cluster import Simulator

ADDRS = [f"10.0.0.{i + 1}:7000" for i in range(5)]


def _lost_majority() -> tuple[Simulator, dict]:
    sim = Simulator(3)
    for i, a in enumerate(ADDRS):
        sim.add_node(a, seeds=[x for x in ADDRS if x != a], kind=WITNESS_KIND if i < 2 else TRAINER_KIND,
                     replica_id=f"w{i}" if i < 2 else f"r{i}")
    sim.run_until(15.0, stop=lambda: sim.converged() and all(len(n.view.voters) == 5 for n in sim.nodes.values()))
    assert sim.converged()
    before = members_report(sim.nodes[ADDRS[0]], 0.0)
    assert before["quorum_lost"] == [] and "MAJORITY" not in format_members(before)
    for a in ADDRS[2:]:
        sim.crash(a)
    sim.run_until(sim.now + 8.0, stop=lambda: all(n.quorum_lost for n in sim.nodes.values()))
    return sim, members_report(sim.nodes[ADDRS[0]], 0.0)


def test_members_and_top_name_the_missing_voters() -> None:
    sim, rep = _lost_majority()
    assert {v["replica_id"] for v in rep["quorum_lost"]} == {"r2", "r3", "r4"}
    assert {v["addr"] for v in rep["quorum_lost"]} == set(ADDRS[2:])
    text = format_members(rep)
    assert "MAJORITY OF VOTERS LOST: r2 (" in text and ADDRS[4] in text
    frame = build_frame("peer", {**rep, "now": 1.0}, None)
    assert sorted(frame.quorum_lost) == sorted(f"{v['replica_id']} ({v['voter']})" for v in rep["quorum_lost"])
    screen = render_plain(frame)
    assert "! majority of voters lost: " in screen and "r3 (" in screen
    # Restarted without data directories they are strangers: still lost, still reported.
    for a in ADDRS[2:]:
        sim.restart(a, seeds=ADDRS[:2])
    sim.run_until(sim.now + 5.0)
    assert members_report(sim.nodes[ADDRS[0]], 0.0)["quorum_lost"]


def test_voters_that_left_are_a_warning_not_an_error(caplog) -> None:   # type: ignore[no-untyped-def]
    """A job stopped with SIGTERM (every replica leaves): the witnesses say so once, at WARNING."""
    import logging
    sim = Simulator(4)
    for i, a in enumerate(ADDRS):
        sim.add_node(a, seeds=[x for x in ADDRS if x != a], kind=WITNESS_KIND if i < 2 else TRAINER_KIND,
                     replica_id=f"w{i}" if i < 2 else f"r{i}")
    sim.run_until(15.0, stop=lambda: sim.converged() and all(len(n.view.voters) == 5 for n in sim.nodes.values()))
    with caplog.at_level(logging.WARNING, logger="p2pft.core.node"):
        for a in ADDRS[2:]:
            sim.call(a, lambda node, now: node.leave(now))
            sim.crash(a)
        sim.run_until(sim.now + 8.0)
    assert all(sim.nodes[a].quorum_lost for a in ADDRS[:2])
    lines = [r for r in caplog.records if "voters" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING, logging.WARNING], [r.getMessage() for r in lines]
    assert all("have left" in r.getMessage() for r in lines)
