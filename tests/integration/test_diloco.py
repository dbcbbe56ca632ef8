"""DiLoCo replicas as real processes on loopback: SIGKILLs during the inner steps and during
the outer allreduce, a restart that catches up. Checked from the replicas' own records:

- survivors keep every inner step they ran (each span they computed is in a committed mean);
- a kill during inner steps: the next sync commits with the survivors' pseudo-gradients;
- a kill during the outer allreduce: the survivors retry with the saved pseudo-gradient;
- replicas at the same sync hold identical global weights and outer optimizer state, the
  restarted one included once it has caught up; no sample is trained twice.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from replica_harness import ProcessSet, check_invariants, ports, records, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
HERE = Path(__file__).parent


class DiLoCoReplicas(ProcessSet):
    tolerate_sigkill = True

    def __init__(self, tmp: Path, n: int) -> None:
        super().__init__(tmp)
        self.addrs = [f"127.0.0.1:{p}" for p in ports(n)]

    def spawn(self, i: int, name: str, *extra: str) -> None:
        seeds = ",".join(a for j, a in enumerate(self.addrs) if j != i)
        stats = self.tmp / f"{name}.jsonl"
        cmd = [sys.executable, str(HERE / "diloco_replica.py"), "--replica-id", f"r{i}", "--listen", self.addrs[i],
               "--seeds", seeds, "--stats", str(stats), *extra]
        log = open(self.tmp / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                            env=dict(os.environ, OMP_NUM_THREADS="1"))
        log.close()
        self.stats[name] = stats

    def syncs(self, name: str) -> list[dict[str, Any]]:
        return steps(self.stats[name])

    def kill(self, name: str) -> float:
        """SIGKILL `name`; the time just before the signal (survivors may react before the reap)."""
        t = time.time()
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=5)
        return t


def _kept_all(rs: DiLoCoReplicas, name: str) -> None:
    ran = sum(r["ran"] for r in rs.syncs(name))
    kept = sum(r["kept"] for r in rs.syncs(name))
    assert ran > 0 and kept == ran, f"{name} kept {kept} of the {ran} inner steps it ran"


def _no_gaps(rs: DiLoCoReplicas, final: tuple[str, ...]) -> None:
    """The samples trained form [0, X) (holes were handed out again), below the last range each
    final replica trained (later ones may still owe holes when the test stopped them)."""
    ranges = sorted(tuple(x) for n in rs.stats for r in rs.syncs(n) for x in r.get("tr", []))
    upto = min(max(x[0] for r in rs.syncs(n) for x in r.get("tr", [])) for n in final)
    end = 0
    for a, b in ranges:
        if a >= upto:
            break
        assert a == end, f"samples [{end}, {a}) never trained (a hole not handed out again)"
        end = b


STREAMING = ("--sync-every", "8", "--fragments", "2", "--overlap", "2", "--alpha", "0.5", "--compression", "int8")


def _oracle(rs: DiLoCoReplicas, final: tuple[str, ...], h: int, batch: int = 4) -> float:
    """Replay plain DiLoCo from the records in one plain PyTorch process: per sync, each
    contributor's inner AdamW steps (one optimizer per process, fresh for a restarted one) from
    the global weights on the ranges it reports (a partial span: fewer of them), the pseudo-
    gradients' sum over the inner steps taken in spans (docs/diloco.md, "Partial spans"), the
    outer Nesterov step. The largest difference from the final replicas' saved global weights."""
    import copy

    import torch
    sys.path.insert(0, str(HERE))
    from diloco_replica import LR, build, sample

    from p2pft.trainer.algorithms.outer import outer_sgd
    by_sync: dict[int, list[tuple[str, list[tuple[int, int]]]]] = {}
    for name in rs.stats:
        for r in rs.syncs(name):
            if r.get("tr"):
                by_sync.setdefault(r["step"], []).append((name, [tuple(x) for x in r["tr"]]))
    glob = build()
    outer = outer_sgd(list(glob.parameters()))
    locals_: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    saved = {n: torch.load(str(rs.stats[n]) + ".final.pt") for n in final}
    at: dict[int, list[torch.Tensor]] = {}
    for s in range(1, max(v["syncs"] for v in saved.values()) + 1):
        grads = []
        spans = 0.0
        for name, ranges in sorted(by_sync.get(s, [])):
            if name not in locals_:
                m = copy.deepcopy(glob)
                locals_[name] = (m, torch.optim.AdamW(m.parameters(), lr=LR))
            m, opt = locals_[name]
            with torch.no_grad():
                for lp, gp in zip(m.parameters(), glob.parameters()):
                    lp.copy_(gp)
            idx = [i for a, b in ranges for i in range(a, b)]
            assert 0 < len(idx) <= h * batch and len(idx) % batch == 0, f"{name}: {len(idx)} samples at sync {s}"
            for k in range(len(idx) // batch):
                x, y = torch.utils.data.default_collate([sample(i) for i in idx[k * batch:(k + 1) * batch]])
                opt.zero_grad()
                (m(x) - y).pow(2).mean().backward()
                opt.step()
            grads.append([gp.detach() - lp.detach() for gp, lp in zip(glob.parameters(), m.parameters())])
            spans += len(idx) / (h * batch)
        assert grads, f"no contributor recorded for sync {s}"
        for j, gp in enumerate(glob.parameters()):
            gp.grad = sum(g[j] for g in grads) / spans
        outer.step()
        at[s] = [p.detach().clone() for p in glob.parameters()]
    return max(float((a - b).abs().max()) for v in saved.values() for a, b in zip(v["weights"], at[v["syncs"]]))


@pytest.mark.parametrize("mode", [(), STREAMING], ids=["diloco", "streaming-int8"])
def test_kill_during_inner_steps_then_restart_catches_up(tmp_path: Path, mode: tuple[str, ...]) -> None:
    rs = DiLoCoReplicas(tmp_path, 3)
    for i in range(3):
        rs.spawn(i, f"r{i}-0", "--min-replicas", "3", *mode)
    try:
        rs.wait(lambda: all(len(rs.syncs(f"r{i}-0")) >= 3 for i in range(3)), 50, "3 syncs on every replica")
        # Right after r2 ends a sync it is in its inner steps (span 4 x 20 ms and more).
        seen = len(rs.syncs("r2-0"))
        rs.wait(lambda: len(rs.syncs("r2-0")) > seen, 10, "r2's next sync")
        t_kill = rs.kill("r2-0")
        last = rs.last_step("r2-0")   # the others may record that same sync just after the kill
        rs.wait(lambda: all(any(r["t"] > t_kill and r["n"] == 2 and r["c"] for r in rs.syncs(n))
                            for n in ("r0-0", "r1-0")), 20, "a sync without r2")
        rs.spawn(2, "r2-1", *mode)
        rs.wait(lambda: any(r.get("tr") and r["n"] == 3 for r in rs.syncs("r2-1")), 40,
                "the restarted replica to contribute")
        target = max(rs.last_step(n) for n in ("r0-0", "r1-0", "r2-1")) + 2
        rs.wait(lambda: all(rs.last_step(n) >= target for n in ("r0-0", "r1-0", "r2-1")), 20, "2 more syncs")
    finally:
        rcs = rs.stop_all()
    assert rcs["r0-0"] == 0 and rcs["r1-0"] == 0 and rcs["r2-1"] == 0, f"exit statuses {rcs}"
    for n in ("r0-0", "r1-0"):
        _kept_all(rs, n)
        after = [r for r in rs.syncs(n) if r["step"] > last]
        assert after[0]["n"] == 2 and after[0]["c"] and after[0]["kept"] == after[0]["ran"] > 0, after[0]
    digests = check_invariants(rs.stats)
    _no_gaps(rs, ("r0-0", "r1-0", "r2-1"))
    if not mode:  # the oracle replays plain DiLoCo (not the streaming merge)
        diff = _oracle(rs, ("r0-0", "r1-0", "r2-1"), h=4)
        # the ring adds three pseudo-gradients in its own order: float rounding, not bitwise
        assert diff < 1e-4, f"the replay differs from the replicas' global weights by {diff}"
    mine = {r["step"] for r in rs.syncs("r2-1") if "digest" in r}
    assert any(s in digests for s in mine), "no digest of the restarted replica to compare"
    events = [r for r in records(rs.stats["r2-1"]) if r.get("kind") == "event"]
    assert any(e.get("event") == "catchup_done" for e in events), "the restarted replica did not catch up"


def test_kill_during_outer_allreduce_survivors_retry_with_saved_pseudo_gradient(tmp_path: Path) -> None:
    rs = DiLoCoReplicas(tmp_path, 3)
    rs.spawn(0, "r0-0", "--min-replicas", "3")
    rs.spawn(1, "r1-0", "--min-replicas", "3")
    rs.spawn(2, "r2-0", "--min-replicas", "3", "--step-delay", "0.5")  # slow: the others wait in the ring
    try:
        rs.wait(lambda: all(len(rs.syncs(f"r{i}-0")) >= 2 for i in range(3)), 50, "2 syncs on every replica")

        def in_ring() -> bool:
            done = {n: rs.last_step(n) for n in ("r0-0", "r1-0")}
            return all(any(r.get("kind") == "syncing" and r["sync"] == done[n] and time.time() - r["t"] > 0.3
                           for r in records(rs.stats[n])) for n in done)
        rs.wait(in_ring, 20, "r0 and r1 in the allreduce of a sync, waiting for r2")
        at = rs.last_step("r0-0")
        t_kill = rs.kill("r2-0")
        rs.wait(lambda: all(rs.last_step(n) >= at + 3 for n in ("r0-0", "r1-0")), 30, "3 syncs after the kill")
    finally:
        rcs = rs.stop_all()
    assert rcs["r0-0"] == 0 and rcs["r1-0"] == 0, f"exit statuses {rcs}"
    for n in ("r0-0", "r1-0"):
        _kept_all(rs, n)
        retried = [r for r in rs.syncs(n) if r["step"] == at + 1][0]
        assert retried["c"] and retried["r"] >= 1 and retried["n"] == 2, retried
        assert retried["kept"] == retried["ran"] > 0 and retried["t"] > t_kill
    check_invariants(rs.stats)


def test_a_restarted_replica_contributes_from_the_next_sync(tmp_path: Path) -> None:
    """Spans of 10 inner steps x 50 ms: a restarted replica pulls the global weights and outer
    optimizer as soon as it is in the view (donors serve them during their inner steps), hands
    over between syncs, is promoted, trains the rest of the span in progress and contributes it
    (a partial span) to the very next sync; no survivor waits for it (their syncs keep their
    pace); a replay with the partial spans weighted by their inner steps lands on the weights."""
    span = ("--sync-every", "10", "--step-delay", "0.05")
    rs = DiLoCoReplicas(tmp_path, 3)
    for i in range(3):
        rs.spawn(i, f"r{i}-0", "--min-replicas", "3", *span)
    try:
        rs.wait(lambda: all(len(rs.syncs(f"r{i}-0")) >= 3 for i in range(3)), 60, "3 syncs on every replica")
        t_kill = rs.kill("r2-0")
        rs.wait(lambda: any(r["t"] > t_kill and r["n"] == 2 and r["c"] for r in rs.syncs("r0-0")), 20,
                "a sync without r2")
        rs.spawn(2, "r2-1", *span)
        rs.wait(lambda: any(r.get("tr") and r["c"] for r in rs.syncs("r2-1")), 40,
                "the restarted replica to contribute")
        rs.wait(lambda: sum(1 for r in rs.syncs("r2-1") if r.get("tr") and r["c"]) >= 4, 20,
                "three more syncs with the restarted replica")
    finally:
        rcs = rs.stop_all()
    assert rcs["r0-0"] == 0 and rcs["r1-0"] == 0 and rcs["r2-1"] == 0, f"exit statuses {rcs}"
    up = [r for r in records(rs.stats["r2-1"]) if r.get("kind") == "begin"][0]
    at_up = max(r["step"] for r in rs.syncs("r0-0") if r["c"] and r["t"] <= up["t"])
    first = min(r["step"] for r in rs.syncs("r2-1") if r.get("tr") and r["c"])
    held = [r for r in records(rs.stats["r2-1"]) if r.get("event") == "catchup_done"][0]["step"]
    # It holds sync `held` (at most one sync after it came up) and contributes to the very next.
    assert held <= at_up + 1 and first == held + 1, f"up at sync {at_up}, held {held}, first contribution {first}"
    rec = next(r for r in rs.syncs("r2-1") if r["step"] == first)
    print(f"up at sync {at_up}, held {held}, first contribution at sync {first}: "
          f"{sum(b - a for a, b in rec['tr'])} samples of 40 ({rec['ran']} inner steps)")
    _kept_all(rs, "r0-0")
    gaps = [b["t"] - a["t"] for a, b in zip(rs.syncs("r0-0"), rs.syncs("r0-0")[1:]) if a["t"] > up["t"]]
    assert gaps and max(gaps) < 2.5, f"a survivor's sync waited {max(gaps):.2f} s after the restart"
    check_invariants(rs.stats)
    assert _oracle(rs, ("r0-0", "r1-0", "r2-1"), 10) < 1e-4
