"""Fleet-scale ETT model (bench/fleet.py): paper reproduction, Monte Carlo agreement, shape.

The bench is a script, not a package module, so it is loaded from its path.
"""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "fleet.py"
MIN = 60.0


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_fleet", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while building classes
    spec.loader.exec_module(mod)
    return mod


fleet = _load()
P = fleet.PAPER


def test_paper_inputs_reproduce_44_and_80_percent() -> None:
    assert (P.mtbf_s, P.replicas, P.sync_recovery_s, P.ft_stall_s) == (18 * MIN, 12, 10 * MIN, 3 * MIN)
    assert fleet.sync_ett_of(P) == pytest.approx(0.44, abs=0.01)
    assert fleet.ft_ett_of(P) == pytest.approx(0.80, abs=0.01)
    # the dropped second-order term is small enough not to change the conclusion
    assert fleet.ft_hsdp_ett_overlap(P.mtbf_s, P.replicas, P.ft_stall_s, P.ft_down_s) == pytest.approx(0.80, abs=0.01)


@pytest.mark.parametrize("seed", [1, 2])
def test_monte_carlo_agrees_with_analytic_at_paper_inputs(seed: int) -> None:
    mc_sync = fleet.mc_sync(P.mtbf_s, P.sync_recovery_s, failures=20000, seed=seed)
    assert mc_sync == pytest.approx(fleet.sync_ett_of(P), abs=0.005)
    mc_ft = fleet.mc_ft_hsdp(P.mtbf_s, P.replicas, P.ft_stall_s, P.ft_down_s, failures=20000, seed=seed)
    # the replay includes the overlap of an absence with other stalls; the closed forms bracket it
    assert mc_ft == pytest.approx(fleet.ft_hsdp_ett_overlap(P.mtbf_s, P.replicas, P.ft_stall_s, P.ft_down_s),
                                  abs=0.003)
    assert mc_ft == pytest.approx(fleet.ft_ett_of(P), abs=0.01)


@pytest.mark.parametrize("mtbf_min,replicas,stall_s,down_s", [(60, 12, 180, 600), (18, 48, 60, 300),
                                                              (30, 4, 5, 650)])
def test_monte_carlo_agrees_away_from_paper_point(mtbf_min: float, replicas: int, stall_s: float,
                                                  down_s: float) -> None:
    mc = fleet.mc_ft_hsdp(mtbf_min * MIN, replicas, stall_s, down_s, failures=20000, seed=5)
    assert mc == pytest.approx(fleet.ft_hsdp_ett_overlap(mtbf_min * MIN, replicas, stall_s, down_s), abs=0.003)


@pytest.mark.parametrize("ckpt_min", [2.0, 30.0])
def test_lost_work_since_checkpoint_matches_replay(ckpt_min: float) -> None:
    mtbf = 60 * MIN
    lost = fleet.lost_work_s(mtbf, ckpt_min * MIN)
    analytic = fleet.sync_ett(mtbf, 10 * MIN, lost)
    mc = fleet.mc_sync(mtbf, 10 * MIN, ckpt_interval_s=ckpt_min * MIN, failures=20000, seed=3)
    assert mc == pytest.approx(analytic, abs=0.005)
    assert analytic < fleet.sync_ett(mtbf, 10 * MIN)


def test_lost_work_limits() -> None:
    mtbf = 18 * MIN
    assert fleet.lost_work_s(mtbf, 0.0) == 0.0
    assert fleet.lost_work_s(mtbf, 6.0) == pytest.approx(3.0, rel=0.01)        # frequent: half an interval
    assert fleet.lost_work_s(mtbf, 1000 * mtbf) == pytest.approx(mtbf, rel=0.01)  # rare: the whole run


def test_ett_falls_with_failure_rate_and_ft_hsdp_beats_sync() -> None:
    p2p = fleet.P2pftInputs(stall_s=5.0, rejoin_s=30.0, relaunch_s=600.0)
    for replicas in (1, 4, 12, 48):
        prev = None
        for mtbf_min in (3, 6, 12, 18, 30, 60, 240, 1440):
            inp = fleet.FleetInputs(mtbf_s=mtbf_min * MIN, replicas=replicas)
            row = (fleet.sync_ett_of(inp), fleet.ft_ett_of(inp), fleet.p2pft_ett(inp, p2p))
            assert all(0.0 <= x <= 1.0 for x in row)
            assert row[1] >= row[0]
            if prev is not None:
                assert all(a >= b for a, b in zip(row, prev)), (replicas, mtbf_min)
            prev = row
    # a single replica is synchronous training: the stall is the whole recovery
    assert fleet.ft_hsdp_ett(P.mtbf_s, 1, P.sync_recovery_s, P.sync_recovery_s) == pytest.approx(fleet.sync_ett_of(P))
    # more replicas -> a smaller share of the fleet is out while one restarts
    ft = [fleet.ft_hsdp_ett(P.mtbf_s, r, P.ft_stall_s, P.ft_down_s) for r in (4, 8, 12, 24, 48)]
    assert ft == sorted(ft)
    assert fleet.sync_ett(6 * MIN, 10 * MIN) == 0.0  # failures faster than recovery: no progress


def test_chaos_file_parsing(tmp_path: Path) -> None:
    rows = [{"system": "p2pft", "ett": 0.93, "stall_p50_s": 1.5, "stall_max_s": 4.0, "rejoin_p50_s": 12.0,
             "kills": 5, "final_step": 930},
            {"system": "torchft", "ett": 0.40, "stall_p50_s": None, "kills": 5, "final_step": 400},
            {"system": "failure_free", "ett": 1.0, "kills": 0, "final_step": 1000}]
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps(rows))
    as_obj = tmp_path / "obj.json"
    as_obj.write_text(json.dumps({"run": "x", "systems": rows}))
    for path in (as_list, as_obj):
        got = fleet.load_chaos(path)
        assert set(got) == {"p2pft", "torchft", "failure_free"}
        assert got["p2pft"].stall_p50_s == 1.5 and got["p2pft"].rejoin_p50_s == 12.0
        assert math.isnan(got["torchft"].stall_p50_s) and got["torchft"].kills == 5
    inp = fleet.p2pft_inputs(fleet.load_chaos(as_list)["p2pft"], view_s=1.0, relaunch_s=600.0)
    assert inp.stall_s == pytest.approx(2.5) and inp.down_s == pytest.approx(612.0)
    worst = fleet.p2pft_inputs(fleet.load_chaos(as_list)["p2pft"], view_s=1.0, relaunch_s=600.0, worst=True)
    assert worst.stall_s == pytest.approx(5.0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nope": []}))
    with pytest.raises(ValueError):
        fleet.load_chaos(bad)


def test_view_time_interpolates_in_log_n() -> None:
    rows = [{"replicas": 12, "view_p50_s": 1.0}, {"replicas": 1200, "view_p50_s": 3.0}]
    assert fleet.view_time_at(rows, 4) == 1.0
    assert fleet.view_time_at(rows, 120) == pytest.approx(2.0)
    assert fleet.view_time_at(rows, 5000) == 3.0
    assert fleet.view_time_at([], 12) == 0.0


def test_cli_writes_paper_numbers_and_p2pft_prediction(tmp_path: Path) -> None:
    chaos = tmp_path / "chaos.json"
    chaos.write_text(json.dumps({"systems": [
        {"system": "p2pft", "ett": 0.95, "stall_p50_s": 2.0, "stall_max_s": 6.0, "rejoin_p50_s": 20.0,
         "kills": 4, "final_step": 950},
        {"system": "sync", "ett": 0.6, "stall_p50_s": 30.0, "stall_max_s": 40.0, "rejoin_p50_s": 30.0,
         "kills": 4, "final_step": 600}]}))
    out = tmp_path / "fleet.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--paper", "--json", str(out), "--chaos", str(chaos),
                           "--sim-sizes", "12", "--crashes", "2", "--mc-failures", "4000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["sync_ett"] == pytest.approx(0.44, abs=0.01)
    assert res["ft_hsdp_ett"] == pytest.approx(0.80, abs=0.01)
    sim = res["control_plane"][0]
    assert sim["replicas"] == 12 and 0.0 < sim["view_p50_s"] <= sim["view_p99_s"] < 30.0
    # seconds of stall instead of minutes: the prediction beats the paper's FT-HSDP
    assert res["ft_hsdp_ett"] < res["p2pft_ett_worst"] <= res["p2pft_ett"] < 1.0
    assert res["p2pft_inputs"]["stall_s"] == pytest.approx(2.0 + sim["view_p50_s"])
    by_r = res["sweep"]["by_replicas"]
    assert [r["replicas"] for r in by_r] == [4, 8, 12, 24, 48]
    assert all({"sync_ett", "ft_hsdp_ett", "p2pft_ett"} <= set(r) for r in by_r)
    by_m = [r["p2pft_ett"] for r in res["sweep"]["by_mtbf"]]
    assert by_m == sorted(by_m)


def test_cli_without_chaos_or_simulation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fleet.json"
    png = tmp_path / "ett.png"
    assert fleet.main(["--paper", "--json", str(out), "--sim-sizes", "", "--mc-failures", "2000",
                       "--plot", str(png)]) == 0
    res = json.loads(out.read_text())
    assert "p2pft_ett" not in res and res["control_plane"] == []
    assert res["preset"] == "paper"
    assert png.stat().st_size > 1000
    assert "FT-HSDP" in capsys.readouterr().out
