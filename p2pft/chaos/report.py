"""The chaos report: a table for people, JSON for tools, a PNG timeline.

rich renders the table and the live view (a well-kept terminal library that degrades to plain
text when stdout is not a terminal); matplotlib (Agg, no display needed) draws the timeline.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

COLUMNS = [
    ("system", "system", "{}"),
    ("ett", "ETT", "{:.0%}"),
    ("sample_ett", "sample ETT", "{:.0%}"),
    ("final_step", "final step", "{}"),
    ("kills", "failures", "{}"),
    ("survivor_crashes", "survivor crashes", "{}"),
    ("stall_p50_s", "stall p50", "{:.2f} s"),
    ("stall_max_s", "stall max", "{:.2f} s"),
    ("rejoin_p50_s", "rejoin p50", "{:.2f} s"),
    ("rejoin_excl_imports_p50_s", "rejoin w/o imports", "{:.2f} s"),
    ("divergent_steps", "divergent steps", "{}"),
    ("oracle_max_abs_diff", "oracle abs", "{:.1e}"),
    ("oracle_max_rel_diff", "oracle rel", "{:.1e}"),
]

EXPLAIN = """\
ETT (effective training time) = final committed step / the failure-free run's final step, all
systems run at the same time on this machine; 'sample ETT' = samples in committed steps / the
failure-free run's (a step with a replica missing trains fewer samples). 'stall' = a surviving replica's longest gap between
two committed steps after a failure, minus one normal step ({step}); 'rejoin' = a restarted replica's
process start to its first step that counts its gradients ('w/o imports': from after Python and
torch imports). 'divergent steps' = steps at which two replicas held different weights (state
digests compared every {digest} steps). sync = every failure restarts all replicas from the last
disk checkpoint (every {ckpt} steps), as an elastic launcher does. 'oracle abs/rel' (--workload gpt) =
the largest difference between a survivor's final weights and the committed steps replayed in one
plain PyTorch process (rel: per tensor, over its largest weight)."""


def public(report: dict[str, Any]) -> dict[str, Any]:
    """The JSON a tool reads: systems without the bulky private series."""
    out = dict(report)
    out["systems"] = [{k: v for k, v in s.items() if not k.startswith("_")} for s in report["systems"]]
    return out


def write_json(report: dict[str, Any], path: Path, full: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report if full else public(report), indent=2, default=str))


def print_table(report: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title="p2pft chaos: {replicas} replicas, {duration:g} s, a {fault} every {kill_every:g} s, "
              "restart after {restart_after:g} s".format(**report["config"]))
    for _, title, _ in COLUMNS:
        t.add_column(title, justify="right" if title != "system" else "left")
    for s in report["systems"]:
        cells = []
        for key, _, fmt in COLUMNS:
            v = s.get(key)
            cells.append("-" if v is None else fmt.format(v))
        t.add_row(*cells)
    console.print(t)
    step = next((s.get("step_time_p50_s") for s in report["systems"] if s["system"] == "failure_free"), None)
    console.print(EXPLAIN.format(step=f"{step:.2f} s" if step else "-", digest=report["config"]["digest_every"],
                                 ckpt=report["config"]["checkpoint_every"]))


def plot_timeline(report: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = report["systems"]
    t0 = report.get("t0", 0.0)
    fig, axes = plt.subplots(len(systems), 1, figsize=(10, 2.6 * len(systems)), sharex=True, squeeze=False)
    for ax, s in zip(axes[:, 0], systems):
        colors: dict[str, Any] = {}
        for name, pts in sorted(s.get("_steps", {}).items()):
            if not pts:
                continue
            replica = name.split(".")[0]
            first = replica not in colors
            line, = ax.plot([p[0] - t0 for p in pts], [p[1] for p in pts], lw=1.2,
                            color=colors.get(replica), label=replica if first else None)
            colors.setdefault(replica, line.get_color())
        for e in s.get("_events", []):
            x = e["t"] - t0
            if x < 0:
                continue
            if e["kind"] in ("kill", "pause"):
                ax.axvline(x, color="red", lw=1.0, alpha=0.7)
            elif e["kind"] == "restart":
                ax.axvline(x, color="green", lw=0.8, ls="--", alpha=0.7)
            elif e["kind"] == "crash":
                ax.axvline(x, color="black", lw=1.5)
        ett = s.get("ett")
        ax.set_title(f"{s['system']}: final step {s['final_step']}" + (f", ETT {ett:.0%}" if ett else ""),
                     fontsize=10, loc="left")
        ax.set_ylabel("committed step")
        ax.grid(alpha=0.3)
        if s.get("_steps"):
            ax.legend(fontsize=7, loc="upper left", ncol=4)
    axes[-1, 0].set_xlabel("seconds (red: failure, green dashed: restart, black: crash)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
