"""Harness ports: outside the kernel's ephemeral range, free, and never handed out twice."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from p2pft.deploy import ports


def test_ports_lie_outside_the_ephemeral_range_and_can_be_bound() -> None:
    lo, hi = ports.ephemeral_range()
    got = ports.free_ports(20)
    assert len(set(got)) == 20
    assert all(not lo <= p <= hi for p in got)
    for p in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_no_port_is_handed_out_twice_in_a_process() -> None:
    seen: set[int] = set()
    for _ in range(30):
        batch = ports.free_ports(5)
        assert not seen & set(batch)
        seen |= set(batch)


def test_a_port_someone_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        # Leave exactly two candidates outside the range: the busy port and the one after it.
        monkeypatch.setattr(ports, "_spans", lambda lo, hi: [(busy, busy + 1)])
        monkeypatch.setattr(ports, "_handed_out", set())
        monkeypatch.setattr(ports, "_share", (0, 1))   # both candidates ours (a test worker has a share)
        got = ports.free_ports(1)
        nxt_free = ports._bindable("127.0.0.1", busy + 1)
    assert got != [busy]
    if nxt_free:
        assert got == [busy + 1]


def test_without_room_outside_the_range_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    got = ports.free_ports(3)
    assert len(set(got)) == 3 and all(1024 <= p <= 65535 for p in got)


def test_the_range_is_read_from_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", f)
    assert ports.ephemeral_range() == (40000, 50000)
    f.write_text("garbage")
    assert ports.ephemeral_range() == ports.LINUX_DEFAULT
    with pytest.raises(ValueError):
        ports.free_ports(-1)


def test_harnesses_side_by_side_draw_from_disjoint_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parallel test workers each take a share: no port of one is ever a port of another."""
    monkeypatch.setattr(ports, "_share", ports._share)   # restored after the test
    drawn = {}
    for index in range(3):
        ports.share(index, 3)
        drawn[index] = ports.free_ports(40)
        assert all(p % 3 == index for p in drawn[index]), drawn[index]
    assert not set(drawn[0]) & set(drawn[1]) and not set(drawn[1]) & set(drawn[2])
    for bad in ("2", "a/b", "3/3", "-1/2", "0/0"):
        with pytest.raises(ValueError, match="P2PFT_PORT_SHARE"):
            ports._parse_share(bad)
    for index, count in ((3, 2), (0, 0)):
        with pytest.raises(ValueError, match=r"^share\(\): .* got %d/%d" % (index, count)):
            ports.share(index, count)
