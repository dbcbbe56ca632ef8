"""The NCCL data plane against the TCP ring under the same chaos schedule, on the CPU stand-in.

Runs ``p2pft chaos --data-plane nccl --systems p2pft,failure_free --no-live`` with the stand-in
of CuPy's NCCL and of the device on the path (``tests/fakes``), then the same with
``--data-plane tcp``, ``--pairs`` times (nccl first in each pair), and reports each run's
survivor crashes, divergent steps and stalls, and per pair the ratio of the NCCL plane's stall
max to the TCP plane's (the bound is 2x). With the stand-in on the path the TCP plane stages
"device" tensors through the stand-in's deferred copy engine, so the two differ only in the
plane. The stand-in keeps NCCL's failure semantics; it says nothing of GPU speed.

    python bench/nccl_standin.py                         # 2 pairs, table on stdout
    python bench/nccl_standin.py --pairs 3 --json results/nccl_standin.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FAKES = Path(__file__).resolve().parents[1] / "tests" / "fakes"
RUN_TIMEOUT_S = 600.0


def one_run(plane: str, out: Path, seed: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(FAKES), os.environ.get("PYTHONPATH")])))
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "p2pft", "chaos", "--data-plane", plane, "--systems",
                           "p2pft,failure_free", "--no-live", "--seed", str(seed), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"p2pft chaos --data-plane {plane} exited {proc.returncode}: {proc.stderr[-2000:]}")
    systems = {s["system"]: s for s in json.loads((out / "chaos.json").read_text())["systems"]}
    p = systems["p2pft"]
    return {"plane": plane, "load": [round(load0, 1), round(os.getloadavg()[0], 1)],
            "wall_s": round(time.monotonic() - t0, 1), "kills": p["kills"],
            "survivor_crashes": p["survivor_crashes"], "divergent_steps": p["divergent_steps"],
            "stall_p50_s": p["stall_p50_s"], "stall_max_s": p["stall_max_s"], "rejoin_p50_s": p["rejoin_p50_s"],
            "sample_ett": p["sample_ett"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the runs and ratios here")
    ap.add_argument("--workdir", type=Path, help="keep the chaos runs' logs here (default: a temporary folder)")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="p2pft-nccl-standin-"))
    rows: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []
    for i in range(args.pairs):
        pair = [one_run(plane, work / f"{i}-{plane}", args.seed + i) for plane in ("nccl", "tcp")]
        for r in pair:
            rows.append({"pair": i + 1, **r})
        n, t = (r["stall_max_s"] for r in pair)
        pairs.append({"pair": i + 1, "nccl_stall_max_s": n, "tcp_stall_max_s": t,
                      "ratio": round(n / t, 2) if n is not None and t else None})
    print("| pair | plane | load | survivor crashes | divergent steps | stall p50 | stall max | rejoin p50 |")
    print("|---|---|---|---|---|---|---|---|")

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"
    for r in rows:
        print(f"| {r['pair']} | {r['plane']} | {r['load'][0]} → {r['load'][1]} | {r['survivor_crashes']} | "
              f"{r['divergent_steps']} | {fmt(r['stall_p50_s'])} | {fmt(r['stall_max_s'])} | "
              f"{fmt(r['rejoin_p50_s'])} |")
    for p in pairs:
        print(f"pair {p['pair']}: NCCL stall max / TCP stall max = {p['ratio']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": rows, "pairs": pairs}, indent=1))
    print(f"chaos runs and logs: {work}")


if __name__ == "__main__":
    main()
