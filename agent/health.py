"""Node health: the probes' readings and the rules that turn them into GREEN/YELLOW/RED.

The rules are a pure function of a :class:`HealthSample` and the thresholds, so
they are unit-tested without an agent.  The loop monitor measures how late the
event loop wakes up, which is the earliest sign of a node in trouble.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from revenant.messages import HealthState, HealthSummary

_ORDER: dict[HealthState, int] = {"GREEN": 0, "YELLOW": 1, "RED": 2}


@dataclass(frozen=True)
class HealthThresholds:
    memory_yellow_percent: float = 85.0
    memory_red_percent: float = 95.0
    storage_yellow_free_bytes: int = 2 * 1024**3
    storage_red_free_bytes: int = 256 * 1024**2
    loop_lag_yellow_s: float = 0.25
    loop_lag_red_s: float = 2.0


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
    nats_connected: bool = True


def evaluate(sample: HealthSample, t: HealthThresholds) -> HealthSummary:
    """The worst state any probe reports, with one reason per probe that is not GREEN."""
    findings: list[tuple[HealthState, str]] = []
    if sample.memory_percent >= t.memory_red_percent:
        findings.append(("RED", f"memory {sample.memory_percent:.0f}% >= {t.memory_red_percent:g}%"))
    elif sample.memory_percent >= t.memory_yellow_percent:
        findings.append(("YELLOW", f"memory {sample.memory_percent:.0f}% >= {t.memory_yellow_percent:g}%"))
    if sample.storage_free_bytes is not None:
        free_mib = sample.storage_free_bytes / 2**20
        if sample.storage_free_bytes < t.storage_red_free_bytes:
            findings.append(("RED", f"storage free {free_mib:.0f} MiB < {t.storage_red_free_bytes / 2**20:.0f} MiB"))
        elif sample.storage_free_bytes < t.storage_yellow_free_bytes:
            findings.append(("YELLOW", f"storage free {free_mib:.0f} MiB < {t.storage_yellow_free_bytes / 2**20:.0f} MiB"))
    if sample.loop_lag_s >= t.loop_lag_red_s:
        findings.append(("RED", f"event loop lag {sample.loop_lag_s:.2f} s"))
    elif sample.loop_lag_s >= t.loop_lag_yellow_s or sample.recent_stalls > 0:
        findings.append(("YELLOW", f"event loop stalled ({sample.recent_stalls} recent, lag {sample.loop_lag_s:.2f} s)"))
    if not sample.criu_ok:
        findings.append(("RED", f"criu unusable: {sample.criu_error or 'unknown error'}"))
    if not sample.nats_connected:
        findings.append(("YELLOW", "NATS disconnected"))
    state: HealthState = "GREEN"
    for s, _ in findings:
        if _ORDER[s] > _ORDER[state]:
            state = s
    return HealthSummary(
        state=state,
        reasons=[reason for _, reason in findings],
        loop_lag_s=round(sample.loop_lag_s, 4),
        loop_stalls=sample.loop_stalls,
        memory_percent=round(sample.memory_percent, 1),
        storage_free_bytes=sample.storage_free_bytes or 0,
    )


@dataclass
class LoopMonitor:
    """Measures event-loop lag by sleeping a fixed period and timing the wake-up."""

    period_s: float = 0.1
    stall_threshold_s: float = 0.25
    clock: Callable[[], float] = time.monotonic
    lag_s: float = 0.0
    max_lag_s: float = 0.0
    stalls: int = 0
    _reported_stalls: int = field(default=0, repr=False)
    _reported_max: float = field(default=0.0, repr=False)

    def record(self, lag_s: float) -> None:
        self.lag_s = lag_s
        self.max_lag_s = max(self.max_lag_s, lag_s)
        if lag_s >= self.stall_threshold_s:
            self.stalls += 1

    def take_window(self) -> tuple[float, int]:
        """(worst lag, stalls) since the previous call."""
        worst, recent = self.max_lag_s, self.stalls - self._reported_stalls
        self._reported_stalls = self.stalls
        self.max_lag_s = self.lag_s
        return worst, recent

    async def run(self) -> None:
        while True:
            start = self.clock()
            await asyncio.sleep(self.period_s)
            self.record(max(0.0, self.clock() - start - self.period_s))
