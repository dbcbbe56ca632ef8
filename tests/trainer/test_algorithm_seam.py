"""The algorithm seam: algorithms are compositions the kernel drives, never its subclasses.

Read from the source: no algorithm module names a private member of the kernel or subclasses it
(docs/architecture.md, "Adding an algorithm"). Run for real: local SGD with a span of inner steps
longer than ``loop_timeout`` keeps both replicas in the view, because the kernel's ``Spans`` beats
at every inner step; the same run with that beat taken out gets a replica left out as stalled.
"""
from __future__ import annotations

import ast
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from p2pft import Runtime
from p2pft.deploy.ports import free_ports
from p2pft.trainer.examples.local_sgd import LocalSGD
from p2pft.trainer.kernel.errors import Stopped
from p2pft.trainer.kernel.span import Spans

ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS = sorted((ROOT / "trainer" / "algorithms").glob("*.py")) + [ROOT / "trainer/examples/local_sgd.py"]
KERNEL = ROOT / "trainer" / "kernel" / "engine.py"


def _kernel_privates() -> set[str]:
    """Every private name the kernel defines: methods and ``self._x`` attributes."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(KERNEL.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and not node.name.startswith("__"):
            names.add(node.name)
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            names.add(node.attr)
    return names


def test_the_kernel_has_privates_to_find() -> None:
    """The check below reads something: the kernel does keep private members."""
    assert {"_attempts", "_decide", "_slot", "_start_control"} <= _kernel_privates()


@pytest.mark.parametrize("path", ALGORITHMS, ids=lambda p: p.name)
def test_no_algorithm_names_a_private_of_the_kernel(path: Path) -> None:
    privates = _kernel_privates()
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            foreign = not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            if node.attr in privates or (foreign and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.name}:{node.lineno}: .{node.attr}")
        if isinstance(node, ast.ClassDef):
            bad += [f"{path.name}:{node.lineno}: {node.name} subclasses the kernel" for b in node.bases
                    if isinstance(b, (ast.Name, ast.Attribute)) and ast.unparse(b).endswith("StepEngine")]
    assert not bad, bad


# ---------------------------------------------------------------------------------- a long span
SYNC_EVERY = 4
INNER_S = 0.5        # one inner step: a span of 2 s
LOOP_TIMEOUT = 1.2   # shorter than the span, longer than the communicator timeout
SYNCS = 3


def _local_sgd_pair() -> list[Any]:
    """Two local-SGD replicas in one process (real Runtimes, real sockets, a thread each), each
    returning its sync results (step, contributors) and whether it ever left the view."""
    addrs = [f"127.0.0.1:{p}" for p in free_ports(2)]
    rts = [Runtime(replica_id=f"r{i}", listen=addrs[i], seeds=[addrs[1 - i]], comm_timeout=0.5).start()
           for i in range(2)]
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 1) for _ in range(2)]
    out: list[Any] = [None, None]

    def replica(i: int) -> None:
        try:
            rt, model = rts[i], models[i]
            algo = LocalSGD(rt, model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=SYNC_EVERY,
                            batch_per_replica=4, loop_timeout=LOOP_TIMEOUT, min_replicas=2, step_timeout=30.0)
            syncs: list[tuple[int, int]] = []
            left_out = False
            while algo.step < SYNCS:
                idx = algo.begin()
                algo.zero_grad()
                if idx:
                    model(torch.ones(len(idx), 4)).sum().backward()
                    time.sleep(INNER_S)
                me = rt.me()
                left_out |= me is None or me.role.value != "participant"
                res = algo.commit()
                if res is not None and res.committed:
                    syncs.append((res.step, res.contributors))
            out[i] = (syncs, left_out or any(e.get("kind") == "excluded" for e in algo.events))
            algo.request_stop()
            algo.close()
        except Stopped:
            out[i] = ([], True)
        except BaseException as exc:
            out[i] = exc
    threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    finally:
        for rt in rts:
            rt.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_span_longer_than_loop_timeout_keeps_the_replicas_in_the_view() -> None:
    assert SYNC_EVERY * INNER_S > LOOP_TIMEOUT
    out = _local_sgd_pair()
    for got in out:
        assert not isinstance(got, BaseException) and got is not None, got
        syncs, left_out = got
        assert not left_out, "a replica training a long span was left out of the view as stalled"
        assert [n for _, n in syncs] == [2] * SYNCS, syncs


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_without_the_span_beat_the_same_run_leaves_a_replica_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the beat at every inner step is what keeps them in (a span's inner steps
    then beat only at its start, in the kernel's collective begin)."""
    def begin_without_beat(self: Spans, stop: bool = False) -> list[int]:
        if self.k == 0:
            self.samples = self.kernel.begin(stop)
        per = len(self.samples) // self.span
        return self.samples[self.k * per:(self.k + 1) * per]
    monkeypatch.setattr(Spans, "begin", begin_without_beat)
    out = _local_sgd_pair()
    assert not any(isinstance(g, BaseException) for g in out), out
    assert any(left_out or any(n < 2 for _, n in syncs) for syncs, left_out in out), out
