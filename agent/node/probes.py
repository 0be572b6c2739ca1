"""The node's readings each heartbeat, turned into its health.

:class:`HealthProbes` reads memory, free storage, the event loop's lag, the GPUs and
what the agent knows (criu, NATS, the supervisor's failures and queue), hands them
to the pure health rules (``agent/node/health.py``) and the 3-sigma detector
(``agent/node/anomaly.py``), and records the result in the metrics.  Publishing the
health is the liveness thread's job; emitting anomaly events is the agent's.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Callable

import psutil

from revenant.agent.gpus.gpu import GpuMonitor
from revenant.agent.node.anomaly import Anomaly, AnomalyDetector
from revenant.agent.node.health import HealthSample, evaluate, probe_values
from revenant.common.serving.loopmonitor import LoopMonitor
from revenant.common.serving.metrics import AgentMetrics
from revenant.common.settings.thresholds import HealthThresholds
from revenant.messages import AnomalyEvent, CriuInfo, HealthSummary

log = logging.getLogger(__name__)


def anomaly_event(node: str, a: Anomaly, at: float) -> AnomalyEvent:
    return AnomalyEvent(node=node, metric=a.metric, value=a.value, mean=a.mean, std=a.std, at=at)


class HealthProbes:
    def __init__(self, storage: Path, thresholds: HealthThresholds, anomalies: AnomalyDetector,
                 loop_monitor: LoopMonitor, gpu_monitor: GpuMonitor, metrics: AgentMetrics, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.storage = storage
        self.thresholds = thresholds
        self.anomalies = anomalies
        self.loop_monitor = loop_monitor
        self.gpu_monitor = gpu_monitor
        self.metrics = metrics
        self.clock = clock

    async def sample(self, criu: CriuInfo, *, nats_connected: bool, checkpoint_failures: int = 0,
                     pending_ops: int = 0, running_jobs: int | None = None) -> tuple[HealthSummary, list[Anomaly]]:
        """The node's health now, and the readings that are anomalies (``running_jobs`` None: no
        supervisor yet)."""
        gpus = await self.gpu_monitor.read() if self.gpu_monitor.gpus else []
        worst_lag, recent_stalls = self.loop_monitor.take_window()
        try:
            free = shutil.disk_usage(self.storage).free
        except OSError:
            free = 0
        sample = HealthSample(
            loop_lag_s=worst_lag,
            loop_stalls=self.loop_monitor.stalls,
            recent_stalls=recent_stalls,
            memory_percent=psutil.virtual_memory().percent,
            storage_free_bytes=free,
            criu_ok=criu.ok,
            criu_error=criu.error,
            criu_network_error=criu.network_error,
            nats_connected=nats_connected,
            checkpoint_failures=checkpoint_failures,
            pending_ops=pending_ops,
            gpus=gpus,
            gpu_recent_xids=self.gpu_monitor.recent_xids() if gpus else {},
            gpu_errors=dict(self.gpu_monitor.errors),
        )
        summary = evaluate(sample, self.thresholds)
        self.metrics.update_health(summary)
        if running_jobs is not None:
            self.metrics.set_jobs({"running": running_jobs})
        found = self.anomalies.observe_all(probe_values(summary), self.clock())
        for a in found:
            self.metrics.count_anomaly(a.metric)
            log.warning("anomaly: %s = %g (mean %g, std %g)", a.metric, a.value, a.mean, a.std)
        return summary, found
