"""GpuMonitor and the GPU rules, driven through a stand-in with pynvml's shape.

NVML cannot load on this machine, so the stand-in below implements the pynvml
calls the monitor makes (same names, arguments, return shapes and NVMLError
codes as nvidia-ml-py's pynvml.py) and the monitor is handed it as its
``nvml`` module: the code under test is the code real NVML drives.
"""

from __future__ import annotations

import queue
import threading
import time
import types

import pytest

from revenant.agent.gpus.gpu import APPLICATION_XIDS, GpuMonitor, classify_gpu, classify_xid
from revenant.agent.node.health import HealthSample, evaluate
from revenant.common.settings.thresholds import GpuThresholds, HealthThresholds
from revenant.messages import GpuHealth

pytestmark = pytest.mark.unit

NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_TIMEOUT, NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_GPU_IS_LOST = 3, 10, 13, 15


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__({3: "Not Supported", 10: "Timeout", 13: "Function Not Found", 15: "GPU is lost"}.get(value, "Unknown Error"))
        self.value = value


class Handle:
    """Opaque, like pynvml's ctypes device pointers: no equality by value."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec


class StandInNvml:
    NVMLError = NVMLError
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_TIMEOUT = NVML_ERROR_TIMEOUT
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 0x8
    nvmlEventTypePState = 0x4

    def __init__(self, devices: list[dict] | None = None, *, init_error: int | None = None) -> None:
        self.devices = [Handle(d) for d in devices or []]
        self.init_error = init_error
        self.inits = self.shutdowns = 0
        self.calls: dict[str, int] = {}
        self.events: queue.Queue = queue.Queue()
        self.event_sets_freed = 0
        self.register_error: int | None = None
        self._cond = threading.Condition()
        self._waits_started = 0
        self._taken_by: int | None = None

    def _call(self, name: str, handle: Handle | None = None, key: str | None = None):
        self.calls[name] = self.calls.get(name, 0) + 1
        if handle is not None:
            if handle.spec.get("lost"):
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            if key in handle.spec.get("unsupported", ()):
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)

    # -- pynvml's calls, as the monitor makes them
    def nvmlInit(self):
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return "580.65"

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.devices[index]

    def nvmlDeviceGetName(self, h):
        return h.spec.get("name", "NVIDIA H200")

    def nvmlDeviceGetUUID(self, h):
        self._call("uuid", h)
        return h.spec["uuid"].encode()

    def nvmlDeviceGetMemoryInfo(self, h):
        self._call("memory", h)
        return types.SimpleNamespace(total=h.spec.get("total", 141 * 2**30), used=h.spec.get("used", 0), free=0)

    def nvmlDeviceGetTemperatureV(self, h, sensor):
        self._call("temperatureV", h)
        if h.spec.get("old_driver"):  # pynvml finds no such symbol in an older libnvidia-ml
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        assert sensor == self.NVML_TEMPERATURE_GPU
        return h.spec.get("temp", 40)

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._call("temperature", h, "temperature")
        return h.spec.get("temp", 40)

    def nvmlDeviceGetUtilizationRates(self, h):
        self._call("utilization", h, "utilization")
        return types.SimpleNamespace(gpu=h.spec.get("util", 0), memory=0)

    def nvmlDeviceGetPowerUsage(self, h):
        self._call("power", h, "power")
        return h.spec.get("power_mw", 100_000)

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        self._call("ecc", h, "ecc")
        assert (error_type, counter_type) == (1, 0)  # uncorrected, volatile
        return h.spec.get("ecc", 0)

    def nvmlDeviceGetRemappedRows(self, h):
        self._call("remap", h, "remap")
        return (0, 0, h.spec.get("remap_pending", 0), h.spec.get("remap_failed", 0))

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self._call("processes", h, "processes")
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=mem, gpuInstanceId=0, computeInstanceId=0)
                for pid, mem in h.spec.get("procs", [])]

    def nvmlEventSetCreate(self):
        return object()

    def nvmlDeviceRegisterEvents(self, h, event_types, event_set):
        if self.register_error is not None:
            raise NVMLError(self.register_error)
        assert event_types & self.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait(self, event_set, timeout_ms):
        with self._cond:
            self._waits_started += 1
            call = self._waits_started
            self._cond.notify_all()
        try:
            data = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None
        with self._cond:
            self._taken_by = call
        return data

    def nvmlEventSetFree(self, event_set):
        self.event_sets_freed += 1

    # -- test helpers
    def xid(self, index: int | None, code: int, event_type: int = 0x8) -> None:
        """Deliver one event and wait until the monitor's thread has handled it."""
        device = self.devices[index] if index is not None else Handle({"uuid": "GPU-unknown", "lost": True})
        self.events.put(types.SimpleNamespace(device=device, eventType=event_type, eventData=code,
                                              gpuInstanceId=0, computeInstanceId=0))
        with self._cond:
            # Handled once the thread has taken it and started its next wait.
            assert self._cond.wait_for(lambda: self._taken_by is not None and self._waits_started > self._taken_by, 10)
            self._taken_by = None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def two_gpus(**extra) -> list[dict]:
    return [{"uuid": "GPU-a", **extra}, {"uuid": "GPU-b"}]


@pytest.fixture
def clock() -> Clock:
    return Clock()


def monitor(nvml, clock=None, **kw) -> GpuMonitor:
    return GpuMonitor(nvml, clock=clock or time.monotonic, event_timeout_ms=20, **kw)


# ------------------------------------------------------------------ no GPU is normal


@pytest.mark.parametrize("nvml", [StandInNvml(init_error=12), StandInNvml(init_error=9), StandInNvml([])],
                         ids=["no-library", "no-driver", "no-device"])
async def test_no_gpu_is_gpu_none_and_no_error(nvml):
    async with GpuMonitor(nvml) as m:
        assert m.kind == "none" and m.gpus == []
        assert await m.read() == [] and m.sample() == [] and m.errors == {}
        assert evaluate(HealthSample(gpus=m.sample()), HealthThresholds()).state == "GREEN"
    assert nvml.shutdowns == nvml.inits  # NVML's init count is balanced


def test_real_nvml_here_is_not_an_error():
    m = GpuMonitor()
    m.start()
    try:
        assert m.kind in ("none", "nvml")
        assert len(m.sample()) == len(m.gpus)
    finally:
        m.stop()


def test_stop_before_start_and_twice_is_harmless():
    nvml = StandInNvml(two_gpus())
    m = monitor(nvml)
    m.stop()
    m.start()  # after stop: stays stopped
    assert nvml.inits == 0 and m.kind == "none"
    m2 = monitor(nvml)
    m2.start()
    m2.start()
    m2.stop()
    m2.stop()
    assert (nvml.inits, nvml.shutdowns, nvml.event_sets_freed) == (1, 1, 1)


# ------------------------------------------------------------------ readings


def test_readings_of_every_gpu():
    nvml = StandInNvml([
        {"uuid": "GPU-a", "temp": 71, "used": 3 * 2**30, "total": 80 * 2**30, "util": 97, "power_mw": 412_345,
         "ecc": 2, "remap_pending": 1, "procs": [(4242, 2**30), (4343, None)]},
        {"uuid": "GPU-b"},
    ])
    jobs = {4242: "train-7"}
    m = monitor(nvml, job_of=jobs.get)
    m.start()
    try:
        assert m.kind == "nvml" and [g.uuid for g in m.gpus] == ["GPU-a", "GPU-b"]
        a, b = m.sample()
    finally:
        m.stop()
    assert (a.index, a.uuid, a.temperature_c, a.utilization_percent, a.power_w) == (0, "GPU-a", 71.0, 97.0, 412.3)
    assert (a.memory_used_bytes, a.memory_total_bytes) == (3 * 2**30, 80 * 2**30)
    assert (a.ecc_uncorrected_volatile, a.remapped_rows_pending, a.remapped_rows_failed) == (2, 1, 0)
    assert [(p.pid, p.used_memory_bytes, p.job) for p in a.processes] == [(4242, 2**30, "train-7"), (4343, 0, "")]
    assert b.index == 1 and b.xids == [] and b.processes == []


def test_missing_features_read_as_zero_and_are_asked_once():
    nvml = StandInNvml([{"uuid": "GPU-a", "unsupported": {"ecc", "remap", "power"}, "old_driver": True,
                         "temp": 55}])
    m = monitor(nvml)
    m.start()
    try:
        for _ in range(3):
            (g,) = m.sample()
        assert m.errors == {}
    finally:
        m.stop()
    assert (g.ecc_uncorrected_volatile, g.power_w, g.temperature_c) == (0, 0.0, 55.0)
    assert nvml.calls["ecc"] == nvml.calls["remap"] == nvml.calls["power"] == 1
    assert (nvml.calls["temperatureV"], nvml.calls["temperature"]) == (1, 3)  # old driver: the old call


def test_a_job_lookup_that_fails_costs_only_the_job_name():
    def broken(pid):
        raise RuntimeError("supervisor busy")

    m = monitor(StandInNvml([{"uuid": "GPU-a", "procs": [(1, 5)]}]), job_of=broken)
    m.start()
    try:
        assert [(p.pid, p.job) for p in m.sample()[0].processes] == [(1, "")]
    finally:
        m.stop()


def test_a_lost_gpu_is_red_with_its_reason():
    nvml = StandInNvml(two_gpus())
    m = monitor(nvml)
    m.start()
    try:
        nvml.devices[1].spec["lost"] = True
        readings = m.sample()
        assert m.errors == {1: "GPU is lost"} and len(readings) == 2
        s = evaluate(HealthSample(gpus=readings, gpu_errors=m.errors), HealthThresholds())
        assert s.state == "RED" and any("GPU 1 unreadable: GPU is lost" in r for r in s.reasons)
        assert [(f.state, f.code) for f in s.findings] == [("RED", "gpu_unreadable")]
        nvml.devices[1].spec["lost"] = False
        m.sample()
        assert m.errors == {}
    finally:
        m.stop()


# ------------------------------------------------------------------ XIDs


def test_xids_reach_the_heartbeat_once_and_stay_held(clock):
    nvml = StandInNvml(two_gpus())
    m = monitor(nvml, clock=clock, thresholds=GpuThresholds(xid_hold_s=300))
    m.start()
    try:
        nvml.xid(1, 79)   # fallen off the bus: critical
        nvml.xid(0, 13)   # illegal address in a kernel: the application's fault
        nvml.xid(0, 99, event_type=nvml.nvmlEventTypePState)  # not an XID event: ignored
        a, b = m.sample()
        assert (a.xids, b.xids) == ([13], [79])
        assert [g.xids for g in m.sample()] == [[], []]  # "since the previous heartbeat"
        assert m.recent_xids() == {0: [13], 1: [79]}
        s = evaluate(HealthSample(gpus=m.sample(), gpu_recent_xids=m.recent_xids()), HealthThresholds())
        assert s.state == "RED"
        assert "GPU 1 critical XID 79" in s.reasons and "GPU 0 application XID 13" in s.reasons
        clock.now += 301
        assert m.recent_xids() == {}
        assert evaluate(HealthSample(gpus=m.sample(), gpu_recent_xids=m.recent_xids()),
                        HealthThresholds()).state == "GREEN"
    finally:
        m.stop()


def test_an_xid_from_a_device_nvml_cannot_name_still_counts(clock):
    nvml = StandInNvml(two_gpus())
    m = monitor(nvml, clock=clock)
    m.start()
    try:
        nvml.xid(None, 48)
        assert [g.xids for g in m.sample()] == [[], []]
        assert m.recent_xids() == {-1: [48]}
        s = evaluate(HealthSample(gpus=m.sample(), gpu_recent_xids=m.recent_xids()), HealthThresholds())
        assert s.state == "RED" and "a GPU critical XID 48" in s.reasons
        assert [(f.state, f.code) for f in s.findings] == [("RED", "gpu_xid")]
    finally:
        m.stop()


def test_stop_is_prompt_while_the_thread_waits_for_events():
    nvml = StandInNvml(two_gpus())
    m = GpuMonitor(nvml, event_timeout_ms=200)
    m.start()
    assert m._thread is not None and m._thread.is_alive()
    started = time.monotonic()
    m.stop()
    assert not m._thread.is_alive()
    assert time.monotonic() - started < 5  # bounded by the wait timeout, generously
    assert (nvml.event_sets_freed, nvml.shutdowns) == (1, 1)


def test_gpus_without_xid_events_are_still_read():
    nvml = StandInNvml(two_gpus())
    nvml.register_error = NVML_ERROR_NOT_SUPPORTED
    m = monitor(nvml)
    m.start()
    try:
        assert m._thread is None and len(m.sample()) == 2
    finally:
        m.stop()


async def test_async_use_keeps_nvml_off_the_event_loop():
    nvml = StandInNvml(two_gpus(temp=88))
    loop_thread = threading.get_ident()
    seen = []
    original = nvml.nvmlDeviceGetMemoryInfo

    def spy(h):
        seen.append(threading.get_ident())
        return original(h)

    nvml.nvmlDeviceGetMemoryInfo = spy
    async with GpuMonitor(nvml, event_timeout_ms=20) as m:
        readings = await m.read()
    assert readings[0].temperature_c == 88.0
    assert seen and loop_thread not in seen


# ------------------------------------------------------------------ the rules


@pytest.mark.parametrize("xid", sorted(APPLICATION_XIDS))
def test_application_xids_are_yellow(xid):
    assert classify_xid(xid) == "YELLOW"
    assert classify_gpu(GpuHealth(index=0, xids=[xid]), GpuThresholds()) == [
        ("YELLOW", "gpu_xid_app", f"GPU 0 application XID {xid}")]


@pytest.mark.parametrize("xid", [48, 63, 64, 74, 79, 92, 94, 95, 119, 999])
def test_every_other_xid_is_red(xid):
    assert classify_xid(xid) == "RED"
    assert classify_gpu(GpuHealth(index=2, xids=[xid]), GpuThresholds())[0][:2] == ("RED", "gpu_xid")


@pytest.mark.parametrize(
    "gpu, expected",
    [
        (GpuHealth(index=0, temperature_c=84.9), []),
        (GpuHealth(index=0, temperature_c=85), [("YELLOW", "gpu_temperature", "GPU 0 temperature 85 C >= 85 C")]),
        (GpuHealth(index=0, temperature_c=90), [("RED", "gpu_temperature", "GPU 0 temperature 90 C >= 90 C")]),
        (GpuHealth(index=0, ecc_uncorrected_volatile=1), [("RED", "gpu_ecc", "GPU 0 1 uncorrectable ECC errors")]),
        (GpuHealth(index=0, remapped_rows_pending=1),
         [("YELLOW", "gpu_remap_pending", "GPU 0 row remapping pending: reset the GPU")]),
        (GpuHealth(index=0, remapped_rows_pending=1, remapped_rows_failed=1),
         [("RED", "gpu_remap_failed", "GPU 0 row remapping failed")]),
        (GpuHealth(index=0, xids=[13, 79, 13]), [("RED", "gpu_xid", "GPU 0 critical XID 79"),
                                               ("YELLOW", "gpu_xid_app", "GPU 0 application XID 13")]),
    ],
)
def test_gpu_findings(gpu, expected):
    assert classify_gpu(gpu, GpuThresholds()) == expected


def test_gpu_thresholds_are_configurable_and_checked():
    assert classify_gpu(GpuHealth(index=0, temperature_c=70), GpuThresholds(temperature_yellow_c=70))[0][0] == "YELLOW"
    assert classify_gpu(GpuHealth(index=0, ecc_uncorrected_volatile=3), GpuThresholds(ecc_uncorrected_red=5)) == []
    with pytest.raises(ValueError, match="temperature_yellow_c"):
        GpuThresholds(temperature_yellow_c=95, temperature_red_c=90)
    with pytest.raises(ValueError, match="ecc_uncorrected_red"):
        GpuThresholds(ecc_uncorrected_red=0)


def test_a_stopped_monitor_reads_nothing():
    nvml = StandInNvml(two_gpus())
    m = monitor(nvml)
    m.start()
    m.stop()
    assert m.sample() == [] and m.errors == {}


def test_a_broken_event_set_does_not_stop_the_readings(caplog):
    nvml = StandInNvml(two_gpus())
    waited = threading.Event()

    def broken_wait(event_set, timeout_ms):
        waited.set()
        raise NVMLError(999)

    nvml.nvmlEventSetWait = broken_wait
    m = monitor(nvml)
    m.start()
    try:
        assert waited.wait(10)
        assert len(m.sample()) == 2 and m.errors == {}
    finally:
        m.stop()  # prompt even while the thread backs off
    assert "waiting for NVML events failed" in caplog.text
