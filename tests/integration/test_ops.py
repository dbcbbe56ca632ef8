"""Operating a job: Prometheus metrics of live replicas and witnesses, `p2pft top`, seed warnings.

Real processes on loopback: two example replicas and one `p2pft peer` witness, all serving
/metrics; the test scrapes them over HTTP while the replicas train.
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from replica_harness import Replicas

from p2pft.deploy.ports import free_ports

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict[str, float]:
    """One scrape, flattened to {'name{label="v",...}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class OpsCluster(Replicas):
    """Two replicas and one witness, each with a metrics port."""

    def __init__(self, tmp: Path) -> None:
        self.metrics = dict(zip(("r0", "r1", "w0"), _ports(3)))
        super().__init__(tmp, 2, witnesses=1)

    def start(self) -> None:
        addr = self.witness_addrs[0]
        log = open(self.tmp / "w0.log", "wb")
        self.procs["w0"] = subprocess.Popen(
            [sys.executable, "-m", "p2pft", "--log-level", "INFO", "peer", "--listen", addr, "--seeds",
             ",".join(self.addrs), "--replica-id", "w0", "--metrics-port", str(self.metrics["w0"])],
            stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        for i in range(2):
            self.extra = ["--metrics-port", str(self.metrics[f"r{i}"])]
            self.spawn(i, f"r{i}")


def _ports(n: int) -> list[int]:
    return free_ports(n)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpsCluster]:
    c = OpsCluster(tmp_path_factory.mktemp("ops"))
    c.start()
    try:
        c.wait(lambda: c.last_step("r0") >= 5 and c.last_step("r1") >= 5, 120, "both replicas training")
        yield c
    finally:
        c.stop_all()


def test_metrics_move_while_training(cluster: OpsCluster) -> None:
    first = {name: scrape(port) for name, port in cluster.metrics.items()}
    # Each replica ten steps past its own first scrape (they were scraped at different steps).
    cluster.wait(lambda: all(cluster.last_step(r) >= first[r]["p2pft_committed_step"] + 10 for r in ("r0", "r1")),
                 60, "ten more steps on each replica")
    later = {name: scrape(port) for name, port in cluster.metrics.items()}
    for r in ("r0", "r1"):
        a, b = first[r], later[r]
        assert b["p2pft_committed_step"] >= a["p2pft_committed_step"] + 10
        assert b["p2pft_step_seconds_count"] >= a["p2pft_step_seconds_count"] + 10
        assert b['p2pft_steps_total{outcome="committed"}'] > a['p2pft_steps_total{outcome="committed"}']
        assert b["p2pft_allreduce_total"] > a["p2pft_allreduce_total"]
        assert b["p2pft_allreduce_bytes_total"] > a["p2pft_allreduce_bytes_total"]
        assert b["p2pft_allreduce_seconds_total"] > a["p2pft_allreduce_seconds_total"]
        assert b['p2pft_replica_role{role="participant"}'] == 1
        assert b["p2pft_step_contributors"] == 2
        assert b["p2pft_view_epoch"] >= 1
        assert b['p2pft_members{role="participant",state="alive"}'] == 2
    w0, w1 = first["w0"], later["w0"]
    # The witness trains nothing: it sees the step through gossip, and the whole membership.
    assert w1["p2pft_cluster_step"] >= w0["p2pft_cluster_step"] + 5
    assert w1['p2pft_members{role="participant",state="alive"}'] == 2
    assert w1['p2pft_members{role="witness",state="alive"}'] == 1
    assert "p2pft_committed_step" not in w1
    sent = 'p2pft_control_messages_sent_total{family="gossip",type="g.ping"}'
    got = 'p2pft_control_messages_received_total{family="gossip",type="g.ack"}'
    assert w1[sent] > w0[sent] and w1[got] > w0[got]
    assert w1["p2pft_view_epoch"] >= 1


def families(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {f.name + ("_total" if f.type == "counter" else "") for f in text_string_to_metric_families(text)
            if not f.name.endswith("_created")}


def test_every_metric_is_documented(cluster: OpsCluster) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    table = {line.split("|")[1].strip().strip("`") for line in doc.splitlines() if line.startswith("| `p2pft_")}
    exposed = families(cluster.metrics["r0"]) | families(cluster.metrics["w0"])
    assert len(exposed) >= 30
    assert exposed <= table, sorted(exposed - table)
    assert table <= exposed, sorted(table - exposed)    # no stale rows either


def rejected_frames(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("p2pft_control_frames_rejected_total"))


def test_rejected_frame_is_counted(cluster: OpsCluster) -> None:
    before = rejected_frames(scrape(cluster.metrics["w0"]))
    host, port = cluster.witness_addrs[0].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"\x00\x00\x00\x05\x00junk")     # a well-framed payload that is not msgpack
        s.settimeout(5)
        assert s.recv(1) == b""                       # the node closes that connection
    deadline = time.monotonic() + 5
    while rejected_frames(scrape(cluster.metrics["w0"])) < before + 1:
        assert time.monotonic() < deadline, "the rejected frame was not counted"
        time.sleep(0.05)


def test_top_plain_shows_the_cluster(cluster: OpsCluster, ctl: Any) -> None:
    peer = cluster.witness_addrs[0]
    proc = subprocess.run(ctl.p2pft_command() + ["top", "--peer", peer, "--count", "2", "--interval", "0.5"],
                          capture_output=True, text=True, timeout=60, env=ctl.child_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    frames = proc.stdout.split("\n\n")
    assert len(frames) == 2
    last = frames[-1]
    assert last.startswith(f"p2pft top  {peer} (w0)  epoch ")
    rows = {ln.split()[0]: ln.split() for ln in last.splitlines() if ln.split() and ln.split()[0] in ("r0", "r1", "w0")}
    assert set(rows) == {"r0", "r1", "w0"}
    assert rows["r0"][1:3] == ["participant", "alive"] and rows["w0"][1] == "witness"
    assert float(rows["r0"][4]) > 0          # steps/s between the two polls: it trains
    assert "catch-ups: none" in last
    # The witness logs at least its first view; which joins it saw after that depends on when it
    # came up (its first view may already hold everyone): the event kinds are unit-tested.
    events = last.split("recent events:\n", 1)[1].splitlines()
    assert events and all(re.fullmatch(r"  \d\d:\d\d:\d\d  (e\d+: |leader ).+", ln) for ln in events), last


def test_admin_top_answer(cluster: OpsCluster, ctl: Any) -> None:
    import asyncio
    from p2pft.net.admin import admin_request
    rep = asyncio.run(admin_request(cluster.addrs[0], "admin.top", timeout=5))
    assert {m["replica_id"] for m in rep["members"]} == {"r0", "r1", "w0"}
    assert rep["term"] >= 1 and rep["now"] > 0 and isinstance(rep["events"], list)
    assert all(set(e) == {"t", "kind", "text"} for e in rep["events"])
    json.dumps(rep)   # the answer is plain data


def _one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_top_unreachable_peer_is_one_line(ctl: Any) -> None:
    proc = subprocess.run(ctl.p2pft_command() + ["top", "--peer", "127.0.0.1:1"], capture_output=True, text=True,
                          timeout=30, env=ctl.child_env(), stdin=subprocess.DEVNULL)
    _one_line_error(proc, "p2pft top: error:", "127.0.0.1:1", "connection refused")


def test_bad_or_taken_metrics_port_is_one_line(ctl: Any) -> None:
    port, mport = ctl.free_ports(2)
    proc = subprocess.run(ctl.p2pft_command() + ["peer", "--listen", f"127.0.0.1:{port}", "--metrics-port", "x"],
                          capture_output=True, text=True, timeout=30, env=ctl.child_env(), stdin=subprocess.DEVNULL)
    _one_line_error(proc, "bad --metrics-port", "'x' is not a number")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", mport))
        taken.listen()
        env = dict(ctl.child_env(), P2PFT_METRICS_PORT=str(mport))     # the environment works too
        proc = subprocess.run(ctl.p2pft_command() + ["--log-level", "WARNING", "peer", "--listen",
                                                     f"127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=30, env=env, stdin=subprocess.DEVNULL)
    _one_line_error(proc, f"cannot serve metrics on {mport}")


def test_seed_that_does_not_resolve_or_answer_is_a_warning(ctl: Any, tmp_path: Path) -> None:
    port, dead = ctl.free_ports(2)
    log = tmp_path / "peer.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(ctl.p2pft_command() + ["peer", "--listen", f"127.0.0.1:{port}", "--seeds",
                                                       f"nohost.invalid:7000,127.0.0.1:{dead}"],
                                stdout=fh, stderr=subprocess.STDOUT, env=ctl.child_env(), stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        want = ("WARNING", "seed nohost.invalid:7000 does not resolve", f"seed 127.0.0.1:{dead} has not answered")
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if all(w in text for w in want):
                break
            assert proc.poll() is None, text
            time.sleep(0.1)
        else:
            pytest.fail(f"no seed warnings: {log.read_text(errors='replace')}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def test_peer_takes_seeds_and_identity_from_slurm(ctl: Any, tmp_path: Path) -> None:
    """`--seeds-from slurm` on a real peer: identity and seeds from SLURM variables, the port
    offset from SLURM_LOCALID; the command line still wins for what it gives."""
    base, = ctl.free_ports(1)
    env = dict(ctl.child_env(), SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_PROCID="4", SLURM_NODEID="0",
               SLURM_LOCALID="0", SLURMD_NODENAME="127.0.0.1", P2PFT_SEEDS_FROM="slurm")
    ready = tmp_path / "ready"
    log = tmp_path / "peer.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(ctl.p2pft_command() + ["peer", "--listen", f"127.0.0.1:{base}", "--ready-file",
                                                       str(ready)],
                                stdout=fh, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        text = log.read_text()
        assert "as w4." in text, text                                     # replica id w<SLURM_PROCID>
        assert f"seeds: 127.0.0.1:{base},127.0.0.2:{base}" in text, text   # the nodelist at the base port
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def test_top_live_screen_on_a_terminal_ends_on_ctrl_c(cluster: OpsCluster, ctl: Any) -> None:
    """On a terminal (a pseudo-terminal here) `top` draws a rich table until SIGINT, then exits 0:
    even when it was started with SIGINT ignored, as a script's `cmd &` starts its commands (the
    ignored disposition is inherited through exec; `top` ignored Ctrl-C then)."""
    import pty
    master, slave = pty.openpty()
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(ctl.p2pft_command() + ["top", "--peer", cluster.witness_addrs[0], "--interval", "0.3"],
                                stdin=slave, stdout=slave, stderr=subprocess.PIPE,
                                env=dict(ctl.child_env(), COLUMNS="160"))
    finally:
        signal.signal(signal.SIGINT, saved)
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and out.count("recent events".encode()) < 2:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                out += os.read(master, 65536)
        proc.send_signal(signal.SIGINT)
        # Keep reading the terminal while it exits, as a terminal does: a full pseudo-terminal
        # buffer would block its last frames (and so its exit) on a reader that went away.
        end = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    out += os.read(master, 65536)
                except OSError:   # the child closed its side
                    break
        rc = proc.wait(timeout=max(0.1, end - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    text = out.decode(errors="replace")
    assert rc == 0, proc.stderr.read().decode() if proc.stderr else rc
    assert "\x1b[" in text and "│" in text                     # ANSI styles and a drawn table
    assert "participant" in text and "steps/s" in text
