"""Node health: the probes' readings and the rules that turn them into GREEN/YELLOW/RED.

The rules are a pure function of a :class:`HealthSample` and the thresholds, so
they are unit-tested without an agent.  The thresholds are configuration values
(:mod:`revenant.common.settings.thresholds`); the readings are taken by ``agent/node/probes.py``,
the loop's by :mod:`revenant.common.serving.loopmonitor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from revenant.agent.gpus.gpu import Finding, classify_gpu
from revenant.common.settings.thresholds import HealthThresholds
from revenant.messages import GpuHealth, HealthFinding, HealthState, HealthSummary

_ORDER: dict[HealthState, int] = {"GREEN": 0, "YELLOW": 1, "RED": 2}


@dataclass(frozen=True)
class HealthSample:
    loop_lag_s: float = 0.0
    loop_stalls: int = 0
    # Stalls since the previous heartbeat: recent trouble, not ancient history.
    recent_stalls: int = 0
    memory_percent: float = 0.0
    storage_free_bytes: int | None = None
    criu_ok: bool = True
    criu_error: str | None = None
    criu_network_error: str | None = None
    nats_connected: bool = True
    # Checkpoints that failed in a row (reset by a success), and the supervisor's queue.
    checkpoint_failures: int = 0
    pending_ops: int = 0
    # GpuMonitor.sample(), .recent_xids() and .errors.
    gpus: Sequence[GpuHealth] = ()
    gpu_recent_xids: Mapping[int, Sequence[int]] = field(default_factory=dict)
    gpu_errors: Mapping[int, str] = field(default_factory=dict)


def _findings(sample: HealthSample, t: HealthThresholds) -> list[Finding]:
    findings: list[Finding] = []
    if sample.memory_percent >= t.memory_red_percent:
        findings.append(("RED", "memory", f"memory {sample.memory_percent:.0f}% >= {t.memory_red_percent:g}%"))
    elif sample.memory_percent >= t.memory_yellow_percent:
        findings.append(("YELLOW", "memory", f"memory {sample.memory_percent:.0f}% >= {t.memory_yellow_percent:g}%"))
    if sample.storage_free_bytes is not None:
        free_mib = sample.storage_free_bytes / 2**20
        if sample.storage_free_bytes < t.storage_red_free_bytes:
            findings.append(("RED", "storage_low",
                             f"storage free {free_mib:.0f} MiB < {t.storage_red_free_bytes / 2**20:.0f} MiB"))
        elif sample.storage_free_bytes < t.storage_yellow_free_bytes:
            findings.append(("YELLOW", "storage_low",
                             f"storage free {free_mib:.0f} MiB < {t.storage_yellow_free_bytes / 2**20:.0f} MiB"))
    if sample.loop_lag_s >= t.loop_lag_red_s:
        findings.append(("RED", "loop_lag", f"event loop lag {sample.loop_lag_s:.2f} s"))
    elif sample.loop_lag_s >= t.loop_lag_yellow_s or sample.recent_stalls > 0:
        findings.append(("YELLOW", "loop_lag",
                         f"event loop stalled ({sample.recent_stalls} recent, lag {sample.loop_lag_s:.2f} s)"))
    if not sample.criu_ok:
        findings.append(("RED", "criu", f"criu unusable: {sample.criu_error or 'unknown error'}"))
    elif sample.criu_network_error:
        findings.append(("YELLOW", "criu_network", f"criu cannot checkpoint sockets: {sample.criu_network_error}"))
    if not sample.nats_connected:
        findings.append(("YELLOW", "nats", "NATS disconnected"))
    failures = sample.checkpoint_failures
    if failures >= t.checkpoint_failures_red:
        findings.append(("RED", "checkpoint_failures", f"{failures} checkpoints failed in a row"))
    elif failures >= t.checkpoint_failures_yellow:
        findings.append(("YELLOW", "checkpoint_failures",
                         f"{failures} checkpoint{'s' if failures > 1 else ''} failed in a row"))
    if sample.pending_ops >= t.pending_ops_red:
        findings.append(("RED", "pending_ops", f"{sample.pending_ops} operations queued >= {t.pending_ops_red}"))
    elif sample.pending_ops >= t.pending_ops_yellow:
        findings.append(("YELLOW", "pending_ops", f"{sample.pending_ops} operations queued >= {t.pending_ops_yellow}"))
    seen = set()
    for gpu in sample.gpus:
        seen.add(gpu.index)
        if gpu.index in sample.gpu_errors:
            findings.append(("RED", "gpu_unreadable", f"GPU {gpu.index} unreadable: {sample.gpu_errors[gpu.index]}"))
        findings.extend(classify_gpu(gpu, t.gpu, sample.gpu_recent_xids.get(gpu.index, ())))
    for index, xids in sample.gpu_recent_xids.items():  # XIDs from a GPU we could not name
        if index not in seen and xids:
            findings.extend(classify_gpu(GpuHealth(index=index), t.gpu, xids))
    return findings


def evaluate(sample: HealthSample, t: HealthThresholds) -> HealthSummary:
    """The worst state any probe reports, with one reason per probe that is not GREEN."""
    findings = _findings(sample, t)
    state: HealthState = "GREEN"
    for s, _, _ in findings:
        if _ORDER[s] > _ORDER[state]:
            state = s
    return HealthSummary(
        state=state,
        reasons=[reason for _, _, reason in findings],
        findings=[HealthFinding(state=s, code=code) for s, code, _ in findings],
        loop_lag_s=round(sample.loop_lag_s, 4),
        loop_stalls=sample.loop_stalls,
        memory_percent=round(sample.memory_percent, 1),
        storage_free_bytes=sample.storage_free_bytes or 0,
        criu_ok=sample.criu_ok,
        nats_connected=sample.nats_connected,
        checkpoint_failures=sample.checkpoint_failures,
        pending_ops=sample.pending_ops,
        gpus=list(sample.gpus),
    )


def probe_values(summary: HealthSummary) -> dict[str, float]:
    """The numeric readings worth watching for anomalies, by metric name.

    Only gauges where *higher* is trouble: the anomaly rule is one-sided.
    Cumulative counters (stalls) always grow and free storage rises each time
    retention deletes a checkpoint, so both would raise nothing but noise.
    """
    values = {
        "loop_lag_s": summary.loop_lag_s,
        "memory_percent": summary.memory_percent,
        "pending_ops": float(summary.pending_ops),
    }
    for gpu in summary.gpus:
        values[f"gpu{gpu.index}.temperature_c"] = gpu.temperature_c
        values[f"gpu{gpu.index}.power_w"] = gpu.power_w
        values[f"gpu{gpu.index}.memory_used_bytes"] = float(gpu.memory_used_bytes)
    return {k: v for k, v in values.items() if math.isfinite(v)}
