"""One rank of a multi-process transport test, driven by JSON lines on stdin.

Started by the tests with subprocess so that it can be SIGKILLed / SIGSTOPped for real. Prints
one JSON object per line on stdout. Commands:
  {"cmd": "comm", "epoch": e, "rank": r, "peers": [...], "timeout": t}
  {"cmd": "allreduce", "epoch": e, "nel": n, "seed": s, "check": bool, "contribute": bool, "tag": k}
  {"cmd": "close", "epoch": e}
  {"cmd": "stats"}     -> {"threads": [...], "fds": n}
  {"cmd": "exit"}
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

from p2pft.transport import CommError, DataServer


def data_for(seed: int, rank: int, nel: int) -> np.ndarray:
    # Cheap deterministic data (np.random for hundreds of MB would dominate the test time).
    base = np.arange(nel, dtype=np.float32)
    return np.sin(base * (0.001 * (rank + 1)) + seed).astype(np.float32)


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    server = DataServer()
    comms: dict[int, object] = {}
    emit({"event": "ready", "addr": server.addr, "pid": os.getpid()})
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "comm":
            comms[msg["epoch"]] = server.communicator(msg["epoch"], 0, msg["rank"], msg["peers"],
                                                      timeout=msg.get("timeout", 10.0),
                                                      connect_timeout=msg.get("connect_timeout", 5.0))
            emit({"event": "comm"})
        elif cmd == "allreduce":
            comm = comms[msg["epoch"]]
            nel = msg["nel"]
            if msg.get("check"):
                x = data_for(msg["seed"], comm.rank, nel)  # type: ignore[attr-defined]
            else:
                x = np.ones(nel, dtype=np.float32)
            emit({"event": "started", "t": time.time()})
            t0 = time.monotonic()
            try:
                count = comm.allreduce(x, contribute=msg.get("contribute", True),  # type: ignore[attr-defined]
                                       tag=msg.get("tag", 0))
            except CommError as e:
                emit({"event": "error", "cls": type(e).__name__, "peer_rank": e.peer_rank,
                      "peer_addr": e.peer_addr, "reason": e.reason, "t": time.time(),
                      "elapsed": time.monotonic() - t0})
                continue
            ok = None
            if msg.get("check"):
                world = comm.world  # type: ignore[attr-defined]
                exp = sum(data_for(msg["seed"], r, nel).astype(np.float64) for r in range(world))
                ok = bool(np.allclose(x, exp, rtol=1e-5, atol=1e-4))
            emit({"event": "done", "count": count, "ok": ok, "elapsed": time.monotonic() - t0})
        elif cmd == "close":
            comms.pop(msg["epoch"]).close()  # type: ignore[attr-defined]
            emit({"event": "closed"})
        elif cmd == "stats":
            emit({"event": "stats", "threads": [t.name for t in threading.enumerate()],
                  "fds": len(os.listdir("/proc/self/fd"))})
        elif cmd == "exit":
            break
    for c in comms.values():
        c.close()  # type: ignore[attr-defined]
    server.close()
    emit({"event": "bye"})


if __name__ == "__main__":
    main()
