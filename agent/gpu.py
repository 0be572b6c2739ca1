"""GPU discovery through NVML (the ``pynvml`` module from nvidia-ml-py).

No driver and no device are the normal case on CPU nodes: they give
``gpu="none"`` and no error.  ``nvml`` is injectable so a stand-in module with
the same shape drives exactly this code in tests.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from revenant.messages import GpuInfo

log = logging.getLogger(__name__)


def _load_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def discover_gpus(nvml: Any = None) -> tuple[str, list[GpuInfo]]:
    """("nvml", [gpus]) when NVML works and sees devices, else ("none", [])."""
    nvml = nvml if nvml is not None else _load_nvml()
    if nvml is None:
        return "none", []
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU here
        log.debug("NVML unavailable: %s", exc)
        return "none", []
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(GpuInfo(
                index=index,
                name=_text(nvml.nvmlDeviceGetName(handle)),
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                memory_total_bytes=int(mem.total),
                driver_version=driver,
            ))
    except Exception as exc:
        log.warning("NVML initialised but could not list GPUs: %s", exc)
        return "none", []
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return ("nvml" if gpus else "none"), gpus
