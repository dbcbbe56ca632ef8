"""Replicas on separate hosts (network namespaces), started exactly as the README says.

Each witness and replica runs in its own namespace with its own address on a bridge, so an
address that only works on one host (127.0.0.1, a wildcard) breaks the run here as it would on
a cluster. Skipped with the reason where namespaces cannot be made (not root, no `ip`).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from replica_harness import ProcessSet, check_invariants, records, steps

from p2pft.chaos.hosts import Hosts, sweep, unavailable

WHY = unavailable()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}")]

REPO = Path(__file__).resolve().parents[2]
CTL, REPLICA_PORT = 7000, 7100
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PFT_")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


class HostSet(ProcessSet):
    """Processes of one test, each in a namespace of `hosts`: witnesses on hosts 0 and 1."""

    tolerate_sigkill = True

    def __init__(self, tmp: Path, hosts: Hosts) -> None:
        super().__init__(tmp)
        self.hosts = hosts
        self.seeds = f"{hosts[0].ip}:{CTL},{hosts[1].ip}:{CTL}"

    def start(self, host: int, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")
        p = self.hosts.spawn(host, argv, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=self.tmp)
        log.close()
        self.procs[name] = p
        return p

    def witnesses(self) -> None:
        for k in range(2):   # the README's CLI line for a witness peer
            self.start(k, f"w{k}", [sys.executable, "-m", "p2pft", "--log-level", "INFO", "peer", "--listen",
                                    f"{self.hosts[k].ip}:{CTL}", "--seeds", self.seeds, "--replica-id", f"w{k}"])

    def replica(self, host: int, name: str, addr_args: list[str]) -> None:
        """The README's replica line (`--listen ... --seeds ...`, no data address), plus the
        harness's stats and pace."""
        stats = self.tmp / f"{name}.jsonl"
        self.stats[name] = stats
        self.start(host, name, [sys.executable, "-m", "p2pft.trainer.examples.replica", "--replica-id",
                                name.split("-")[0], *addr_args, "--seeds", self.seeds, "--stats", str(stats),
                                "--step-delay", "0.05", "--digest-every", "5", "--batch", "4",
                                "--log-level", "INFO", "--comm-timeout", "5", "--loop-timeout", "20"])

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_hosts_library_links_ports_and_cleanup(tmp_path: Path) -> None:
    """Addresses are distinct and reachable across hosts; a link down loses packets without a
    reset; a blocked port drops silently; everything is gone after close, and what a SIGKILLed
    owner left behind is swept by the next run."""
    probe = ("import socket,sys,time\nc=socket.socket();c.settimeout(1.0);t=time.time()\n"
             "try:\n c.connect((sys.argv[1],int(sys.argv[2])));print('ok')\n"
             "except OSError as e: print(type(e).__name__, round(time.time()-t,1))")
    with Hosts(2, link_mbit=200) as hs:
        a, b = hs[0], hs[1]
        assert a.ip != b.ip and a.ip.startswith("10.213.")
        hs.spawn(1, [sys.executable, "-c", f"import socket,time\nl=[socket.create_server(('{b.ip}',p)) "
                     f"for p in (7000,7001)]\ntime.sleep(60)"])
        deadline = time.monotonic() + 10
        while hs.run(0, [sys.executable, "-c", probe, b.ip, "7000"]).stdout.strip() != "ok":
            assert time.monotonic() < deadline, "server in host 1 not reachable from host 0"
            time.sleep(0.1)
        hs.block_port(1, 7001)
        assert hs.run(0, [sys.executable, "-c", probe, b.ip, "7001"]).stdout.split()[0] == "TimeoutError"
        assert hs.run(0, [sys.executable, "-c", probe, b.ip, "7000"]).stdout.strip() == "ok"
        hs.link(1, False)
        assert hs.run(0, [sys.executable, "-c", probe, b.ip, "7000"]).stdout.split()[0] == "TimeoutError"
        hs.link(1, True)
        assert hs.run(0, [sys.executable, "-c", probe, b.ip, "7000"]).stdout.strip() == "ok"
        # Names resolve at once inside a host: the set's hosts from its hosts file, anything else
        # refused (not a wait for the machine's resolver through the bridge: 10 s before).
        lookups = ("import socket,sys,time\nt=time.time();n=socket.gethostbyaddr(sys.argv[1])[0]\n"
                   "try: socket.getaddrinfo('no-such-host.invalid', 80); u='resolved'\n"
                   "except OSError: u='refused'\nprint(n, u, round(time.time()-t,2))")
        name, unknown, took = hs.run(0, [sys.executable, "-c", lookups, b.ip]).stdout.split()
        assert (name, unknown) == (b.netns, "refused") and float(took) < 1.0, (name, unknown, took)
        names = [h.netns for h in hs.hosts] + [hs.bridge]
    left = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert not any(n in left for n in names)
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)
    assert not any(n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout for n in names)
    # A harness SIGKILLed with hosts up: the next sweep removes them and what runs inside.
    code = ("import time,sys\nfrom p2pft.chaos.hosts import Hosts\nh=Hosts(2).create()\n"
            "h.spawn(0,[sys.executable,'-c','import time; time.sleep(60)'])\nprint(h.hosts[0].netns,flush=True)\n"
            "time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        ns = owner.stdout.readline().strip() if owner.stdout else ""
    finally:
        owner.kill()
        owner.wait(5)
        if owner.stdout:
            owner.stdout.close()
    assert ns.startswith("p2pft-"), ns
    assert os.path.exists(f"/etc/netns/{ns}/hosts")
    assert ns in sweep()
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not os.path.exists(f"/etc/netns/{ns}")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_readme_command_lines_train_across_hosts(tmp_path: Path) -> None:
    """Two witnesses and three replicas on five hosts, with the README's lines: `--listen
    HOST:PORT`, `--listen 0.0.0.0:PORT` alone, and `--listen 0.0.0.0:PORT --advertise
    HOST:PORT`. They train, the wildcard one is SIGKILLed and restarted, digests agree."""
    with Hosts(5) as hs:
        ps = HostSet(tmp_path, hs)
        forms = {"r0": ["--listen", f"{hs[2].ip}:{REPLICA_PORT}"],
                 "r1": ["--listen", f"0.0.0.0:{REPLICA_PORT}"],
                 "r2": ["--listen", f"0.0.0.0:{REPLICA_PORT}", "--advertise", f"{hs[4].ip}:{REPLICA_PORT}"]}
        ps.witnesses()
        for i, (rid, args) in enumerate(forms.items()):
            ps.replica(2 + i, f"{rid}-0", args)
        try:
            ps.wait(lambda: all(ps.last_step(f"r{i}-0") >= 15 for i in range(3)), 45, "15 steps on every replica")
            ps.procs["r1-0"].send_signal(signal.SIGKILL)
            ps.procs["r1-0"].wait(timeout=5)
            at_kill = {n: ps.last_step(n) for n in ("r0-0", "r2-0")}
            ps.wait(lambda: all(ps.last_step(n) >= at_kill[n] + 10 for n in at_kill), 20,
                    "survivors to commit 10 more steps")
            ps.replica(3, "r1-1", forms["r1"])
            ps.wait(lambda: any(r.get("c") and r.get("n", 0) == 3 for r in steps(ps.stats["r1-1"])), 45,
                    "the restarted replica to contribute")
            target = max(ps.last_step(n) for n in ("r0-0", "r2-0", "r1-1")) + 6
            ps.wait(lambda: all(ps.last_step(n) >= target for n in ("r0-0", "r2-0", "r1-1")), 20,
                    "6 more steps with three replicas")
        finally:
            rcs = ps.stop_all()
        logs = {n: ps.log(n) for n in ps.procs}
    assert rcs["r0-0"] == 0 and rcs["r2-0"] == 0 and rcs["r1-1"] == 0, f"exit statuses {rcs}"
    digests = check_invariants(ps.stats)
    restarted = {r["step"] for r in steps(ps.stats["r1-1"]) if "digest" in r}
    assert restarted & set(digests), "no digest of the restarted replica to compare"
    for name, text in logs.items():   # nobody was told a wildcard or a loopback address
        assert "0.0.0.0:" not in text.split("listening on")[-1].split("\n")[0].split("advertised as")[-1], name
        assert "cannot connect" not in text, f"{name}: {text[-2000:]}"
    events = [r for r in records(ps.stats["r1-1"]) if r.get("kind") == "event"]
    assert any(e.get("event") == "catchup_done" for e in events), "the restarted replica did not catch up"


# The README's loop module as written, with the runtime's INFO lines (views, failures, pauses,
# fast-forwards) in each replica's log, so that a failure here can be read afterwards.
LOOP_LOGGING_INFO = ("import logging, runpy; from p2pft.ops.log import setup_logging; setup_logging('INFO'); "
                     "runpy.run_module('p2pft.trainer.examples.loop', run_name='__main__')")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_readme_api_loop_trains_across_hosts(tmp_path: Path) -> None:
    """The README's loop as written (trainer/examples/loop.py: `Runtime(replica_id=...,
    listen=..., seeds=...)`, the job's end at step 60) on three hosts, two witnesses on two
    more. A replica that is not the leader is SIGKILLed once the leader evaluated step 20 and
    restarted at once: the survivors end at step 60 with the same digest, and the restarted one
    either catches up and ends with them or, arriving as the job ends, trains nothing; every
    one exits 0. About 30 s on an idle machine."""
    with Hosts(5) as hs:
        ps = HostSet(tmp_path, hs)
        ps.witnesses()
        addrs = [f"{hs[2 + i].ip}:{REPLICA_PORT}" for i in range(3)]

        def run(i: int, name: str) -> None:
            ps.start(2 + i, name, [sys.executable, "-c", LOOP_LOGGING_INFO, f"r{i}", addrs[i],
                                   *ps.seeds.split(","), *(a for j, a in enumerate(addrs) if j != i)])
        for i in range(3):
            run(i, f"r{i}-0")
        try:
            ps.wait(lambda: any("step 20 eval loss" in ps.log(f"r{i}-0") for i in range(3)), 40,
                    "the leader's evaluation at step 20")
            leader = next(i for i in range(3) if "step 20 eval loss" in ps.log(f"r{i}-0"))
            victim = (leader + 1) % 3
            ps.procs[f"r{victim}-0"].send_signal(signal.SIGKILL)
            ps.procs[f"r{victim}-0"].wait(timeout=5)
            run(victim, f"r{victim}-1")
            names = [f"r{i}-0" for i in range(3) if i != victim] + [f"r{victim}-1"]
            ps.wait(lambda: all(ps.procs[n].poll() is not None for n in names), 40,
                    "every replica to finish the job and exit", allow_exit=tuple(names))
        finally:
            rcs = ps.stop_all()
        out = {n: ps.log(n) for n in names}
    assert all(rcs[n] == 0 for n in names), (rcs, {n: o[-1500:] for n, o in out.items()})
    finals = {n: [ln.split() for ln in o.splitlines() if " digest " in ln] for n, o in out.items()}
    survivors, restarted = names[:2], names[2]
    assert all(len(finals[n]) == 1 for n in survivors), finals
    assert {finals[n][0][2] for n in survivors} == {"60"}, finals
    assert len({finals[n][0][-1] for n in survivors}) == 1, f"digests differ: {finals}"
    # The restarted one caught up and ended with them (one digest line, step 60), or it came as
    # the job ended and trained nothing: then it says so, and prints no digest of its own weights.
    if finals[restarted]:
        assert len(finals[restarted]) == 1 and finals[restarted][0][2] == "60", finals
        assert finals[restarted][0][-1] == finals[survivors[0]][0][-1], f"digests differ: {finals}"
    else:
        assert "the job already finished at step 60" in out[restarted], out[restarted][-1500:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_unreachable_data_port_is_named_and_left_out(tmp_path: Path) -> None:
    """r2's data port is dropped by a firewall on its host (its control port works): the others
    train within the bound, one ERROR line on them names r2 and its data address, `p2pft top`
    shows it, and once the port is open again r2 comes back and contributes."""
    from p2pft.net.dataprobe import DATA_UNREACHABLE_S, PROBE_TIMEOUT_S
    with Hosts(5) as hs:
        ps = HostSet(tmp_path, hs)
        ps.witnesses()
        data_port = 7300
        hs.block_port(4, data_port)
        for i in range(3):
            extra = ["--data-listen", f"{hs[4].ip}:{data_port}"] if i == 2 else []
            ps.replica(2 + i, f"r{i}-0", ["--listen", f"{hs[2 + i].ip}:{REPLICA_PORT}", *extra, "--min-replicas", "3"])
        try:
            ps.wait(lambda: all(any(r.get("kind") == "start" for r in records(ps.stats[f"r{i}-0"])) for i in range(3)),
                    45, "every replica to start")
            t0 = max(next(r["t"] for r in records(ps.stats[n]) if r.get("kind") == "start") for n in ("r0-0", "r1-0"))
            ps.wait(lambda: all(ps.last_step(n) >= 10 for n in ("r0-0", "r1-0")), 40, "r0 and r1 to train 10 steps")
            first = min(r["t"] for n in ("r0-0", "r1-0") for r in steps(ps.stats[n]) if r.get("c"))
            top = hs.run(0, [sys.executable, "-m", "p2pft", "top", "--peer", f"{hs[0].ip}:{CTL}", "--plain",
                             "--count", "1"])
            hs.block_port(4, data_port, blocked=False)
            ps.wait(lambda: any(r.get("c") and r.get("n") == 3 for r in steps(ps.stats["r2-0"])), 40,
                    "r2 to contribute once its data port is reachable")
        finally:
            rcs = ps.stop_all()
        logs = {n: ps.log(n) for n in ("r0-0", "r1-0", "r2-0")}
    assert rcs["r0-0"] == 0 and rcs["r1-0"] == 0, f"exit statuses {rcs}"
    stall = first - t0
    # the ring's connect timeout (5 s) + the bound + one probe timeout + a view, with slack for
    # two loaded cores (about 10.5 s measured)
    assert stall < 5.0 + DATA_UNREACHABLE_S + PROBE_TIMEOUT_S + 5.0, f"r0/r1 trained only {stall:.1f} s after starting"
    addr = f"{hs[4].ip}:{data_port}"
    errors = {n: [ln for ln in logs[n].splitlines() if "ERROR" in ln and addr in ln] for n in ("r0-0", "r1-0")}
    assert all(len(e) <= 1 for e in errors.values()) and sum(map(len, errors.values())) >= 1, errors
    assert all("member r2." in e[0] for e in errors.values() if e), errors
    assert any("ERROR" in ln and "cannot reach this replica's data address" in ln for ln in logs["r2-0"].splitlines())
    assert "data port unreachable, left out: r2 " + addr in top.stdout, top.stdout + top.stderr
    check_invariants(ps.stats)
    print(f"stall before r0/r1 trained without r2: {stall:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", ["native", "python"])
def test_vanished_host_fails_the_ring_within_the_ack_timeout(tmp_path: Path, loop: str) -> None:
    """Three ring ranks on three hosts; host 2's link goes down between ops (no reset, no EOF).
    Rank 1 sends to it: it fails within about the ack timeout, blaming rank 2, and rank 0 (which
    waits on rank 2) hears rank 1's verdict and blames rank 2 too, long before the op timeout
    (10 s). This is the data-plane evidence the failure detector gets for a lost host."""
    from p2pft.transport.options import RING_ACK_TIMEOUT_S
    worker = Path(__file__).with_name("ring_rank.py")
    env = dict(_env(), P2PFT_NATIVE_RING="1" if loop == "native" else "0")
    with Hosts(3) as hs:
        peers = [f"{hs[i].ip}:7300" for i in range(3)]
        outs = [tmp_path / f"rank{i}.out" for i in range(3)]
        for i in range(3):
            with open(outs[i], "wb") as out:
                hs.spawn(i, [sys.executable, str(worker), str(i), "10", *peers], stdout=out,
                         stderr=subprocess.STDOUT, env=env, cwd=REPO)

        def lines(i: int) -> list[dict]:
            import json
            return [json.loads(ln) for ln in outs[i].read_text().splitlines() if ln.startswith("{")]
        deadline = time.monotonic() + 30
        while not all(any(m.get("ready") for m in lines(i)) for i in range(3)):
            assert time.monotonic() < deadline, [outs[i].read_text()[-2000:] for i in range(3)]
            time.sleep(0.1)
        down = time.time()
        hs.link(2, False)
        deadline = time.monotonic() + 8
        while not all(any("error" in m for m in lines(i)) for i in (0, 1)):
            assert time.monotonic() < deadline, [outs[i].read_text()[-2000:] for i in range(2)]
            time.sleep(0.05)
    errs = {i: next(m for m in lines(i) if "error" in m) for i in (0, 1)}
    for i, e in errs.items():
        assert e["peer"] == peers[2], errs
        # the next op's first send (<= 0.05 s of compute away), then the ack timeout and one
        # 0.05 s slice; slack for two loaded cores
        assert e["t"] - down < RING_ACK_TIMEOUT_S + 1.0, (i, e["t"] - down, errs)
    assert "acknowledged nothing" in errs[1]["reason"], errs
    print({i: round(e["t"] - down, 2) for i, e in errs.items()})


RUNTIME_ONLY = '''
import sys, time
from p2pft import Runtime
from p2pft.ops.log import setup_logging
setup_logging("INFO")
rid, listen, seed, data_listen = sys.argv[1:5]
rt = Runtime(replica_id=rid, listen=listen, seeds=[seed], data_listen=data_listen or None).start()
v = rt.wait_view(lambda v: len([m for m in v.members if m.role.value != "witness"]) == 2, 20)
assert v is not None, "no view with both trainers"
other = next(m.node for m in v.members if m.role.value != "witness" and m.node != rt.node_id)
t0 = time.monotonic()
while rid == "a" and time.monotonic() - t0 < 20:
    if rt.view.member(other) is None:
        print(f"left out after {time.monotonic() - t0:.1f} s", flush=True)
        break
    rt.report_failure(other)      # what the engine reports after a failed ring connect
    time.sleep(0.5)
while rid == "b" and time.monotonic() - t0 < 20:
    time.sleep(0.2)
rt.close()
'''


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_loopback_data_address_among_remote_peers(tmp_path: Path) -> None:
    """Runtime b on its own host binds its data port on 127.0.0.1: both sides name it at ERROR,
    and the data-plane evidence against it leaves it out of the view after the bound."""
    script = tmp_path / "rt.py"
    script.write_text(RUNTIME_ONLY)
    with Hosts(3) as hs:
        ps = HostSet(tmp_path, hs)
        seed = f"{hs[0].ip}:{CTL}"
        ps.start(0, "w0", [sys.executable, "-m", "p2pft", "--log-level", "INFO", "peer", "--listen", seed,
                           "--replica-id", "w0"])
        ps.start(1, "a", [sys.executable, str(script), "a", f"{hs[1].ip}:{REPLICA_PORT}", seed, ""])
        ps.start(2, "b", [sys.executable, str(script), "b", f"{hs[2].ip}:{REPLICA_PORT}", seed, "127.0.0.1:7300"])
        try:
            ps.wait(lambda: ps.procs["a"].poll() is not None, 45, "a to finish", allow_exit=("a", "b"))
        finally:
            ps.stop_all()
        a, b = ps.log("a"), ps.log("b")
    assert "left out after" in a, a[-3000:]
    assert any("ERROR" in ln and "advertises the loopback address 127.0.0.1:7300" in ln and "member b." in ln
               for ln in a.splitlines()), a[-3000:]
    assert any("ERROR" in ln and "this replica advertises the loopback address 127.0.0.1:7300" in ln
               for ln in b.splitlines()), b[-3000:]
    # the evidence names it too, at WARNING: one ERROR line per member and address
    assert any("WARNING" in ln and "member b." in ln and "cannot be reached" in ln for ln in a.splitlines())
    assert sum("ERROR" in ln and "member b." in ln for ln in a.splitlines()) == 1
