"""Prometheus metrics for the agent and the coordinator, and the health endpoints' answers.

Each process gets its own :class:`prometheus_client.CollectorRegistry` (held by
:class:`AgentMetrics` or :class:`CoordinatorMetrics`), never the global one, so
two agents in one test process do not collide.  Names follow Prometheus
conventions: ``revenant_`` prefix, base units (seconds, bytes, ratios),
``_total`` on counters.  Metrics carry no ``node`` label of their own: the
scrape config sets it per target (deploy/prometheus), except on the
coordinator, which speaks about many nodes.
"""

from __future__ import annotations

import math
from typing import Any, Awaitable, Callable, Iterable, Mapping

import msgspec
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from revenant.common.serving.httpserver import Handler, Response
from revenant.messages import HealthSummary, NodeEvent, NodeStatus

# A `_created` series per counter and histogram doubles what is stored and no
# dashboard reads it.  The switch is process-wide; revenant owns its processes.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
JSON = "application/json"
HEALTH_VALUE = {"GREEN": 0, "YELLOW": 1, "RED": 2}
NODE_STATES = ("alive", "suspect", "dead", "left")
NODE_EVENT_KINDS = ("joined", "suspect", "dead", "recovered", "left")

_SECONDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_FREEZE_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BYTES = tuple(float(2**p) for p in range(20, 40, 2))  # 1 MiB .. 256 GiB, x4
_DETECTION_SECONDS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0)

_GPU_GAUGES = (
    ("temperature", "revenant_gpu_temperature_celsius", "GPU temperature."),
    ("memory_used", "revenant_gpu_memory_used_bytes", "GPU memory in use."),
    ("memory_total", "revenant_gpu_memory_total_bytes", "GPU memory in all."),
    ("utilization", "revenant_gpu_utilization_ratio", "Share of time a kernel ran (0-1)."),
    ("power", "revenant_gpu_power_watts", "GPU power draw."),
    ("ecc", "revenant_gpu_ecc_uncorrected_errors", "Uncorrectable ECC errors since the driver loaded."),
    ("remap_pending", "revenant_gpu_remapped_rows_pending", "1 when a row remapping waits for a GPU reset."),
    ("remap_failed", "revenant_gpu_remapped_rows_failed", "1 when a row remapping failed."),
    ("processes", "revenant_gpu_processes", "CUDA processes on the GPU."),
)


def _check(name: str, value: float | None) -> None:
    if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class AgentMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.health_state = Gauge("revenant_node_health_state", "Node health: 0 GREEN, 1 YELLOW, 2 RED.", registry=r)
        self.loop_lag = Gauge("revenant_event_loop_lag_seconds", "Worst event-loop lag since the last heartbeat.",
                              registry=r)
        self.loop_stalls = Counter("revenant_event_loop_stalls", "Event-loop wake-ups later than the stall threshold.",
                                   registry=r)
        self.memory = Gauge("revenant_memory_usage_ratio", "Share of the node's memory in use (0-1).", registry=r)
        self.storage_free = Gauge("revenant_storage_free_bytes", "Free space on the checkpoint storage.", registry=r)
        self.criu_up = Gauge("revenant_criu_up", "1 when criu passes `criu check`.", registry=r)
        self.nats_connected = Gauge("revenant_nats_connected", "1 while connected to NATS.", registry=r)
        self.checkpoint_failures = Gauge("revenant_checkpoint_consecutive_failures",
                                         "Checkpoints that failed in a row.", registry=r)
        self.pending_ops = Gauge("revenant_pending_operations", "Operations waiting for a dump/restore slot.",
                                 registry=r)
        self.checkpoints = Counter("revenant_checkpoints", "Checkpoints by result.", ["result"], registry=r)
        self.checkpoint_duration = Histogram("revenant_checkpoint_duration_seconds", "Whole checkpoint, start to done.",
                                             buckets=_SECONDS, registry=r)
        self.checkpoint_freeze = Histogram("revenant_checkpoint_freeze_seconds", "Time the job was frozen.",
                                           buckets=_FREEZE_SECONDS, registry=r)
        self.checkpoint_bytes = Histogram("revenant_checkpoint_bytes", "Checkpoint image size.", buckets=_BYTES,
                                          registry=r)
        self.jobs = Gauge("revenant_jobs", "Jobs on this node by state.", ["state"], registry=r)
        self.gpu = {key: Gauge(name, doc, ["gpu"], registry=r) for key, name, doc in _GPU_GAUGES}
        self.gpu_xids = Counter("revenant_gpu_xid_errors", "XID events by GPU and code.", ["gpu", "xid"], registry=r)
        self.anomalies = Counter("revenant_anomalies", "Values above mean + 3 sigma, by metric.", ["metric"],
                                 registry=r)
        self.heartbeats = Counter("revenant_heartbeats_sent", "Heartbeats published.", registry=r)
        for result in ("ok", "failed"):
            self.checkpoints.labels(result=result)
        self._stalls_seen = 0
        self._gpus: set[str] = set()
        self._job_states: set[str] = set()

    def update_health(self, summary: HealthSummary) -> None:
        """Set every health gauge from a fresh summary; call once per summary (XIDs are counted)."""
        self.health_state.set(HEALTH_VALUE[summary.state])
        self.loop_lag.set(summary.loop_lag_s)
        if summary.loop_stalls > self._stalls_seen:
            self.loop_stalls.inc(summary.loop_stalls - self._stalls_seen)
        self._stalls_seen = summary.loop_stalls
        self.memory.set(summary.memory_percent / 100)
        self.storage_free.set(summary.storage_free_bytes)
        self.criu_up.set(int(summary.criu_ok))
        self.nats_connected.set(int(summary.nats_connected))
        self.checkpoint_failures.set(summary.checkpoint_failures)
        self.pending_ops.set(summary.pending_ops)
        present = set()
        for g in summary.gpus:
            label = str(g.index)
            present.add(label)
            for key, value in (("temperature", g.temperature_c), ("memory_used", g.memory_used_bytes),
                               ("memory_total", g.memory_total_bytes), ("utilization", g.utilization_percent / 100),
                               ("power", g.power_w), ("ecc", g.ecc_uncorrected_volatile),
                               ("remap_pending", g.remapped_rows_pending), ("remap_failed", g.remapped_rows_failed),
                               ("processes", len(g.processes))):
                self.gpu[key].labels(gpu=label).set(value)
            for xid in g.xids:
                self.gpu_xids.labels(gpu=label, xid=str(xid)).inc()
        for gone in self._gpus - present:  # a GPU that vanished must not keep its last reading
            for gauge in self.gpu.values():
                gauge.remove(gone)
        self._gpus = present

    def observe_checkpoint(self, *, ok: bool, duration_s: float, freeze_s: float | None = None,
                           size_bytes: int | None = None) -> None:
        _check("duration_s", duration_s)
        _check("freeze_s", freeze_s)
        _check("size_bytes", size_bytes)
        self.checkpoints.labels(result="ok" if ok else "failed").inc()
        if not ok:
            return
        self.checkpoint_duration.observe(duration_s)
        if freeze_s is not None:
            self.checkpoint_freeze.observe(freeze_s)
        if size_bytes is not None:
            self.checkpoint_bytes.observe(size_bytes)

    def set_jobs(self, counts: Mapping[str, int]) -> None:
        """Jobs per state; a state that is no longer listed drops to 0."""
        for state in self._job_states - set(counts):
            self.jobs.labels(state=state).set(0)
        for state, n in counts.items():
            self.jobs.labels(state=state).set(n)
        self._job_states |= set(counts)

    def count_anomaly(self, metric: str) -> None:
        self.anomalies.labels(metric=metric).inc()

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


FAILOVER_CAUSES = ("dead", "evicted", "takeover")
PROACTIVE_ACTIONS = ("checkpoint", "migrate")


class CoordinatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.node_health_state = Gauge("revenant_node_health_state",
                                       "Health each live node reports: 0 GREEN, 1 YELLOW, 2 RED.", ["node"],
                                       registry=r)
        self.nodes = Gauge("revenant_nodes", "Nodes by membership state.", ["state"], registry=r)
        self.nodes_by_health = Gauge("revenant_nodes_by_health", "Nodes in touch (alive or suspect) by the health "
                                     "they report.", ["health"], registry=r)
        self.failovers = Counter("revenant_failovers",
                                 "Jobs recovered elsewhere: their node died (cause=dead), stopped them itself "
                                 "(evicted: a drain or a fence), or a new leader finished the recovery (takeover).",
                                 ["result", "cause"], registry=r)
        self.failover_paused = Gauge("revenant_failover_paused",
                                     "1 while automatic failover is paused (a storm, or an operator's hold).",
                                     registry=r)
        self.failure_detection = Histogram("revenant_failure_detection_seconds",
                                           "From a node's last heartbeat to its dead verdict.",
                                           buckets=_DETECTION_SECONDS, registry=r)
        self.node_events = Counter("revenant_node_events", "Membership events published.", ["kind"], registry=r)
        self._node_event_children: dict[str, Any] = {}
        self.heartbeats = Counter("revenant_heartbeats_received", "Heartbeats received.", ["result"], registry=r)
        self._hb_ok = self.heartbeats.labels(result="ok")
        self._hb_malformed = self.heartbeats.labels(result="malformed")
        self.loop_lag = Gauge("revenant_event_loop_lag_seconds", "Worst event-loop lag of the coordinator lately.",
                              registry=r)
        # No label set is made in advance: the reasons are configuration (proactive_*_reasons).
        self.proactive_actions = Counter("revenant_proactive_actions",
                                         "Proactive actions on jobs of sick nodes that succeeded: action checkpoint "
                                         "(a fresh epoch) or migrate (moved to a healthy node); reason: the health "
                                         "finding code that predicted trouble (or anomaly).",
                                         ["action", "reason"], registry=r)
        self.proactive_paused = Gauge("revenant_proactive_paused",
                                      "1 while proactive moves are paused: too many nodes sick at once.", registry=r)
        self.events_refused = Counter("revenant_job_events_refused",
                                      "Agents' job and epoch events the leader ignored: the node they name is not "
                                      "the node whose subject (and credential) they came on.", registry=r)
        for state in NODE_STATES:
            self.nodes.labels(state=state).set(0)
        for kind in NODE_EVENT_KINDS:
            self.node_events.labels(kind=kind)
        for result in ("ok", "failed"):
            for cause in FAILOVER_CAUSES:
                self.failovers.labels(result=result, cause=cause)
        for result in ("ok", "malformed"):
            self.heartbeats.labels(result=result)
        self._nodes: set[str] = set()

    def update_nodes(self, statuses: Iterable[NodeStatus], per_node: bool = True) -> None:
        """From the detector's records (or a snapshot): counts by state and by health, and (with
        ``per_node``) the health of each node still in touch."""
        counts = dict.fromkeys(NODE_STATES, 0)
        healths = dict.fromkeys(HEALTH_VALUE, 0)
        live = set()
        for s in statuses:
            counts[s.state] = counts.get(s.state, 0) + 1
            if s.state in ("alive", "suspect"):
                healths[s.health] = healths.get(s.health, 0) + 1
                if per_node:
                    live.add(s.name)
                    self.node_health_state.labels(node=s.name).set(HEALTH_VALUE[s.health])
        for state, n in counts.items():
            self.nodes.labels(state=state).set(n)
        for health, n in healths.items():
            self.nodes_by_health.labels(health=health).set(n)
        # A dead node's last report is stale: it leaves a gap, not a false GREEN.
        for gone in self._nodes - live:
            self.node_health_state.remove(gone)
        self._nodes = live

    def count_node_event(self, event: NodeEvent) -> None:
        # Once per kind, not per event: 100,000 nodes join a coordinator that starts.
        child = self._node_event_children.get(event.kind)
        if child is None:
            child = self._node_event_children[event.kind] = self.node_events.labels(kind=event.kind)
        child.inc()
        if event.kind == "dead":
            self.observe_detection(event.silence_s)

    def observe_detection(self, seconds: float) -> None:
        _check("detection seconds", seconds)
        self.failure_detection.observe(seconds)

    def count_failover(self, ok: bool = True, cause: str = "dead") -> None:
        self.failovers.labels(result="ok" if ok else "failed", cause=cause).inc()

    def count_proactive(self, action: str, reason: str) -> None:
        """One proactive action that succeeded: ``action`` checkpoint or migrate, ``reason`` a finding code."""
        if action not in PROACTIVE_ACTIONS:
            raise ValueError(f"proactive action must be one of {', '.join(PROACTIVE_ACTIONS)}, got {action!r}")
        self.proactive_actions.labels(action=action, reason=reason).inc()

    def set_proactive_paused(self, paused: bool) -> None:
        self.proactive_paused.set(int(paused))

    def count_heartbeats(self, ok: int, malformed: int) -> None:
        """Heartbeats counted outside (coordinator/nodes/heartbeats.py: the hot path counts in plain ints)."""
        if ok:
            self._hb_ok.inc(ok)
        if malformed:
            self._hb_malformed.inc(malformed)

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


# ---------------------------------------------------------------------- health endpoints


def _json(doc: Any) -> bytes:
    return msgspec.json.encode(doc) + b"\n"


def health_response(summary: HealthSummary, extra: Mapping[str, Any] | None = None) -> Response:
    """``/health``: always 200; the state, the reasons and every probe's value."""
    probes = msgspec.to_builtins(summary)
    doc = {"state": probes.pop("state"), "reasons": probes.pop("reasons"), "probes": probes, **(extra or {})}
    return 200, JSON, _json(doc)


def ready_response(summary: HealthSummary) -> Response:
    """``/ready``: 503 when RED or cut off from NATS, so no new work is sent here."""
    ready = summary.state != "RED" and summary.nats_connected
    reasons = list(summary.reasons) + ([] if summary.nats_connected else ["NATS disconnected"])
    return (200 if ready else 503), JSON, _json({"ready": ready, "state": summary.state,
                                                "reasons": list(dict.fromkeys(reasons))})


def live_response(stuck_for_s: float, stuck_after_s: float) -> Response:
    """``/live``: 503 only when the event loop was stuck for ``stuck_after_s`` or more.

    A loop that is stuck right now cannot answer at all; the probe's own timeout
    covers that.  This catches the request that waited out a long stall, and a
    loop monitor that stopped running.
    """
    live = stuck_for_s < stuck_after_s
    return (200 if live else 503), JSON, _json({"live": live, "loop_stuck_s": round(stuck_for_s, 3)})


def health_routes(*, render_metrics: Callable[[], bytes], summary: Callable[[], HealthSummary],
                  stuck_for: Callable[[], float], stuck_after_s: float = 5.0,
                  started: Callable[[], bool] | None = None,
                  extra: Callable[[], Mapping[str, Any]] | None = None) -> dict[str, Handler]:
    """The four routes for :class:`~revenant.common.serving.httpserver.HttpServer`.

    ``started()`` is False while the process is still starting (criu check, NATS
    connect): ``/ready`` says 503 then, whatever the placeholder summary says.
    """

    def ready() -> Response:
        if started is not None and not started():
            return 503, JSON, _json({"ready": False, "state": "YELLOW", "reasons": ["starting"]})
        return ready_response(summary())

    def route(make: Callable[[], Response]) -> Callable[[], Awaitable[Response]]:
        async def handler() -> Response:
            return make()
        return handler

    return {
        "/metrics": route(lambda: (200, CONTENT_TYPE, render_metrics())),
        "/health": route(lambda: health_response(summary(), extra() if extra else None)),
        "/ready": route(ready),
        "/live": route(lambda: live_response(stuck_for(), stuck_after_s)),
    }
