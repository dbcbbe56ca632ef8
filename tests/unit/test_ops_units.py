"""Step metrics, cluster events and the `p2pft top` frame, on real registries and real views."""
from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from p2pft.net.driver import NodeServer
from p2pft.ops.metrics import parse_metrics_addr
from p2pft.trainer.metrics import StepMetrics, state_bytes
from p2pft.ops.observe import family, rejected_counts
from p2pft.ops.top import build_frame, render_plain
from p2pft.trainer.algorithms.ft import StepResult
from p2pft.core.view import View


def value(reg: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    v = reg.get_sample_value(name, labels or {})
    assert v is not None, (name, generate_latest(reg).decode())
    return v


def ok(step: int, n: int = 3, retries: int = 0, role: str = "participant") -> StepResult:
    return StepResult(step=step, committed=True, contributors=n, retries=retries, role=role)


def test_step_metrics_count_steps_retries_and_stalls() -> None:
    reg = CollectorRegistry()
    m = StepMetrics(reg)
    for s in range(1, 11):
        m.observe_step(ok(s), seconds=0.1)
    m.observe_step(ok(11, n=3, retries=2), seconds=0.6)      # a failure mid-step: retried
    m.observe_step(ok(12, n=2), seconds=0.35)                # a contributor fewer
    m.observe_step(StepResult(12, False, 0, 0, "joiner", fast_forwarded=4), seconds=0.1)
    assert value(reg, "p2pft_committed_step") == 12
    assert value(reg, "p2pft_steps_total", {"outcome": "committed"}) == 12
    assert value(reg, "p2pft_steps_total", {"outcome": "not_committed"}) == 1
    assert value(reg, "p2pft_step_retries_total") == 2
    assert value(reg, "p2pft_fast_forwarded_steps_total") == 4
    assert value(reg, "p2pft_step_seconds_count") == 13
    assert value(reg, "p2pft_failure_stall_seconds_count") == 2
    assert value(reg, "p2pft_failure_stall_seconds_sum") == pytest.approx(0.5 + 0.25)   # over the 0.1 s median
    assert value(reg, "p2pft_replica_role", {"role": "joiner"}) == 1
    assert value(reg, "p2pft_replica_role", {"role": "participant"}) == 0
    assert value(reg, "p2pft_step_contributors") == 2


class Trainer:
    """The attributes StepMetrics reads from FaultTolerant or HSDP: synced, model, opt."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(8, 4)
        self.opt = torch.optim.AdamW(self.model.parameters())
        self.model(torch.ones(2, 8)).sum().backward()
        self.opt.step()
        self.synced = True


def test_catchup_seconds_and_bytes() -> None:
    reg = CollectorRegistry()
    tr = Trainer()
    m = StepMetrics(reg, tr)
    m.observe_step(ok(1), seconds=0.1)
    assert value(reg, "p2pft_catchup_in_progress") == 0
    tr.synced = False
    m.observe_step(StepResult(1, False, 0, 0, "joiner"), seconds=0.1)
    assert value(reg, "p2pft_catchup_in_progress") == 1
    time.sleep(0.05)
    tr.synced = True
    m.observe_step(ok(5), seconds=0.1)
    assert value(reg, "p2pft_catchups_total") == 1
    assert value(reg, "p2pft_catchup_seconds_sum") >= 0.05
    # weights 8x4 + bias 4 = 36 floats; AdamW keeps exp_avg and exp_avg_sq of each, plus a step scalar each
    assert state_bytes(tr) == 36 * 4 * 3 + 2 * 4
    assert value(reg, "p2pft_catchup_bytes_total") == state_bytes(tr)


def test_disabled_step_metrics_cost_nothing() -> None:
    m = StepMetrics.attach(None, None)
    assert not m.enabled
    m.observe_step(ok(1))    # no registry: nothing to do, no error


def test_metrics_addr() -> None:
    assert parse_metrics_addr("9100", "127.0.0.1") == ("127.0.0.1", 9100)
    assert parse_metrics_addr("0.0.0.0:9100", "127.0.0.1") == ("0.0.0.0", 9100)
    assert parse_metrics_addr(9100, "") == ("0.0.0.0", 9100)
    for bad in ("x", "1:y", "70000"):
        with pytest.raises(ValueError):
            parse_metrics_addr(bad, "127.0.0.1")


def test_message_families_and_rejections() -> None:
    assert family("g.ping") == "gossip" and family("r.ae") == "raft" and family("v.delta") == "view"
    assert family("g.evil") == "other" and family("") == "other"
    assert rejected_counts({"bad_frame_malformed": 2, "idle_closed": 1, "frames_sent": 9}) == {
        "malformed": 2, "idle_closed": 1}


def member(node: str, role: str, step: int = 0) -> dict:
    return {"node": node, "replica_id": node.split(".")[0], "addr": f"127.0.0.1:{7000 + len(node)}",
            "data_addr": "", "role": role, "slot": None, "shards": 1, "since": 1}


def test_observer_turns_views_into_events() -> None:
    server = NodeServer(listen="127.0.0.1:0", seeds=[])
    obs = server.observer
    v1 = {"epoch": 1, "members": [member("a.1", "participant"), member("w.1", "witness")], "voters": ["a.1"]}
    v2 = {"epoch": 2, "members": [member("a.1", "participant"), member("b.1", "joiner"), member("w.1", "witness")]}
    v3 = {"epoch": 3, "members": [member("b.1", "participant"), member("w.1", "witness")], "left": []}
    for v in (v1, v2, v3):
        for cb in server.on_view:
            cb(View.from_wire(v))
    texts = [e.text for e in obs.events]
    assert texts[0] == "e1: first view here, 2 member(s)"
    assert "e2: b joined as joiner" in texts
    assert "e3: b joiner -> participant (caught up)" in texts
    assert "e3: a removed" in texts
    assert obs.joiner_since == {} and obs.views_seen == 3


def test_top_frame_rates_catchups_and_witnesses() -> None:
    t = 1000.0
    prev = {"now": t, "members": [dict(member("a.1", "participant"), state="alive", step=10, voter=True),
                                  dict(member("b.1", "joiner"), state="alive", step=0, voter=False)]}
    cur = {"now": t + 2, "node": "w.1", "epoch": 4, "data_epoch": 3, "leader": "a.1", "committed_at": t + 1,
           "term": 2, "leader_changes": 1, "joiner_since": {"b.1": t - 3},
           "events": [{"t": t, "kind": "joined", "text": "e4: b joined as joiner"}],
           "members": [dict(member("a.1", "participant"), state="alive", step=30, voter=True),
                       dict(member("b.1", "joiner"), state="alive", step=0, voter=False),
                       dict(member("w.1", "witness"), state="suspect", step=0, voter=True)]}
    f = build_frame("127.0.0.1:7000", cur, prev)
    assert [r.replica_id for r in f.members] == ["a", "b", "w"]
    assert f.members[0].rate == pytest.approx(10.0)
    assert f.view_age == pytest.approx(1.0) and f.leader == "a"
    assert f.catchups == [("b", 5.0, 0, 30)]
    text = render_plain(f)
    assert "epoch 4 (data 3)  leader a  term 2  view age 1.0 s  leader changes 1" in text
    w_row = next(ln for ln in text.splitlines() if ln.startswith("w "))
    assert w_row.split()[1:5] == ["witness", "suspect", "-", "-"]
    assert "b: joiner for 5.0 s, step 0 (participants at 30)" in text
    assert "e4: b joined as joiner" in text


def test_replica_metrics_port_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pft.trainer.examples.replica import parse_args
    monkeypatch.setenv("P2PFT_METRICS_PORT", "9400")
    assert parse_args(["--replica-id", "a"]).metrics_port == "9400"
    assert parse_args(["--replica-id", "a", "--metrics-port", "9500"]).metrics_port == "9500"
    monkeypatch.delenv("P2PFT_METRICS_PORT")
    assert parse_args(["--replica-id", "a"]).metrics_port is None        # off by default
    with pytest.raises(SystemExit):
        parse_args(["--replica-id", "a", "--metrics-port", "nine"])
