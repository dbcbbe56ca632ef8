"""DiLoCo across islands: 2 FSDP replicas x 2 ranks (gloo inside), DiLoCo between them, 2
witnesses, real processes on loopback (``trainer/examples/hsdp_replica.py --sync-every``).

Island B is SIGKILLed whole (its launcher and every rank) mid-run and restarted. Checked from the
islands' own records: A keeps syncing alone (1 contributor) with a bounded gap; the restarted B
catches up shard by shard, hands over between syncs and contributes at the very next sync (the
rest of the span in progress: a partial span); at equal syncs both islands hold bitwise equal
per-shard digests (global weights and outer optimizer state); committed syncs never go back, no
sample is trained twice; both end at the job's last inner step with one full digest, exit 0.
Then a plain PyTorch replay in this process (``replay``: one unsharded model per island
incarnation, each inner step's gradient as the island's two ranks computed it, partial spans
weighted by their inner steps, the outer Nesterov SGD) lands on A's final global weights.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from replica_harness import check_invariants, records, steps
from test_hsdp import Cluster

from p2pft.deploy.procs import pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SPAN = 8           # inner steps per sync (a restarted island usually comes back mid-span)
SYNCS = 20         # the job's end: SYNCS * SPAN inner steps (long enough for B to come back)
BATCH = 4          # samples per island per inner step (2 per rank), as test_hsdp's Cluster runs them
LR = 3e-3          # the inner AdamW's (hsdp_replica.py's default), betas (0.9, 0.99)


def test_diloco_islands_survive_the_loss_of_a_whole_island(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    extra = ("--sync-every", str(SPAN), "--steps", str(SPAN * SYNCS), "--digest-every", "1",
             "--step-delay", "0.05", "--rank-timeout", "3")
    c.spawn_witnesses()
    c.spawn("a", "a", extra + ("--checkpoint-dir", str(tmp_path / "ckpt-a"), "--checkpoint-every", str(SYNCS)))
    c.spawn("b", "b0", extra)
    pids: list[int] = []
    try:
        c.wait(lambda: c.last_step("a") >= 3 and c.last_step("b0") >= 3, 90, "3 syncs on both islands")
        start = [r for r in records(c.stats["b0"]) if r.get("kind") == "start"][0]
        pids = [int(p) for p in start["pids"]]
        c.procs["b0"].kill()          # the whole island: its launcher and every rank
        for p in pids:
            os.kill(p, signal.SIGKILL)
        t_kill = time.time()
        c.wait(lambda: c.procs["b0"].poll() is not None, 10, "B's launcher to die", allow_exit=("b0",))
        c.gone = ("b0",)
        t_restart = time.time()
        # At once: A syncs alone while B's ranks start. B's first inner steps are slow (a cold
        # start: 0.6 s more each), so the span it joins ends, when A starts the sync, before B
        # has taken all of its inner steps: a partial span, whatever the moment B hands over (on
        # this 2-core box the snapshot's stream, at the lowest priority, lands as A syncs).
        c.spawn("b", "b1", extra + ("--cold-steps", str(SPAN), "--cold-delay", "0.6"))
        c.wait(lambda: any(r["c"] and r["n"] == 1 for r in steps(c.stats["a"]) if r["t"] > t_kill), 30,
               "A to sync alone", allow_exit=c.gone)
        c.wait(lambda: any(r["c"] and r["role"] == "participant" and r["n"] == 2 for r in steps(c.stats["b1"])),
               90, "the restarted B to contribute", allow_exit=c.gone)
        c.wait(lambda: c.procs["a"].poll() is not None and c.procs["b1"].poll() is not None, 120,
               "both islands to finish the job", allow_exit=c.gone + ("a", "b1"))
    finally:
        rcs = c.stop_all()
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
    assert rcs["a"] == 0 and rcs["b1"] == 0, f"exit statuses {rcs}"
    assert not any(pid_alive(p) for p in pids)
    digests = check_invariants({"a": c.stats["a"], "b0": c.stats["b0"], "b1": c.stats["b1"]})
    a_syncs = [r for r in steps(c.stats["a"]) if r["c"]]
    t_back = min(r["t"] for r in steps(c.stats["b1"]) if r["c"] and r["n"] == 2)
    during = [r for r in a_syncs if t_kill < r["t"] < t_back]
    assert sum(1 for r in during if r["n"] == 1) >= 2, "A did not sync alone while B was away"
    before = max(r["t"] for r in a_syncs if r["t"] <= t_kill)
    gaps = [y["t"] - x["t"] for x, y in zip([{"t": before}] + during, during)]
    assert max(gaps) < 10.0, f"A's longest gap between syncs while B was away: {max(gaps):.2f} s"
    # B caught up on every rank and contributed; per-shard digests equal at equal syncs.
    assert any(r.get("event") == "catchup_done" for r in records(c.stats["b1"]) if r.get("kind") == "event")
    common = sorted({r["step"] for r in steps(c.stats["a"]) if "digest" in r}
                    & {r["step"] for r in steps(c.stats["b1"]) if "digest" in r})
    assert len(common) >= 2 and all(len(digests[s].split(",")) == 2 for s in common)
    ends = {n: [r for r in records(c.stats[n]) if r.get("kind") == "exit"][-1] for n in ("a", "b1")}
    assert ends["a"]["step"] == ends["b1"]["step"] == SYNCS
    assert ends["a"]["digest"] == ends["b1"]["digest"] and ends["a"]["full"] == ends["b1"]["full"]
    # B holds the global weights at sync `held` and contributes to the very next one.
    held = [r for r in records(c.stats["b1"]) if r.get("event") == "catchup_done"][0]["step"]
    first = min((r for r in steps(c.stats["b1"]) if r["c"] and r.get("tr")), key=lambda r: r["step"])
    assert first["step"] == held + 1, f"B held sync {held}, first contributed to sync {first['step']}"
    assert sum(y - x for x, y in first["tr"]) < BATCH * SPAN, f"B's first span was whole: {first}"
    got = replay({n: c.stats[n] for n in ("a", "b0", "b1")}, tmp_path / "ckpt-a", SYNCS)
    # Bitwise: the same kernels on the same samples in the same order, two contributions a sum.
    assert got["cursor_checked"] >= SYNCS and got["partial_spans"] >= 1 and got["max_abs_diff"] == 0.0, got
    print(f"\nislands: A's first sync alone {during[0]['t'] - t_kill:.2f} s after the kill, longest gap "
          f"{max(gaps):.2f} s; restart -> B contributes {t_back - t_restart:.2f} s; B held sync {held} and "
          f"contributed {sum(b - a for a, b in first['tr'])} of {BATCH * SPAN} samples to sync {held + 1}; "
          f"equal shard digests at syncs {common}; replay {got}")


def replay(stats: dict[str, Path], ckpt_dir: Path, syncs: int) -> dict[str, Any]:
    """Train the committed syncs in this process, plain PyTorch: per island incarnation (a stats
    file) an unsharded model and inner AdamW; per sync, each contributor restarts its model from
    the global weights and takes its inner steps on the samples it recorded (an inner step's
    gradient: the mean of its two ranks' gradients, each on its half of the step's samples, as
    FSDP reduces them); the pseudo-gradients' sum over the spans' worth of work they did (a
    partial span counts as its fraction), the outer Nesterov SGD; compared with A's final global
    weights (its DCP checkpoint)."""
    import copy

    import torch
    import torch.distributed.checkpoint as dcp

    from p2pft.trainer.algorithms.outer import outer_sgd
    from p2pft.trainer.data import TextDataset
    from p2pft.trainer.kernel.cursor import DataCursor
    from p2pft.trainer.model import model_config_for

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = model_config_for("tiny")
    glob = cfg.build()
    data = TextDataset(cfg.seq_len)
    outer = outer_sgd(list(glob.parameters()))
    b = BATCH * SPAN
    # (sync index, slot) -> (incarnation, ranges), from each island's own records
    mine: dict[tuple[int, int], tuple[str, list[tuple[int, int]]]] = {}
    for name, path in stats.items():
        for r in steps(path):
            if r["c"] and r.get("tr"):
                mine[(r["ts"], r["slot"])] = (name, [(x[0], x[1]) for x in r["tr"]])
    rings = {r["step"] - 1: sorted(s for s, _ in r["sr"]) for r in steps(stats["a"]) if r["c"] and r.get("sr")}
    cursor = DataCursor(b)
    inner: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    owner: dict[int, str] = {}
    checked, partial = 0, 0
    for i in range(syncs):
        slots = rings[i]
        total = [torch.zeros_like(p) for p in glob.parameters()]
        work, short = 0.0, {}
        for slot in slots:
            name, ranges = mine.get((i, slot), (owner.get(slot, ""), cursor.assign(slot)))
            owner[slot] = name
            idx = [k for x, y in ranges for k in range(x, y)]
            if len(idx) < b:
                short[slot], partial = b - len(idx), partial + 1
            assert [tuple(x) for x in cursor.trained(slot, short.get(slot, 0))] == [tuple(x) for x in ranges]
            checked += (i, slot) in mine
            if name not in inner:
                m = copy.deepcopy(glob)
                inner[name] = (m, torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.99)))
            m, opt = inner[name]
            with torch.no_grad():
                for lp, gp in zip(m.parameters(), glob.parameters()):
                    lp.copy_(gp)
            for k in range(len(idx) // BATCH):
                step = idx[k * BATCH:(k + 1) * BATCH]
                half = BATCH // 2
                grads = []
                for r in range(2):
                    opt.zero_grad(set_to_none=True)
                    m.loss(data.batch(step[r * half:(r + 1) * half])).backward()
                    grads.append([p.grad.detach().clone() for p in m.parameters()])
                for p, g0, g1 in zip(m.parameters(), *grads):
                    p.grad = (g0 + g1) / 2
                opt.step()
            for t, gp, lp in zip(total, glob.parameters(), m.parameters()):
                t.add_(gp.detach() - lp.detach())
            work += len(idx) / b
        cursor.commit([k in slots for k in range(cursor.max_slots)], short)
        for gp, t in zip(glob.parameters(), total):
            gp.grad = torch.div(t, work)
        outer.step()
        outer.zero_grad(set_to_none=True)
    theirs = cfg.build()
    sd = {"model": theirs.state_dict()}
    dcp.load(sd, checkpoint_id=str(ckpt_dir / f"step-{syncs:012d}"), no_dist=True)
    theirs.load_state_dict(sd["model"])
    ref = dict(theirs.named_parameters())
    diff = max(float((p.detach() - ref[n].detach()).abs().max()) for n, p in glob.named_parameters())
    torch.manual_seed(0)
    moved = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(glob.parameters(),
                                                                             cfg.build().parameters()))
    return {"max_abs_diff": diff, "cursor_checked": checked, "partial_spans": partial, "moved": moved}
