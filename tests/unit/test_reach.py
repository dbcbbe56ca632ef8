"""Who is left out for an unreachable data port (p2pft/core/reach.py) and how gossip carries it."""
from __future__ import annotations

import pytest

from p2pft.core.gossip.members import GossipMember
from p2pft.core.meta import Kind, MemberMeta
from p2pft.core.reach import data_unreachable


def _m(node: str, names: tuple[str, ...] = (), kind: Kind = Kind.TRAINER) -> GossipMember:
    return GossipMember(node, f"{node}:1", 0, "alive", MemberMeta(kind=kind, data_unreachable=names), 0.0)


def test_a_named_member_is_left_out_until_nobody_names_it() -> None:
    logged: set[str] = set()
    members = [_m("w0", kind=Kind.WITNESS), _m("a", ("c",)), _m("b"), _m("c")]
    assert data_unreachable("w0", members, logged) == {"c"} and logged == {"c"}
    assert data_unreachable("w0", [_m("a"), _m("b"), _m("c")], logged) == set() and not logged
    assert data_unreachable("w0", [_m("a", ("c",)), _m("c", ("a",))], set()) == {"a", "c"}  # two trainers, each
    assert data_unreachable("a", [_m("a"), _m("c", ("a",))], set()) == set()                 # never the leader
    assert data_unreachable("w0", [_m("a", ("gone",)), _m("b")], set()) == set()             # not a member now


def test_a_trainer_that_reaches_nobody_is_the_one_left_out() -> None:
    """Its outgoing connections are dropped: it names most peers, the others name nobody."""
    members = [_m("a"), _m("b"), _m("c"), _m("y", ("a", "b"))]
    assert data_unreachable("w0", members, set()) == {"y"}
    members = [_m("a"), _m("b"), _m("c"), _m("d"), _m("e"), _m("y", ("a",))]
    assert data_unreachable("w0", members, set()) == {"a"}          # one name: taken at its word


def test_meta_wire_round_trip() -> None:
    meta = MemberMeta(kind=Kind.TRAINER, data_unreachable=("r2.0a0b0c0d",))
    w = meta.to_wire()
    assert w["du"] == ["r2.0a0b0c0d"]
    assert MemberMeta.from_wire(dict(w)).data_unreachable == ("r2.0a0b0c0d",)
    assert "du" not in MemberMeta(kind=Kind.TRAINER).to_wire()
    with pytest.raises(TypeError):
        MemberMeta.from_wire({"du": [1, 2]})
