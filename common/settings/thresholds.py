"""Where a node's readings turn YELLOW and RED, and how the anomaly rule is tuned: values.

These are configuration, so they live below the agent: ``common/settings/config.py`` builds
and validates them when a config is loaded (a bad value is a ``ConfigError`` there),
and the agent's rules (``agent/node/health.py``, ``agent/gpus/gpu.py``, ``agent/node/anomaly.py``)
read them.  Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuThresholds:
    # A100/H100/H200 report a "max operating" temperature near 85-87 C and slow
    # down near 90 C; YELLOW warns before throttling, RED means it is throttling.
    temperature_yellow_c: float = 85.0
    temperature_red_c: float = 90.0
    # Any uncorrectable error since the driver loaded: results may be corrupt.
    ecc_uncorrected_red: int = 1
    # How long an XID keeps its finding; it needs a human (or a reset) to clear.
    xid_hold_s: float = 300.0

    def __post_init__(self) -> None:
        if self.temperature_yellow_c > self.temperature_red_c:
            raise ValueError("gpu temperature_yellow_c must not exceed temperature_red_c")
        if self.ecc_uncorrected_red < 1 or self.xid_hold_s < 0:
            raise ValueError("gpu ecc_uncorrected_red must be >= 1 and xid_hold_s >= 0")


@dataclass(frozen=True)
class HealthThresholds:
    """Where each probe turns YELLOW and RED; docs/observability.md gives the reasons."""

    memory_yellow_percent: float = 85.0
    memory_red_percent: float = 95.0
    storage_yellow_free_bytes: int = 2 * 1024**3
    storage_red_free_bytes: int = 256 * 1024**2
    loop_lag_yellow_s: float = 0.25
    loop_lag_red_s: float = 2.0
    # Consecutive failed checkpoints (any job): one may be the job's fault, three are the node's.
    checkpoint_failures_yellow: int = 1
    checkpoint_failures_red: int = 3
    # Operations waiting for the supervisor's dump/restore slots.
    pending_ops_yellow: int = 8
    pending_ops_red: int = 32
    gpu: GpuThresholds = GpuThresholds()

    def __post_init__(self) -> None:
        # The loop-lag pair is left out on purpose: its YELLOW follows the
        # agent's stall threshold, which may exceed the RED lag (then RED wins).
        for low, high in (("memory_yellow_percent", "memory_red_percent"),
                          ("storage_red_free_bytes", "storage_yellow_free_bytes"),
                          ("checkpoint_failures_yellow", "checkpoint_failures_red"),
                          ("pending_ops_yellow", "pending_ops_red")):
            lo, hi = getattr(self, low), getattr(self, high)
            if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float))) or lo > hi:
                raise ValueError(f"health thresholds: {low}={lo!r} must be a number <= {high}={hi!r}")
        if self.checkpoint_failures_yellow < 1 or self.pending_ops_yellow < 1:
            raise ValueError("health thresholds: checkpoint_failures_yellow and pending_ops_yellow must be >= 1")


@dataclass(frozen=True)
class AnomalySettings:
    """The 3-sigma rule's window and rate limits (see ``agent/node/anomaly.py``)."""

    window: int = 60
    sigmas: float = 3.0
    min_samples: int = 30
    # A perfectly flat window has std 0, and then any wobble would be an
    # "infinite-sigma" anomaly; the floors keep the rule about real change.
    min_std: float = 1e-9
    min_relative_std: float = 0.01
    # One report per metric per cooldown_s, and a token bucket (burst, one more each refill_s) across all.
    cooldown_s: float = 300.0
    burst: int = 5
    refill_s: float = 60.0
    max_metrics: int = 256

    def __post_init__(self) -> None:
        window, min_samples = self.window, self.min_samples
        if window < 2 or not 2 <= min_samples <= window:
            raise ValueError(f"anomaly window={window} needs 2 <= min_samples ({min_samples}) <= window")
        if not self.sigmas > 0 or self.min_std < 0 or self.min_relative_std < 0 or self.cooldown_s < 0:
            raise ValueError("anomaly sigmas must be > 0; min_std, min_relative_std and cooldown_s >= 0")
        if self.burst < 1 or not self.refill_s > 0 or self.max_metrics < 1:
            raise ValueError("anomaly burst and max_metrics must be >= 1 and refill_s > 0")
