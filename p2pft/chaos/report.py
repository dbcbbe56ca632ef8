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

from .breakdown import PHASES, STALL_FACTOR

COLUMNS = [
    ("system", "system", "{}"),
    ("sample_ett", "sample ETT", "{:.0%}"),
    ("ett", "step ETT", "{:.0%}"),
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
sample ETT (effective training time, the headline) = samples in the committed steps the run kept /
the failure-free run's, all systems run at the same time on this machine: a step with a replica
missing trains fewer samples, a step lost to a rollback trains none. step ETT = final step / the
failure-free run's; above 100% it only says that steps with fewer replicas are cheaper on shared
cores. 'stall' = a surviving replica's longest gap between two committed steps after a failure,
minus one normal step ({step}); for a job restarted as a whole, failure to its next committed
step. 'rejoin' = a restarted replica's process start to its first step that counts its gradients
('w/o imports': from after Python and torch imports). 'divergent steps' = steps at which two
replicas held different weights (state digests compared every {digest} steps; for a job
restarted as a whole, within one start of it). ddp = plain
PyTorch DDP (Gloo): every failure restarts all ranks from the last disk checkpoint (every {ckpt}
steps), as torchrun does; sync = p2pft replicas restarted the same way. 'oracle abs/rel'
(--workload gpt) = the largest difference between a survivor's final weights and the committed
steps replayed in one plain PyTorch process (rel: per tensor, over its largest weight); with
--algo diloco a step is a sync, and the replay runs each replica's inner steps and the outer step."""


def title(config: dict[str, Any], failures: int) -> str:
    """The run in one line; a schedule without failures says so instead of announcing them."""
    head = "p2pft chaos: {replicas} replicas, {duration:g} s".format(**config)
    if config.get("hosts") == "netns":
        mbit = config.get("link_mbit")
        head += ", a network namespace per host" + (f" ({mbit:g} Mbit/s links)" if mbit else "")
    if not failures:
        return head + ", no failures scheduled"
    what = {"kill": "SIGKILL", "pause": "SIGSTOP ({pause_for:g} s)", "leader": "SIGKILL of the leader's replica",
            "two": "SIGKILL of two replicas",
            "host": "host loss (link down, then SIGKILL)"}[config["fault"]].format(**config)
    tail = "" if config["fault"] == "pause" else ", restart after {restart_after:g} s".format(**config)
    return head + f", a {what} every {config['kill_every']:g} s" + tail


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
    failures = max((int(s.get("kills", 0)) for s in report["systems"]), default=0)
    t = Table(title=title(report["config"], failures))
    for _, head, _ in COLUMNS:
        t.add_column(head, justify="right" if head != "system" else "left")
    for s in report["systems"]:
        cells = []
        for key, _, fmt in COLUMNS:
            v = s.get(key)
            cells.append("-" if v is None else fmt.format(v))
        t.add_row(*cells)
    console.print(t)
    console.print(breakdown_table(report))
    if report.get("overhead_vs_ddp") is not None:
        console.print(f"failure-free overhead: a p2pft step takes {report['overhead_vs_ddp']:+.0%} against a plain "
                      "DDP step (median step times before the first failure, same cores, same time)")
    step = next((s.get("step_time_p50_s") for s in report["systems"] if s["system"] == "failure_free"), None)
    console.print(EXPLAIN.format(step=f"{step:.2f} s" if step else "-", digest=report["config"]["digest_every"],
                                 ckpt=report["config"]["checkpoint_every"]))


def breakdown_table(report: dict[str, Any]) -> Table:
    """Where the time went: seconds with k contributors, step time by phase, CPU per process kind."""
    replicas = int(report["config"]["replicas"])
    t = Table(title="where the time went")
    t.add_column("system")
    for k in range(replicas, -1, -1):
        t.add_column(f"{k} contrib." if k else "no step", justify="right")
    for phase in PHASES:
        t.add_column(f"step {phase.replace('_', ' ')}", justify="right")
    t.add_column("CPU s by process kind")
    for s in report["systems"]:
        cs = s.get("contributor_seconds", {})
        ph = s.get("step_time_by_phase", {})
        cells = [s["system"]]
        cells += [f"{cs[str(k)]:.1f} s" if str(k) in cs else "-" for k in range(replicas, -1, -1)]
        for phase in PHASES:
            v = ph.get(phase, {})
            cells.append(f"{v['step_p50_s']:.3f} s ({v['steps']})" if v.get("step_p50_s") is not None else "-")
        cells.append(", ".join(f"{k} {v:.0f}" for k, v in sorted(s.get("cpu_s", {}).items())) or "-")
        t.add_row(*cells)
    t.caption = ("seconds of the run with k replicas contributing to the committed step ('no step': stalls "
                 "and restarts); median step time (steps) while a restarted replica catches up, waits as a "
                 "caught-up joiner, and for 10 steps after its promotion; CPU seconds of each process kind")
    return t


def contributor_steps(commits: list[list[float]], step_p50: float, t0: float,
                      t_end: float) -> tuple[list[float], list[int]]:
    """A step curve of contributors over time: each step's count over the time it took, and 0
    over stalls (a gap longer than STALL_FACTOR normal steps) and after the last commit."""
    limit = STALL_FACTOR * step_p50 if step_p50 > 0 else float("inf")
    xs: list[float] = []
    ys: list[int] = []
    prev = t0
    for t, n in commits:
        if t - prev > limit:
            xs.append(prev - t0)
            ys.append(0)
            prev = t - step_p50
        xs.append(prev - t0)
        ys.append(int(n))
        prev = t
    if xs:
        xs += [prev - t0, max(prev, t_end) - t0]
        ys += [0, 0]
    return xs, ys


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
        xs, ys = contributor_steps(s.get("_contributors", []), s.get("step_time_p50_s") or 0.0, t0,
                                   report.get("t_end", t0))
        if xs:
            ax2 = ax.twinx()
            ax2.step(xs, ys, where="post", color="grey", lw=0.8, alpha=0.6)
            ax2.set_ylim(-0.2, report["config"]["replicas"] + 0.5)
            ax2.set_yticks(range(report["config"]["replicas"] + 1))
            ax2.set_ylabel("contributors (grey)", fontsize=8)
        sett = s.get("sample_ett")
        ax.set_title(f"{s['system']}: final step {s['final_step']}" + (f", sample ETT {sett:.0%}" if sett else ""),
                     fontsize=10, loc="left")
        ax.set_ylabel("committed step")
        ax.grid(alpha=0.3)
        if s.get("_steps"):
            ax.legend(fontsize=7, loc="upper left", ncol=4)
    axes[-1, 0].set_xlabel("seconds (lines: committed step per process; grey: contributors; red: failure, "
                           "green dashed: restart, black: crash)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
