"""Training over slow links: synchronous p2pft vs p2pft DiLoCo and Streaming DiLoCo vs torchft's two.

The same transformer LM (2 layers, d_model 128 in --quick: 0.44M parameters, one synchronous
step's allreduce about 8x its compute on a 50 Mbit/s link; d_model 256 otherwise: 1.7M), byte
data, inner AdamW (lr 1e-3, the synchronous optimizer too) and per-replica batch (8 x 64
tokens), three replicas whose links are rate-limited (``bench/wanlink.py``: namespaces + ``tc
tbf`` where they exist, else a token-bucket proxy on loopback; the JSON says which). Every DiLoCo
system uses the same H (20) and outer SGD (lr 0.7, Nesterov momentum 0.5). Each system runs for
the same wall time, without failures and with a SIGKILL of a random replica (never r0, which
evaluates) every ``--kill-every`` seconds, restarted 2 s later; with ``--kill-phases mid,sync``
the k-th kill hits r1, r2, r1, ... at its next ``mid`` (half a span done) or ``sync`` (its sync
starting) phase, alternating. torchft 0.2.0's DiLoCo and Streaming DiLoCo (``torchft``,
``torchft-streaming``; the same fragments, overlap and alpha as p2pft's, float32) run where
torchft is installed, on namespace links only, its lighthouse on a host of its own, healing restarted replicas through
its PG transport, with the quorum timeout its Manager's docs ask for DiLoCo (an hour) and the
lighthouse as torchft's DiLoCo example starts it (join timeout 10 s; heartbeat timeout 5 s, its
default; a majority minimum): docs/diloco.md says why.

Reported per system and failure setting: wall time to the target validation loss on a fixed
held-out set (the loss synchronous training reaches without failures at the end of its run, so
synchronous training's time to target is its duration), the validation loss at equal samples
(the system's own point at the most samples not above synchronous training's, beside
synchronous training's loss there; r0 saves the judged weights after every commit and the
losses are computed after the run, so evaluating costs no system training time), samples trained (and the samples of every replica's own work in
committed syncs), bytes through the links per replica, the longest time r0 went without a commit
(from the start of training to its end), survivors' work kept (inner steps, or steps, that
ended in a committed mean with the replica's own work, over the ones they computed: a torchft
round in which the replica healed is not kept, its weights were the donor's), restarted replicas
that contributed their own work again, crashes and divergent steps. torchft rows are checked
against torchft's own logs: a recovery error there, or a restarted replica that never contributed
while there was time, flags the row (``recovery`` column).

With ``--ranks R`` (R > 1) each replica is an *island*: an FSDP2 replica of R ranks on one host
(``bench/wan_island.py``: gloo between its ranks on the host's loopback, fast), the islands
joined by the rate-limited links (the ranks' data ports of one island share its link). Systems:
``sync`` (synchronous HSDP across islands), ``diloco`` and ``streaming`` (p2pft's DiLoCo over
FSDP replicas), ``torchft`` (torchft's DiLoCo with FSDP inside; namespace links only). A kill
SIGKILLs a whole island (its launcher and every rank, one process group). The islands table
adds, per row: whether every island ended with the same per-shard digests (at the last sync all
the final islands recorded), for each restarted island the syncs from its ``ready`` (it holds the
global weights again) to its first own contribution (a committed sync with its work kept), and
the longest gap without a commit without kills beside the one with kills.

    python bench/wan.py --quick --json results/wan.json --plot results/wan.png
    python bench/wan.py --quick --ranks 2 --replicas 3 --kill-phases mid,sync
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wanlink import open_links  # noqa: E402

from p2pft.chaos.records import read_stats  # noqa: E402
from p2pft.deploy.ports import free_ports  # noqa: E402

WORKER = Path(__file__).resolve().parent / "wan_worker.py"
ISLAND = Path(__file__).resolve().parent / "wan_island.py"
SYSTEMS = ("sync", "diloco", "streaming", "torchft", "torchft-streaming")
ISLAND_SYSTEMS = ("sync", "diloco", "streaming", "torchft")
ISLAND_STOP_WAIT_S = 40.0   # beyond an island launcher's own grace for its ranks (30 s)
# torchft's Manager docstring: "For LocalSGD/DiLoCo this may need to be set to ~1h or longer
# depending on how frequently the syncs occur" (a replica at its sync waits in the quorum for the
# others still in their span). The lighthouse's join and heartbeat timeouts are torchft's own for
# DiLoCo (its DiLoCo example's --join_timeout_ms 10000, the default heartbeat timeout): with 1 s
# ones, a replica whose span ended a second after the others' was left out and had to heal.
TORCHFT_QUORUM_TIMEOUT_S = 3600.0
TFT_JOIN_TIMEOUT_MS = 10000
TFT_HEARTBEAT_TIMEOUT_MS = 5000
RECOVERY_ERROR = "got exception in recovery"


@dataclass
class Row:
    system: str
    failures: str
    time_to_target_s: float | None
    equal_samples: int | None              # the samples of the equal-samples comparison
    val_loss_equal_samples: float | None   # this system's loss there
    ref_val_loss_equal_samples: float | None   # synchronous training's (no failures) loss there
    val_loss_final: float | None
    samples: int
    target: float | None
    bytes_sent_per_replica: int
    survivor_work_kept: float | None
    samples_in_syncs: int                  # every process's own kept work, in samples
    restarts_contributing: str             # "k/m": restarted replicas due to contribute that did
    recovery: str                          # ok | the reason the row is flagged
    survivor_crashes: int
    divergent_steps: int
    stall_max_s: float
    kills: int
    links: str
    curve: list[tuple[float, int, float]]   # (seconds since r0 was ready to train, samples, val loss)
    ranks: int = 1                         # ranks per replica (an island when > 1)
    same_digests_end: str = "-"            # every final island's per-shard digests equal at their last common sync
    restart_syncs: dict[str, int | None] = field(default_factory=dict)   # restart: syncs from ready to own work
    stall_none_s: float | None = None      # the same system's longest gap without kills (on kill rows)
    restarts_not_due: list[str] = field(default_factory=list)   # killed again or started too late to contribute
    # Islands: the time to target if every rank had a core of its own (own_cores): each commit's
    # largest rank CPU-seconds plus its share of the bytes at the link rate, summed to the target.
    own_cores_ttt_s: float | None = None


def run_one(system: str, kill: bool, a: argparse.Namespace, tmp: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One cluster of `a.replicas` workers for `a.duration` s; every incarnation's records."""
    n, ranks = a.replicas, a.ranks
    ctl_ports = free_ports(n)
    data = free_ports(n * ranks)   # one data port per rank (per shard); an island's share its host and link
    tft = system.startswith("torchft")
    links = open_links([("127.0.0.1", p) for p in data], a.rate_mbit, "netns" if tft else a.links,
                       extra_hosts=1 if tft else 0, host_of=[i for i in range(n) for _ in range(ranks)])
    ctl = [f"{links.ip(i)}:{p}" for i, p in enumerate(ctl_ports)]
    tag = f"{system}-{'kill' if kill else 'none'}"
    go = tmp / f"{tag}.go"
    lighthouse = None
    lh = ""
    until = time.time() + a.startup + a.duration   # the workers' own limit; the run ends earlier
    deadline = until
    procs: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
    spawned: dict[str, float] = {}
    sysargs = {"sync": [], "diloco": ["--sync-every", str(a.sync_every)],
               "streaming": ["--sync-every", str(a.sync_every), "--fragments", str(a.fragments), "--overlap", "1",
                             "--alpha", "0.5", "--compression", a.compression],
               "torchft": ["--sync-every", str(a.sync_every), "--go-file", str(go),
                           "--quorum-timeout", str(TORCHFT_QUORUM_TIMEOUT_S)],
               # torchft's Streaming DiLoCo: the same fragments, overlap and alpha; fp32 pseudo-gradients
               # (its should_quantize is a CUDA kernel).
               "torchft-streaming": ["--sync-every", str(a.sync_every), "--fragments", str(a.fragments), "--overlap", "1",
                                     "--alpha", "0.5", "--go-file", str(go),
                                     "--quorum-timeout", str(TORCHFT_QUORUM_TIMEOUT_S)]}[system]

    def spawn(i: int, inc: int) -> str:
        name = f"{tag}-r{i}-{inc}"
        mine = range(i * ranks, (i + 1) * ranks)
        cmd = [sys.executable, str(ISLAND if ranks > 1 else WORKER), "--system", system, "--replica-id", f"r{i}",
               "--listen", ctl[i], "--seeds", ",".join(c for j, c in enumerate(ctl) if j != i),
               "--data-listen", ",".join(f"{links.ip(i)}:{data[j]}" for j in mine),
               "--advertise-data", ",".join(links.advertise[j] for j in mine),
               "--stats", str(tmp / f"{name}.jsonl"), "--until", str(until),
               "--min-replicas", str(n), "--d-model", str(a.d_model), "--layers", str(a.layers), "--lr", str(a.lr),
               "--batch", str(a.batch), "--eval-every", str(a.eval_every), "--outer-lr", str(a.outer_lr),
               "--outer-momentum", str(a.outer_momentum), "--comm-timeout", str(a.comm_timeout),
               "--step-delay", str(a.step_delay), *sysargs] + (["--ranks", str(ranks)] if ranks > 1 else [])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if tft:
            cmd += ["--lighthouse", f"http://{lh}"]
            env["GLOO_SOCKET_IFNAME"] = links.ifname(i)   # type: ignore[union-attr]
        log = open(tmp / f"{name}.log", "wb")
        spawned[name] = time.time()
        procs[name] = (i, links.spawn(i, cmd, stdout=subprocess.DEVNULL, stderr=log, env=env))
        log.close()
        return name

    t_spawn = time.time()
    rng = random.Random(a.seed)
    kill_log: list[dict[str, Any]] = []
    killed: set[str] = set()
    kills = 0
    inc = {i: 0 for i in range(n)}
    t_first = None
    # Synchronous training has no spans: its kills come at the scheduled times.
    phases = [ph for ph in a.kill_phases.split(",") if ph] if system != "sync" else []
    pending: tuple[str, str, float] | None = None   # (victim, phase, give-up time) of a kill waiting for its phase
    try:
        if tft:   # torchft's coordinator, on a host of its own (host n), never a kill target
            from p2pft.chaos.torchft_system import lighthouse_command
            lh = f"{links.ip(n)}:{free_ports(1)[0]}"
            with open(tmp / f"{tag}-lighthouse.log", "wb") as lh_log:
                lighthouse = links.spawn(n, lighthouse_command(lh, min_replicas=n // 2 + 1,
                                                               join_timeout_ms=a.tft_join_timeout_ms,
                                                               heartbeat_timeout_ms=a.tft_heartbeat_timeout_ms),
                                         stdout=subprocess.DEVNULL, stderr=lh_log)
        for i in range(n):
            spawn(i, 0)
        while time.time() < deadline:
            if pending is None:
                time.sleep(0.2)
            if tft and not go.exists() and all(read_stats(tmp / f"{tag}-r{i}-0.jsonl") for i in range(n)):
                go.touch()   # torchft's replicas start their inner steps together, as p2pft's wait for the view
            if t_first is None:
                if all(p.poll() is not None for _, p in procs.values()):
                    print(f"  every {system} worker exited before training started: see {tmp}/{tag}-*.log")
                    break
                first = [r for r in read_stats(tmp / f"{tag}-r0-0.jsonl") if r.get("kind") == "ready"]
                if first:   # r0 saw its group (or torchft's go): training starts now for every system
                    t_first = first[0]["t"]
                    deadline = t_first + a.duration   # equal training time for every system
                    next_kill = t_first + a.kill_every
                continue
            if (kill and pending is None and time.time() >= next_kill and time.time() < deadline - 4
                    and not (a.max_kills and kills >= a.max_kills)):
                i = 1 + kills % (n - 1) if phases else rng.randrange(1, n)
                name = next(k for k, (j, p) in procs.items() if j == i and p.poll() is None)
                if phases:   # wait for the victim's next phase record
                    pending = (name, phases[kills % len(phases)], time.time() + 4 * a.sync_every * (a.step_delay + 0.2) + 10)
                    seen = len(read_stats(tmp / f"{name}.jsonl"))
                    continue
                pending = (name, "", 0.0)
            if pending is not None:
                name, phase, give_up = pending
                if phase:
                    new = read_stats(tmp / f"{name}.jsonl")[seen:]
                    if not any(r.get("kind") == "phase" and r.get("phase") == phase for r in new):
                        if time.time() < give_up:
                            time.sleep(0.01)
                            continue
                        print(f"  no {phase} phase of {name} in time: killed anyway", flush=True)
                pending = None
                kill_replica(procs[name][1], ranks > 1)
                killed.add(name)
                kills += 1
                kill_log.append({"t": time.time(), "proc": name, "phase": phase})
                time.sleep(a.restart_after)
                i = procs[name][0]
                inc[i] += 1
                spawn(i, inc[i])
                next_kill = time.time() + a.kill_every
    finally:
        t_stop = time.time()
        for _, p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        rcs: dict[str, int | None] = {}
        for name, (_, p) in procs.items():
            try:
                rcs[name] = p.wait(timeout=ISLAND_STOP_WAIT_S if ranks > 1 else 30)
            except subprocess.TimeoutExpired:
                p.kill()
                rcs[name] = None
            if ranks > 1:   # whatever is left of the island (its ranks die with the launcher anyway)
                kill_group(p.pid)
        if lighthouse is not None:
            lighthouse.terminate()
            try:
                lighthouse.wait(timeout=10)
            except subprocess.TimeoutExpired:
                lighthouse.kill()
        carried = links.bytes_total()   # before close: namespace links count until removed
        links.close()
    recs = []
    for name in procs:
        for r in read_stats(tmp / f"{name}.jsonl"):
            recs.append({**r, "proc": name})
    evaluate_saved(recs, a)
    # -SIGTERM: ended by the harness before its handler was installed (a restart still starting)
    crashes = sum(1 for k, rc in rcs.items() if k not in killed and rc not in (0, -signal.SIGTERM))
    print(f"  start-up {(t_first or t_stop) - t_spawn:.1f} s, stop {time.time() - t_stop:.1f} s, exit statuses "
          f"{ {k.rsplit('-', 2)[-2] + '-' + k.rsplit('-', 1)[-1]: v for k, v in rcs.items()} }", flush=True)
    info = {"kills": kills, "crashes": crashes, "killed": sorted(killed), "links": links.kind, "kill_log": kill_log,
            "procs": sorted(procs), "spawned": spawned, "tag": tag, "tmp": str(tmp), "ranks": ranks,
            "bytes_per_replica": carried // n, "t_first": t_first, "batch": a.batch, "rate_mbit": a.rate_mbit,
            "error": None if t_first is not None else first_error(tmp / f"{tag}-r0-0.log"),
            "t_end": min(t_stop, deadline) if t_first is not None else None}
    return recs, info


def first_error(log: Path) -> str | None:
    """The exception a worker that never trained died of: the last line of its log's first
    traceback (a system that cannot run here, e.g. torchft's DiLoCo over FSDP, gives its reason)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Traceback")), None)
    if start is None:
        return None
    tail = next((ln for ln in lines[start + 1:] if ln and not ln.startswith((" ", "\t"))), None)
    return tail.strip() if tail else None


def kill_group(pgid: int) -> None:
    """SIGKILL an island's process group (its launcher leads it); nothing left is fine."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_replica(p: subprocess.Popen[bytes], island: bool) -> None:
    """SIGKILL a replica: an island's launcher and every rank at once (one process group)."""
    try:
        leader = island and os.getpgid(p.pid) == p.pid
    except ProcessLookupError:
        leader = False
    if leader:
        kill_group(p.pid)
    else:   # one rank, or a launcher that has not yet made its group (its ranks die with it)
        p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)


def evaluate_saved(recs: list[dict[str, Any]], a: argparse.Namespace) -> None:
    """The validation loss of every set of weights r0 saved (after the run: no system spends
    training time on it), on the fixed held-out set; the files are removed."""
    import torch

    from p2pft.trainer.data import TextDataset
    from p2pft.trainer.model import ModelConfig

    cfg = ModelConfig(vocab_size=256, d_model=a.d_model, n_layers=a.layers, n_heads=4, seq_len=64)
    model = cfg.build()
    held = TextDataset(cfg.seq_len, n_samples=64, seed=1).batch(list(range(64)))
    torch.set_num_threads(1)
    for r in recs:
        if r.get("kind") == "eval" and "file" in r:
            model.load_state_dict(torch.load(r["file"], weights_only=True))
            with torch.no_grad():
                r["val"] = float(model.loss(held))
            os.remove(r["file"])


def equal_samples(curve: list[tuple[float, int, float]], ref: list[tuple[float, int, float]],
                  limit: int) -> tuple[int, float, float] | None:
    """(samples, loss, reference loss): the last point of `curve` at or below `limit` samples,
    and the reference curve's loss at those samples (linear between its two points around them).

    Like for like: the system's own measured point, never an interpolation across one of its
    syncs (its global weights change only there, so a line between two syncs overstates the loss
    before the second); the reference (synchronous training, a point per step) is dense."""
    pts = [(s, v) for _, s, v in curve if 0 < s <= limit]
    if not pts:
        return None
    s, v = max(pts, key=lambda x: x[0])
    rpts = sorted((rs, rv) for _, rs, rv in ref)
    for (s0, v0), (s1, v1) in zip(rpts, rpts[1:]):
        if s0 <= s <= s1:
            return s, v, v0 if s1 == s0 else v0 + (v1 - v0) * (s - s0) / (s1 - s0)
    if rpts and s == rpts[-1][0]:
        return s, v, rpts[-1][1]
    return None


def summarize(system: str, kill: bool, recs: list[dict[str, Any]], info: dict[str, Any],
              ref: Row | None) -> Row:
    t0 = info["t_first"] or 0.0
    commits = [r for r in recs if r.get("kind") is None]
    batch = info.get("batch", 0)
    if system.startswith("torchft"):
        # r0's count is participants x H x B per committed round, which counts a healed replica's
        # copy of its donor's pseudo-gradient as new samples: count every process's own kept work.
        own = sorted((r["step"], r["kept"] * batch) for r in commits if r["c"])
        evals = sorted((r["t"] - t0, sum(k for st, k in own if st <= r["step"]), r["val"])
                       for r in recs if r.get("kind") == "eval")
    else:
        evals = sorted((r["t"] - t0, r["samples"], r["val"]) for r in recs if r.get("kind") == "eval")
    survivors = [r for r in commits if r["proc"] not in info["killed"]]
    ran = sum(r["ran"] for r in survivors)
    kept = sum(r["kept"] for r in survivors)
    # Work is kept only when it is in a committed mean, also where the replica learned of that
    # commit from a peer's log (a fast-forward: its record has c 0 and ff > 0).
    in_syncs = sum(r["kept"] for r in commits if r["c"] or r.get("ff")) * batch
    digests: dict[int, set[str]] = {}
    for r in commits:
        if "digest" in r:
            digests.setdefault(r["step"], set()).add(r["digest"])
    # The longest time r0 (never killed) went without a commit, from the start of training to its
    # end: the wait after its last commit is a stall too (a group that stopped). A commit it
    # applied from a peer's log (ff) ends a gap as one of its own does.
    r0 = sorted(r["t"] for r in commits if r["proc"].endswith("-r0-0") and (r["c"] or r.get("ff")))
    marks = ([t0] if info["t_first"] else []) + r0 + ([info["t_end"]] if info.get("t_end") else [])
    marks.sort()
    stall = max((b - a for a, b in zip(marks, marks[1:])), default=0.0)
    contributing, due, recovery = recovery_check(system, recs, info, r0)
    if info.get("error"):   # the system never trained: its error, verbatim, is the row's result
        recovery = f"did not run: {info['error']}"
    target = ref.val_loss_final if ref is not None else (evals[-1][2] if evals else None)
    ttt = next((t for t, _, v in evals if target is not None and v <= target), None)
    own = own_cores(recs, t0, info["bytes_per_replica"], info.get("rate_mbit", 0.0))
    own_ttt = next((c for t, c in own if t >= ttt - 1e-6), own[-1][1]) if ttt is not None and own else None
    eq = equal_samples(evals, ref.curve, ref.samples) if ref is not None else None
    return Row(system=system, failures="kill" if kill else "none", time_to_target_s=ttt,
               equal_samples=eq[0] if eq else None, val_loss_equal_samples=eq[1] if eq else None,
               ref_val_loss_equal_samples=eq[2] if eq else None, val_loss_final=evals[-1][2] if evals else None,
               samples=evals[-1][1] if evals else 0, target=target,
               bytes_sent_per_replica=int(info["bytes_per_replica"]),
               survivor_work_kept=kept / ran if ran else None, samples_in_syncs=in_syncs,
               restarts_contributing=f"{contributing}/{due}", recovery=recovery, survivor_crashes=info["crashes"],
               divergent_steps=sum(1 for d in digests.values() if len(d) > 1), stall_max_s=round(stall, 2),
               kills=info["kills"], links=info["links"], curve=evals, ranks=info.get("ranks", 1),
               same_digests_end=end_digests(recs, info), restart_syncs=restart_syncs(recs, info),
               restarts_not_due=[short_name(p) for p in info["procs"]
                                 if not p.endswith("-0") and p not in due_restarts(info, r0)],
               own_cores_ttt_s=round(own_ttt, 2) if own_ttt is not None else None)


def own_cores(recs: list[dict[str, Any]], t0: float, bytes_per_island: float,
              rate_mbit: float) -> list[tuple[float, float]]:
    """r0's clock if each of its ranks had a core of its own: (wall seconds since the start, own-
    core seconds) at each of its records. A commit's own-core time is the largest CPU-seconds any
    of its ranks used since the previous record (the ranks of an island run in parallel and meet
    at each step) plus its share of the island's bytes at the link rate (the link does not speed
    up). Only an islands run records CPU-seconds (``wan_island.py``); [] otherwise."""
    mine = sorted((r for r in recs if str(r.get("proc", "")).endswith("-r0-0") and r.get("cpu")
                   and r.get("kind") in (None, "ready")), key=lambda r: r["t"])
    steps = [r for r in mine if r.get("kind") is None]
    if not steps or rate_mbit <= 0:
        return []
    link_s = bytes_per_island / len(steps) / (rate_mbit * 1e6 / 8)
    out: list[tuple[float, float]] = []
    clock, prev = 0.0, mine[0]["cpu"]
    for r in mine[1:]:
        clock += max(c - p for c, p in zip(r["cpu"], prev)) + link_s
        prev = r["cpu"]
        out.append((r["t"] - t0, clock))
    return out


def final_procs(info: dict[str, Any]) -> list[str]:
    """Each replica's last incarnation, where it was not killed (it ran to the end)."""
    last: dict[str, str] = {}
    for p in sorted(info["procs"], key=lambda q: int(q.rsplit("-", 1)[1])):
        last[p.rsplit("-", 1)[0]] = p
    return sorted(p for p in last.values() if p not in info["killed"])


def end_digests(recs: list[dict[str, Any]], info: dict[str, Any]) -> str:
    """'yes at 41' when every replica that ran to the end recorded the same digests (every rank's
    shard, comma-joined) at the last sync they all recorded one (a committed sync's, or the one a
    restart held when ready); 'no at 41' otherwise; '-' when they share none."""
    finals = final_procs(info)
    by: dict[str, dict[int, str]] = {p: {} for p in finals}
    for r in recs:
        if r["proc"] in by and "digest" in r and (r.get("kind") == "ready" or (r.get("kind") is None and r["c"])):
            by[r["proc"]][r["step"]] = r["digest"]
    common = set.intersection(*(set(d) for d in by.values())) if by else set()
    if not common:
        return "-"
    last = max(common)
    return f"{'yes' if len({d[last] for d in by.values()}) == 1 else 'no'} at {last}"


def restart_syncs(recs: list[dict[str, Any]], info: dict[str, Any]) -> dict[str, int | None]:
    """For each restarted replica: syncs from the one it held when ready (holding the global
    weights again; a torchft replica at its heal) to its first committed sync with its own work
    kept (None: it never contributed, or was never ready)."""
    out: dict[str, int | None] = {}
    for p in info["procs"]:
        if p.endswith("-0"):
            continue
        mine = [r for r in recs if r["proc"] == p]
        healed = [r["step"] for r in mine if r.get("kind") is None and r.get("healed")]
        ready = healed[:1] or [r["step"] for r in mine if r.get("kind") == "ready" and "step" in r][:1]
        own = [r["step"] for r in mine if r.get("kind") is None and r["c"] and r.get("kept", 0) > 0]
        out[short_name(p)] = own[0] - ready[0] if ready and own else None
    return out


def short_name(proc: str) -> str:
    """'diloco-kill-r1-1' -> 'r1-1': the replica and its incarnation."""
    return proc.rsplit("-", 2)[-2] + "-" + proc.rsplit("-", 1)[-1]


def due_restarts(info: dict[str, Any], r0_commits: list[float]) -> list[str]:
    """The restarts due to contribute (``recovery_check`` says when)."""
    restarted = [p for p in info["procs"] if not p.endswith("-0")]
    t_end = info.get("t_end") or 0.0
    gaps = [b - a for a, b in zip(r0_commits, r0_commits[1:])]
    margin = 3 * median(gaps) + 10.0 if gaps else 10.0
    killed_at = {k["proc"]: k["t"] for k in info.get("kill_log", [])}
    return [p for p in restarted if info["spawned"][p] < min(t_end, killed_at.get(p, t_end)) - margin]


def recovery_check(system: str, recs: list[dict[str, Any]], info: dict[str, Any],
                   r0_commits: list[float]) -> tuple[int, int, str]:
    """Did every restarted replica come back? (contributing, due, verdict).

    A restart is due to contribute when its process lived at least three syncs (r0's median gap)
    and 10 s, to the end of the run or to its own kill (a restart killed again before that had no
    time to come back); it contributed when one of its syncs committed with its own work. For
    torchft, its own logs are read too: any "got exception in recovery" flags the row, as does a
    due restart that never contributed (for every system)."""
    due = due_restarts(info, r0_commits)
    contributing = [p for p in due if any(r.get("kind") is None and r.get("c") and r.get("kept", 0) > 0
                                          and r["proc"] == p for r in recs)]
    problems = []
    if system.startswith("torchft"):
        errors, unhealed = 0, 0
        for p in info["procs"]:
            log = Path(info["tmp"]) / f"{p}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            errors += text.count(RECOVERY_ERROR)
            # A restart at step 0 among replicas past it must heal before it can commit.
            unhealed += p in due and "Loaded state dict" not in text
        if errors:
            problems.append(f"{errors} recovery errors in torchft's logs")
        if unhealed:
            problems.append(f"{unhealed} restarted replicas never loaded a state dict")
    if len(contributing) < len(due):
        problems.append(f"{len(due) - len(contributing)} restarted replicas never contributed")
    return len(contributing), len(due), "; ".join(problems) or "ok"


def fmt(v: Any, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def equal_cell(r: Row) -> str:
    """'2.412 (2.391) at 960, +0.9%': this system's loss, synchronous training's, the samples, the gap."""
    if r.val_loss_equal_samples is None or r.ref_val_loss_equal_samples is None:
        return "-"
    gap = 100 * (r.val_loss_equal_samples / r.ref_val_loss_equal_samples - 1)
    return (f"{r.val_loss_equal_samples:.3f} ({r.ref_val_loss_equal_samples:.3f}) at {r.equal_samples}, "
            f"{gap:+.1f}%")


def table(rows: list[Row]) -> str:
    if any(r.ranks > 1 for r in rows):
        return island_table(rows)
    head = ("| system | failures | time to target | val loss at equal samples (sync's) | final val loss | samples | "
            "own samples in syncs | MB/replica | survivor work kept | longest gap without a commit | "
            "restarts contributing | crashes | divergent | recovery |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        lines.append(f"| {r.system} | {r.failures} ({r.kills} kills) | {fmt(r.time_to_target_s, '.1f') + (' s' if r.time_to_target_s is not None else '')} | "
                     f"{equal_cell(r)} | {fmt(r.val_loss_final, '.4f')} | {r.samples} | "
                     f"{r.samples_in_syncs} | {r.bytes_sent_per_replica / 1e6:.1f} | "
                     f"{fmt(r.survivor_work_kept and 100 * r.survivor_work_kept, '.1f')}% | {r.stall_max_s:.2f} s | "
                     f"{r.restarts_contributing} | {r.survivor_crashes} | {r.divergent_steps} | "
                     f"{r.recovery if r.recovery == 'ok' else '**' + r.recovery + '**'} |")
    return "\n".join(lines)


def restarts_cell(r: Row) -> str:
    """'r1-1: 1, r2-1: never (not due)': syncs from each restart's ready to its first own
    contribution; 'not due': killed again, or started too late in the run to be due to contribute."""
    if not r.restart_syncs:
        return "-"
    return ", ".join(f"{p}: {'never' if v is None else v}" + (" (not due)" if v is None and p in r.restarts_not_due
                                                               else "") for p, v in sorted(r.restart_syncs.items()))


def island_table(rows: list[Row]) -> str:
    """The islands' table: today's columns, the per-shard digests at the end, each restart's syncs
    from ready to its own contribution, and the longest gap with kills beside the one without."""
    head = ("| system | failures | time to target (own cores) | val loss at equal samples (sync's) | final val loss | samples | "
            "own samples in syncs | MB/island | survivor work kept | longest gap without a commit (no kills) | "
            "restarts contributing | syncs from ready to own contribution | same per-shard digests at the end | "
            "crashes | divergent | recovery |")
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        gap = f"{r.stall_max_s:.2f} s" + (f" ({r.stall_none_s:.2f} s)" if r.stall_none_s is not None else "")
        lines.append(f"| {r.system} | {r.failures} ({r.kills} kills) | "
                     f"{fmt(r.time_to_target_s, '.1f') + (' s' if r.time_to_target_s is not None else '')}"
                     f"{f' ({r.own_cores_ttt_s:.1f} s)' if r.own_cores_ttt_s is not None else ''} | "
                     f"{equal_cell(r)} | {fmt(r.val_loss_final, '.4f')} | {r.samples} | {r.samples_in_syncs} | "
                     f"{r.bytes_sent_per_replica / 1e6:.1f} | "
                     f"{fmt(r.survivor_work_kept and 100 * r.survivor_work_kept, '.1f')}% | {gap} | "
                     f"{r.restarts_contributing} | {restarts_cell(r)} | {r.same_digests_end} | {r.survivor_crashes} | "
                     f"{r.divergent_steps} | {r.recovery if r.recovery == 'ok' else '**' + r.recovery + '**'} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        if r.curve:
            ax.plot([c[0] for c in r.curve], [c[2] for c in r.curve], label=f"{r.system}, {r.failures}",
                    linestyle="-" if r.failures == "none" else "--")
    if rows and rows[0].target is not None:
        ax.axhline(rows[0].target, color="grey", linewidth=0.8, label="target")
    ax.set_xlabel("wall time since training started (s)")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's settings (`systems` and `fails` as lists); usage errors exit, as argparse does."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smaller model, shorter runs (under 6 minutes on 2 cores; islands of 2 ranks: under 10)")
    p.add_argument("--systems", default=None,
                   help="default sync,diloco,streaming,torchft,torchft-streaming (with --ranks: "
                        "sync,diloco,streaming,torchft); torchft, torchft-streaming (torchft 0.2.0's DiLoCo, its "
                        "Streaming DiLoCo) need torchft and namespace links; skipped without torchft")
    p.add_argument("--failures", default="none,kill")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--ranks", type=int, default=1,
                   help="ranks per replica: > 1 makes each replica an island, an FSDP replica of this many ranks "
                        "on one host (bench/wan_island.py)")
    p.add_argument("--rate-mbit", type=float, default=50.0, help="each replica's link, Mbit/s per direction")
    p.add_argument("--links", choices=["auto", "netns", "proxy"], default="auto",
                   help="netns: a namespace per replica, tc tbf on its link (root); proxy: token-bucket proxies "
                        "on loopback; auto: netns where it can be made")
    p.add_argument("--duration", type=float, default=None, help="seconds of training per run")
    p.add_argument("--sync-every", type=int, default=None, help="H, inner steps between syncs")
    p.add_argument("--lr", type=float, default=1e-3, help="inner AdamW (and synchronous AdamW) learning rate")
    p.add_argument("--batch", type=int, default=8, help="samples per replica and (inner) step")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer SGD learning rate (every DiLoCo system)")
    p.add_argument("--outer-momentum", type=float, default=0.5, help="outer SGD's Nesterov momentum (0: none)")
    p.add_argument("--comm-timeout", type=float, default=10.0,
                   help="every system's collective timeout (p2pft's comm_timeout, torchft's Manager and Gloo)")
    p.add_argument("--eval-every", type=float, default=0.0,
                   help="least seconds between r0's saved weights, evaluated after the run (0: every commit)")
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--compression", default="bf16", choices=["none", "bf16", "int8"])
    p.add_argument("--kill-every", type=float, default=None)
    p.add_argument("--restart-after", type=float, default=2.0)
    p.add_argument("--max-kills", type=int, default=None,
                   help="kills per run at most (default: no limit; --quick islands: 2, the kill shape of one island "
                        "killed mid-span and one during a sync)")
    p.add_argument("--kill-phases", default="",
                   help="comma list of mid,sync: the k-th kill hits r1, r2, r1, ... at its next such phase (mid: "
                        "half a span done; sync: its sync starting), phases taken in turn; empty: a random "
                        "replica at the scheduled time")
    p.add_argument("--step-delay", type=float, default=0.0, help="emulated accelerator seconds per (inner) step")
    p.add_argument("--tft-join-timeout-ms", type=int, default=TFT_JOIN_TIMEOUT_MS,
                   help="torchft's lighthouse --join_timeout_ms (docs/diloco.md says why the default)")
    p.add_argument("--tft-heartbeat-timeout-ms", type=int, default=TFT_HEARTBEAT_TIMEOUT_MS,
                   help="torchft's lighthouse --heartbeat_timeout_ms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="keep the replicas' records and logs here")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    islands = a.ranks > 1
    if a.ranks < 1 or (islands and a.batch % a.ranks):
        p.error(f"--ranks must be at least 1 and divide --batch ({a.batch}), got {a.ranks}")
    a.d_model, a.layers = (128, 2) if a.quick else (256, 2)
    # Islands start R processes per replica (each imports torch): the quick runs train longer, so
    # that a restarted island has time to come back and contribute.
    a.duration = a.duration or ((45.0 if islands else 20.0) if a.quick else 120.0)
    a.sync_every = a.sync_every or 20
    # full: 5 kills, some during syncs; quick islands: two kills early enough that the second
    # restart (about 12 s to start two ranks on a loaded 2-core host) comes back and contributes
    a.kill_every = a.kill_every or (a.duration / (6 if islands else 3) if a.quick else 20.0)
    if a.max_kills is None:
        a.max_kills = 2 if islands and a.quick else 0
    a.startup = 90.0
    bad = [ph for ph in a.kill_phases.split(",") if ph and ph not in ("mid", "sync")]
    if bad:
        p.error(f"--kill-phases takes mid and sync, not {', '.join(bad)}")
    systems = [s for s in (a.systems or ",".join(ISLAND_SYSTEMS if islands else SYSTEMS)).split(",") if s]
    unknown = [s for s in systems if s not in (ISLAND_SYSTEMS if islands else SYSTEMS)]
    if unknown:
        p.error(f"unknown systems: {', '.join(unknown)}")
    if any(s.startswith("torchft") for s in systems):
        try:
            import torchft.local_sgd  # noqa: F401
        except ImportError as e:
            print(f"torchft skipped: {e} (pip install -e '.[compare]')")
            systems = [s for s in systems if not s.startswith("torchft")]
    fails = [f == "kill" for f in a.failures.split(",") if f]
    if "sync" not in systems or False not in fails:
        p.error("the target and the equal-samples reference are synchronous training without failures: "
                "keep 'sync' in --systems and 'none' in --failures")
    a.systems_list, a.fails = systems, fails
    return a


def main() -> int:
    a = parse()
    systems, fails = a.systems_list, a.fails
    rows: list[Row] = []
    ref: Row | None = None
    with tempfile.TemporaryDirectory(prefix="p2pft-wan-") as d:
        tmp = Path(a.workdir or d)
        tmp.mkdir(parents=True, exist_ok=True)
        order = ["sync"] + [s for s in systems if s != "sync"]
        for system in order:
            for kill in sorted(fails):
                t = time.time()
                recs, info = run_one(system, kill, a, tmp)
                row = summarize(system, kill, recs, info, ref)
                if kill:
                    row.stall_none_s = next((r.stall_max_s for r in rows if r.system == system
                                             and r.failures == "none"), None)
                if system == "sync" and not kill:
                    ref = row
                    row.equal_samples = row.samples
                    row.val_loss_equal_samples = row.ref_val_loss_equal_samples = row.val_loss_final
                rows.append(row)
                print(f"{system:9s} {'kill' if kill else 'none':4s}: {row.samples} samples, val "
                      f"{fmt(row.val_loss_final, '.3f')}, {time.time() - t:.0f} s", flush=True)
    print(table(rows))
    for r in rows:
        if r.recovery != "ok":
            print(f"FLAGGED: {r.system} {r.failures}: {r.recovery}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        meta = {"replicas": a.replicas, "ranks": a.ranks, "max_kills": a.max_kills, "rate_mbit": a.rate_mbit, "duration_s": a.duration, "sync_every": a.sync_every,
                "fragments": a.fragments, "compression": a.compression, "d_model": a.d_model, "layers": a.layers,
                "lr": a.lr, "batch": a.batch, "comm_timeout": a.comm_timeout, "outer_lr": a.outer_lr,
                "outer_momentum": a.outer_momentum, "step_delay": a.step_delay, "kill_every": a.kill_every,
                "kill_phases": a.kill_phases, "restart_after": a.restart_after,
                "torchft_quorum_timeout_s": TORCHFT_QUORUM_TIMEOUT_S, "torchft_join_timeout_ms": a.tft_join_timeout_ms,
                "torchft_heartbeat_timeout_ms": a.tft_heartbeat_timeout_ms}
        Path(a.json).write_text(json.dumps({"config": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
