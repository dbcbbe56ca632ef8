"""The same start everywhere: the job's first participants start from one state at step 0.

The lead holds a copy of its step-0 state (every rank, its own shard) and serves it; the others
pull it (``initial_state='broadcast'``, as DDP broadcasts rank 0's; an FSDP replica's rank i
takes shard i of the lead replica's rank i) or only its digest (``'check'``). With ``'check'``
every checker tells the lead its outcome, and the lead's verdict over all of them is one
``InitialStateMismatch`` everywhere, so nobody trains on alone past a failed check. A network
protocol of its own, kept apart from forming and from the per-step hooks.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ...core.lifecycle import Fetch, initial_fetch
from ...core.view import View, shard_addr
from ...transport import CommTimeout, PeerFailed
from ...transport.stream import StateSnapshot, fetch_state
from ..kernel.errors import InitialStateMismatch, StepTimeout, Stopped
from ..kernel.options import InitialState, JobOptions
from ..kernel.ports import LifePort
from ..kernel.requests import RequestKind, StateRequest
from .ranks import POLL_S, Ranks, log, raise_if_unusable

FETCH_INITIAL_TIMEOUT_S = 30.0
ATTEMPT_TIMEOUT_S = 5.0     # one try at the lead's data port; the view is read again between tries
VERDICT_SEEN_S = 5.0        # the lead, before it raises: time for the checkers to read its verdict


@dataclass(frozen=True)
class InitialPlan:
    how: Fetch
    lead: str = ""                                  # the lead's replica id
    lead_node: str = ""
    addrs: tuple[str, ...] = ()                     # the lead's data address per shard


class SameStart:
    """One rank's part in agreeing the state at step 0: the lead's copy it serves, the pull
    and check of the others, and the lead's record of their checks."""

    def __init__(self, port: LifePort, options: JobOptions, ranks: Ranks) -> None:
        self.port = port
        self.options = options
        self.ranks = ranks
        self._held: tuple[StateSnapshot, str] | None = None   # the lead's step-0 state and its digest
        self._checks = InitialChecks()         # the lead's record of the others' digest checks
        port.donor.register(RequestKind.INITIAL, self._initial_state)
        port.donor.register(RequestKind.CHECKED, self._checks.report)

    def plan(self) -> InitialPlan:
        """Rank 0: how the state at step 0 is agreed (``initial_fetch``)."""
        rt = self.ranks.rt
        view = rt.view
        how = initial_fetch(view, rt.node_id, self.port.step, rt.member_step,
                            agree=self.options.initial_state is not InitialState.OFF)
        if how is Fetch.CATCH_UP:
            log.info("the group started without this replica: catching up from a snapshot instead of "
                     "taking the initial state")
        if how in (Fetch.HOLD, Fetch.FROM):
            assert view is not None
            return self._lead_plan(view)
        return InitialPlan(how)

    def hold(self) -> None:
        """The lead (every rank): keep a copy of this shard's state at step 0 for the others."""
        meta, tensors = self.port.capture_state()
        self._held = (StateSnapshot(meta=meta, tensors=tensors), self.port.digest())
        log.info("holding the initial state for the group (digest %s)", self._held[1][:12])

    def take(self, plan: InitialPlan, deadline: float) -> None:
        """Collective: every rank pulls its shard of the lead's step-0 state (or its digest);
        rank 0 picks the lead again after a failed round (it may have moved, died or gone on)."""
        p = self.port
        mode = self.options.initial_state
        end = min(deadline, time.monotonic() + FETCH_INITIAL_TIMEOUT_S)
        last: str | None = None
        while True:
            got: StateSnapshot | BaseException
            try:
                addr = shard_addr(plan.addrs, p.shard, plan.lead_node)
                got = fetch_state(addr, StateRequest.initial(mode is InitialState.CHECK, p.shard).to_wire(),
                                  secret=p.secret, timeout=max(0.1, min(ATTEMPT_TIMEOUT_S, end - time.monotonic())),
                                  into=p.receive_into() if mode is InitialState.BROADCAST else None,
                                  source_host=p.ds.host)
            except Exception as exc:  # not held yet (the lead is still starting), or gone: look again
                got = exc
            errors = [g for g in p.group.agree(None if isinstance(got, StateSnapshot) else _failure(got))
                      if g is not None]
            if not errors:
                assert isinstance(got, StateSnapshot)
                self._check(plan, got, mode)
                return
            last = errors[0][1]
            plan = self.ranks.decided(lambda: self._retry(plan, errors, end))
            if plan.how is Fetch.HOLD:
                self.hold()
                return
            if plan.how is Fetch.CATCH_UP:
                p.catchup.start("the group started without this replica")
                return
            if plan.how is Fetch.NONE:
                return
            if time.monotonic() >= end:
                raise StepTimeout(f"could not get the initial state from the leader within "
                                  f"{FETCH_INITIAL_TIMEOUT_S} s: {last}")

    def collect_checks(self, deadline: float) -> None:
        """Collective, after the start: the lead with initial_state='check' (the one holding a
        step-0 copy) waits for the others' checks; a no-op on every other replica."""
        if self._held is not None and self.options.initial_state is InitialState.CHECK:
            self.ranks.decided(lambda: self._collect_checks(deadline))

    def on_step(self) -> None:
        if self._held is not None and self.port.step > 0:
            self._held = None  # every first participant is past step 0: nobody pulls it any more

    # ------------------------------------------------------------------ rank 0
    def _lead_plan(self, view: View) -> InitialPlan:
        lead = view.lead()
        if lead is None:
            return InitialPlan(Fetch.NONE)
        if lead.node == self.ranks.rt.node_id:
            return InitialPlan(Fetch.HOLD)
        return InitialPlan(Fetch.FROM, lead=lead.replica_id, lead_node=lead.node, addrs=tuple(lead.data_addrs))

    def _retry(self, plan: InitialPlan, errors: list[tuple[bool, str]], end: float) -> InitialPlan:
        """Rank 0, after a failed round: report an unreachable lead, notice one that went on
        without us, wait a little, and name the lead of the current view."""
        rt, p = self.ranks.rt, self.port
        if p.stopping:
            raise Stopped("stop requested")
        raise_if_unusable(p)   # the data plane can never work here: do not wait for the lead
        if any(unreachable for unreachable, _ in errors):
            # Evidence like a failed ring connect: a lead whose data port we cannot reach is
            # probed and, past the bound, left out, and the next view names another.
            rt.report_failure(plan.lead_node)
        elif rt.member_step(plan.lead_node) > 0:
            # The group started without us (the lead trained alone, or committed before we
            # asked): its step-0 copy is gone. Catch up from a snapshot as a joiner does.
            log.info("the lead %s is past step 0: catching up instead of taking the initial state", plan.lead)
            return InitialPlan(Fetch.CATCH_UP)
        if time.monotonic() < end:
            rt.wait_view(lambda v: False, POLL_S, loop_timeout=p.loop_timeout)
        view = rt.view
        return self._lead_plan(view) if view is not None else plan

    def _check(self, plan: InitialPlan, snap: StateSnapshot, mode: InitialState) -> None:
        """Every rank: load the lead's shard (broadcast) and compare digests; a mismatch on any
        rank is one error on every rank."""
        p = self.port
        want = str(snap.meta["digest"])
        if mode is InitialState.BROADCAST:
            with p.state_mutation():     # no donor copies a half-loaded state
                p.load_state(snap.meta, snap.tensors)
        mine = p.digest()
        same = p.group.agree(mine == want)
        if mode is InitialState.CHECK:
            end = time.monotonic() + FETCH_INITIAL_TIMEOUT_S
            self.ranks.decided(lambda: self._report_check(plan, all(same), end))
        if not all(same):
            log.error("initial state differs from the leader %s's before step 0 (digest %s here, %s there)",
                      plan.lead, mine[:12], want[:12])
            raise InitialStateMismatch(f"initial state differs from replica {plan.lead}'s before step 0 "
                                       f"(digest {mine[:12]} here, {want[:12]} there): seed every replica alike, "
                                       "or use initial_state='broadcast'")
        log.info("%s the initial state of %s (digest %s)",
                 "took" if mode is InitialState.BROADCAST else "checked", plan.lead, mine[:12])
        p.events.append({"t": time.time(), "kind": "initial_state", "from": plan.lead, "digest": mine})

    def _report_check(self, plan: InitialPlan, ok: bool, deadline: float) -> None:
        """Rank 0 of a replica that checked the lead's digest: tell the lead (so that it does
        not train on alone past a failed check) and wait, bounded, for its verdict over every
        check. A failed check elsewhere raises here too; an unreachable lead leaves our own
        outcome to decide (the view then names another lead)."""
        rt = self.ranks.rt
        addr = shard_addr(plan.addrs, 0, plan.lead_node)
        while True:
            try:
                got = fetch_state(addr, StateRequest.checked(ok, rt.replica_id).to_wire(), secret=self.port.secret,
                                  timeout=max(0.1, min(ATTEMPT_TIMEOUT_S, deadline - time.monotonic())),
                                  source_host=self.port.ds.host)
                verdict, bad = got.meta.get("verdict"), list(got.meta.get("bad", []))
            except Exception as exc:   # the lead is gone or does not answer: our own outcome stands
                log.info("no verdict on the initial state from the lead %s (%s)", plan.lead, exc)
                return
            if verdict == "mismatch" and ok:
                log.error("the initial state of replica(s) %s differs from the leader %s's before step 0 (ours "
                          "matches): the job's replicas do not start alike; stopping", ", ".join(bad), plan.lead)
                raise InitialStateMismatch(f"the initial state of replica(s) {', '.join(bad)} differs from replica "
                                           f"{plan.lead}'s before step 0: seed every replica alike, or use "
                                           "initial_state='broadcast'")
            if verdict != "pending" or time.monotonic() >= deadline or self.port.stopping:
                return
            time.sleep(POLL_S)

    def _collect_checks(self, deadline: float) -> None:
        """Rank 0 of the lead with initial_state='check': wait (bounded) until every other
        participant at step 0 has reported its check, or left the view; one failed check is an
        InitialStateMismatch here too, after the checkers had a moment to read the verdict."""
        rt, p = self.ranks.rt, self.port
        end = min(deadline, time.monotonic() + FETCH_INITIAL_TIMEOUT_S)
        while True:
            view = rt.view
            others = {m.replica_id for m in (view.participants if view is not None else [])
                      if m.node != rt.node_id and rt.member_step(m.node) == 0}
            missing = others - self._checks.heard()
            if not missing or time.monotonic() >= end or p.stopping:
                break
            rt.wait_view(lambda v: False, POLL_S, loop_timeout=p.loop_timeout)
        bad = self._checks.decide()
        if missing:
            log.warning("no initial-state check from %s within %g s: starting without their word",
                        ", ".join(sorted(missing)), FETCH_INITIAL_TIMEOUT_S)
        if not bad:
            return
        digest = self._held[1][:12] if self._held is not None else "?"
        log.error("the initial state of replica(s) %s differs from this leader's before step 0 (digest %s): the "
                  "job's replicas do not start alike; stopping", ", ".join(bad), digest)
        self._checks.wait_seen(VERDICT_SEEN_S)
        raise InitialStateMismatch(f"the initial state of replica(s) {', '.join(bad)} differs from this leader's "
                                   "before step 0: seed every replica alike, or use initial_state='broadcast'")

    # ------------------------------------------------------------------ transport threads
    def _initial_state(self, request: StateRequest) -> StateSnapshot | None:
        """Transport thread: the state (or only its digest) the lead holds for step 0."""
        held = self._held
        if held is None:
            return None
        snap, digest = held
        if request.digest_only:
            return StateSnapshot(meta={"digest": digest}, tensors={})
        return StateSnapshot(meta={**snap.meta, "digest": digest}, tensors=snap.tensors)


class InitialChecks:
    """The lead's record of the others' initial-state checks (written by transport threads):
    'pending' until the lead decides, then 'ok' or 'mismatch' with the replicas that differ."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ok: dict[str, bool] = {}
        self._verdict = "pending"
        self._bad: list[str] = []
        self._seen: set[str] = set()
        self._all_seen = threading.Event()

    def report(self, req: StateRequest) -> StateSnapshot:
        """Transport thread: record one check, answer with the verdict so far."""
        with self._lock:
            self._ok.setdefault(req.who, req.ok)
            self._ok[req.who] = self._ok[req.who] and req.ok
            if self._verdict != "pending":
                self._seen.add(req.who)
                if self._seen >= set(self._ok):
                    self._all_seen.set()
            return StateSnapshot(meta={"verdict": self._verdict, "bad": list(self._bad)}, tensors={})

    def heard(self) -> set[str]:
        with self._lock:
            return set(self._ok)

    def decide(self) -> list[str]:
        """The verdict over the checks heard: the replicas whose check failed."""
        with self._lock:
            self._bad = sorted(w for w, ok in self._ok.items() if not ok)
            self._verdict = "mismatch" if self._bad else "ok"
            return list(self._bad)

    def wait_seen(self, timeout: float) -> None:
        """Until every checker read the verdict (bounded): the lead is about to stop."""
        self._all_seen.wait(timeout)


def _failure(exc: BaseException) -> tuple[bool, str]:
    """(the lead's data port is unreachable, what happened) of a failed fetch."""
    return isinstance(exc, (PeerFailed, CommTimeout)), f"{type(exc).__name__}: {exc}"


__all__ = ["ATTEMPT_TIMEOUT_S", "FETCH_INITIAL_TIMEOUT_S", "InitialChecks", "InitialPlan", "SameStart",
           "VERDICT_SEEN_S"]
