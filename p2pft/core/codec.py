"""Control messages to and from their wire form: short-key dicts that msgpack carries.

``to_wire(msg)`` gives the frame body (its ``t`` is the message type); ``from_wire(body)`` gives
the message back. Called only at the edges: the driver (before ``wire.encode``, after the frame
decoder) and the simulator (around its msgpack round trip).

Malformed content raises ``KeyError``/``TypeError``/``ValueError`` (the driver counts the message
as ``bad_message`` and closes that connection; the simulator counts it). As before this layer
existed, one malformed piggybacked update or push-pull row is dropped on its own and the rest of
its message is kept; an unknown message type decodes to ``Unknown`` (counted, ignored).
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable, TypeVar

from .messages import (ALIVE, DEAD, LEFT, SUSPECT, Ack, MemberState, Append, AppendResp, Envelope, GossipMessage,
                       Message, Nack, Ping, PreVote, PreVoteResp, ProbeRequest, PushPull, RaftMessage, Row, Snapshot,
                       Unknown, Update, Updates, ViewDelta, ViewFull, ViewRequest, Vote, VoteResp, Who)
from .meta import MemberMeta
from .view import Member, View, job_from_wire, job_to_wire

_VIEW_CACHE_MAX = 16
_view_cache: dict[int, tuple[View, dict[str, Any]]] = {}


def view_to_wire(view: View, term: int) -> dict[str, Any]:
    """A view's wire dict with its Raft term. The same view goes to every voter and to every
    member that asks, so the O(members) part is built once per view object."""
    hit = _view_cache.get(id(view))
    if hit is None or hit[0] is not view:
        if len(_view_cache) >= _VIEW_CACHE_MAX:
            _view_cache.clear()
        hit = (view, view.to_wire())
        _view_cache[id(view)] = hit
    return {**hit[1], "term": term}


_MEMBERS_MAX = 16384
_members: dict[tuple[Any, ...], Member] = {}


def member_from_wire(d: dict[str, Any]) -> Member:
    """``Member.from_wire``, memoized: consecutive views repeat almost every member, and a
    view goes to every voter (Raft) and every member (deltas) again and again."""
    if not isinstance(d, dict):
        raise TypeError("a member is not a map")
    try:
        key: tuple[Any, ...] | None = tuple(d.items())
        hit = _members.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable value: decode (and fail) without the memo
        key, hit = None, None
    if hit is not None:
        return hit
    m = Member.from_wire(d)
    if key is not None:
        if len(_members) >= _MEMBERS_MAX:
            _members.clear()
        _members[key] = m
    return m


_VIEWS_MAX = 64
_views: dict[tuple[Any, ...], View] = {}
_VIEW_FIELDS = tuple(f.name for f in fields(View) if f.init and f.name != "members")


def view_from_wire(d: dict[str, Any]) -> tuple[View, int]:
    """(view, its Raft term). ``View.from_wire`` reads the header; the members go through the
    memo above. Memoized by content too: a leader sends the same view to every voter and to
    every member that asks, and resends it until it is acknowledged."""
    if not isinstance(d, dict):
        raise TypeError("a view is not a map")
    members = d["members"]
    if not isinstance(members, (list, tuple)):
        raise TypeError("'members' is not a list")
    term = int(d.get("term", 0))
    try:
        key: tuple[Any, ...] | None = (
            tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k != "members"),
            tuple(tuple(m.items()) for m in members))
        hit = _views.get(key)  # type: ignore[arg-type]
    except (TypeError, AttributeError):  # unhashable or not maps: decode (and fail) without the memo
        key, hit = None, None
    if hit is not None:
        return hit, term
    head = View.from_wire({**d, "members": ()})
    view = View(members=tuple(member_from_wire(m) for m in members), **{n: getattr(head, n) for n in _VIEW_FIELDS})
    if key is not None:
        if len(_views) >= _VIEWS_MAX:
            _views.clear()
        _views[key] = view
    return view, term


# ---------------------------------------------------------------------- updates and rows
def update_to_wire(u: Update) -> dict[str, Any]:
    """Built once per update: it rides on several messages (its retransmit count)."""
    w = u.wire
    if w is None:
        if u.state == ALIVE:
            w = {"k": ALIVE, "n": u.node, "i": u.inc, "a": u.addr,
                 "m": u.meta.to_wire() if u.meta is not None else {}}
        elif u.state == LEFT:
            w = {"k": LEFT, "n": u.node, "i": u.inc}
        else:
            w = {"k": u.state, "n": u.node, "i": u.inc, "f": u.accuser}
        u.wire = w
    return w


def update_from_wire(d: Any) -> Update | None:
    """One update, or None when it is malformed or of an unknown kind (dropped on its own)."""
    try:
        kind = d["k"]
        node = d["n"]
        if not isinstance(node, str):
            return None
        inc = int(d["i"])
        if kind == ALIVE:
            u = Update(ALIVE, node, inc, str(d["a"]), MemberMeta.from_wire(d.get("m") or None))
        elif kind in (SUSPECT, DEAD):
            u = Update(MemberState(kind), node, inc, accuser=str(d.get("f", "")))
        elif kind == LEFT:
            u = Update(LEFT, node, inc)
        else:
            return None
    except (KeyError, TypeError, ValueError, OverflowError, IndexError):
        return None
    u.wire = d   # relayed as received (gossip passes most updates on)
    return u


def _row_from_wire(r: Any) -> Row | None:
    try:
        node, addr, inc, state, meta = r
        if not isinstance(node, str) or not isinstance(state, str):
            return None
        return Row(node, str(addr), int(inc), MemberState(state), MemberMeta.from_wire(meta or None))
    except (KeyError, TypeError, ValueError, OverflowError, IndexError):
        return None


# ---------------------------------------------------------------------- encoding
def _envelope(m: Envelope) -> dict[str, Any]:
    return {"t": m.TYPE, "from": m.frm, "src": m.src}


def _gossip(m: GossipMessage) -> dict[str, Any]:
    d = _envelope(m)
    if m.updates:
        d["pb"] = [update_to_wire(u) for u in m.updates]
    if m.epoch is not None:
        d["e"] = m.epoch
    if m.step is not None:
        d["st"] = m.step
    if m.beat is not None:
        d["lb"] = m.beat
    return d


def _raft(m: RaftMessage) -> dict[str, Any]:
    d = _envelope(m)
    if m.to:
        d["to"] = m.to
    d["term"] = m.term
    return d


def _enc_ping(m: Ping) -> dict[str, Any]:
    d = _gossip(m)
    d["seq"], d["to"] = m.seq, m.to
    return d


def _enc_seq(m: Ack | Nack) -> dict[str, Any]:
    d = _gossip(m)
    d["seq"] = m.seq
    return d


def _enc_preq(m: ProbeRequest) -> dict[str, Any]:
    d = _gossip(m)
    d["seq"], d["tn"], d["ta"] = m.seq, m.target, m.target_addr
    return d


def _enc_pp(m: PushPull) -> dict[str, Any]:
    d = _gossip(m)
    d["join"], d["reply"] = m.join, m.reply
    d["state"] = [[r.node, r.addr, r.inc, r.state, r.meta.to_wire()] for r in m.rows]
    return d


def _enc_vote(m: PreVote | Vote) -> dict[str, Any]:
    d = _raft(m)
    d["lli"], d["llt"] = m.last_index, m.last_term
    return d


def _enc_vote_resp(m: PreVoteResp | VoteResp) -> dict[str, Any]:
    d = _raft(m)
    d["ok"] = m.ok
    return d


def _enc_append(m: Append) -> dict[str, Any]:
    # the most frequent message (heartbeats): one dict literal, no helper calls
    return {"t": "r.ae", "from": m.frm, "src": m.src, "to": m.to, "term": m.term, "prev": m.prev,
            "pterm": m.prev_term, "ents": [[t, view_to_wire(v, t)] for t, v in m.entries] if m.entries else [],
            "commit": m.commit}


def _enc_append_resp(m: AppendResp) -> dict[str, Any]:
    if m.ok:
        return {"t": "r.aer", "from": m.frm, "src": m.src, "to": m.to, "term": m.term, "ok": True, "match": m.match}
    return {"t": "r.aer", "from": m.frm, "src": m.src, "to": m.to, "term": m.term, "ok": False, "hint": m.hint}


def _enc_snap(m: Snapshot) -> dict[str, Any]:
    d = _raft(m)
    d["index"], d["sterm"], d["view"] = m.index, m.snap_term, view_to_wire(m.view, m.snap_term)
    return d


def _enc_view_get(m: ViewRequest) -> dict[str, Any]:
    d = _envelope(m)
    d["e"] = m.epoch
    return d


def _enc_view(m: ViewFull) -> dict[str, Any]:
    d = _envelope(m)
    d["view"], d["leader"], d["laddr"] = view_to_wire(m.view, m.term), m.leader, m.leader_addr
    return d


def _enc_delta(m: ViewDelta) -> dict[str, Any]:
    d = _envelope(m)
    d["base"] = m.base
    d["hdr"] = {"epoch": m.epoch, "voters": list(m.voters), "data_epoch": m.data_epoch, "hw": m.high_water,
                "left": list(m.left), "term": m.term, **job_to_wire(m.target, m.finished)}
    d["set"] = [x.to_wire() for x in m.changed]
    d["del"] = list(m.removed)
    d["leader"], d["laddr"] = m.leader, m.leader_addr
    return d


def _enc_unknown(m: Unknown) -> dict[str, Any]:
    return {"t": m.type, "from": m.frm, "src": m.src}


_ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    Ping: _enc_ping, Ack: _enc_seq, Nack: _enc_seq, ProbeRequest: _enc_preq, PushPull: _enc_pp,
    Updates: _gossip, Who: _gossip, PreVote: _enc_vote, Vote: _enc_vote, PreVoteResp: _enc_vote_resp,
    VoteResp: _enc_vote_resp, Append: _enc_append, AppendResp: _enc_append_resp, Snapshot: _enc_snap,
    ViewRequest: _enc_view_get, ViewFull: _enc_view, ViewDelta: _enc_delta, Unknown: _enc_unknown,
}


def to_wire(msg: Message) -> dict[str, Any]:
    """The frame body of a message (``t`` names its type)."""
    return _ENCODERS[type(msg)](msg)


# ---------------------------------------------------------------------- decoding
def _str(d: dict[str, Any], key: str) -> str:
    v = d[key]
    if not isinstance(v, str):
        raise TypeError(f"{key!r} is a {type(v).__name__}, not a string")
    return v


def _updates(d: dict[str, Any]) -> list[Update]:
    pb = d.get("pb")
    if not pb:
        return []
    if not isinstance(pb, (list, tuple)):
        raise TypeError("'pb' is not a list")
    return [u for u in map(update_from_wire, pb) if u is not None]


_G = TypeVar("_G", bound=GossipMessage)
_Seq = TypeVar("_Seq", Ack, Nack)


def _dec_gossip(cls: type[_G], d: dict[str, Any]) -> _G:
    """The header every gossip message has; the caller sets its own fields."""
    g = d.get
    e, st, lb = g("e"), g("st"), g("lb")
    msg = cls.__new__(cls)
    msg.frm, msg.src, msg.updates = _str(d, "from"), _str(d, "src"), _updates(d)
    msg.epoch = None if e is None else int(e)
    msg.step = None if st is None else int(st)
    msg.beat = None if lb is None else int(lb)
    return msg


def _dec_ping(d: dict[str, Any]) -> Ping:
    m = _dec_gossip(Ping, d)
    m.seq, m.to = int(d["seq"]), _str(d, "to")
    return m


def _dec_seq(cls: type[_Seq]) -> Callable[[dict[str, Any]], _Seq]:
    def dec(d: dict[str, Any]) -> _Seq:
        m = _dec_gossip(cls, d)
        m.seq = int(d["seq"])
        return m
    return dec


def _dec_preq(d: dict[str, Any]) -> ProbeRequest:
    m = _dec_gossip(ProbeRequest, d)
    m.seq, m.target, m.target_addr = int(d["seq"]), _str(d, "tn"), _str(d, "ta")
    return m


def _dec_plain(cls: type[_G]) -> Callable[[dict[str, Any]], _G]:
    return lambda d: _dec_gossip(cls, d)


def _to(d: dict[str, Any]) -> str:
    to = d.get("to", "")
    return to if isinstance(to, str) else ""


def _dec_pp(d: dict[str, Any]) -> PushPull:
    state = d.get("state", ())
    if not isinstance(state, (list, tuple)):
        raise TypeError("'state' is not a list")
    m = _dec_gossip(PushPull, d)
    m.join, m.reply = bool(d.get("join")), bool(d.get("reply"))
    m.rows = [r for r in map(_row_from_wire, state) if r is not None]
    return m


def _dec_append(d: dict[str, Any]) -> Append:
    frm, src, to, ents = d["from"], d["src"], d.get("to", ""), d["ents"]
    if not (isinstance(frm, str) and isinstance(src, str)):
        raise TypeError("'from'/'src' are not strings")
    return Append(frm=frm, src=src, to=to if isinstance(to, str) else "", term=int(d["term"]), prev=int(d["prev"]),
                  prev_term=int(d["pterm"]), entries=[(int(t), view_from_wire(e)[0]) for t, e in ents] if ents else [],
                  commit=int(d["commit"]))


def _dec_append_resp(d: dict[str, Any]) -> AppendResp:
    g = d.get
    frm, src, to = d["from"], d["src"], g("to", "")
    if not (isinstance(frm, str) and isinstance(src, str)):
        raise TypeError("'from'/'src' are not strings")
    return AppendResp(frm=frm, src=src, to=to if isinstance(to, str) else "", term=int(d["term"]), ok=bool(g("ok")),
                      match=int(g("match", 0)), hint=int(g("hint", 0)))


def _dec_vote(cls: type, d: dict[str, Any]) -> Any:
    return cls(frm=_str(d, "from"), src=_str(d, "src"), to=_to(d), term=int(d["term"]), last_index=int(d["lli"]),
               last_term=int(d["llt"]))


def _dec_vote_resp(cls: type, d: dict[str, Any]) -> Any:
    return cls(frm=_str(d, "from"), src=_str(d, "src"), to=_to(d), term=int(d["term"]), ok=bool(d.get("ok")))


def _dec_snap(d: dict[str, Any]) -> Snapshot:
    return Snapshot(frm=_str(d, "from"), src=_str(d, "src"), to=_to(d), term=int(d["term"]), index=int(d["index"]),
                    snap_term=int(d["sterm"]), view=view_from_wire(d["view"])[0])


def _dec_view_get(d: dict[str, Any]) -> ViewRequest:
    return ViewRequest(frm=_str(d, "from"), src=_str(d, "src"), epoch=int(d.get("e", 0)))


def _dec_view(d: dict[str, Any]) -> ViewFull:
    view, term = view_from_wire(d["view"])
    leader = d.get("leader")
    return ViewFull(frm=_str(d, "from"), src=_str(d, "src"), view=view, term=term,
                    leader=str(leader) if leader else None, leader_addr=str(d.get("laddr") or ""))


def _dec_delta(d: dict[str, Any]) -> ViewDelta:
    hdr = d["hdr"]
    if not isinstance(hdr, dict):
        raise TypeError("'hdr' is not a map")
    epoch = int(hdr["epoch"])
    leader = d.get("leader")
    return ViewDelta(frm=_str(d, "from"), src=_str(d, "src"), base=int(d["base"]), epoch=epoch,
                     term=int(hdr.get("term", 0)), voters=tuple(str(v) for v in hdr.get("voters", ())),
                     data_epoch=int(hdr.get("data_epoch", epoch)), high_water=int(hdr.get("hw", 0)),
                     left=tuple(str(n) for n in hdr.get("left", ())), **job_from_wire(hdr),
                     changed=[member_from_wire(m) for m in d["set"]], removed=[str(n) for n in d["del"]],
                     leader=str(leader) if leader else None, leader_addr=str(d.get("laddr") or ""))


_DECODERS: dict[str, Callable[[dict[str, Any]], Message]] = {
    "g.ping": _dec_ping,
    "g.ack": _dec_seq(Ack),
    "g.nack": _dec_seq(Nack),
    "g.preq": _dec_preq,
    "g.pp": _dec_pp,
    "g.upd": _dec_plain(Updates),
    "g.who": _dec_plain(Who),
    "r.pv": lambda d: _dec_vote(PreVote, d),
    "r.rv": lambda d: _dec_vote(Vote, d),
    "r.pvr": lambda d: _dec_vote_resp(PreVoteResp, d),
    "r.rvr": lambda d: _dec_vote_resp(VoteResp, d),
    "r.ae": _dec_append,
    "r.aer": _dec_append_resp,
    "r.snap": _dec_snap,
    "v.get": _dec_view_get,
    "v.view": _dec_view,
    "v.delta": _dec_delta,
}


def from_wire(body: dict[str, Any]) -> Message:
    """The message a frame body holds. Raises KeyError/TypeError/ValueError when malformed."""
    if not isinstance(body, dict):
        raise TypeError("a message body is not a map")
    t = body.get("t")
    dec = _DECODERS.get(t) if isinstance(t, str) else None
    if dec is None:
        return Unknown(type=str(t), frm=str(body.get("from", "")), src=str(body.get("src", "")))
    return dec(body)


__all__ = ["from_wire", "to_wire", "update_from_wire", "update_to_wire", "view_from_wire", "view_to_wire"]
