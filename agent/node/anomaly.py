"""The 3-sigma rule over a sliding window, per metric (sans-IO: the caller passes the time).

Each metric keeps its last ``window`` values.  A new value above
``mean + sigmas * std`` of the values *before* it is an :class:`Anomaly`; the
value then joins the window, so a lasting change of level becomes the new
normal instead of an alarm every heartbeat.  Reports are rate-limited twice:
one per metric per ``cooldown_s``, and a token bucket across all metrics, so a
node in trouble cannot flood the event stream.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Mapping

from revenant.common.settings.thresholds import AnomalySettings


@dataclass(frozen=True)
class Anomaly:
    metric: str
    value: float
    mean: float
    std: float
    at: float

    @property
    def sigmas(self) -> float:
        """How many standard deviations above the mean (inf for a flat window)."""
        return (self.value - self.mean) / self.std if self.std > 0 else math.inf


class AnomalyDetector:
    def __init__(self, *, window: int = 60, sigmas: float = 3.0, min_samples: int = 30,
                 min_std: float = 1e-9, min_relative_std: float = 0.01, cooldown_s: float = 300.0,
                 burst: int = 5, refill_s: float = 60.0, max_metrics: int = 256) -> None:
        # One validation rule, shared with the config that builds these settings.
        s = AnomalySettings(window=window, sigmas=sigmas, min_samples=min_samples, min_std=min_std,
                            min_relative_std=min_relative_std, cooldown_s=cooldown_s, burst=burst,
                            refill_s=refill_s, max_metrics=max_metrics)
        self.window, self.sigmas, self.min_samples = s.window, s.sigmas, s.min_samples
        # A perfectly flat window has std 0, and then any wobble would be an
        # "infinite-sigma" anomaly; the floors keep the rule about real change.
        self.min_std, self.min_relative_std = s.min_std, s.min_relative_std
        self.cooldown_s = s.cooldown_s
        self.burst, self.refill_s, self.max_metrics = s.burst, s.refill_s, s.max_metrics
        self._values: dict[str, collections.deque[float]] = {}
        self._last_report: dict[str, float] = {}
        self._tokens = float(burst)
        self._tokens_at: float | None = None
        # Anomalies seen but not reported (rate limit), values ignored (not finite, too many metrics).
        self.suppressed = 0
        self.ignored = 0

    @classmethod
    def from_settings(cls, settings: AnomalySettings) -> AnomalyDetector:
        return cls(window=settings.window, sigmas=settings.sigmas, min_samples=settings.min_samples,
                   min_std=settings.min_std, min_relative_std=settings.min_relative_std,
                   cooldown_s=settings.cooldown_s, burst=settings.burst, refill_s=settings.refill_s,
                   max_metrics=settings.max_metrics)

    def stats(self, metric: str) -> tuple[float, float, int] | None:
        """(mean, std, samples) of the metric's window, or None before its first value."""
        values = self._values.get(metric)
        if not values:
            return None
        mean = math.fsum(values) / len(values)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
        return mean, std, len(values)

    def observe(self, metric: str, value: float, now: float) -> Anomaly | None:
        """Add one value; the anomaly it is, if it is one and the rate limit allows a report."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"anomaly metric {metric!r}: value must be a number, got {type(value).__name__}")
        value = float(value)
        if not math.isfinite(value):
            self.ignored += 1
            return None
        values = self._values.get(metric)
        if values is None:
            if len(self._values) >= self.max_metrics:
                self.ignored += 1
                return None
            values = self._values[metric] = collections.deque(maxlen=self.window)
        found = None
        if len(values) >= self.min_samples:
            mean, std, _ = self.stats(metric)  # type: ignore[misc]
            floor = max(std, self.min_std, abs(mean) * self.min_relative_std)
            if value > mean + self.sigmas * floor:
                found = Anomaly(metric=metric, value=value, mean=mean, std=std, at=now)
        values.append(value)
        if found is not None and not self._allow(metric, now):
            self.suppressed += 1
            return None
        return found

    def observe_all(self, values: Mapping[str, float], now: float) -> list[Anomaly]:
        out = []
        for metric, value in values.items():
            anomaly = self.observe(metric, value, now)
            if anomaly is not None:
                out.append(anomaly)
        return out

    def _allow(self, metric: str, now: float) -> bool:
        last = self._last_report.get(metric)
        if last is not None and now - last < self.cooldown_s:
            return False
        if self._tokens_at is not None:
            self._tokens = min(self.burst, self._tokens + max(0.0, now - self._tokens_at) / self.refill_s)
        self._tokens_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        self._last_report[metric] = now
        return True
