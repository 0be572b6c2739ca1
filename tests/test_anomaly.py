"""The 3-sigma rule on synthetic series, with an injected clock and its rate limits."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from revenant.agent.node.anomaly import Anomaly, AnomalyDetector

pytestmark = pytest.mark.unit


def feed(d: AnomalyDetector, metric: str, values, start: float = 0.0, step: float = 1.0) -> list[Anomaly]:
    found = []
    for i, v in enumerate(values):
        a = d.observe(metric, v, start + i * step)
        if a is not None:
            found.append(a)
    return found


def alternating(n: int, mean: float = 10.0, spread: float = 1.0) -> list[float]:
    """mean +/- spread: population std is exactly ``spread``."""
    return [mean + (spread if i % 2 else -spread) for i in range(n)]


def test_the_boundary_is_mean_plus_three_sigma_of_the_window_before():
    d = AnomalyDetector(window=60, min_samples=60)
    assert feed(d, "lag", alternating(60)) == []
    assert d.stats("lag") == (10.0, 1.0, 60)
    assert d.observe("lag", 13.0, 60) is None  # exactly mean + 3 sigma: not above
    d2 = AnomalyDetector(window=60, min_samples=60)
    feed(d2, "lag", alternating(60))
    a = d2.observe("lag", 13.01, 60)
    assert a == Anomaly(metric="lag", value=13.01, mean=10.0, std=1.0, at=60)
    assert a.sigmas == pytest.approx(3.01)


def test_only_values_above_count():
    d = AnomalyDetector(min_samples=10, window=10)
    feed(d, "m", alternating(10))
    assert d.observe("m", -100.0, 10) is None


def test_a_noisy_series_with_one_spike():
    rng = random.Random(7)
    series = [rng.gauss(50.0, 2.0) for _ in range(200)]
    series[150] = 80.0
    d = AnomalyDetector(window=60, min_samples=30, cooldown_s=0)
    found = feed(d, "gpu0.temperature_c", series)
    spikes = [a for a in found if a.value == 80.0]
    assert len(spikes) == 1
    window = series[150 - 60:150]
    assert spikes[0].mean == pytest.approx(statistics.fmean(window))
    assert spikes[0].std == pytest.approx(statistics.pstdev(window))
    # Gaussian noise crosses 3 sigma about 0.13% of the time: a handful at most.
    assert len(found) <= 3


def test_the_window_slides():
    d = AnomalyDetector(window=5, min_samples=5)
    feed(d, "m", [1000.0] + [1.0] * 5)
    assert d.stats("m") == (1.0, 0.0, 5)  # the old 1000 has left the window


def test_a_level_shift_becomes_the_new_normal():
    d = AnomalyDetector(window=20, min_samples=10, cooldown_s=0, burst=100)
    feed(d, "mem", alternating(20, 40.0))
    found = feed(d, "mem", alternating(40, 70.0), start=20)
    assert 1 <= len(found) < 20
    assert feed(d, "mem", alternating(20, 70.0), start=60) == []


def test_nothing_before_min_samples():
    d = AnomalyDetector(window=60, min_samples=30)
    assert feed(d, "m", alternating(29) + [1e9]) == []


def test_a_flat_series_needs_a_real_change():
    d = AnomalyDetector(window=10, min_samples=10, min_relative_std=0.01, cooldown_s=0)
    feed(d, "mem", [40.0] * 10)
    assert d.observe("mem", 41.0, 10) is None  # 1 point is 2.5 "floor sigmas" at 1% of 40
    assert d.observe("mem", 42.0, 11) is not None


def test_per_metric_cooldown():
    d = AnomalyDetector(window=10, min_samples=10, cooldown_s=300)
    feed(d, "a", alternating(10))
    assert d.observe("a", 100.0, 10) is not None
    assert d.observe("a", 1000.0, 11) is None and d.suppressed == 1
    d2 = AnomalyDetector(window=10, min_samples=10, cooldown_s=300)
    feed(d2, "a", alternating(10))
    d2.observe("a", 100.0, 10)
    feed(d2, "a", alternating(10), start=11)
    assert d2.observe("a", 1000.0, 311) is not None  # the cooldown is over


def test_a_global_token_bucket_caps_a_storm_across_metrics():
    d = AnomalyDetector(window=10, min_samples=10, cooldown_s=0, burst=3, refill_s=60)
    metrics = [f"m{i}" for i in range(10)]
    for m in metrics:
        feed(d, m, alternating(10))
    reported = [m for m in metrics if d.observe(m, 100.0, 10.0)]
    assert len(reported) == 3 and d.suppressed == 7
    assert d.observe("m0", 1e6, 40.0) is None  # half a token
    assert d.observe("m1", 1e6, 70.0) is not None  # one token refilled


def test_observe_all():
    d = AnomalyDetector(window=10, min_samples=10)
    for i, v in enumerate(alternating(10)):
        assert d.observe_all({"x": v, "y": v}, i) == []
    found = d.observe_all({"x": 100.0, "y": 10.0}, 10)
    assert [a.metric for a in found] == ["x"]


def test_bad_input_is_a_clear_error_or_ignored():
    d = AnomalyDetector(max_metrics=1)
    with pytest.raises(TypeError, match="'m': value must be a number, got str"):
        d.observe("m", "12", 0)  # type: ignore[arg-type]
    assert d.observe("m", math.nan, 0) is None and d.observe("m", math.inf, 0) is None
    assert d.stats("m") is None and d.ignored == 2
    d.observe("m", 1.0, 0)
    assert d.observe("other", 1.0, 0) is None and d.ignored == 3  # bounded number of metrics
    assert d.stats("other") is None


@pytest.mark.parametrize(
    "kwargs",
    [{"window": 1}, {"window": 10, "min_samples": 11}, {"min_samples": 1}, {"sigmas": 0},
     {"cooldown_s": -1}, {"burst": 0}, {"refill_s": 0}, {"min_std": -1}],
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="anomaly"):
        AnomalyDetector(**kwargs)
