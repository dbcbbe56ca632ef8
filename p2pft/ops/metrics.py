"""Prometheus metrics of one process: its node's view of the cluster, its data plane, its steps.

Off by default; ``--metrics-port`` (``p2pft peer``, the example replicas), ``P2PFT_METRICS_PORT``
or ``Runtime(metrics_port=...)`` turns it on. Every process has its own ``CollectorRegistry``
(never the global one, so several runtimes in one process, as in tests, do not collide).

The control and data planes are read at scrape time (pull-style collectors over the counters
the driver, the node and the data server keep anyway): nothing is written on their hot paths
for metrics. Only the trainer's per-step values are pushed, once per step, by
``p2pft.trainer.metrics.StepMetrics`` (trainer code: it reads a ``StepResult``).
Names and units follow Prometheus conventions; the table is in docs/operations.md.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterator, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from .observe import family, rejected_counts
from ..core.view import Role

if TYPE_CHECKING:
    from ..net.driver import NodeServer


class Runtime(Protocol):
    """What the metrics read of a ``p2pft.Runtime`` (a protocol: the runtime imports this module)."""

    server: Any
    data: Any

log = logging.getLogger(__name__)

ROLES = tuple(r.value for r in Role)
STATES = ("alive", "suspect", "dead", "left")
CONNECTION_REJECTS = ("inbound_evicted", "idle_closed", "slow_reader_closed")


def parse_metrics_addr(text: str | int, listen_host: str) -> tuple[str, int]:
    """'9100' or 'HOST:9100' -> (host, port). A bare port binds the host of --listen, so a
    peer on loopback serves its metrics on loopback and one on 0.0.0.0 everywhere."""
    from ..transport.addr import parse_hostport
    raw = str(text).strip()
    if ":" in raw:
        host, port = parse_hostport(raw, "metrics address")
    else:
        if not raw.isdigit():
            raise ValueError(f"metrics port {raw!r} is not a number (PORT or HOST:PORT)")
        host, port = listen_host, int(raw)
    if port > 65535:
        raise ValueError(f"metrics port {port} is out of range")
    return host or "0.0.0.0", port


class MetricsEndpoint:
    """A registry served over HTTP (``/metrics``) on a daemon thread until closed."""

    def __init__(self, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._httpd, self._thread = start_http_server(port, host, registry=self.registry)
        self.host, self.port = host, int(self._httpd.server_address[1])
        log.info("serving metrics on http://%s:%d/metrics", host if ":" not in host else f"[{host}]", self.port)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(2.0)


# ---------------------------------------------------------------------- control plane (pull)
class NodeCollector(Collector):
    """The node's view of the cluster and its control-plane traffic, read at scrape time.

    Runs on the HTTP thread while the control loop runs: it only copies (views are replaced,
    never mutated; a Counter copy is one C call), so a scrape never blocks the loop."""

    def __init__(self, server: "NodeServer") -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        server, node = self.server, self.server.node
        view = node.view if node is not None else None
        yield _gauge("p2pft_view_epoch", "Epoch of the latest committed view this node holds.",
                     view.epoch if view else 0)
        yield _gauge("p2pft_view_data_epoch", "Data epoch of that view (communicators are tagged with it).",
                     view.data_epoch if view else 0)
        when = server.view_wall_time
        yield _gauge("p2pft_view_age_seconds", "Seconds since this node received its latest committed view.",
                     time.time() - when if when else 0.0)
        members = GaugeMetricFamily("p2pft_members", "Members of the committed view by role and gossip state.",
                                    labels=["role", "state"])
        counts = {(r, s): 0 for r in ROLES for s in STATES}
        high = 0
        if view and node is not None:
            for m in view.members:
                state = "alive" if m.node == node.id else node.member_state(m.node)
                counts[(m.role.value, state)] = counts.get((m.role.value, state), 0) + 1
                high = max(high, node.member_step(m.node))
        for (role, state), n in sorted(counts.items()):
            members.add_metric([role, state], n)
        yield members
        yield _gauge("p2pft_cluster_step", "Highest committed step among the view's members, as gossip "
                     "reports it to this node.", high)
        yield _gauge("p2pft_raft_term", "Current Raft term of this node.", node.raft.term if node else 0)
        yield _gauge("p2pft_raft_leader", "1 when this node is the Raft leader.",
                     1 if node is not None and node.is_leader() else 0)
        obs = server.observer
        yield _counter("p2pft_leader_changes_total", "Raft leader changes this node has seen.", obs.leader_changes)
        yield _counter("p2pft_views_total", "Committed views this node has received.", obs.views_seen)
        for name, doc, counts_by_type in (
                ("p2pft_control_messages_sent_total", "Control messages (gossip, Raft, view) sent, by type.",
                 dict(obs.sent)),
                ("p2pft_control_messages_received_total", "Control messages received and accepted by the "
                 "decoder, by type ('other': unknown types).", dict(obs.received))):
            fam = CounterMetricFamily(name.removesuffix("_total"), doc, labels=["family", "type"])
            for mtype, n in sorted(counts_by_type.items()):
                fam.add_metric([family(mtype), mtype], n)
            yield fam
        counters = dict(server.counters)
        rejected = rejected_counts(counters)
        frames = CounterMetricFamily("p2pft_control_frames_rejected", "Control frames refused (the connection "
                                     "that carried one is closed), by reason.", labels=["reason"])
        conns = CounterMetricFamily("p2pft_control_connections_rejected", "Inbound control connections closed "
                                    "by the node's limits, by reason.", labels=["reason"])
        for reason, n in sorted(rejected.items()):
            (conns if reason in CONNECTION_REJECTS else frames).add_metric([reason], n)
        yield frames
        yield conns
        failures = CounterMetricFamily("p2pft_control_connect_failures", "Outgoing control connections that "
                                       "failed, by reason.", labels=["reason"])
        failures.add_metric(["refused"], counters.get("connect_refused", 0))
        failures.add_metric(["failed"], counters.get("connect_failed", 0))
        failures.add_metric(["send_failed"], counters.get("send_failed", 0))
        failures.add_metric(["peer_eof"], counters.get("peer_eof", 0))
        yield failures
        yield _counter("p2pft_control_send_dropped_total", "Control frames dropped because a peer's send queue "
                       "was full.", counters.get("send_dropped", 0))
        events = CounterMetricFamily("p2pft_node_events", "Node events by kind (views proposed, stalled "
                                     "loops, misaddressed or unknown messages).", labels=["event"])
        for key, n in sorted(dict(node.stats).items() if node is not None else ()):
            events.add_metric([key], n)
        yield events


# ---------------------------------------------------------------------- data plane (pull)
class DataCollector(Collector):
    """A data server's completed collectives and refused connections, read at scrape time."""

    def __init__(self, data_server: Any) -> None:
        self.ds = data_server

    def collect(self) -> Iterator[Any]:
        ops = dict(getattr(self.ds, "ops", {}))
        yield _counter("p2pft_allreduce_total", "Completed allreduce operations.", ops.get("allreduce", 0))
        yield _counter("p2pft_allreduce_seconds_total", "Wall seconds spent in completed allreduce operations.",
                       ops.get("allreduce_seconds", 0.0))
        yield _counter("p2pft_allreduce_bytes_total", "Bytes of the buffers reduced by completed allreduce "
                       "operations.", ops.get("allreduce_bytes", 0))
        fam = CounterMetricFamily("p2pft_data_rejected", "Data-plane connections and streams refused or "
                                  "dropped, by reason.", labels=["reason"])
        for reason, n in sorted(dict(self.ds.counters).items()):
            fam.add_metric([reason], n)
        yield fam


# ---------------------------------------------------------------------- trainer (push, per step)
# ---------------------------------------------------------------------- wiring
def serve_node_metrics(server: "NodeServer", port: str | int) -> MetricsEndpoint:
    """The metrics of a witness peer (`p2pft peer --metrics-port`)."""
    host, p = parse_metrics_addr(port, server.host)
    endpoint = MetricsEndpoint(host, p)
    endpoint.registry.register(NodeCollector(server))
    return endpoint


def serve_runtime_metrics(rt: "Runtime", port: str | int) -> MetricsEndpoint:
    """The metrics of a replica's runtime (control plane and its data server); the training
    loop adds its step metrics with ``StepMetrics.attach(rt, trainer)``."""
    assert rt.server is not None
    host, p = parse_metrics_addr(port, rt.server.host)
    endpoint = MetricsEndpoint(host, p)
    endpoint.registry.register(NodeCollector(rt.server))
    if rt.data is not None:
        endpoint.registry.register(DataCollector(rt.data))
    return endpoint


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name.removesuffix("_total"), doc, value=value)


__all__ = ["DataCollector", "MetricsEndpoint", "NodeCollector", "ROLES", "STATES", "parse_metrics_addr",
           "serve_node_metrics", "serve_runtime_metrics"]
