"""GPU discovery (discover_gpus) through a stand-in with pynvml's shape, and the real NVML here."""

from __future__ import annotations

import types

import pytest

from revenant.agent.gpus.gpu import discover_gpus

pytestmark = pytest.mark.unit


class NVMLError(Exception):
    pass


def fake_nvml(devices: list[dict] | None, init_error: bool = False):
    """A stand-in with pynvml's shape, for the code path real NVML drives."""
    m = types.SimpleNamespace()

    def init():
        if init_error:
            raise NVMLError("NVML Shared Library Not Found")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: b"580.65"
    m.nvmlDeviceGetCount = lambda: len(devices or [])
    m.nvmlDeviceGetHandleByIndex = lambda i: devices[i]
    m.nvmlDeviceGetName = lambda h: h["name"]
    m.nvmlDeviceGetUUID = lambda h: h["uuid"]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=h["mem"], used=0, free=h["mem"])
    return m


def test_gpu_discovery_lists_devices():
    kind, gpus = discover_gpus(fake_nvml([{"name": "NVIDIA H200", "uuid": "GPU-a", "mem": 141 * 2**30}]))
    assert kind == "nvml"
    assert gpus[0].name == "NVIDIA H200" and gpus[0].driver_version == "580.65"


def test_no_driver_or_no_device_is_gpu_none():
    assert discover_gpus(fake_nvml(None, init_error=True)) == ("none", [])
    assert discover_gpus(fake_nvml([])) == ("none", [])


def test_real_nvml_on_this_machine_is_not_an_error():
    kind, gpus = discover_gpus()
    assert kind in ("none", "nvml")
