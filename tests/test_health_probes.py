"""Each health probe's thresholds and transitions, through the pure rules (and real loop stalls)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from revenant.agent.node.health import HealthSample, evaluate, probe_values
from revenant.common.serving.loopmonitor import LoopMonitor
from revenant.common.settings.thresholds import GpuThresholds, HealthThresholds
from revenant.messages import GpuHealth, GpuProcess, HealthSummary

pytestmark = pytest.mark.unit

T = HealthThresholds()
CALM = HealthSample(memory_percent=40, storage_free_bytes=100 * 2**30)
HEALTHY_GPUS = (GpuHealth(index=0, temperature_c=45, memory_total_bytes=2**30),
                GpuHealth(index=1, temperature_c=47, memory_total_bytes=2**30))


def state(**changes) -> tuple[str, list[str]]:
    s = evaluate(replace(CALM, **changes), T)
    return s.state, s.reasons


# ------------------------------------------------------------------ one probe at a time, at its edges


@pytest.mark.parametrize(
    "changes, expected, reason",
    [
        ({}, "GREEN", None),
        ({"memory_percent": 84.9}, "GREEN", None),
        ({"memory_percent": 85.0}, "YELLOW", "memory 85% >= 85%"),
        ({"memory_percent": 94.9}, "YELLOW", "memory"),
        ({"memory_percent": 95.0}, "RED", "memory 95% >= 95%"),
        ({"storage_free_bytes": 2 * 2**30}, "GREEN", None),
        ({"storage_free_bytes": 2 * 2**30 - 1}, "YELLOW", "storage free"),
        ({"storage_free_bytes": 256 * 2**20 - 1}, "RED", "storage free"),
        ({"loop_lag_s": 0.24}, "GREEN", None),
        ({"loop_lag_s": 0.25}, "YELLOW", "event loop stalled"),
        ({"recent_stalls": 1}, "YELLOW", "event loop stalled (1 recent"),
        ({"loop_lag_s": 2.0}, "RED", "event loop lag 2.00 s"),
        ({"loop_stalls": 50}, "GREEN", None),  # old stalls are history, not health
        ({"criu_ok": False, "criu_error": "criu check failed: vdso"}, "RED", "criu unusable: criu check failed"),
        ({"criu_ok": False}, "RED", "criu unusable: unknown error"),
        ({"criu_network_error": "inet_sockets: Can't get 1:16 opt"}, "YELLOW",
         "criu cannot checkpoint sockets: inet_sockets: Can't get 1:16 opt"),
        ({"criu_ok": False, "criu_network_error": "x"}, "RED", "criu unusable"),
        ({"nats_connected": False}, "YELLOW", "NATS disconnected"),
        ({"checkpoint_failures": 1}, "YELLOW", "1 checkpoint failed in a row"),
        ({"checkpoint_failures": 2}, "YELLOW", "2 checkpoints failed in a row"),
        ({"checkpoint_failures": 3}, "RED", "3 checkpoints failed in a row"),
        ({"pending_ops": 7}, "GREEN", None),
        ({"pending_ops": 8}, "YELLOW", "8 operations queued >= 8"),
        ({"pending_ops": 32}, "RED", "32 operations queued >= 32"),
        ({"gpus": HEALTHY_GPUS}, "GREEN", None),
        ({"gpus": (GpuHealth(index=0, temperature_c=86),)}, "YELLOW", "GPU 0 temperature 86 C"),
        ({"gpus": (GpuHealth(index=0, temperature_c=91),)}, "RED", "GPU 0 temperature 91 C"),
        ({"gpus": (GpuHealth(index=1, ecc_uncorrected_volatile=4),)}, "RED", "GPU 1 4 uncorrectable ECC"),
        ({"gpus": (GpuHealth(index=0, xids=[31]),)}, "YELLOW", "GPU 0 application XID 31"),
        ({"gpus": (GpuHealth(index=0, xids=[79]),)}, "RED", "GPU 0 critical XID 79"),
        ({"gpus": HEALTHY_GPUS, "gpu_recent_xids": {1: [45]}}, "YELLOW", "GPU 1 application XID 45"),
        ({"gpus": HEALTHY_GPUS, "gpu_errors": {0: "GPU is lost"}}, "RED", "GPU 0 unreadable: GPU is lost"),
    ],
)
def test_probe_thresholds(changes, expected, reason):
    got, reasons = state(**changes)
    assert got == expected, reasons
    if reason is None:
        assert reasons == []
    else:
        assert any(reason in r for r in reasons), reasons


def test_memory_pressure_is_yellow_even_when_every_device_answers():
    s = evaluate(replace(CALM, memory_percent=85, gpus=HEALTHY_GPUS), T)
    assert (s.state, s.reasons) == ("YELLOW", ["memory 85% >= 85%"])


def test_summary_carries_every_probe():
    gpus = (GpuHealth(index=0, temperature_c=50, processes=[GpuProcess(pid=7, job="j")]),)
    s = evaluate(replace(CALM, criu_ok=False, nats_connected=False, checkpoint_failures=2, pending_ops=5,
                         loop_stalls=9, gpus=gpus), T)
    assert (s.criu_ok, s.nats_connected, s.checkpoint_failures, s.pending_ops, s.loop_stalls) == (False, False, 2, 5, 9)
    assert s.gpus == list(gpus) and s.storage_free_bytes == 100 * 2**30


def test_transitions_follow_the_readings_both_ways():
    walk = [
        ({}, "GREEN"),
        ({"checkpoint_failures": 1}, "YELLOW"),
        ({"checkpoint_failures": 3}, "RED"),
        ({"checkpoint_failures": 0}, "GREEN"),  # a good checkpoint clears it
        ({"pending_ops": 9, "memory_percent": 90}, "YELLOW"),
        ({"pending_ops": 40}, "RED"),
        ({"pending_ops": 0, "memory_percent": 50}, "GREEN"),
    ]
    current = CALM
    for changes, expected in walk:
        current = replace(current, **changes)
        assert evaluate(current, T).state == expected, (changes, evaluate(current, T).reasons)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"gpus": (GpuHealth(index=0, temperature_c=86),)}, [("YELLOW", "gpu_temperature")]),
        ({"gpus": (GpuHealth(index=0, temperature_c=91),)}, [("RED", "gpu_temperature")]),
        ({"gpus": (GpuHealth(index=1, ecc_uncorrected_volatile=4),)}, [("RED", "gpu_ecc")]),
        ({"gpus": (GpuHealth(index=0, remapped_rows_failed=1),)}, [("RED", "gpu_remap_failed")]),
        ({"gpus": (GpuHealth(index=0, remapped_rows_pending=1),)}, [("YELLOW", "gpu_remap_pending")]),
        ({"gpus": (GpuHealth(index=0, xids=[79]),)}, [("RED", "gpu_xid")]),
        ({"gpus": (GpuHealth(index=0, xids=[31]),)}, [("YELLOW", "gpu_xid_app")]),
        ({"gpus": HEALTHY_GPUS, "gpu_recent_xids": {1: [45]}}, [("YELLOW", "gpu_xid_app")]),
        ({"gpus": HEALTHY_GPUS, "gpu_recent_xids": {-1: [48]}}, [("RED", "gpu_xid")]),  # a GPU NVML cannot name
        ({"gpus": HEALTHY_GPUS, "gpu_errors": {0: "GPU is lost"}}, [("RED", "gpu_unreadable")]),
        ({"gpus": (GpuHealth(index=0, temperature_c=91, ecc_uncorrected_volatile=1, remapped_rows_pending=1,
                             xids=[13, 79]),), "gpu_errors": {0: "timeout"}},
         [("RED", "gpu_unreadable"), ("RED", "gpu_temperature"), ("RED", "gpu_ecc"), ("YELLOW", "gpu_remap_pending"),
          ("RED", "gpu_xid"), ("YELLOW", "gpu_xid_app")]),
    ],
)
def test_each_gpu_finding_has_its_own_code(changes, expected):
    s = evaluate(replace(CALM, **changes), T)
    assert [(f.state, f.code) for f in s.findings] == expected
    assert len(s.findings) == len(s.reasons)


def test_worst_finding_wins_and_each_has_its_reason():
    s = evaluate(replace(CALM, memory_percent=90, pending_ops=8, gpus=(GpuHealth(index=0, xids=[48]),)), T)
    assert s.state == "RED" and len(s.reasons) == 3


def test_thresholds_are_configurable():
    t = HealthThresholds(memory_yellow_percent=60, checkpoint_failures_yellow=2, pending_ops_yellow=2,
                         pending_ops_red=3, gpu=GpuThresholds(temperature_yellow_c=60, temperature_red_c=70))
    assert evaluate(replace(CALM, memory_percent=61), t).state == "YELLOW"
    assert evaluate(replace(CALM, checkpoint_failures=1), t).state == "GREEN"
    assert evaluate(replace(CALM, pending_ops=3), t).state == "RED"
    assert evaluate(replace(CALM, gpus=(GpuHealth(index=0, temperature_c=65),)), t).state == "YELLOW"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"memory_yellow_percent": 96}, "memory_yellow_percent=96 must be a number <= memory_red_percent=95.0"),
        ({"storage_red_free_bytes": 3 * 2**30}, "storage_red_free_bytes"),
        ({"checkpoint_failures_yellow": 4}, "checkpoint_failures_yellow"),
        ({"pending_ops_yellow": 0}, "pending_ops_yellow"),
        ({"pending_ops_red": "many"}, "pending_ops_red='many'"),
    ],
)
def test_inconsistent_thresholds_are_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        HealthThresholds(**kwargs)


def test_probe_values_for_the_anomaly_detector():
    summary = HealthSummary(loop_lag_s=0.01, memory_percent=40.0, pending_ops=2, loop_stalls=7,
                            gpus=[GpuHealth(index=1, temperature_c=60, power_w=300.5, memory_used_bytes=10)])
    assert probe_values(summary) == {
        "loop_lag_s": 0.01, "memory_percent": 40.0, "pending_ops": 2.0,
        "gpu1.temperature_c": 60.0, "gpu1.power_w": 300.5, "gpu1.memory_used_bytes": 10.0,
    }


# ------------------------------------------------------------------ the event loop, for real


async def test_an_injected_loop_stall_counts_and_turns_the_node_yellow():
    monitor = LoopMonitor(period_s=0.02, stall_threshold_s=0.1)
    task = asyncio.create_task(monitor.run())
    try:
        await asyncio.sleep(0.05)
        before = monitor.stalls
        time.sleep(0.4)  # the stall under test: block the loop
        await asyncio.sleep(0.05)
    finally:
        task.cancel()
    worst, recent = monitor.take_window()
    assert monitor.stalls > before and recent >= 1 and worst >= 0.2
    t = replace(T, loop_lag_yellow_s=0.1, loop_lag_red_s=2.0)
    s = evaluate(replace(CALM, loop_lag_s=worst, recent_stalls=recent, loop_stalls=monitor.stalls), t)
    assert s.state == "YELLOW" and s.loop_stalls >= 1
    assert any("event loop stalled" in r for r in s.reasons)
    # The next window, without a stall, is GREEN again.
    _, recent = monitor.take_window()
    assert evaluate(replace(CALM, recent_stalls=recent), t).state == "GREEN"


def test_stuck_for_measures_how_overdue_the_monitor_is():
    monitor = LoopMonitor(period_s=0.1)
    assert monitor.stuck_for(100.0) == 0.0  # not running yet: nothing to say
    monitor.last_wake = 100.0
    assert monitor.stuck_for(100.05) == 0.0
    assert monitor.stuck_for(107.1) == pytest.approx(7.0)


# ------------------------------------------------------------------ the rules and the loop monitor, at a glance

@pytest.mark.parametrize(
    "sample, state, reason",
    [
        (HealthSample(memory_percent=50, storage_free_bytes=10 * 2**30), "GREEN", None),
        (HealthSample(memory_percent=85, storage_free_bytes=10 * 2**30), "YELLOW", "memory"),
        (HealthSample(memory_percent=96, storage_free_bytes=10 * 2**30), "RED", "memory"),
        (HealthSample(storage_free_bytes=2**30), "YELLOW", "storage"),
        (HealthSample(storage_free_bytes=2**20), "RED", "storage"),
        (HealthSample(storage_free_bytes=10 * 2**30, recent_stalls=1, loop_lag_s=0.3), "YELLOW", "event loop"),
        (HealthSample(storage_free_bytes=10 * 2**30, loop_lag_s=3.0), "RED", "event loop"),
        (HealthSample(storage_free_bytes=10 * 2**30, criu_ok=False, criu_error="criu not found"), "RED", "criu"),
        (HealthSample(storage_free_bytes=10 * 2**30, nats_connected=False), "YELLOW", "NATS"),
    ],
)
def test_health_rules(sample, state, reason):
    summary = evaluate(sample, T)
    assert summary.state == state
    if reason is None:
        assert summary.reasons == []
    else:
        assert any(reason in r for r in summary.reasons), summary.reasons


def test_worst_probe_wins_and_every_reason_is_listed():
    s = evaluate(HealthSample(memory_percent=90, storage_free_bytes=1, nats_connected=False), T)
    assert s.state == "RED" and len(s.reasons) == 3


def test_loop_monitor_counts_stalls_per_window():
    m = LoopMonitor(stall_threshold_s=0.25)
    for lag in (0.001, 0.3, 0.002, 1.0):
        m.record(lag)
    assert m.take_window() == (1.0, 2)
    m.record(0.01)
    assert m.take_window() == (1.0, 0)  # worst of the window includes the lag carried over
    assert m.take_window() == (0.01, 0)
    assert m.stalls == 2


async def test_loop_monitor_sees_a_blocked_loop():
    import time

    m = LoopMonitor(period_s=0.02, stall_threshold_s=0.1)
    task = asyncio.create_task(m.run())
    await asyncio.sleep(0.05)
    time.sleep(0.3)  # block the loop
    await asyncio.sleep(0.05)
    task.cancel()
    worst, stalls = m.take_window()
    assert stalls >= 1 and worst >= 0.2
