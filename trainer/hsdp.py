"""``HSDP``: the step protocol for a replica of R ranks sharded with FSDP2 (one object per rank).

Inside the replica the ranks use an ordinary ``torch.distributed`` process group (gloo on CPU,
nccl on GPU) and ``fully_shard``; across replicas rank i allreduces its local gradient shards
with rank i of the others on the communicator of ``(data epoch, shard i)``. Only rank 0 runs a
``p2pft.Runtime``; the other ranks never see gossip. Per attempt (see docs/hsdp.md):

1. rank 0 turns the current view into a *plan* (data epoch, ordered peers' data addresses,
   this replica's rank in the view, whether it contributes) and broadcasts it in-replica;
2. every rank allreduces its shard of the step buffer on ``(epoch, shard = its rank)``;
3. the ranks all-gather a small verdict (ok / which peer failed / the contributors' steps read
   from the reduced buffer / catch-up readiness) and take the same decision from the same
   list: either every rank of the replica commits the step or none does. On failure rank 0
   reports the peer, waits for the next view, and all ranks retry with their saved local
   gradient shards (no recomputation).

A replica found behind (a joiner, or one that missed a commit) catches up shard by shard: it
contributes zeros, logs each reduced shard buffer, pulls its shard's snapshot from rank i of a
donor replica in the background, and restores + replays at a step boundary that all its ranks
agree on (every rank reports readiness in the verdict).
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
import time
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..node import JOINER, PARTICIPANT
from ..runtime import Runtime
from ..transport import CommAborted, CommError, DataServer
from ..transport.stream import StateSnapshot, fetch_state
from .cursor import DataCursor
from .donor import SnapshotRequests
from .ft import StepResult, StepTimeout, Stopped, _Entry
from .lr import LRPolicy, apply_lr_scale, base_lrs, lr_scale
from .shardstate import ShardStepBuffer, capture_shard, restore_shard, shard_digest

log = logging.getLogger(__name__)

_PING = struct.pack(">q", -1)  # on the side channel: "answer if you are running"
RANK_TIMEOUT_S = 10.0          # a rank silent for this long takes its replica down


def _exit_replica(rank: int, silent_s: float) -> None:
    """Default reaction to a stalled rank: end this process; the launcher then ends the rest of
    the replica and restarts it whole (the replica is the unit of failure)."""
    logging.shutdown()
    os._exit(75)

__all__ = ["HSDP", "StepResult", "StepTimeout", "Stopped", "agree", "append_replay"]


def agree(obj: Any, group: Any = None) -> list[Any]:
    """All-gather one small picklable object per rank of the replica (in rank order)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def append_replay(replay: list[_Entry], e: _Entry, cap_bytes: int, keep_from: int | None = None) -> None:
    """Log a reduced buffer for replay: contiguous steps only; past the cap the oldest entries
    go, but never those at or after `keep_from` (the step of a snapshot already held)."""
    while replay and replay[-1].step >= e.step:
        replay.pop()  # a step reduced again (nobody committed the earlier round): keep the latest
    if replay and e.step != replay[-1].step + 1:
        replay.clear()  # a gap: those entries can no longer be replayed in order
    replay.append(e)
    size = sum(x.flat.numel() * 4 for x in replay)
    while len(replay) > 1 and size > cap_bytes and (keep_from is None or replay[0].step < keep_from):
        size -= replay[0].flat.numel() * 4
        replay.pop(0)


class HSDP:
    """One rank of a multi-rank replica. Rank 0 passes the Runtime; the others pass None."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, data_server: DataServer,
                 runtime: Runtime | None, batch_per_replica: int, nominal_replicas: int | None = None,
                 lr_policy: str = "sqrt", max_slots: int = 256, replay_cap_bytes: int = 1 << 30,
                 step_timeout: float = 120.0, comm_timeout: float = 10.0, secret: bytes | None = None,
                 state_rate_limit: float | None = None, group: Any = None, rank_timeout: float = RANK_TIMEOUT_S,
                 on_rank_lost: Callable[[int, float], None] = _exit_replica,
                 loop_timeout: float | None = 60.0) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if (runtime is not None) != (self.rank == 0):
            raise ValueError("rank 0, and only rank 0, runs the Runtime")
        if batch_per_replica % self.world:
            raise ValueError(f"batch_per_replica={batch_per_replica} must be divisible by {self.world} ranks")
        if loop_timeout is not None and loop_timeout <= comm_timeout:
            raise ValueError(f"loop_timeout={loop_timeout} s must exceed comm_timeout={comm_timeout} s: "
                             "an allreduce may block that long without a beat")
        self.rt = runtime
        self.model = model
        self.opt = optimizer
        self.ds = data_server
        self.buf = ShardStepBuffer([p for p in model.parameters() if p.requires_grad], max_slots=max_slots)
        self.cursor = DataCursor(batch_per_replica, max_slots)
        self.policy = LRPolicy.parse(lr_policy)
        self.nominal = nominal_replicas
        self.base_lrs = base_lrs(optimizer)
        self.step = 0
        self.synced = True
        self.replay: list[_Entry] = []
        self.replay_cap = replay_cap_bytes
        self.step_timeout = step_timeout
        self.comm_timeout = comm_timeout
        self.secret = secret
        self.state_rate_limit = state_rate_limit
        self.events: deque[dict[str, Any]] = deque(maxlen=10_000)
        self._slot: int | None = None
        self._ranges: list[tuple[int, int]] = []
        self._comms: dict[int, Any] = {}
        self._superseded_by = -1  # newest data epoch announced: older communicators are dead
        self._comm_lock = threading.Lock()
        self._donors = SnapshotRequests()
        self._snap_box: "queue.Queue[StateSnapshot | BaseException]" = queue.Queue(1)
        self._fetching = False
        self._snapshot: StateSnapshot | None = None
        self._stop = threading.Event()
        self._plan_view: dict[str, Any] | None = None
        self._was_participant = False  # rank 0: see _plan
        self._rejoin_pending = False
        self._deadline = 0.0
        self.ds.serve_state(self._provide)
        # Newer data epochs reach the non-leader ranks over a tiny side channel (a blocked
        # collective could not deliver them), so their stale communicators abort as rank 0's do.
        self._listener: socket.socket | None = None
        self._side_slots = threading.BoundedSemaphore(8)
        host = self.ds.addr.rsplit(":", 1)[0].strip("[]")
        if self.rank != 0:
            self._listener = socket.create_server((host, 0))
            threading.Thread(target=self._epoch_listener, daemon=True, name="p2pft-hsdp-epochs").start()
        port = self._listener.getsockname()[1] if self._listener is not None else 0
        self._notify = [tuple(a) for a in agree((host, port), group)[1:]]
        self.rank_timeout = rank_timeout
        self.loop_timeout = loop_timeout  # see FaultTolerant: rank 0 reports the loop's beats
        self._on_rank_lost = on_rank_lost
        if self.rt is not None:
            self.rt.set_status("ready", self.step)
            self.rt.publish_step(self.step)
            threading.Thread(target=self._abort_superseded, daemon=True, name="p2pft-hsdp-views").start()
            if self._notify:
                threading.Thread(target=self._watch_ranks, daemon=True, name="p2pft-hsdp-watch").start()

    @classmethod
    def start(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, replica_id: str, listen: str,
              seeds: list[str], secret: bytes | None = None, data_host: str = "127.0.0.1",
              runtime_kw: dict[str, Any] | None = None, **kw: Any) -> "HSDP":
        """Collective over the replica: every rank opens its data server and reports the address
        to rank 0, which starts the Runtime announcing all of them (one per shard)."""
        ds = DataServer(data_host, 0, secret=secret)
        addrs = agree(ds.addr, kw.get("group"))
        rt = None
        if dist.get_rank(kw.get("group")) == 0:
            rt = Runtime(replica_id=replica_id, listen=listen, seeds=seeds, data_addrs=addrs,
                         shards=len(addrs), secret=secret, **(runtime_kw or {})).start()
        dist.barrier(kw.get("group"))
        return cls(model, optimizer, data_server=ds, runtime=rt, secret=secret, **kw)

    # ------------------------------------------------------------------ public loop API
    def begin(self, stop: bool = False) -> list[int]:
        """Collective. This rank's sample indices for the step ([] = the replica contributes
        nothing); raises Stopped when any rank asked to stop (so all ranks leave together)."""
        slot = None
        if self.rt is not None:
            me = self.rt.me()
            if me is not None and me["role"] == PARTICIPANT and self.synced and me["slot"] is not None:
                slot = int(me["slot"])
        got = agree({"stop": bool(stop or self._stop.is_set()), "slot": slot}, self.group)
        if any(g["stop"] for g in got):
            raise Stopped("stop requested")
        self._slot = got[0]["slot"]
        if self._slot is None:
            self._ranges = []
            return []
        self._ranges = self.cursor.assign(self._slot)
        idx = [i for a, b in self._ranges for i in range(a, b)]
        per = len(idx) // self.world
        return idx[self.rank * per:(self.rank + 1) * per]

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def commit(self) -> StepResult:
        """Collective. Allreduce this rank's shard, agree in-replica, retry across views, apply."""
        slot = self._slot
        self._slot = None
        self.buf.pack_step(slot if self.synced else None, self.step)
        self.buf.save()
        self._deadline = time.monotonic() + self.step_timeout
        retries = 0
        while True:
            out: list[Any] = [self._plan(slot) if self.rt is not None else None]
            dist.broadcast_object_list(out, src=0, group=self.group)
            plan = out[0]
            if plan["kind"] == "stop":
                raise Stopped(f"stopped while committing step {self.step}")
            if plan["kind"] == "timeout":
                raise StepTimeout(f"no view to commit step {self.step} in within {self.step_timeout} s")
            if plan["kind"] == "wait":
                continue
            if plan["rejoin"] and self.synced:
                log.warning("left out of a view after being a participant at step %d: catching up from a "
                            "snapshot before contributing again", self.step)
                self._start_catchup()
            if plan["demote"] and slot is not None:
                slot = None  # demoted or re-slotted while computing: these gradients must not count
                self.buf.pack_step(None, self.step)
                self.buf.save()
            err = self._allreduce(plan)
            verdicts = agree(self._verdict(err), self.group)
            outcome = self._decide(plan, verdicts, retries, slot)
            if outcome is not None:
                return outcome
            self.buf.restore()
            retries += 1

    def digests(self) -> list[str]:
        """Collective: every rank's shard digest (parameters + optimizer state), in rank order."""
        return agree(shard_digest(self.model, self.opt), self.group)

    def request_stop(self) -> None:
        """From a signal handler: the next begin() or plan raises Stopped on every rank."""
        self._stop.set()

    def close(self) -> None:
        with self._comm_lock:
            comms = list(self._comms.values())
            self._comms.clear()
        for c in comms:
            c.abort("closing")
            c.close()
        if self.rt is not None:
            self.rt.close(leave=True)
        if self._listener is not None:
            self._listener.close()
        self.ds.close()

    # ------------------------------------------------------------------ one attempt
    def _plan(self, slot: int | None) -> dict[str, Any]:
        """Rank 0: what every rank of the replica does in this attempt, from the current view."""
        rt = self.rt
        assert rt is not None
        if self._stop.is_set():
            return {"kind": "stop"}
        if time.monotonic() > self._deadline:
            return {"kind": "timeout"}
        if self.loop_timeout:
            rt.loop_beat(self.loop_timeout)
        view = rt.view
        me = rt.me(view)
        # Left out of a view after being a participant (absent, or a joiner it did not ask to
        # be): this replica may hold a step the others redid without it, so every rank catches
        # up from a snapshot before contributing again (see FaultTolerant._note_role).
        if me is not None and me["role"] == PARTICIPANT:
            self._was_participant = True
        elif self._was_participant and view is not None:
            self._was_participant = False
            self._rejoin_pending = True
        if view is None or me is None or me["role"] not in (PARTICIPANT, JOINER):
            rt.wait_view(lambda v: (rt.me(v) or {}).get("role") in (PARTICIPANT, JOINER),
                         timeout=min(1.0, max(0.0, self._deadline - time.monotonic())), loop_timeout=self.loop_timeout)
            return {"kind": "wait"}
        members = rt.data_members(view)
        bad = [m["node"] for m in members if len(m["data_addr"].split(",")) != self.world]
        if bad:
            log.error("data-plane members %s do not have %d shards; waiting for another view", bad, self.world)
            rt.wait_view(lambda v: v["epoch"] > view["epoch"], 0.5, loop_timeout=self.loop_timeout)
            return {"kind": "wait"}
        rejoin, self._rejoin_pending = self._rejoin_pending, False
        still_mine = (slot is not None and self.synced and not rejoin and me["role"] == PARTICIPANT
                      and me["slot"] == slot)
        donors = [m for m in view["members"] if m["role"] == PARTICIPANT and m["node"] != rt.node_id]
        donor = min(donors, key=lambda m: m["slot"] if m["slot"] is not None else 1 << 30) if donors else None
        self._plan_view = view
        return {"kind": "allreduce", "epoch": view["epoch"], "d": rt.data_epoch(view),
                "rank": [m["node"] for m in members].index(rt.node_id),
                "addrs": [m["data_addr"] for m in members], "contribute": still_mine,
                "demote": slot is not None and not still_mine, "role": me["role"], "rejoin": rejoin,
                "donor": (donor["node"], donor["data_addr"]) if donor else None}

    def _comm(self, d: int, rank: int, peers: list[str]) -> Any:
        with self._comm_lock:
            comm = self._comms.get(d)
            if comm is not None and comm.failed is None:
                return comm
            stale = [k for k in self._comms if k <= d]
            old = [self._comms.pop(k) for k in stale]
        for c in old:
            c.abort(f"replaced by data epoch {d}")
            c.close()
        comm = self.ds.communicator(d, self.rank, rank, peers, timeout=self.comm_timeout)
        with self._comm_lock:
            if d < self._superseded_by:
                # A newer data epoch was announced while this plan was in flight: the new
                # communicator must not wait out its connect timeout on a dead peer.
                comm.abort(f"superseded by data epoch {self._superseded_by} before first use")
            self._comms[d] = comm
        return comm

    def _allreduce(self, plan: dict[str, Any]) -> BaseException | None:
        peers = [a.split(",")[self.rank] for a in plan["addrs"]]
        try:
            comm = self._comm(plan["d"], plan["rank"], peers)
            comm.allreduce(self.buf.flat, contribute=plan["contribute"], timeout=self.comm_timeout)
            return None
        except CommError as exc:
            return exc
        except Exception as exc:  # e.g. a communicator of this epoch was just closed
            log.debug("allreduce not possible: %r", exc)
            return exc

    def _verdict(self, err: BaseException | None) -> dict[str, Any]:
        """This rank's outcome, small enough to all-gather every attempt."""
        if err is not None:
            return {"ok": False, "comm": isinstance(err, CommError), "aborted": isinstance(err, CommAborted),
                    "peer": getattr(err, "peer_addr", None), "why": repr(err)[:300]}
        try:
            steps = self.buf.slot_steps()
            count = self.buf.contributors()
        except Exception as exc:
            return {"ok": False, "comm": False, "aborted": False, "peer": None, "why": repr(exc)[:300]}
        return {"ok": True, "steps": sorted(steps.items()), "count": count, "ready": self._catchup_ready()}

    def _decide(self, plan: dict[str, Any], verdicts: list[dict[str, Any]], retries: int,
                slot: int | None) -> StepResult | None:
        """Identical on every rank: a function of the gathered verdicts and replicated state."""
        role = plan["role"]
        bad = [v for v in verdicts if not v["ok"]]
        if not bad and any((v["steps"], v["count"]) != (verdicts[0]["steps"], verdicts[0]["count"])
                           for v in verdicts):
            log.warning("shards reduced different contributor sets; retrying on a fresh data epoch")
            bad = [{"ok": False, "comm": True, "aborted": True, "peer": None, "why": "shards disagree"}]
        if bad:
            if self.rt is not None:
                self._recover(bad)
            return None
        steps = dict(verdicts[0]["steps"])
        count = int(verdicts[0]["count"])
        if not steps:
            time.sleep(0.01)  # nobody contributed: hand back so begin() reads the next roles
            return StepResult(self.step, False, 0, retries, role)
        lo, hi = min(steps.values()), max(steps.values())
        if lo != hi:
            # An earlier step committed at some replicas only. Those behind catch up from a
            # snapshot (no per-shard fast-forward yet); everybody discards this round.
            if self.synced and self.step < hi:
                self._start_catchup()
                return StepResult(self.step, False, 0, retries, role)
            time.sleep(0.005)
            return None
        s = hi
        mask = [i in steps for i in range(self.buf.max_slots)]
        entry = _Entry(s, self.buf.flat.clone(), count, mask)
        if not self.synced:
            # Readiness was judged on the log before this entry: only valid if it extends it.
            extends = bool(self.replay) and self.replay[-1].step + 1 == s
            append_replay(self.replay, entry, self.replay_cap,
                          int(self._snapshot.meta["step"]) if self._snapshot is not None else None)
            if extends and all(v["ready"] for v in verdicts):
                self._finish_catchup()
            else:
                self._maybe_fetch(plan)
            return StepResult(self.step, False, count, retries, role)
        if self.step < s:
            self._start_catchup()
            return StepResult(self.step, False, 0, retries, role)
        if self.step > s:
            time.sleep(0.005)  # contributors are behind us: they catch up; retry
            return None
        trained = list(self._ranges) if slot is not None and mask[slot] else None
        self._apply(entry)
        self._after_commit()
        return StepResult(self.step, True, count, retries, role, trained=trained)

    def _apply(self, e: _Entry) -> None:
        """One optimizer update of this rank's shard from a reduced shard buffer."""
        if e.step != self.step:
            raise AssertionError(f"applying step {e.step} at step {self.step}")
        self.buf.unpack(float(e.count), source=e.flat)
        apply_lr_scale(self.opt, self.base_lrs, lr_scale(self.policy, e.count, self.nominal or e.count))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.cursor.commit(e.mask)
        self.step += 1

    def _after_commit(self) -> None:
        if self.rt is not None:
            self.rt.publish_step(self.step)
        self._serve_donor_requests()

    # ------------------------------------------------------------------ failures (rank 0)
    def _recover(self, bad: list[dict[str, Any]]) -> None:
        """Report the peers the ranks blamed, then wait (bounded) for a newer data epoch; if none
        comes (nobody died: a peer was slow) ask for a fresh one. Same policy as FaultTolerant."""
        rt, view = self.rt, self._plan_view
        assert rt is not None and view is not None
        d = rt.data_epoch(view)
        for v in bad:
            peer = rt.peer_of_data_addr(v["peer"], view)
            if v["comm"] and not v["aborted"] and peer is not None and peer["node"] != rt.node_id:
                rt.report_failure(peer["node"])
            self.events.append({"t": time.time(), "kind": "comm_error", "error": v["why"][:80],
                                "peer": peer["node"] if peer else None, "epoch": view["epoch"]})
        log.info("step %d failed on data epoch %d (%s); waiting for the next view", self.step, d,
                 "; ".join(v["why"] for v in bad)[:300])
        if not any(v["comm"] for v in bad):
            rt.wait_view(lambda v: rt.data_epoch(v) > d, 0.2, loop_timeout=self.loop_timeout)
            return
        wait = max(0.0, min(self._deadline - time.monotonic(), 6 * rt.profile.suspicion_min * 4))
        if rt.wait_view(lambda v: rt.data_epoch(v) > d, wait, loop_timeout=self.loop_timeout) is None:
            log.warning("no new view after a failure on data epoch %d; asking for a fresh data epoch", d)
            rt.request_new_data_epoch(d)
            rt.wait_view(lambda v: rt.data_epoch(v) > d, max(0.0, min(self._deadline - time.monotonic(), 5.0)),
                         loop_timeout=self.loop_timeout)

    def _abort_below(self, d: int) -> None:
        with self._comm_lock:
            self._superseded_by = max(self._superseded_by, d)
            stale = [c for k, c in self._comms.items() if k < d]
        for c in stale:
            c.abort(f"superseded by data epoch {d}")

    def _abort_superseded(self) -> None:
        """Rank 0: a newer data epoch aborts the older communicators of every rank of the
        replica (unblocks an allreduce waiting on a dead or stalled peer at once)."""
        rt = self.rt
        assert rt is not None
        seen = -1
        socks: dict[int, socket.socket] = {}
        while not rt._closed:
            v = rt.wait_view(lambda v: rt.data_epoch(v) > seen, 1.0)
            if v is None:
                continue
            seen = rt.data_epoch(v)
            self._abort_below(seen)
            for i, addr in enumerate(self._notify):
                for _ in range(2):  # one reconnect: the rank may have restarted its accept
                    try:
                        if i not in socks:
                            socks[i] = socket.create_connection(addr, timeout=1.0)
                        socks[i].sendall(struct.pack(">q", seen))
                        break
                    except OSError:
                        old = socks.pop(i, None)
                        if old is not None:
                            old.close()

    def _watch_ranks(self) -> None:
        """Rank 0: ping every other rank on the side channel. A rank that is stopped or wedged
        keeps its sockets open, so no peer sees an error, and rank 0 (which still answers
        gossip) would keep the replica in the view while the other replicas' allreduces time
        out again and again. Past `rank_timeout` of silence, rank 0 leaves the view at once and
        takes the replica down, to be restarted whole."""
        rt = self.rt
        assert rt is not None
        conns: dict[int, socket.socket] = {}
        last_ok = {i: time.monotonic() for i in range(len(self._notify))}
        while not self._stop.is_set() and not rt._closed:
            for i, addr in enumerate(self._notify):
                try:
                    if i not in conns:
                        conns[i] = socket.create_connection(addr, timeout=1.0)
                    conns[i].settimeout(1.0)
                    conns[i].sendall(_PING)
                    if not conns[i].recv(1):
                        raise ConnectionError("closed")
                    last_ok[i] = time.monotonic()
                except OSError:
                    old = conns.pop(i, None)
                    if old is not None:
                        old.close()
                silent = time.monotonic() - last_ok[i]
                if silent > self.rank_timeout and not self._stop.is_set() and not rt._closed:
                    log.error("rank %d of this replica has not answered for %.1f s: leaving the view and "
                              "taking the replica down (it restarts whole)", i + 1, silent)
                    rt.close(leave=True, timeout=2.0)
                    self._on_rank_lost(i + 1, silent)
                    return
            time.sleep(0.5)
        for c in conns.values():
            c.close()

    def _epoch_listener(self) -> None:
        """Non-leader ranks: accept rank 0's side-channel connections (epochs, pings)."""
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._side_slots.acquire(blocking=False):
                conn.close()  # only rank 0 connects here (two connections); refuse a flood
                continue
            threading.Thread(target=self._side_channel, args=(conn,), daemon=True,
                             name="p2pft-hsdp-side").start()

    def _side_channel(self, conn: socket.socket) -> None:
        """Abort communicators older than each data epoch rank 0 announces; answer pings."""
        try:
            self._serve_side(conn)
        finally:
            conn.close()
            self._side_slots.release()

    def _serve_side(self, conn: socket.socket) -> None:
        buf = b""
        while True:
            try:
                chunk = conn.recv(64)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while len(buf) >= 8:
                (d,), buf = struct.unpack(">q", buf[:8]), buf[8:]
                if d < 0:
                    try:
                        conn.sendall(b"\x01")
                    except OSError:
                        return
                else:
                    self._abort_below(d)

    # ------------------------------------------------------------------ catch-up (per shard)
    def _start_catchup(self) -> None:
        self.synced = False
        self.replay.clear()
        self._snapshot = None
        if self.rt is not None:
            self.rt.set_status("joining", self.step)
        self.events.append({"t": time.time(), "kind": "catchup_start", "step": self.step})

    def _catchup_ready(self) -> bool:
        """Holds a snapshot that the replay log reaches (polled before each verdict)."""
        if self.synced:
            return False
        if self._snapshot is None:
            try:
                got = self._snap_box.get_nowait()
            except queue.Empty:
                return False
            self._fetching = False
            if isinstance(got, BaseException):
                log.info("shard snapshot fetch failed (%s); will retry", got)
                return False
            self._snapshot = got
        s0 = int(self._snapshot.meta["step"])
        if self.replay and s0 < self.replay[0].step:
            log.info("snapshot of step %d predates the replay log (%d..); pulling a newer one", s0,
                     self.replay[0].step)
            self._snapshot = None
            return False
        return bool(self.replay) and s0 <= self.replay[-1].step + 1

    def _maybe_fetch(self, plan: dict[str, Any]) -> None:
        if self._fetching or self._snapshot is not None or not self.replay or plan["donor"] is None:
            return
        self._fetching = True
        node, addrs = plan["donor"]
        threading.Thread(target=self._fetch, args=(node, addrs.split(",")[self.rank], self.replay[0].step),
                         daemon=True, name="p2pft-hsdp-catchup").start()

    def _fetch(self, node: str, addr: str, min_step: int) -> None:
        try:
            t0 = time.monotonic()
            snap = fetch_state(addr, {"kind": "snapshot", "min_step": min_step, "shard": self.rank},
                               secret=self.secret, timeout=60.0, rate_limit_bytes_per_s=self.state_rate_limit)
            if int(snap.meta.get("shard", -1)) != self.rank:
                raise CommError(f"donor sent shard {snap.meta.get('shard')} for shard {self.rank}")
            snap.meta["_donor"] = node
            snap.meta["_fetch_s"] = time.monotonic() - t0
            self._snap_box.put(snap)
        except BaseException as exc:  # reported to the training thread, which retries
            self._snap_box.put(exc)

    def _finish_catchup(self) -> None:
        """All ranks at once (agreed in the verdicts): restore the shard snapshot, replay."""
        snap = self._snapshot
        assert snap is not None
        s0 = int(snap.meta["step"])
        pending = [e for e in self.replay if e.step >= s0]
        restore_shard(self.model, self.opt, snap.meta["state"], snap.tensors)
        self.cursor.load_state_dict(snap.meta["cursor"])
        self.step = s0
        for e in pending:
            self._apply(e)
        self.replay.clear()
        self._snapshot = None
        self.synced = True
        if self.rt is not None:
            self.rt.set_status("ready", self.step)
            self.rt.publish_step(self.step)
        self.events.append({"t": time.time(), "kind": "catchup_done", "step": self.step, "snapshot_step": s0,
                            "replayed": len(pending), "fetch_s": snap.meta.get("_fetch_s")})
        log.info("shard %d caught up: snapshot of step %d from %s (%.2f s), replayed %d step(s)", self.rank,
                 s0, snap.meta.get("_donor"), snap.meta.get("_fetch_s", 0.0), len(pending))

    # ------------------------------------------------------------------ donor side (per shard)
    def _provide(self, request: dict[str, Any]) -> StateSnapshot | None:
        """Transport thread: hand a shard snapshot taken by the training thread at a step boundary."""
        if request.get("kind") != "snapshot" or int(request.get("shard", self.rank)) != self.rank:
            return None
        return self._donors.request(request)

    def _serve_donor_requests(self) -> None:
        def take() -> StateSnapshot:
            meta, tensors = capture_shard(self.model, self.opt, {})
            return StateSnapshot(meta={"step": self.step, "shard": self.rank, "state": meta,
                                       "cursor": self.cursor.state_dict()}, tensors=tensors)
        self._donors.serve(lambda req: self.synced and self.step >= int(req.get("min_step", 0)), take)
