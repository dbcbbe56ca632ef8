"""Fuzz the decoders for longer than the test run does, then hit real servers with the same bytes.

Phase 1 (in process, seeded mutation fuzzing for ``--seconds``): valid frames are built, then
mutated (bit flips, byte overwrites, truncation, extension, splices of two frames, random
length prefixes, pure random bytes) and fed, split at random points, to

- the control-plane ``FrameDecoder`` with and without a cluster secret: the only exception
  allowed is ``WireError``; with a secret, a mutated frame must never decode at all;
- the data-plane handshake parsers (``parse_hello``, ``parse_ack``) and the error-frame scanner
  (``find_error_frame``): ``parse_hello`` returns a status and never raises, ``parse_ack`` raises
  only ``ProtocolMismatch``, ``find_error_frame`` never raises; a mutated authenticated hello or
  ack is never accepted;
- the message codec (``p2pft.core.codec.from_wire``), with real control messages whose bodies have one
  value replaced, dropped or added: it raises only what the driver counts as ``bad_message``,
  and a message it accepts is handed to a ``Node`` that keeps running (what the node itself
  raises is counted by kind).

Phase 2 (real sockets, ``--live`` connections): the same kinds of bytes are sent on fresh
connections to a ``p2pft peer`` process (control port) and to a transport ``DataServer`` (data
port), both with a secret; afterwards the peer still answers ``p2pft members`` and the data
server still streams a state snapshot to a client with the secret. The peer's RSS is read
before and after.

Any failure prints the seed and the input (hex) that reproduces it.

    python bench/fuzz.py --seconds 60 --live 2000 --json results/fuzz.json
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack

from p2pft.core import codec
from p2pft.core.messages import (Append, AppendResp, Ping, PushPull, Row, Snapshot, Update, Updates, ViewDelta,
                                 ViewFull, ViewRequest)
from p2pft.core.meta import Kind, MemberMeta, NodeSpec, Status
from p2pft.core.node import Node
from p2pft.core.view import Member, Role, View
from p2pft.deploy.ports import free_ports
from p2pft.deploy.procs import spawn as spawn_child
from p2pft.net.wire import FrameDecoder, WireError, encode
from p2pft.transport import DataServer, ProtocolMismatch
from p2pft.transport.errors import PeerFailed
from p2pft.transport.stream import StateSnapshot, fetch_state
from p2pft.transport.wire import (ACK_LEN, KIND_RING, ST_AUTH, ST_OK, find_error_frame, pack_ack,
                                  pack_error_frame, pack_hello, parse_ack, parse_hello)

SECRET = b"fuzz-secret-0123456789"


class Failure(Exception):
    pass


def mutate(rng: random.Random, data: bytes, other: bytes) -> bytes:
    """One random mutation of a valid input (never the identity)."""
    b = bytearray(data)
    op = rng.randrange(8)
    if op == 0 and b:                       # flip bits
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1 and b:                     # overwrite bytes
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 2 and len(b) > 1:            # truncate
        del b[rng.randrange(1, len(b)):]
    elif op == 3:                           # extend
        b += rng.randbytes(rng.randint(1, 64))
    elif op == 4:                           # splice with another frame
        cut = rng.randrange(len(b) + 1)
        b = b[:cut] + other[rng.randrange(len(other) + 1):]
    elif op == 5 and len(b) >= 4:           # random length prefix
        b[0:4] = rng.choice([0, 1, 5, 0xFFFFFFFF, rng.randrange(1 << 32)]).to_bytes(4, "big")
    elif op == 6:                           # pure random bytes
        b = bytearray(rng.randbytes(rng.randint(0, 256)))
    else:                                   # insert or delete a run
        i = rng.randrange(len(b) + 1)
        if rng.random() < 0.5:
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        else:
            del b[i:i + rng.randint(1, 16)]
    out = bytes(b)
    return out if out != data else out + b"\x00"


def valid_control(rng: random.Random, secret: bytes | None) -> bytes:
    body = {"k": rng.randrange(1 << 30), "x": rng.randbytes(rng.randint(0, 40)).hex(),
            "l": [rng.random() for _ in range(rng.randint(0, 5))]}
    return encode(rng.choice(["ping", "ack", "append", "vote", "admin.members"]), f"n{rng.randrange(100)}",
                  body, secret=secret)


def fuzz_control(rng: random.Random, secret: bytes | None, stats: dict[str, int]) -> None:
    good, other = valid_control(rng, secret), valid_control(rng, secret)
    data = mutate(rng, good, other)
    dec = FrameDecoder(secret=secret)
    cuts = sorted(rng.randrange(len(data) + 1) for _ in range(rng.randint(0, 3)))
    pieces = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
    got = []
    try:
        for p in pieces:
            got += dec.feed(p)
        dec.eof()
        stats["control_accepted"] += 1
    except WireError as e:
        stats[f"control_rejected_{e.kind}"] += 1
    except Exception as e:  # noqa: BLE001 - this is what the fuzzer looks for
        raise Failure(f"FrameDecoder raised {type(e).__name__}: {e}; input {data.hex()}") from None
    if secret is not None and got:
        # A mutation may reproduce a whole valid frame (a splice at 0 is the other frame), but
        # a signed stream must never yield a message that neither valid frame carried.
        refs = FrameDecoder(secret=secret).feed(good) + FrameDecoder(secret=secret).feed(other)
        if any(m not in refs for m in got):
            raise Failure(f"mutated signed frame decoded to {got!r}; input {data.hex()}")


def fuzz_data(rng: random.Random, stats: dict[str, int]) -> None:
    hello = pack_hello(SECRET, KIND_RING, rng.randrange(100), 0, 1, 0, 3)
    other = pack_hello(SECRET, KIND_RING, rng.randrange(100), 0, 2, 0, 3)
    bad = mutate(rng, hello, other)
    try:
        st, h = parse_hello(SECRET, bad)
    except Exception as e:  # noqa: BLE001
        raise Failure(f"parse_hello raised {type(e).__name__}: {e}; input {bad.hex()}") from None
    if st == ST_OK and bad not in (hello, other):  # a splice at 0 reproduces `other` exactly
        raise Failure(f"a mutated hello authenticated; input {bad.hex()}")
    stats["hello_ok" if st == ST_OK else "hello_rejected"] += 1
    ack = pack_ack(SECRET, hello, ST_OK)
    bad_ack = mutate(rng, ack, pack_ack(SECRET, other, ST_OK))[:ACK_LEN]
    if len(bad_ack) == ACK_LEN:  # the caller always reads exactly ACK_LEN bytes
        try:
            status = parse_ack(SECRET, hello, bad_ack)
        except ProtocolMismatch:
            stats["ack_rejected"] += 1
        except Exception as e:  # noqa: BLE001
            raise Failure(f"parse_ack raised {type(e).__name__}: {e}; input {bad_ack.hex()}") from None
        else:
            # The MAC covers the hello and the ack; only an unsigned "auth failed" answer (which
            # a peer without the secret must be able to send) is taken without it.
            if bad_ack != ack and status != ST_AUTH:
                raise Failure(f"a mutated ack was accepted with status {status}; input {bad_ack.hex()}")
            stats["ack_ok"] += 1
    frame = pack_error_frame(1, 0, 2, PeerFailed("peer gone", peer_rank=1, peer_addr="127.0.0.1:1"), 2)
    bad_frame = mutate(rng, frame, hello)
    try:
        find_error_frame(bad_frame)
        stats["error_frames_scanned"] += 1
    except Exception as e:  # noqa: BLE001
        raise Failure(f"find_error_frame raised {type(e).__name__}: {e}; input {bad_frame.hex()}") from None


# The exceptions the driver counts as a malformed message (and closes that connection for).
DRIVER_DROPS = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError)
_JUNK: list[Any] = [None, -1, 0, 1 << 70, "x", "", [], {}, 1.5, True, float("nan"), [[1, 2]], {"k": 1}]


def _sample_bodies() -> list[dict[str, Any]]:
    """Frame bodies of real control messages (typed messages through the codec)."""
    meta = MemberMeta(replica_id="r1", data_addrs=("127.0.0.1:8000",), kind=Kind.TRAINER, status=Status.READY,
                      start=1.0, step=3, loop_timeout=10.0)
    m1 = Member(node="r1.a", replica_id="r1", addr="127.0.0.1:7000", data_addrs=("127.0.0.1:8000",),
                role=Role.PARTICIPANT, slot=0, since=1)
    m2 = Member(node="w.b", replica_id="w", addr="127.0.0.1:7001", data_addrs=(), role=Role.WITNESS, slot=None)
    view = View(epoch=3, members=(m1, m2), voters=("w.b",), data_epoch=2, high_water=3)
    hdr: dict[str, Any] = {"frm": "127.0.0.1:7001", "src": "w.b"}
    ups = [Update("alive", "r1.a", 2, "127.0.0.1:7000", meta), Update("suspect", "x.c", 1, accuser="w.b")]
    msgs: list[Any] = [
        Ping(**hdr, updates=ups, epoch=3, step=3, seq=9, to="fz.0"),
        PushPull(**hdr, join=True, rows=[Row("r1.a", "127.0.0.1:7000", 2, "alive", meta)]),
        Updates(**hdr, updates=ups, beat=4, step=3),
        Append(**hdr, to="fz.0", term=2, prev=2, prev_term=1, entries=[(2, view)], commit=2),
        AppendResp(**hdr, to="fz.0", term=2, ok=True, match=3),
        Snapshot(**hdr, to="fz.0", term=2, index=3, snap_term=2, view=view),
        ViewFull(**hdr, view=view, term=2, leader="w.b", leader_addr="127.0.0.1:7001"),
        ViewDelta(**hdr, base=2, epoch=3, term=2, voters=("w.b",), data_epoch=2, changed=[m1], removed=["g.d"]),
        ViewRequest(**hdr, epoch=1),
    ]
    return [codec.to_wire(m) for m in msgs]


def _mutate_body(rng: random.Random, body: Any) -> Any:
    """Replace, drop or add one value somewhere inside a body (a copy)."""
    body = msgpack.unpackb(msgpack.packb(body), raw=False, strict_map_key=False)
    node, depth = body, 0
    while depth < 4 and isinstance(node, (dict, list)) and node and rng.random() < 0.6:
        child = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        if not isinstance(node[child], (dict, list)) or not node[child]:
            break
        node, depth = node[child], depth + 1
    if isinstance(node, dict) and node:
        key = rng.choice(list(node))
        op = rng.randrange(3)
        if op == 0:
            del node[key]
        elif op == 1:
            node[key] = rng.choice(_JUNK)
        else:
            node[f"junk{rng.randrange(9)}"] = rng.choice(_JUNK)
    elif isinstance(node, list) and node:
        node[rng.randrange(len(node))] = rng.choice(_JUNK)
    return body


def fuzz_messages(rng: random.Random, node: Node, stats: dict[str, int]) -> None:
    """A mutated real message body: decoding raises only what the driver counts and drops; a
    decoded message reaches the node (as the driver hands it), which then still runs."""
    body = _mutate_body(rng, rng.choice(_sample_bodies()))
    try:
        msg = codec.from_wire(body)
    except DRIVER_DROPS:
        stats["message_rejected"] += 1
        return
    except Exception as e:  # noqa: BLE001 - this is what the fuzzer looks for
        raise Failure(f"codec.from_wire raised {type(e).__name__}: {e}; body {body!r}") from None
    stats["message_decoded"] += 1
    try:
        node.handle(msg, 1.0)
    except DRIVER_DROPS:
        stats["message_dropped_by_node"] += 1
    except Exception as e:  # noqa: BLE001 - caught by the driver too, but no check anticipated it
        stats[f"node_raised_{type(e).__name__}"] += 1
    node.tick(2.0)
    node.ready()


def phase_decoders(seed: int, seconds: float) -> dict[str, Any]:
    rng = random.Random(seed)
    class Counts(dict):  # type: ignore[type-arg]
        def __missing__(self, k: str) -> int:
            return 0
    stats = Counts()
    node = Node(NodeSpec(replica_id="fz"), addr="127.0.0.1:7999", seeds=["127.0.0.1:7001"], rng=random.Random(seed),
                now=0.0)
    node.ready()
    t_end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < t_end:
        for _ in range(200):
            case_seed = rng.randrange(1 << 62)
            crng = random.Random(case_seed)
            try:
                fuzz_control(crng, None, stats)
                fuzz_control(crng, SECRET, stats)
                fuzz_data(crng, stats)
                fuzz_messages(crng, node, stats)
            except Failure as f:
                raise Failure(f"case seed {case_seed} (replay: fuzz_* with random.Random({case_seed})): {f}") from f
            n += 1
    return {"cases": n, "seconds": seconds, "counts": dict(stats)}


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def _send(addr: tuple[str, int], data: bytes, read: bool) -> None:
    try:
        with socket.create_connection(addr, timeout=2.0) as s:
            s.sendall(data)
            if read:
                s.settimeout(0.2)
                try:
                    s.recv(4096)
                except OSError:
                    pass
    except OSError:
        pass  # the server may close before we finish writing: that is the point


def _free_port() -> int:
    return free_ports(1)[0]


def phase_live(seed: int, conns: int, tmp: Path) -> dict[str, Any]:
    rng = random.Random(seed)
    secret_file = tmp / "secret"
    secret_file.write_bytes(SECRET)
    port = _free_port()
    peer = spawn_child([sys.executable, "-m", "p2pft", "peer", "--listen", f"127.0.0.1:{port}",
                        "--secret-file", str(secret_file)], stdout=subprocess.DEVNULL,
                       stderr=open(tmp / "peer.log", "wb"))
    ds = DataServer("127.0.0.1", 0, secret=SECRET)
    ds.serve_state(lambda req: StateSnapshot(meta={"ok": 1}, tensors={}))

    def members() -> bool:
        r = subprocess.run([sys.executable, "-m", "p2pft", "members", "--peer", f"127.0.0.1:{port}",
                            "--secret-file", str(secret_file), "--json"], capture_output=True, timeout=20)
        return r.returncode == 0 and json.loads(r.stdout)["members"] is not None

    try:
        deadline = time.monotonic() + 20
        while not members():
            if time.monotonic() > deadline or peer.poll() is not None:
                raise Failure("the peer did not start")
            time.sleep(0.2)
        rss0 = _rss_kb(peer.pid)
        host, dport = ds.addr.rsplit(":", 1)
        t0 = time.monotonic()
        for i in range(conns):
            good, other = valid_control(rng, SECRET), valid_control(rng, None)
            _send(("127.0.0.1", port), mutate(rng, good, other), read=i % 10 == 0)
            hello = pack_hello(SECRET, KIND_RING, 1, 0, 1, 0, 2)
            _send((host, int(dport)), mutate(rng, hello, other), read=i % 10 == 0)
        sent_s = time.monotonic() - t0
        time.sleep(0.5)
        alive = peer.poll() is None and members()
        snap = fetch_state(ds.addr, {"kind": "x"}, secret=SECRET, timeout=10.0)
        rss1 = _rss_kb(peer.pid)
        return {"connections_per_port": conns, "seconds": round(sent_s, 2), "peer_serving": alive,
                "data_server_serving": snap.meta.get("ok") == 1, "peer_rss_kb_before": rss0,
                "peer_rss_kb_after": rss1, "data_server_counters": dict(getattr(ds, "counters", {}))}
    finally:
        peer.terminate()
        try:
            peer.wait(10)
        except subprocess.TimeoutExpired:
            peer.kill()
        ds.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="in-process fuzzing time")
    ap.add_argument("--live", type=int, default=1000, help="fuzzed connections per real port (0: skip)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.live < 0:
        ap.error("--seconds must be > 0 and --live >= 0")
    import tempfile
    out: dict[str, Any] = {"seed": args.seed}
    ok = True
    try:
        out["decoders"] = phase_decoders(args.seed, args.seconds)
        if args.live:
            with tempfile.TemporaryDirectory(prefix="p2pft-fuzz-") as d:
                out["live"] = phase_live(args.seed, args.live, Path(d))
            ok = out["live"]["peer_serving"] and out["live"]["data_server_serving"]
    except Failure as f:
        out["failure"] = str(f)
        ok = False
    dec = out.get("decoders", {})
    print(f"{'phase':<10} {'result'}")
    if dec:
        c = dec["counts"]
        rejected = sum(v for k, v in c.items() if k.startswith("control_rejected"))
        print(f"{'decoders':<10} {dec['cases']:,} cases in {dec['seconds']:.0f} s: control frames rejected "
              f"{rejected:,} / accepted {c.get('control_accepted', 0):,}; hellos rejected "
              f"{c.get('hello_rejected', 0):,}; acks rejected {c.get('ack_rejected', 0):,}; mutated messages "
              f"rejected {c.get('message_rejected', 0):,} / decoded {c.get('message_decoded', 0):,}; "
              "no other exception")
        raised = {k: v for k, v in c.items() if k.startswith("node_raised_")}
        if raised:
            print(f"{'':<10} the node raised on decoded messages (the driver drops those too): {raised}")
    live = out.get("live")
    if live:
        print(f"{'live':<10} {live['connections_per_port']:,} fuzzed connections per port in {live['seconds']} s: "
              f"peer serving {live['peer_serving']}, data server serving {live['data_server_serving']}, "
              f"peer RSS {live['peer_rss_kb_before'] / 1024:.1f} -> {live['peer_rss_kb_after'] / 1024:.1f} MB")
    if "failure" in out:
        print("FAIL", out["failure"])
    print("PASS" if ok else "FAIL")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
