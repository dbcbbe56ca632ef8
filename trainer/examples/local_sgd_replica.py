"""A runnable local-SGD replica of a small regression job (``local_sgd.py``'s algorithm)::

    python -m p2pft.trainer.examples.local_sgd_replica --replica-id a --listen 127.0.0.1:7300 --seeds 127.0.0.1:7301
"""
from __future__ import annotations

import torch

from p2pft.runtime import Runtime
from p2pft.trainer.examples.local_sgd import LocalSGD


def main() -> int:
    import argparse
    import json
    import sys
    import time

    from p2pft.trainer.job.cli import add_job_args, job_kwargs
    from p2pft.ops.log import setup_logging
    from p2pft.trainer.kernel.errors import JobError

    p = argparse.ArgumentParser(description="a local-SGD replica of a small regression job")
    for flag, default in (("--replica-id", None), ("--listen", None), ("--seeds", ""), ("--stats", None)):
        p.add_argument(flag, default=default, required=default is None)
    for flag, value in (("--steps", 0), ("--min-replicas", 1), ("--seed", 0), ("--sync-every", 4)):
        p.add_argument(flag, type=int, default=value)
    p.add_argument("--step-delay", type=float, default=0.02)
    p.add_argument("--loop-timeout", type=float, default=60.0)
    p.add_argument("--comm-timeout", type=float, default=10.0)
    add_job_args(p)
    a = p.parse_args()
    setup_logging("INFO")
    torch.manual_seed(a.seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    rt = Runtime(replica_id=a.replica_id, listen=a.listen, seeds=[s for s in a.seeds.split(",") if s],
                 comm_timeout=a.comm_timeout).start()
    algo = LocalSGD(rt, model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=a.sync_every,
                    batch_per_replica=4, loop_timeout=a.loop_timeout, **job_kwargs(a))
    out = open(a.stats, "a", buffering=1)
    code = 0
    try:
        algo.start()
        while not algo.done:
            idx = algo.begin()
            algo.zero_grad()
            if idx:
                x = torch.stack([torch.sin(torch.arange(8.0) + i) for i in idx])
                model(x).sub(x.sum(1, keepdim=True).cos()).pow(2).mean().backward()
                time.sleep(a.step_delay)
            res = algo.commit()
            if res is not None:
                out.write(json.dumps({"t": time.time(), "step": res.step, "c": int(res.committed),
                                      "n": res.contributors, "role": res.role}) + "\n")
        end = algo.finish()
        out.write(json.dumps({"kind": "exit", "step": end, "digest": algo.digest()}) + "\n")
    except JobError as exc:
        print(f"replica {a.replica_id}: {exc}", file=sys.stderr, flush=True)
        code = exc.exit_code
    algo.close()
    rt.close(leave=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
