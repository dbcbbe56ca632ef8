"""The `p2pft` command line: `members --json` schema and one-line errors for user mistakes."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ERROR_DEADLINE = 8.0     # s: a user error must end the command quickly (interpreter start included)


def run_cli(ctl: Any, *args: str, timeout: float = 20.0, env: dict[str, str] | None = None
            ) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = subprocess.run(ctl.p2pft_command() + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env or ctl.child_env(), stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - t0


def assert_one_line_error(proc: subprocess.CompletedProcess[str], took: float, *needles: str) -> None:
    assert proc.returncode != 0
    assert took < ERROR_DEADLINE
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("p2pft ") and "error:" in lines[0]
    for n in needles:
        assert n in lines[0], lines[0]


async def _running_cluster(peers: Any, ctl: Any, n: int, secret_file: str | None = None) -> list[str]:
    addrs = [f"127.0.0.1:{p}" for p in ctl.free_ports(n)]
    for a in addrs:
        peers.spawn(a, seeds=sorted(addrs)[:2], secret_file=secret_file, replica_id=f"r-{a.rsplit(':', 1)[1]}")
    secret = Path(secret_file).read_bytes().strip() if secret_file else None

    async def ready() -> bool:
        reps = await ctl.reports(addrs, secret=secret)
        return all(r is not None and len(r["members"]) == n for r in reps.values())

    await ctl.wait_until(ready, 30.0, interval=0.05, what=f"{n} peers in one view")
    return addrs


async def test_members_json_schema(peers: Any, ctl: Any) -> None:
    addrs = await _running_cluster(peers, ctl, 3)
    proc, _ = run_cli(ctl, "members", "--peer", addrs[1], "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert isinstance(rep["epoch"], int) and rep["epoch"] >= 1
    assert isinstance(rep["leader"], str) and rep["leader"]
    assert isinstance(rep["committed_at"], float) and abs(rep["committed_at"] - time.time()) < 600
    assert isinstance(rep["members"], list) and len(rep["members"]) == 3
    for m in rep["members"]:
        assert isinstance(m["replica_id"], str) and m["replica_id"] == "r-" + m["addr"].rsplit(":", 1)[1]
        assert isinstance(m["node"], str) and m["node"].startswith(m["replica_id"] + ".")   # one per incarnation
        assert m["addr"] in addrs
        assert m["role"] in ("participant", "joiner", "witness")
        assert m["state"] in ("alive", "suspect")
        assert isinstance(m["step"], int) and not isinstance(m["step"], bool)
    assert rep["leader"] in {m["node"] for m in rep["members"]}
    assert sorted(m["addr"] for m in rep["members"]) == sorted(addrs)

    table, _ = run_cli(ctl, "members", "--peer", addrs[0])
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].startswith("epoch ") and "leader" in lines[0]
    assert lines[1].split()[:5] == ["node", "replica", "addr", "role", "state"]
    assert len(lines) == 2 + 3


def test_members_where_nothing_listens(ctl: Any) -> None:
    (port,) = ctl.free_ports(1)
    proc, took = run_cli(ctl, "members", "--peer", f"127.0.0.1:{port}")
    assert_one_line_error(proc, took, "nothing listens")


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1:http", "127.0.0.1:70000", ":7000"])
def test_peer_with_unparsable_listen(ctl: Any, listen: str) -> None:
    proc, took = run_cli(ctl, "peer", "--listen", listen)
    assert_one_line_error(proc, took, "--listen")


def test_peer_on_a_port_already_taken(ctl: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc, took = run_cli(ctl, "peer", "--listen", f"127.0.0.1:{port}")
    assert_one_line_error(proc, took, "cannot listen", str(port))


def test_unreadable_secret_file(ctl: Any, tmp_path: Path) -> None:
    (port,) = ctl.free_ports(1)
    missing = tmp_path / "no-such-secret"
    proc, took = run_cli(ctl, "peer", "--listen", f"127.0.0.1:{port}", "--secret-file", str(missing))
    assert_one_line_error(proc, took, "secret file")
    proc, took = run_cli(ctl, "members", "--peer", f"127.0.0.1:{port}", "--secret-file", str(tmp_path))
    assert_one_line_error(proc, took, "secret file")                 # a directory is unreadable too
    empty = tmp_path / "empty"
    empty.write_text("\n")
    proc, took = run_cli(ctl, "members", "--peer", f"127.0.0.1:{port}", "--secret-file", str(empty))
    assert_one_line_error(proc, took, "empty")


async def test_wrong_or_missing_secret_between_cli_and_peer(peers: Any, ctl: Any, tmp_path: Path) -> None:
    right = tmp_path / "right"
    right.write_text("correct horse battery staple\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("something else\n")
    addrs = await _running_cluster(peers, ctl, 2, secret_file=str(right))
    ok, _ = run_cli(ctl, "members", "--peer", addrs[0], "--json", "--secret-file", str(right))
    assert ok.returncode == 0 and len(json.loads(ok.stdout)["members"]) == 2
    proc, took = run_cli(ctl, "members", "--peer", addrs[0], "--secret-file", str(wrong), "--timeout", "2")
    assert_one_line_error(proc, took, addrs[0])
    proc, took = run_cli(ctl, "members", "--peer", addrs[0], "--timeout", "2")           # no secret at all
    assert_one_line_error(proc, took, addrs[0])


def test_argument_wins_over_environment(ctl: Any, tmp_path: Path) -> None:
    env_port, arg_port = ctl.free_ports(2)
    env = dict(ctl.child_env(), P2PFT_LISTEN=f"127.0.0.1:{env_port}")
    ready = tmp_path / "ready"
    with open(tmp_path / "log", "wb") as log:
        proc = subprocess.Popen(ctl.p2pft_command() + ["peer", "--listen", f"127.0.0.1:{arg_port}", "--ready-file",
                                                       str(ready)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert ready.read_text().strip() == f"127.0.0.1:{arg_port}"
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("args, message", [
    (["--loop-timeout", "5", "--comm-timeout", "10"], "--loop-timeout (5 s) must exceed --comm-timeout (10 s)"),
    (["--comm-timeout", "0"], "--comm-timeout must be positive"),
])
def test_example_replica_rejects_a_config_that_cannot_work(args: list[str], message: str) -> None:
    import sys
    r = subprocess.run([sys.executable, "-m", "p2pft.trainer.examples.replica", "--replica-id", "x", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_log_level_is_accepted_after_the_subcommand() -> None:
    """`p2pft peer --log-level INFO` works like `p2pft --log-level INFO peer`; a bad level is one line."""
    from p2pft.cli import build_parser
    p = build_parser()
    assert p.parse_args(["peer", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert p.parse_args(["--log-level", "WARNING", "peer"]).log_level == "WARNING"
    late = ["--log-level", "WARNING", "members", "--peer", "h:1", "--log-level", "INFO"]
    assert p.parse_args(late).log_level == "INFO"
    assert p.parse_args(["peer"]).log_level is None
    assert p.parse_args(["peer", "--log-level", "debug"]).log_level == "DEBUG"
    r = subprocess.run([sys.executable, "-m", "p2pft.cli", "peer", "--log-level", "LOUD"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "unknown level 'LOUD'" in r.stderr and "Traceback" not in r.stderr
