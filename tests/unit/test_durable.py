"""Durable voters: the Raft hard state, its place in ``Ready``, the on-disk store, the driver.

Raft's stable storage is right when a restarted voter never votes twice in a term and never
forgets an entry it acknowledged; the hard state must be written before the messages of the
step that changed it leave. Each property is checked on the real code: ``Raft`` restored from
``hard_state()``, ``Node``'s ``Ready``, ``VoterStore`` on a real directory, ``NodeServer`` on
loopback.
"""
from __future__ import annotations

import asyncio
import random
from pathlib import Path

import msgpack
import pytest

from p2pft.core.config import DEFAULT
from p2pft.core.durable import HardState
from p2pft.core.messages import Append, AppendResp, Vote, VoteResp
from p2pft.core.meta import MemberMeta, NodeSpec
from p2pft.core.node import Node
from p2pft.core.raft import Raft
from p2pft.core.view import Member, Role, View
from p2pft.net.driver import NodeServer
from p2pft.net.store import STATE_FILE, DataDirError, VoterStore


def _view(epoch: int, voters: tuple[str, ...], tag: str = "m") -> View:
    member = Member(node=tag, replica_id=tag, addr="a:1", data_addrs=(), role=Role.WITNESS, slot=None)
    return View(epoch=epoch, members=(member,), voters=voters)


VOTERS = ("a", "b", "c")


def _follower(me: str = "b") -> Raft:
    """A voter of a 3-voter cluster holding epoch 1 (committed) from leader a, term 2."""
    r = Raft(me, DEFAULT, random.Random(1), 0.0)
    r.handle("a", Append(term=2, prev=0, prev_term=0, entries=[(2, _view(1, VOTERS))], commit=1), 0.0)
    r.outbox.clear()
    r.committed.clear()
    return r


def test_a_restarted_voter_never_votes_twice_in_a_term() -> None:
    r = _follower()
    r.handle("c", Vote(term=3, last_index=1, last_term=2), 10.0)   # leader silent: not sticky
    assert r.outbox[-1][1] == VoteResp(term=3, ok=True) and r.voted_for == "c"
    hs = r.hard_state("rb")
    back = Raft("b", DEFAULT, random.Random(2), 20.0, restore=hs)
    assert (back.term, back.voted_for, back.last_index, back.commit) == (3, "c", 1, 1)
    back.handle("a", Vote(term=3, last_index=1, last_term=2), 30.0)
    assert back.outbox[-1][1] == VoteResp(term=3, ok=False), "voted twice in term 3"
    back.handle("a", Vote(term=4, last_index=1, last_term=2), 31.0)
    assert back.outbox[-1][1] == VoteResp(term=4, ok=True)


def test_a_restarted_voter_keeps_what_it_acknowledged() -> None:
    r = _follower()
    # Epoch 2 acknowledged but not yet known committed; epoch 1 committed.
    r.handle("a", Append(term=2, prev=1, prev_term=2, entries=[(2, _view(2, VOTERS, "x"))], commit=1), 1.0)
    assert r.outbox[-1][1] == AppendResp(term=2, ok=True, match=2)
    hs = r.hard_state("rb")
    got = (hs.snap_index, hs.snap_view.epoch if hs.snap_view else None, [v.epoch for _, v in hs.entries])
    assert got == (1, 1, [2])
    back = Raft("b", DEFAULT, random.Random(2), 2.0, restore=hs)
    assert back.last_index == 2 and back.term_at(2) == 2 and back.entry(2) == _view(2, VOTERS, "x")
    assert back.commit == back.applied == 1 and not back.committed   # committed views are not handed out again
    # A candidate whose log lacks epoch 2 cannot win its vote (it could overwrite the entry).
    back.handle("c", Vote(term=3, last_index=1, last_term=2), 10.0)
    assert back.outbox[-1][1] == VoteResp(term=3, ok=False)


def test_hard_key_changes_with_every_durable_change_and_only_then() -> None:
    r = _follower()
    k0 = r.hard_key()
    r.handle("a", Append(term=2, prev=1, prev_term=2, entries=[], commit=1), 1.0)   # a heartbeat
    assert r.hard_key() == k0
    r.handle("a", Append(term=2, prev=1, prev_term=2, entries=[(2, _view(2, VOTERS))], commit=1), 2.0)
    k1 = r.hard_key()
    assert k1 != k0
    r.handle("a", Append(term=2, prev=2, prev_term=2, entries=[], commit=2), 3.0)   # commit moves
    assert r.hard_key() != k1


def test_restore_refuses_another_voters_state() -> None:
    hs = _follower().hard_state("rb")
    with pytest.raises(ValueError, match="voter b"):
        Raft("c", DEFAULT, random.Random(0), 0.0, restore=hs)


def test_hard_state_round_trips_and_rejects_garbage() -> None:
    r = _follower()
    r.handle("a", Append(term=2, prev=1, prev_term=2, entries=[(2, _view(2, VOTERS, "y"))], commit=1), 1.0)
    hs = r.hard_state("rb")
    wire = msgpack.unpackb(msgpack.packb(hs.to_wire(), use_bin_type=True), raw=False)
    assert HardState.from_wire(wire) == hs
    for bad in ({}, {"format": 99}, {**wire, "term": "x"}, {**wire, "entries": [[2, _view(7, VOTERS).to_wire()]]}, [1]):
        with pytest.raises(ValueError, match="not a voter state"):
            HardState.from_wire(bad)   # type: ignore[arg-type]


def test_voter_id_on_the_wire_only_when_it_differs() -> None:
    m = Member(node="r0.2", replica_id="r0", addr="a:1", data_addrs=(), role=Role.JOINER, slot=None)
    assert "vo" not in m.to_wire() and "vo" not in MemberMeta(replica_id="r0").to_wire()
    mv = Member(node="r0.2", replica_id="r0", addr="a:1", data_addrs=(), role=Role.JOINER, slot=None, voter="r0.1")
    assert Member.from_wire(mv.to_wire()) == mv and mv.voter_id == "r0.1" and m.voter_id == "r0.2"
    assert MemberMeta.from_wire(MemberMeta(replica_id="r0", voter="r0.1").to_wire()).voter == "r0.1"
    view = View(epoch=3, members=(mv,), voters=("r0.1",))
    assert view.member_of_voter("r0.1") is mv and view.member_of_voter("r0.2") is None


def _node(durable: bool = True, restore: HardState | None = None, seed: int = 0) -> Node:
    return Node(NodeSpec(replica_id="w0"), addr="10.0.0.1:1", profile=DEFAULT, rng=random.Random(seed), now=0.0,
                durable=durable, restore=restore)


def test_node_hands_out_the_hard_state_with_the_messages_it_must_precede() -> None:
    n = _node()
    first = n.ready()
    assert first.hard_state is not None and first.hard_state.voter == n.id     # bootstrapped: term 1, on disk
    assert first.hard_state.term == 1 and first.hard_state.snap_index == 1
    assert n.ready().hard_state is None                                          # nothing changed since
    plain = _node(durable=False, seed=1)
    assert plain.ready().hard_state is None                                      # no data directory: as before
    # A restarted node: the same voter id, a new node id, its committed view known but not handed out.
    back = _node(restore=first.hard_state, seed=2)
    assert back.voter_id == n.id != back.id and back.gossip.meta.voter == n.id
    assert back.view is not None and back.view.epoch == 1 and back.my_role() is None
    r = back.ready()
    assert not r.views
    # A vote it grants is in the same Ready as the hard state holding it (written first).
    back.raft.handle("x", Vote(term=5, last_index=1, last_term=1), 100.0)
    back._pump(100.0)
    r = back.ready()
    assert r.hard_state is not None and (r.hard_state.term, r.hard_state.vote) == (5, "x")


def test_node_refuses_another_replicas_data_dir() -> None:
    hs = _node().ready().hard_state
    with pytest.raises(ValueError, match="replica 'w0'"):
        Node(NodeSpec(replica_id="w1"), addr="10.0.0.2:1", profile=DEFAULT, rng=random.Random(3), now=0.0, restore=hs)


def test_store_is_atomic_locked_and_checked(tmp_path: Path) -> None:
    hs = _node().ready().hard_state
    assert hs is not None
    store = VoterStore(tmp_path / "d")
    assert store.load() is None
    store.save(hs)
    store.save(hs)
    assert store.load() == hs and sorted(p.name for p in (tmp_path / "d").iterdir()) == ["lock", STATE_FILE]
    with pytest.raises(DataDirError, match="in use by another process"):
        VoterStore(tmp_path / "d")
    store.close()
    (tmp_path / "d" / STATE_FILE).write_bytes(b"\x93garbage")
    again = VoterStore(tmp_path / "d")
    with pytest.raises(DataDirError, match="not a voter state"):
        again.load()
    again.close()


def test_node_server_restores_its_voter_from_the_data_dir(tmp_path: Path, ctl: object) -> None:
    port = ctl.free_ports(1)[0]   # type: ignore[attr-defined]

    async def life(expect_voter: str | None) -> tuple[str, str, int]:
        server = NodeServer(listen=f"127.0.0.1:{port}", spec=NodeSpec(replica_id="w0"), data_dir=str(tmp_path))
        await server.start()
        try:
            node = server.node
            assert node is not None
            if expect_voter is not None:
                assert node.voter_id == expect_voter != node.id
            # A second process (here: server) on the same directory is refused.
            other = NodeServer(listen=f"127.0.0.1:{ctl.free_ports(1)[0]}", spec=NodeSpec(replica_id="w0"),  # type: ignore[attr-defined]
                               data_dir=str(tmp_path))
            with pytest.raises(DataDirError):
                await other.start()
            return node.id, node.voter_id, node.raft.term
        finally:
            await server.stop(leave=False)

    first_id, first_voter, _ = asyncio.run(life(None))
    assert first_voter == first_id
    on_disk = VoterStore(tmp_path)
    hs = on_disk.load()
    on_disk.close()
    assert hs is not None and hs.voter == first_id and hs.term == 1 and hs.snap_index == 1
    second_id, second_voter, term = asyncio.run(life(first_id))
    assert second_voter == first_id and second_id != first_id and term == 1


def test_replica_scripts_honour_data_dir_through_the_environment(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every example script parses the shared replica options; --data-dir reaches a Runtime
    built without data_dir= (gpt.py, an HSDP replica's rank 0) through $P2PFT_DATA_DIR."""
    import argparse

    from p2pft.deploy.replica_args import add_replica_args, require_replica_id
    from p2pft.runtime import Runtime
    monkeypatch.setenv("P2PFT_DATA_DIR", "")   # undone at teardown, with what the parser sets
    p = argparse.ArgumentParser()
    add_replica_args(p, replicas=3, digest_every=10)
    args = p.parse_args(["--replica-id", "r0", "--data-dir", str(tmp_path / "d")])
    require_replica_id(p, args)
    assert args.data_dir == str(tmp_path / "d")
    assert Runtime(replica_id="r0").data_dir == str(tmp_path / "d")
    assert Runtime(replica_id="r0", data_dir=str(tmp_path / "e")).data_dir == str(tmp_path / "e")
    monkeypatch.delenv("P2PFT_DATA_DIR")
    assert Runtime(replica_id="r0").data_dir is None
