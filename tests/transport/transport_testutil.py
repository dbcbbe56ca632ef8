"""Helpers shared by the transport tests: in-process rings and subprocess ranks."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

WORKER = str(Path(__file__).with_name("transport_rank_worker.py"))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def p2pft_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("p2pft-")]


def run_ranks(fns: list[Callable[[], Any]], timeout: float = 20.0) -> list[Any]:
    """Run one callable per rank on its own thread; return results or the exceptions raised."""
    out: list[Any] = [None] * len(fns)

    def wrap(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out[i] = e

    ths = [threading.Thread(target=wrap, args=(i,), name=f"test-rank-{i}") for i in range(len(fns))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout)
    assert not any(t.is_alive() for t in ths), "a rank did not finish in time"
    return out


class RankProc:
    """A transport_rank_worker subprocess speaking JSON lines."""

    def __init__(self) -> None:
        env = dict(os.environ)
        self.p = subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, bufsize=1, env=env)
        self.q: queue.Queue[dict] = queue.Queue(maxsize=1000)
        self.reader = threading.Thread(target=self._read, daemon=True, name="test-rank-reader")
        self.reader.start()
        ready = self.expect("ready", 30)
        self.addr: str = ready["addr"]
        self.pid: int = ready["pid"]

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.q.put(json.loads(line))

    def send(self, **cmd: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def expect(self, *events: str, timeout: float = 30) -> dict:
        msg = self.q.get(timeout=timeout)
        assert msg["event"] in events, f"expected {events}, got {msg}"
        return msg

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.kill(self.p.pid, sig)

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.kill()
            except OSError:
                pass
        self.p.wait(10)
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()  # type: ignore[union-attr]
            except OSError:
                pass
