"""HSDP ready for an LLM recipe: global-norm clipping that replays exactly, and a short pause that
comes back by fast-forward. 2 replicas x 2 FSDP2 ranks (gloo, CPU) + 2 witnesses, real processes
on loopback, the example replica ``trainer/examples/hsdp_replica.py`` with ``--clip-norm``.

1. ``test_hsdp_clip_kill_replays_exactly``: clipping that triggers on most steps; replica B is
   SIGKILLed mid-run (its whole process group) and restarted; it catches up (snapshot + replay of
   the logged steps, each clipped by the norm that rode with its entry) and both replicas end the
   job at ``--steps`` with one digest. Then a plain PyTorch replay in this process (an unsharded
   model from the same seed; per committed step, the contributors' samples from the replicated
   data cursor over the recorded masks, each contributor's gradient as its two ranks computed it,
   their mean, the logged clip coefficient, the lr factor for that step's count, AdamW) ends
   within 1e-5 of the survivor's final weights (its DCP checkpoint loaded into an unsharded model).
2. ``test_hsdp_short_pause_fast_forwards``: replica B pauses (``rep.pause``) while A commits a
   few steps alone; back, every rank of B fetches the mean gradients of its shard for the steps it
   missed from A's rank of the same shard (a ``fast_forward`` event, no ``catchup_start``), and
   the two end with one digest.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from replica_harness import check_invariants, records, steps
from test_hsdp import Cluster as HsdpCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
# By path: the launcher starts without importing torch, so a restart's ranks are up sooner.
SCRIPT = str(ROOT / "trainer" / "examples" / "hsdp_replica.py")
CLIP = 0.9          # the mean gradient's norm is 0.8-3 over these steps: most steps clip, some do not
SEED = 3
BATCH = 4           # samples per replica per step, 2 per rank
LR = 3e-3


class Cluster(HsdpCluster):
    """test_hsdp's two replicas and two witnesses, each process in a session of its own (a kill
    takes a whole replica), with this file's recipe (clipping, seed, lr, the job's end)."""

    tolerate_sigkill = True
    stop_timeout = 30.0
    new_session = True

    def __init__(self, tmp: Path, steps_: int) -> None:
        super().__init__(tmp)
        self.steps_ = steps_

    def spawn(self, rid: str, name: str, extra: tuple[str, ...] = ()) -> None:
        seeds = [a for r, a in self.addr.items() if r != rid] + self.witnesses
        self.stats[name] = self.tmp / f"{name}.jsonl"
        self._popen(name, [sys.executable, SCRIPT, "--nproc-per-node", "2", "--replica-id", rid,
                           "--listen", self.addr[rid], "--seeds", ",".join(seeds), "--stats", str(self.stats[name]),
                           "--min-replicas", "2", "--steps", str(self.steps_), "--seed", str(SEED),
                           "--batch", str(BATCH), "--lr", str(LR), "--clip-norm", str(CLIP), "--digest-every", "5",
                           "--log-level", "INFO", "--progress", "off", *extra])

    def kill(self, name: str) -> None:
        """SIGKILL the whole replica at once: the launcher and its ranks (its process group)."""
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)

    def events(self, name: str, kind: str) -> list[dict[str, Any]]:
        return [r for r in records(self.stats[name]) if r.get("kind") == "event" and r.get("event") == kind]

    def exits(self, name: str) -> list[dict[str, Any]]:
        return [r for r in records(self.stats[name]) if r.get("kind") == "exit"]


def _ended_together(c: Cluster, names: tuple[str, str], total: int) -> dict[str, Any]:
    for n in names:
        assert c.procs[n].returncode == 0, (c.tmp / f"{n}.log").read_text()[-3000:]
    ends = [c.exits(n)[-1] for n in names]
    assert all(e["step"] == total for e in ends), ends
    assert ends[0]["digest"] == ends[1]["digest"] and ends[0]["full"] == ends[1]["full"], \
        "the replicas ended the job with different weights"
    return ends[0]


# ---------------------------------------------------------------------- the plain PyTorch replay
def committed_history(stats: list[Path], total: int) -> list[dict[str, Any]]:
    """Per committed step (0-based: the step from i to i + 1), what every replica's line of it
    says: the contributing slots and their ring, the count, the clip coefficient and norm, the
    lr; lines of one step from several replicas must agree (the norm rode with the entry)."""
    by_step: dict[int, dict[str, Any]] = {}
    for path in stats:
        for r in steps(path):
            if not r["c"] or r.get("ff") or "clip" not in r or "sr" not in r:
                continue
            i = int(r["step"]) - 1
            line = {"n": int(r["n"]), "sr": [tuple(x) for x in r["sr"]], "clip": float(r["clip"]),
                    "norm": float(r["norm"]), "lr": float(r["lr"])}
            seen = by_step.setdefault(i, line)
            assert seen == line, f"step {i + 1}: two replicas recorded {seen} and {line}"
            assert len(line["sr"]) == line["n"], line
    missing = [i for i in range(total) if i not in by_step]
    assert not missing, f"committed steps nobody recorded: {missing}"
    return [by_step[i] for i in range(total)]


def trained_ranges(stats: list[Path]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(step index, slot) -> the sample ranges a replica recorded it trained there."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for path in stats:
        for r in steps(path):
            if r.get("tr") and r.get("slot") is not None and r.get("ts") is not None:
                out[(int(r["ts"]), int(r["slot"]))] = [(int(a), int(b)) for a, b in r["tr"]]
    return out


def replay(history: list[dict[str, Any]], trained: dict[tuple[int, int], list[tuple[int, int]]],
           checkpoint: Path, planned: int = 2) -> dict[str, Any]:
    """Train the committed history in this process on an unsharded model and compare with the
    survivor's final weights (its DCP checkpoint, loaded as a plain PyTorch script does)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from p2pft.trainer.data import TextDataset
    from p2pft.trainer.kernel.cursor import DataCursor
    from p2pft.trainer.model import model_config_for
    from p2pft.trainer.state.whole import params_digest

    t0 = time.monotonic()
    torch.set_num_threads(1)   # as the ranks: the same kernels, the same float sums
    torch.manual_seed(SEED)
    cfg = model_config_for("tiny")
    model = cfg.build()
    data = TextDataset(cfg.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99))
    params = [p for p in model.parameters()]
    cursor = DataCursor(BATCH)
    ranks = 2
    norm_rel, coef_diff, lr_diff, cursor_checked = 0.0, 0.0, 0.0, 0
    for i, st in enumerate(history):
        slots = sorted(s for s, _ in st["sr"])
        total = [torch.zeros_like(p) for p in params]
        for slot in slots:
            ranges = cursor.assign(slot)
            if (i, slot) in trained:   # the replica's own record of its samples
                assert [tuple(x) for x in ranges] == trained[(i, slot)], (i, slot, ranges, trained[(i, slot)])
                cursor_checked += 1
            idx = [k for a, b in ranges for k in range(a, b)]
            per = len(idx) // ranks
            local = []
            for r in range(ranks):       # each rank's gradient of its share (HSDP.begin's split)
                opt.zero_grad(set_to_none=True)
                model.loss(data.batch(idx[r * per:(r + 1) * per])).backward()
                local.append([p.grad.detach().clone() for p in params])
            for t, g0, g1 in zip(total, *local):   # FSDP's reduce-scatter: the ranks' mean
                t.add_((g0 + g1) / ranks)
        cursor.commit([k in slots for k in range(cursor.max_slots)])
        # The replicas' mean. Their sum is the ring's (`sr`) in any order: each shard's ring adds at
        # most two contributions (float addition commutes), the rest of the ring adds zeros.
        assert len(slots) <= 2, st
        for p, t in zip(params, total):
            p.grad = torch.div(t, float(st["n"]))
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(p.grad, dtype=torch.float64)) ** 2 for p in params))
        norm_rel = max(norm_rel, abs(norm - st["norm"]) / st["norm"])
        # the coefficient clip_grad_norm_ takes for this norm: the logged one is it
        coef_diff = max(coef_diff, abs(min(1.0, CLIP / (norm + 1e-6)) - st["clip"]))
        if st["clip"] < 1.0:                     # the logged coefficient, as OptimizerStep._clip applies it
            for p in params:
                p.grad.mul_(st["clip"])
        lr = LR * math.sqrt(st["n"] / planned)   # lr_policy sqrt, nominal replicas 2
        lr_diff = max(lr_diff, abs(lr - st["lr"]))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        for g in opt.param_groups:
            g["lr"] = LR
        opt.zero_grad(set_to_none=True)
    theirs = cfg.build()
    sd = {"model": theirs.state_dict()}
    dcp.load(sd, checkpoint_id=str(checkpoint), no_dist=True)
    theirs.load_state_dict(sd["model"])
    ref = dict(theirs.named_parameters())
    diff = max(float((p.detach() - ref[n].detach()).abs().max()) for n, p in model.named_parameters())
    return {"max_abs_diff": diff, "replay_digest": params_digest(dict(model.named_parameters())),
            "checkpoint_digest": params_digest(ref), "norm_rel_diff": norm_rel, "clip_max_abs_diff": coef_diff,
            "lr_max_abs_diff": lr_diff,
            "cursor_checked": cursor_checked, "seconds": round(time.monotonic() - t0, 1)}


# ---------------------------------------------------------------------- 1. clipping, a kill, the replay
def test_hsdp_clip_kill_replays_exactly(tmp_path: Path) -> None:
    t0 = time.time()
    total = 180   # B's restart takes 5-30 s on a loaded 2-core box (imports): A goes on alone meanwhile
    c = Cluster(tmp_path, total)
    c.spawn_witnesses()
    c.spawn("a", "a", ("--step-delay", "0.15", "--checkpoint-dir", str(tmp_path / "ckpt-a"),
                       "--checkpoint-every", str(total)))
    c.spawn("b", "b0", ("--step-delay", "0.15"))
    try:
        c.wait(lambda: c.last_step("a") >= 12 and c.last_step("b0") >= 12, 90, "12 steps on both replicas")
        at_kill = c.last_step("a")
        t_kill = time.time()
        c.kill("b0")
        c.wait(lambda: c.last_step("a") >= at_kill + 4, 30, "A to commit 4 steps alone", allow_exit=("b0",))
        t_restart = time.time()
        c.spawn("b", "b1", ("--step-delay", "0.15"))
        c.wait(lambda: all(c.procs[n].poll() is not None for n in ("a", "b1")), 150, "the job to finish",
               allow_exit=("b0", "a", "b1"))
    finally:
        c.stop_all()
    end = _ended_together(c, ("a", "b1"), total)
    check_invariants({n: c.stats[n] for n in ("a", "b0", "b1")})

    a_commits = [r for r in steps(c.stats["a"]) if r["c"]]
    # B came back: it caught up (snapshot, then the logged steps replayed) and contributed again.
    done = c.events("b1", "catchup_done")
    assert done, "the restarted B did not catch up"
    back = [r for r in steps(c.stats["b1"]) if r["c"] and r["n"] == 2]
    assert back, "the restarted B never contributed (did it start after the end?)"
    t_back = min(r["t"] for r in a_commits if r["t"] > t_kill and r["n"] == 2)   # as A saw it
    during = [r for r in a_commits if t_kill < r["t"] < t_back]
    assert during and all(r["n"] == 1 for r in during[1:]), "A did not commit alone while B was away"
    before = max(r["t"] for r in a_commits if r["t"] <= t_kill)
    gaps = [y["t"] - x["t"] for x, y in zip([{"t": before}] + during, during)]
    longest = max(gaps)
    assert longest < 5.0, f"A's longest commit gap while B was away: {longest:.2f} s"

    # Clipping triggered: the coefficient is < 1 on most committed steps.
    coefs = [float(r["clip"]) for r in a_commits if "clip" in r]
    clipped = sum(1 for k in coefs if k < 1.0) / len(coefs)
    assert len(coefs) >= total - 1 and clipped >= 0.5, f"clipped on {clipped:.0%} of {len(coefs)} steps"

    # The plain PyTorch replay against A's final checkpoint (DCP, step `total`).
    stats = [c.stats[n] for n in ("a", "b0", "b1")]
    got = replay(committed_history(stats, total), trained_ranges(stats), tmp_path / "ckpt-a" / f"step-{total:012d}")
    assert got["checkpoint_digest"] == end["full"], "the checkpoint does not hold the survivors' final weights"
    assert got["max_abs_diff"] <= 1e-5, got
    assert got["norm_rel_diff"] < 1e-6 and got["clip_max_abs_diff"] < 1e-6 and got["lr_max_abs_diff"] < 1e-12, got
    assert got["cursor_checked"] >= total, got   # the cursor's ranges are what the replicas recorded
    print(f"\nHSDP clip + kill: {total} steps, clipped on {clipped:.0%} "
          f"(coefficients {min(coefs):.3f}-{max(coefs):.3f}); "
          f"A alone {len(during)} steps, longest commit gap after the kill {longest:.2f} s; restart -> B "
          f"contributes {t_back - t_restart:.2f} s (snapshot of step {done[0].get('snapshot_step')}, replayed "
          f"{done[0].get('replayed')}); replay vs survivor max abs diff {got['max_abs_diff']:.3g} "
          f"(bitwise: {got['replay_digest'] == end['full']}), norm rel diff {got['norm_rel_diff']:.2g}, "
          f"replay {got['seconds']} s; total {time.time() - t0:.1f} s")


# ---------------------------------------------------------------------- 2. a short pause: fast-forward
def test_hsdp_short_pause_fast_forwards(tmp_path: Path) -> None:
    t0 = time.time()
    total = 40
    c = Cluster(tmp_path, total)
    c.spawn_witnesses()
    c.spawn("a", "a", ("--step-delay", "0.1"))
    c.spawn("b", "b", ("--step-delay", "0.1", "--pause-at-step", "10", "--pause-s", "1.5"))
    try:
        c.wait(lambda: all(c.procs[n].poll() is not None for n in ("a", "b")), 150, "the job to finish",
               allow_exit=("a", "b"))
    finally:
        c.stop_all()
    _ended_together(c, ("a", "b"), total)
    check_invariants({n: c.stats[n] for n in ("a", "b")})
    pause, resume = c.events("b", "pause"), c.events("b", "resume")
    assert pause and resume, "B did not pause and come back"
    t_pause, t_resume = pause[0]["t"], resume[0]["t"]
    missed = [r for r in steps(c.stats["a"]) if r["c"] and t_pause < r["t"] < t_resume]
    assert len(missed) >= 3, f"A committed only {len(missed)} steps during B's pause"
    after = [r for r in records(c.stats["b"]) if r.get("kind") == "event" and r["t"] >= t_pause]
    ff = [e for e in after if e["event"] == "fast_forward"]
    snap = [e for e in after if e["event"] == "catchup_start"]
    back = min((r for r in steps(c.stats["b"]) if r["c"] and r["n"] == 2 and r["t"] > t_resume), key=lambda r: r["t"])
    print(f"\nHSDP pause: A committed {len(missed)} steps during B's 1.5 s pause; B came back by "
          f"{'fast-forward ' + str([(e['from'], e['to']) for e in ff]) if ff else 'snapshot'}"
          f"{' and snapshot' if ff and snap else ''}, contributing again at step {back['step']} "
          f"{back['t'] - t_resume:.2f} s after the pause ended; total {time.time() - t0:.1f} s")
    assert ff and not snap, f"B came back by {'a snapshot' if snap else 'neither'}: {after}"
    assert ff[0]["from"] == pause[0]["step"], (ff, pause)
    # Every rank fetched its own shard's mean gradients (rank 0 writes the events; rank 1 logs).
    lines = [ln for ln in (c.tmp / "b.log").read_text().splitlines() if "fast-forwarded" in ln]
    assert any("/rank1 " in ln for ln in lines) and any("/rank1 " not in ln for ln in lines), lines
