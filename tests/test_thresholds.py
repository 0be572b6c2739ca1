"""Health thresholds and anomaly settings are configuration values (common/settings/thresholds.py):
bad ones fail when the config is loaded, with one ConfigError, and the agent's rules use them."""

from __future__ import annotations

import re

import pytest

from revenant.agent.node.anomaly import AnomalyDetector
from revenant.common.errors import ConfigError
from revenant.common.settings.config import AgentConfig, load_config
from revenant.common.settings.thresholds import AnomalySettings, GpuThresholds, HealthThresholds

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"memory_yellow_percent": 99, "memory_red_percent": 90},
         "health thresholds: memory_yellow_percent=99.0 must be a number <= memory_red_percent=90.0"),
        ({"pending_ops_yellow": 0}, "checkpoint_failures_yellow and pending_ops_yellow must be >= 1"),
        ({"gpu_temperature_yellow_c": 95}, "gpu temperature_yellow_c must not exceed temperature_red_c"),
        ({"gpu_xid_hold_s": -1}, "gpu ecc_uncorrected_red must be >= 1 and xid_hold_s >= 0"),
        ({"anomaly_min_samples": 100}, "anomaly window=60 needs 2 <= min_samples (100) <= window"),
        ({"anomaly_sigmas": 0}, "anomaly sigmas must be > 0"),
    ],
)
def test_bad_values_fail_at_config_load(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(AgentConfig, "agent", None, overrides, environ={})


def test_the_config_builds_the_values_the_agent_uses():
    cfg = AgentConfig(memory_yellow_percent=70, loop_stall_threshold_s=0.3, gpu_temperature_red_c=88,
                      anomaly_window=20, anomaly_min_samples=10, anomaly_cooldown_s=5)
    t = cfg.health_thresholds()
    assert isinstance(t, HealthThresholds) and isinstance(t.gpu, GpuThresholds)
    assert (t.memory_yellow_percent, t.loop_lag_yellow_s, t.gpu.temperature_red_c) == (70, 0.3, 88)
    s = cfg.anomaly_settings()
    assert s == AnomalySettings(window=20, min_samples=10, cooldown_s=5)
    d = AnomalyDetector.from_settings(s)
    assert (d.window, d.min_samples, d.cooldown_s, d.sigmas) == (20, 10, 5, 3.0)


def test_the_detector_and_the_settings_share_one_validation():
    with pytest.raises(ValueError, match="anomaly burst and max_metrics must be >= 1"):
        AnomalyDetector(burst=0)
    with pytest.raises(ValueError, match="anomaly burst and max_metrics must be >= 1"):
        AnomalySettings(burst=0)
