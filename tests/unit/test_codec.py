"""The control messages' wire form (p2pft/core/codec.py), member metadata (p2pft/core/meta.py), and the
node's one output value per step (Node.ready)."""
from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import msgpack
import pytest

from p2pft.core import codec
from p2pft.core.messages import (ALIVE, DEAD, LEFT, SUSPECT, Ack, Append, AppendResp, Nack, Ping, PreVote, PreVoteResp,
                                 ProbeRequest, PushPull, Row, Snapshot, Unknown, Update, Updates, ViewDelta, ViewFull,
                                 ViewRequest, Vote, VoteResp, Who)
from p2pft.core.meta import Kind, MemberMeta, NodeSpec, Status
from p2pft.core.node import Node
from p2pft.core.view import Member, Role, View

META = MemberMeta(replica_id="r1", data_addrs=("10.0.0.1:8000", "10.0.0.1:8001"), kind=Kind.TRAINER, shards=2,
                  status=Status.READY, start=1234.5, step=7, loop_timeout=30.0, data_epoch_request=4)
M1 = Member(node="r1.0a", replica_id="r1", addr="10.0.0.1:7000", data_addrs=("10.0.0.1:8000",),
            role=Role.PARTICIPANT, slot=0, shards=1, since=2)
M2 = Member(node="w.0b", replica_id="w", addr="10.0.0.2:7000", data_addrs=(), role=Role.WITNESS, slot=None, since=1)
VIEW = View(epoch=5, members=(M1, M2), voters=("w.0b",), data_epoch=3, high_water=9, left=("old.0c",))
HDR: dict[str, Any] = {"frm": "10.0.0.1:7000", "src": "r1.0a"}
UPDATES = [Update(ALIVE, "r1.0a", 3, "10.0.0.1:7000", META), Update(SUSPECT, "x.1", 2, accuser="r1.0a"),
           Update(DEAD, "y.2", 1, accuser="z.3"), Update(LEFT, "q.4", 6)]

MESSAGES = [
    Ping(**HDR, updates=UPDATES, epoch=5, step=7, seq=11, to="w.0b"),
    Ack(**HDR, seq=11, epoch=5, step=7),
    Nack(**HDR, seq=12),
    ProbeRequest(**HDR, seq=13, target="w.0b", target_addr="10.0.0.2:7000"),
    PushPull(**HDR, join=True, reply=False, rows=[Row("r1.0a", "10.0.0.1:7000", 3, ALIVE, META),
                                                  Row("w.0b", "10.0.0.2:7000", 0, DEAD, MemberMeta())]),
    Updates(**HDR, beat=42, step=8),
    Who(**HDR),
    PreVote(**HDR, to="w.0b", term=4, last_index=5, last_term=3),
    Vote(**HDR, to="w.0b", term=4, last_index=5, last_term=3),
    PreVoteResp(**HDR, to="w.0b", term=4, ok=True),
    VoteResp(**HDR, to="w.0b", term=4, ok=False),
    Append(**HDR, to="w.0b", term=4, prev=4, prev_term=3, entries=[(4, VIEW)], commit=4),
    Append(**HDR, to="w.0b", term=4, prev=5, prev_term=4, entries=[], commit=5),
    AppendResp(**HDR, to="w.0b", term=4, ok=True, match=5),
    AppendResp(**HDR, to="w.0b", term=4, ok=False, hint=2),
    Snapshot(**HDR, to="w.0b", term=4, index=5, snap_term=4, view=VIEW),
    ViewRequest(**HDR, epoch=3),
    ViewFull(**HDR, view=VIEW, term=4, leader="w.0b", leader_addr="10.0.0.2:7000"),
    ViewDelta(**HDR, base=4, epoch=5, term=4, voters=("w.0b",), data_epoch=3, high_water=9, left=("old.0c",),
              changed=[M1], removed=["gone.0d"], leader="w.0b", leader_addr="10.0.0.2:7000"),
]


def round_trip(msg: Any) -> Any:
    return codec.from_wire(msgpack.unpackb(msgpack.packb(codec.to_wire(msg), use_bin_type=True), raw=False))


@pytest.mark.parametrize("msg", MESSAGES, ids=[f"{m.TYPE}-{i}" for i, m in enumerate(MESSAGES)])
def test_every_message_survives_the_wire(msg: Any) -> None:
    back = round_trip(msg)
    assert type(back) is type(msg)
    assert back == msg


def test_wire_form_keeps_the_short_keys() -> None:
    """The frame bodies are what peers of this protocol version exchange: pin a few exactly."""
    assert codec.to_wire(MESSAGES[1]) == {"t": "g.ack", "from": "10.0.0.1:7000", "src": "r1.0a", "seq": 11, "e": 5,
                                          "st": 7}
    assert codec.to_wire(MESSAGES[13]) == {"t": "r.aer", "from": "10.0.0.1:7000", "src": "r1.0a", "to": "w.0b",
                                           "term": 4, "ok": True, "match": 5}
    assert codec.to_wire(ViewRequest(**HDR, epoch=3)) == {"t": "v.get", "from": "10.0.0.1:7000", "src": "r1.0a",
                                                          "e": 3}
    body = codec.to_wire(MESSAGES[0])
    assert [u["k"] for u in body["pb"]] == [ALIVE, SUSPECT, DEAD, LEFT]
    assert body["pb"][0] == {"k": ALIVE, "n": "r1.0a", "i": 3, "a": "10.0.0.1:7000", "m": META.to_wire()}
    assert body["pb"][3] == {"k": LEFT, "n": "q.4", "i": 6}
    ent = codec.to_wire(MESSAGES[11])["ents"][0]
    assert ent[0] == 4 and ent[1]["epoch"] == 5 and ent[1]["term"] == 4 and ent[1]["hw"] == 9
    assert ent[1]["members"][0]["data_addr"] == "10.0.0.1:8000"


def test_member_meta_short_keys_only_at_the_edge() -> None:
    assert META.to_wire() == {"r": "r1", "d": "10.0.0.1:8000,10.0.0.1:8001", "k": "trainer", "sh": 2, "s": "ready",
                              "t0": 1234.5, "st": 7, "lt": 30.0, "rb": 4}
    assert MemberMeta.from_wire(META.to_wire()) == META
    assert MemberMeta.from_wire({"r": "r1", "future": [1, 2]}) == MemberMeta(replica_id="r1")  # unknown keys ignored
    assert MemberMeta.from_wire(None) == MemberMeta()
    plain = MemberMeta(replica_id="p")
    assert "lt" not in plain.to_wire() and "rb" not in plain.to_wire() and "k" not in plain.to_wire()
    with pytest.raises(ValueError):
        MemberMeta.from_wire({"k": "coordinator"})
    with pytest.raises(ValueError):
        MemberMeta.from_wire({"s": "sleeping"})
    with pytest.raises(TypeError):
        MemberMeta.from_wire([1, 2])                                 # type: ignore[arg-type]


@pytest.mark.parametrize("body", [
    {"t": "g.ping", "from": "a", "src": "b", "seq": 1},                       # no target
    {"t": "g.ping", "from": 5, "src": "b", "seq": 1, "to": "c"},              # address not a string
    {"t": "g.ack", "from": "a", "src": "b", "seq": "x"},
    {"t": "g.upd", "from": "a", "src": "b", "pb": "nonsense"},
    {"t": "g.pp", "from": "a", "src": "b", "state": 5},
    {"t": "r.ae", "from": "a", "src": "b", "term": 1, "prev": 0, "pterm": 0, "ents": [[1, {"epoch": 1}]], "commit": 0},
    {"t": "r.aer", "from": "a", "src": "b", "term": "one", "ok": True},
    {"t": "r.snap", "from": "a", "src": "b", "term": 1, "index": 1, "sterm": 1, "view": 5},
    {"t": "v.view", "from": "a", "src": "b", "view": {"epoch": 2, "members": "all"}},
    {"t": "v.delta", "from": "a", "src": "b", "hdr": [], "base": "x"},
    {"t": "v.delta", "from": "a", "src": "b", "hdr": {"epoch": 3}, "base": 2, "set": [{"node": "n"}], "del": []},
    {"t": "v.get", "from": "a", "src": "b", "e": float("inf")},
])
def test_malformed_content_raises_the_kinds_the_driver_drops(body: dict[str, Any]) -> None:
    with pytest.raises((KeyError, TypeError, ValueError, OverflowError)):
        codec.from_wire(body)


def test_a_malformed_update_or_row_is_dropped_alone() -> None:
    good = codec.to_wire(MESSAGES[0])["pb"]
    msg = codec.from_wire({"t": "g.upd", "from": "a", "src": "b",
                           "pb": [None, "str", {"k": "alive"}, {"k": "dead", "n": "x", "i": "nan"}, good[0],
                                  {"k": "alive", "n": "y", "i": 1, "a": "h:1", "m": 5},
                                  {"k": "weird", "n": "z", "i": 1}, good[3]]})
    assert [(u.state, u.node) for u in msg.updates] == [(ALIVE, "r1.0a"), (LEFT, "q.4")]
    pp = codec.from_wire({"t": "g.pp", "from": "a", "src": "b", "join": True,
                          "state": [["n.1", "h:1", 0, ALIVE, {}], ["short"], [5, "h:2", 0, ALIVE, {}],
                                    ["n.2", "h:2", "x", ALIVE, {}], ["n.3", "h:3", 1, DEAD, None]]})
    assert [r.node for r in pp.rows] == ["n.1", "n.3"]


def test_unknown_type_is_its_own_message() -> None:
    msg = codec.from_wire({"t": "x.future", "from": "a", "src": "b", "anything": 1})
    assert isinstance(msg, Unknown) and msg.type == "x.future"


# ---------------------------------------------------------------------- the node's outputs
def _node(seeds: tuple[str, ...] = ()) -> Node:
    return Node(NodeSpec(replica_id="r1", data_addrs=("10.0.0.1:8000",), kind=Kind.TRAINER, status=Status.READY),
                addr="10.0.0.1:7000", seeds=seeds, rng=random.Random(1), now=0.0)


def test_ready_hands_each_output_once() -> None:
    node = _node()                                    # no seeds: bootstraps a cluster of one
    first = node.ready()
    assert first.leader_terms == [1]
    assert [v.epoch for v in first.views] == [1] and isinstance(first.views[0], View)
    assert first.views[0].role_of(node.id) is Role.PARTICIPANT
    assert node.view is first.views[0]
    again = node.ready()
    assert not again and again.messages == [] and again.views == [] and again.leader_terms == []
    node.tick(10.0)
    assert all(isinstance(addr, str) and hasattr(msg, "TYPE") for addr, msg in node.ready().messages)


def test_touch_knocks_on_the_control_port_of_a_known_member() -> None:
    node = _node(seeds=("10.0.0.9:7000",))
    node.ready()
    peer = Update(ALIVE, "p.1", 0, "10.0.0.2:7000", MemberMeta(replica_id="p", kind=Kind.WITNESS))
    node.handle(Updates(frm="10.0.0.2:7000", src="p.1", updates=[peer]), 0.1)
    node.ready()
    node.touch("p.1", 0.2)
    sent = node.ready().messages
    assert [(addr, type(m), m.epoch) for addr, m in sent] == [("10.0.0.2:7000", ViewRequest, 1 << 62)]
    node.touch("nobody.0", 0.3)                       # unknown: nothing to knock on
    assert not node.ready().messages


def test_request_data_epoch_and_status_go_into_gossip_metadata() -> None:
    node = _node(seeds=("10.0.0.9:7000",))
    inc = node.gossip.inc
    node.request_data_epoch(6, 1.0)
    assert node.gossip.meta.data_epoch_request == 6 and node.gossip.inc == inc + 1
    node.set_status("joining", 1.1, step=12)
    assert node.gossip.meta.status is Status.JOINING and node.gossip.meta.step == 12 and node.step == 12
    node.loop_beat(1.2, 5.0)
    assert node.gossip.meta.loop_timeout == 5.0


def test_node_spec_is_checked_once_and_is_the_first_metadata() -> None:
    """The options a node starts with (``NodeSpec``): normalized, checked with the option's
    name, and a witness's defaults; they become the node's first ``MemberMeta``."""
    spec = NodeSpec(replica_id="r1", kind="trainer", data_addrs="10.0.0.1:8000,10.0.0.1:8001", shards=2)
    assert spec.kind is Kind.TRAINER and spec.data_addrs == ("10.0.0.1:8000", "10.0.0.1:8001")
    meta = spec.meta(start=5.0)
    assert (meta.status, meta.start, meta.step, meta.shards) == (Status.JOINING, 5.0, 0, 2)
    assert NodeSpec().meta(start=0.0).status is Status.READY     # a witness
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_participants"):
            NodeSpec(max_participants=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        NodeSpec(kind="boss")  # type: ignore[arg-type]
    node = Node(replace(spec, replica_id=""), addr="10.0.0.1:7000", rng=random.Random(1), now=0.0)
    assert node.replica_id == "10.0.0.1:7000", "an empty replica id is the node's address"
