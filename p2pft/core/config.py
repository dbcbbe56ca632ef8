"""Timing profiles for gossip and agreement.

One profile is shared by the real driver and the simulator, so the numbers the simulator
measures are the numbers a deployment gets. ``default`` targets a datacenter or loopback.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Profile:
    # --- gossip (SWIM + Lifeguard) ---
    probe_interval: float = 0.15       # one direct probe per interval (docs/control-plane.md: timing knobs)
    probe_timeout: float = 0.08        # wait for a direct ack before going indirect
    indirect_probes: int = 3           # k members asked to probe on our behalf
    suspicion_mult: float = 1.5        # min suspicion = mult * log10(N) * probe_interval
    suspicion_min: float = 0.25        # floor for small clusters
    suspicion_max_mult: float = 4.0    # max suspicion = max_mult * min
    suspicion_confirmations: int = 3   # K: independent suspicions that shrink the timeout to min
    retransmit_mult: int = 4           # an update is piggybacked retransmit_mult*log10(N+1) times
    max_piggyback: int = 8             # updates per message
    pushpull_interval: float = 15.0    # periodic full-state sync (scaled by log2 of N/32 above 32)
    awareness_max: int = 8             # Lifeguard local-health multiplier cap
    dead_keep: float = 30.0            # keep tombstones this long to reject stale updates
    reconnect_interval: float = 1.0    # push-pull with one random dead member this often
    # --- agreement (Raft) ---
    heartbeat: float = 0.05
    election_min: float = 0.3
    election_max: float = 0.6
    max_voters: int = 5
    batch_window: float = 0.02         # membership changes within this window go into one view
    bootstrap_wait: float = 0.6        # with seeds but no view anywhere, wait before bootstrapping
    view_retry: float = 0.5            # re-ask for a view we heard of but did not get
    compact_after: int = 64            # Raft log entries kept before compacting to a snapshot
    quorum_loss_grace: float = 2.0     # a majority of the voters unreachable this long: one ERROR, shown by top
    # --- data plane ---
    data_ack_timeout: float = 0.3      # a ring neighbour's host silent this long (TCP) fails the op, blaming it

    def scaled(self, factor: float) -> "Profile":
        """All durations multiplied by factor (for slow networks)."""
        fields = {k: getattr(self, k) * factor for k in (
            "probe_interval", "probe_timeout", "suspicion_min", "pushpull_interval", "dead_keep", "reconnect_interval",
            "heartbeat", "election_min", "election_max", "batch_window", "bootstrap_wait", "view_retry",
            "data_ack_timeout", "quorum_loss_grace")}
        return replace(self, **fields)


DEFAULT = Profile()
PROFILES: dict[str, Profile] = {"default": DEFAULT, "wan": DEFAULT.scaled(5.0)}
