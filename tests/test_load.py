"""Load-aware checkpoints (agent/checkpointing/load.py): the readings, their average over a window, and the rule
that skips a scheduled checkpoint under load but never leaves a job without any."""

from __future__ import annotations

from collections import namedtuple

import pytest

from revenant.agent.checkpointing.load import (MAX_SKIPS_IN_A_ROW, Decision, Exceeded, Load, LoadGate, LoadSampler,
                                 PsutilReadings, exceeded, over_threshold)
from revenant.messages import CheckpointPolicy

pytestmark = pytest.mark.unit

CpuTimes = namedtuple("CpuTimes", "user nice system idle iowait irq softirq steal guest guest_nice")
Memory = namedtuple("Memory", "percent")

AWARE = CheckpointPolicy(load_aware=True)  # thresholds: cpu 0.95, io 0.50, memory 0.85
CALM = Load(cpu=0.30, io=0.05, memory=0.40)
BUSY = Load(cpu=0.97, io=0.05, memory=0.40)


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Readings:
    """Stand-in readings, one per call, in order."""

    def __init__(self, *loads: Load) -> None:
        self.loads = list(loads)

    def __call__(self) -> Load:
        return self.loads.pop(0)


def test_a_reading_is_cpu_and_io_wait_since_the_previous_one_and_memory_now():
    times = [CpuTimes(100, 0, 50, 800, 50, 0, 0, 0, 0, 0),
             # +60 user (20 of it guest), +20 system, +100 idle, +20 iowait: 200 ticks
             CpuTimes(160, 0, 70, 900, 70, 0, 0, 0, 20, 0),
             CpuTimes(160, 0, 70, 900, 70, 0, 0, 0, 20, 0)]  # no tick since
    memory = [Memory(42.0), Memory(90.0)]
    read = PsutilReadings(cpu_times=lambda: times.pop(0), virtual_memory=lambda: memory.pop(0))
    first = read()
    assert first == Load(cpu=pytest.approx(80 / 200), io=pytest.approx(20 / 200), memory=pytest.approx(0.42))
    assert read() == Load(cpu=0.0, io=0.0, memory=pytest.approx(0.90))


def test_the_real_readings_are_fractions():
    sampler = LoadSampler(min_samples=1)
    load = sampler.sample()
    assert all(0.0 <= x <= 1.0 for x in (load.cpu, load.io, load.memory))
    assert sampler.averages() == load


def test_the_averages_are_the_mean_over_the_window_never_one_instant():
    clock = Clock()
    sampler = LoadSampler(Readings(Load(0.9, 0.1, 0.5), Load(1.0, 0.3, 0.6), Load(0.8, 0.2, 0.7),
                                   Load(0.2, 0.0, 0.4), Load(0.2, 0.0, 0.4)), window_s=5.0, clock=clock)
    sampler.sample()
    clock.now += 1
    sampler.sample()
    assert sampler.averages() is None  # two readings: not enough to judge the node by
    clock.now += 1
    sampler.sample()
    assert sampler.averages() == Load(pytest.approx(0.9), pytest.approx(0.2), pytest.approx(0.6))
    # Readings older than the window drop out: at 105.5 the one taken at 100 is gone.
    clock.now += 3.5
    sampler.sample()
    assert sampler.averages() == Load(pytest.approx(2.0 / 3), pytest.approx(0.5 / 3), pytest.approx(1.7 / 3))
    # A loop that stopped sampling: the old readings no longer say anything about the node.
    clock.now += 4.0
    assert sampler.averages() is None
    clock.now += 0.5
    sampler.sample()
    assert sampler.averages() is None


def test_each_metric_is_compared_with_its_threshold_and_named_with_value_and_threshold():
    assert exceeded(CALM, AWARE) == []
    assert over_threshold(CALM, AWARE) is None
    assert over_threshold(BUSY, AWARE) == Exceeded("cpu", 0.97, 0.95)
    assert str(over_threshold(BUSY, AWARE)) == "cpu 0.97 > 0.95"
    everything = exceeded(Load(0.99, 0.62, 0.9), AWARE)
    assert [str(e) for e in everything] == ["cpu 0.99 > 0.95", "io 0.62 > 0.50", "memory 0.90 > 0.85"]
    # Equal is not over; just over reads as over.
    assert exceeded(Load(0.95, 0.5, 0.85), AWARE) == []
    assert str(over_threshold(Load(0.9512, 0, 0), AWARE)) == "cpu 0.951 > 0.950"
    tight = CheckpointPolicy(load_aware=True, load_threshold_memory=0.5)
    assert [str(e) for e in exceeded(CALM, tight)] == [] and str(over_threshold(Load(0, 0, 0.6), tight)) == \
        "memory 0.60 > 0.50"


def test_a_scheduled_checkpoint_over_a_threshold_is_skipped_naming_metric_value_and_threshold():
    gate = LoadGate()
    assert gate.decide("1", scheduled=True, force=False, averages=BUSY, policy=AWARE) == \
        Decision(skip=True, forced=False, reason="cpu 0.97 > 0.95")
    assert gate.skipped("1") == 1
    assert gate.decide("1", scheduled=True, force=False, averages=CALM, policy=AWARE) == Decision(skip=False)
    assert gate.skipped("1") == 0  # a checkpoint taken starts the count again


def test_nothing_is_skipped_without_load_awareness_or_without_readings():
    gate = LoadGate()
    off = CheckpointPolicy()
    assert off.load_aware is False
    for _ in range(6):
        assert gate.decide("1", scheduled=True, force=False, averages=BUSY, policy=off) == Decision(skip=False)
        assert gate.decide("2", scheduled=True, force=False, averages=None, policy=AWARE) == Decision(skip=False)
        # A manual checkpoint of a job that is not load-aware is taken, and still warns.
        manual = gate.decide("3", scheduled=False, force=False, averages=BUSY, policy=off)
        assert not manual.skip and not manual.forced and manual.reason.endswith("cpu 0.97 > 0.95")


def test_a_job_skipped_more_than_three_times_in_a_row_gets_the_next_one_anyway():
    assert MAX_SKIPS_IN_A_ROW == 3
    gate = LoadGate()
    decisions = [gate.decide("1", scheduled=True, force=False, averages=BUSY, policy=AWARE) for _ in range(9)]
    assert [(d.skip, d.forced) for d in decisions] == [(True, False)] * 4 + [(False, True)] + \
        [(True, False)] * 4
    assert decisions[4].reason == ("taken although the node is over a load threshold (cpu 0.97 > 0.95): the job's "
                                   "last 4 scheduled checkpoints were skipped in a row")
    assert gate.skipped("1") == 4
    # Each job has its own count.
    assert gate.decide("2", scheduled=True, force=False, averages=BUSY, policy=AWARE).skip
    assert gate.skipped("2") == 1 and gate.skipped("1") == 4


def test_a_manual_or_forced_checkpoint_is_never_skipped_but_warns_and_starts_the_count_again():
    gate = LoadGate()
    for _ in range(3):
        gate.decide("1", scheduled=True, force=False, averages=BUSY, policy=AWARE)
    manual = gate.decide("1", scheduled=False, force=False, averages=Load(0.97, 0.6, 0.4), policy=AWARE)
    assert manual == Decision(skip=False, forced=False, reason="a manual checkpoint is taken although the node is "
                                                               "over a load threshold: cpu 0.97 > 0.95, io 0.60 > 0.50")
    assert gate.skipped("1") == 0
    gate.decide("1", scheduled=True, force=False, averages=BUSY, policy=AWARE)
    forced = gate.decide("1", scheduled=True, force=True, averages=BUSY, policy=AWARE)
    assert not forced.skip and not forced.forced and forced.reason.startswith("a checkpoint asked with force is taken")
    assert gate.skipped("1") == 0
    assert gate.decide("1", scheduled=False, force=False, averages=CALM, policy=AWARE) == Decision(skip=False)


def test_a_forgotten_job_starts_from_nothing():
    gate = LoadGate()
    for _ in range(4):
        gate.decide("1", scheduled=True, force=False, averages=BUSY, policy=AWARE)
    gate.forget("1")
    gate.forget("never-seen")
    assert gate.skipped("1") == 0
    assert gate.decide("1", scheduled=True, force=False, averages=BUSY, policy=AWARE).skip
