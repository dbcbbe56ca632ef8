"""The README's training loop, runnable as written: two replicas on one machine,

    python -m p2pft.trainer.examples.loop r0 127.0.0.1:7100 127.0.0.1:7101
    python -m p2pft.trainer.examples.loop r1 127.0.0.1:7101 127.0.0.1:7100

The replicas need not seed alike: at step 0 every participant takes the leader's weights.
They meet at step 60 and exit together; one started after that prints that the job finished.
"""
import signal
import sys

import torch

from p2pft import Runtime
from p2pft.trainer import FaultTolerant, JobError
from p2pft.trainer.data import TextDataset
from p2pft.trainer.model import model_config_for

replica_id, listen, *seeds = sys.argv[1:]
cfg = model_config_for("tiny")
model, data = cfg.build(), TextDataset(cfg.seq_len)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
held_out = data.batch(list(range(len(data) - 32, len(data))))

rt = Runtime(replica_id=replica_id, listen=listen, seeds=seeds).start()
ft = FaultTolerant(rt, model, opt, batch_per_replica=8,
                   total_steps=60,        # the job's end, kept in the view (a late restart exits at once)
                   min_replicas=2,        # the first begin() waits for 2 participants (start_timeout=120)
                   loop_timeout=60.0,     # left out of the view when the loop stalls this long
                   step_timeout=120.0)    # commit() raises StepTimeout after this long without a view
signal.signal(signal.SIGTERM, lambda *_: ft.request_stop())
code = 0
try:
    while not ft.done:
        idx = ft.begin()                  # joins the group first; [] while this replica catches up
        ft.zero_grad()
        if idx:
            model.loss(data.batch(idx)).backward()
        res = ft.commit()                 # allreduce, retry across views, optimizer step
        if res.committed and res.step % 20 == 0 and ft.is_leader:
            with torch.no_grad():         # side work on one replica per step; it moves if the leader dies
                print(f"{replica_id} step {res.step} eval loss {float(model.loss(held_out)):.4f}", flush=True)
    ft.finish()                           # the end barrier: everyone at step 60, then all leave
    print(replica_id, "step", ft.step, "digest", ft.digest()[:16], flush=True)
except JobError as exc:                   # Stopped (SIGTERM), JobFinished (a late restart): exit 0;
    print(replica_id, exc, flush=True)    # MissingStateError, StepTimeout: 3; a misdeclared job: 2
    code = exc.exit_code
ft.close()
rt.close()
sys.exit(code)
