"""bench/soak.py's false-removal check: views read from the processes' logs, and a view that
drops a replica after a short pause counts only when nothing else (a kill, a long pause) hit it."""
from __future__ import annotations

import importlib.util
import sys
from datetime import datetime
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_soak", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _line(t: float, epoch: int, members: str) -> str:
    stamp = datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return f"{stamp} INFO  [r0.1234 e{epoch} s5] p2pft.net.driver: view e{epoch}: {members}\n"


def test_a_view_dropping_a_briefly_paused_replica_is_a_false_removal(tmp_path: Path) -> None:
    soak = _load()
    t0 = 1_800_000_000.0
    (tmp_path / "r0-0.log").write_text(
        _line(t0 + 1, 3, "r0(p*) r1(p*) r2(p*) w0(w*)") + "noise line\n"
        + _line(t0 + 11, 4, "r0(p*) r2(p*) w0(w*)")          # r1 dropped after its 0.3 s pause
        + _line(t0 + 25, 6, "r0(p*) r1(j) w0(w*)"))          # r2 dropped after its kill
    (tmp_path / "w0.log").write_text(_line(t0 + 10.9, 4, "r0(p*) r2(p*) w0(w*)")
                                     + _line(t0 + 20, 5, "r0(p*) r1(p) r2(p*) w0(w*)"))
    views = soak.views_from_logs(tmp_path)
    assert [(round(t - t0, 1), e) for t, e, _ in views] == [(1.0, 3), (10.9, 4), (20.0, 5), (25.0, 6)]
    assert views[1][2] == {"r0", "r2", "w0"}
    short = [(t0 + 10.5, 1), (t0 + 24.0, 2), (t0 + 30.0, 0)]
    other = [(t0 + 24.5, 2)]                                  # r2 was also killed: it may leave
    assert soak.false_removals(views, short, other) == [(t0 + 10.5, 1, 4)]
    assert soak.false_removals(views, [], other) == []
