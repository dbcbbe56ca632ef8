"""One rank of a TCP ring, for tests that put each rank on a host of its own: allreduce a
small array until an operation fails, then print how (one JSON line) and exit.

argv: rank, op timeout (s), then every rank's data address (rank i's is where rank i listens).
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from p2pft.transport import CommError, DataServer
from p2pft.transport.wire import split_addr


def main() -> None:
    rank, tmo, peers = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    host, port = split_addr(peers[rank])
    with DataServer(host, port) as ds:
        comm = ds.communicator(1, 0, rank, peers, timeout=tmo, connect_timeout=20.0)
        x = np.ones(1024, np.float32)
        n = 0
        while True:
            try:
                comm.allreduce(x)
            except CommError as e:
                print(json.dumps({"rank": rank, "t": time.time(), "ops": n, "error": type(e).__name__,
                                  "peer": e.peer_addr, "reason": str(e)}), flush=True)
                break
            n += 1
            if n == 5:
                print(json.dumps({"rank": rank, "ready": True}), flush=True)
            x[:] = 1.0
            time.sleep(0.05)   # compute between steps
        comm.close()


if __name__ == "__main__":
    main()
