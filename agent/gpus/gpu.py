"""GPUs through NVML (the ``pynvml`` module from nvidia-ml-py): discovery, readings, XIDs.

No driver and no device are the normal case on CPU nodes: they give
``gpu="none"`` and no error.  ``nvml`` is injectable everywhere, so a stand-in
module with pynvml's shape drives exactly this code in tests.

:func:`classify_gpu` is the pure rule that turns one GPU's readings into
findings; :class:`GpuMonitor` is the I/O around NVML.  NVML calls block (a
lost GPU can take seconds to answer), so the agent calls the monitor through
threads: ``async with`` and :meth:`GpuMonitor.read` do that for it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterable

from revenant.common.errors import described
from revenant.common.settings.thresholds import GpuThresholds
from revenant.messages import GpuHealth, GpuInfo, GpuProcess, HealthState

log = logging.getLogger(__name__)

# XIDs caused by the application (illegal address, MMU fault from user code,
# reset channel, preemptive cleanup, video decoder, ...): the job is broken,
# the GPU is fine.  Every other XID points at the GPU, driver or bus.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

# NVML return codes (pynvml's NVML_ERROR_*), used when the module lacks the names.
_NOT_SUPPORTED, _NO_PERMISSION, _TIMEOUT, _FUNCTION_NOT_FOUND, _VERSION_MISMATCH = 3, 4, 10, 13, 25
_XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError

# A finding: its state, a machine-readable code (HealthFinding.code) and the reason in words,
# as in agent/node/health.py.  One code per kind of trouble (gpu_temperature, gpu_ecc, gpu_remap_failed,
# gpu_remap_pending, gpu_xid, gpu_xid_app), so the coordinator's proactive rules can tell a hot
# GPU from a broken one, and either from an application's own fault.
Finding = tuple[HealthState, str, str]


@dataclass(frozen=True)
class CudaProcess:
    """One process using a GPU, as NVML lists it (``pid`` as the agent sees it)."""

    pid: int
    gpu_index: int
    gpu_uuid: str
    gpu_name: str
    used_bytes: int = 0


@dataclass
class GpuScan:
    """The node's CUDA processes now, its GPUs in MIG mode and the MPS clients (agent/gpus/gpustep.py)."""

    processes: list[CudaProcess] = field(default_factory=list)
    mig: set[int] = field(default_factory=set)
    mps_pids: set[int] = field(default_factory=set)
    driver: str = ""


def classify_xid(xid: int) -> HealthState:
    return "YELLOW" if xid in APPLICATION_XIDS else "RED"


def classify_gpu(gpu: GpuHealth, t: GpuThresholds, held_xids: Iterable[int] = ()) -> list[Finding]:
    """Findings for one GPU: temperature, ECC, row remapping and XIDs (this window's and held ones)."""
    name = f"GPU {gpu.index}" if gpu.index >= 0 else "a GPU"
    out: list[Finding] = []
    if gpu.temperature_c >= t.temperature_red_c:
        out.append(("RED", "gpu_temperature",
                    f"{name} temperature {gpu.temperature_c:.0f} C >= {t.temperature_red_c:g} C"))
    elif gpu.temperature_c >= t.temperature_yellow_c:
        out.append(("YELLOW", "gpu_temperature",
                    f"{name} temperature {gpu.temperature_c:.0f} C >= {t.temperature_yellow_c:g} C"))
    if gpu.ecc_uncorrected_volatile >= t.ecc_uncorrected_red:
        out.append(("RED", "gpu_ecc", f"{name} {gpu.ecc_uncorrected_volatile} uncorrectable ECC errors"))
    if gpu.remapped_rows_failed:
        out.append(("RED", "gpu_remap_failed", f"{name} row remapping failed"))
    elif gpu.remapped_rows_pending:
        out.append(("YELLOW", "gpu_remap_pending", f"{name} row remapping pending: reset the GPU"))
    xids = sorted(set(gpu.xids) | set(held_xids))
    app = [x for x in xids if classify_xid(x) == "YELLOW"]
    critical = [x for x in xids if classify_xid(x) == "RED"]
    if critical:
        out.append(("RED", "gpu_xid", f"{name} critical XID {', '.join(map(str, critical))}"))
    if app:
        out.append(("YELLOW", "gpu_xid_app", f"{name} application XID {', '.join(map(str, app))}"))
    return out


def _load_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _code(nvml: Any, name: str, default: int) -> int:
    return getattr(nvml, name, default)


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
        return _list_gpus(nvml)
    except Exception as exc:
        log.warning("NVML initialised but could not list GPUs: %s", exc)
        return "none", []
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _list_gpus(nvml: Any) -> tuple[str, list[GpuInfo]]:
    driver = _text(nvml.nvmlSystemGetDriverVersion())
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        gpus.append(GpuInfo(
            index=index,
            name=_text(nvml.nvmlDeviceGetName(handle)),
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
            driver_version=driver,
        ))
    return ("nvml" if gpus else "none"), gpus


class GpuMonitor:
    """Per-GPU readings each heartbeat, plus a thread that waits for XID events.

    ``job_of(pid)`` names the revenant job a CUDA process belongs to (or None).
    ``start``/``stop`` block on NVML; use ``async with`` or ``asyncio.to_thread``.
    Both are idempotent, and ``stop`` is safe before ``start``.
    """

    def __init__(self, nvml: Any = None, *, job_of: Callable[[int], str | None] | None = None,
                 thresholds: GpuThresholds = GpuThresholds(), clock: Callable[[], float] = time.monotonic,
                 event_timeout_ms: int = 500, max_xids: int = 1024) -> None:
        self._nvml = nvml
        self._job_of = job_of
        self._hold_s = thresholds.xid_hold_s
        self._clock = clock
        self._event_timeout_ms = event_timeout_ms
        self.kind = "none"
        self.gpus: list[GpuInfo] = []
        # GPU index -> why it could not be read in the last sample (a lost GPU is RED).
        self.errors: dict[int, str] = {}
        self._handles: list[Any] = []
        self._index_by_uuid: dict[str, int] = {}
        self._unsupported: set[tuple[int, str]] = set()
        self._temperature_v = True
        self._event_set: Any = None
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()
        # Bounded so an XID storm cannot grow memory: (time, gpu index, xid).
        self._new_xids: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=max_xids)
        self._held: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=max_xids)
        self._started = self._stopped = self._initialised = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._started or self._stopped:
            return
        self._started = True
        nvml = self._nvml if self._nvml is not None else _load_nvml()
        if nvml is None:
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # no library or no driver: a CPU node
            log.debug("NVML unavailable: %s", exc)
            return
        self._nvml, self._initialised = nvml, True
        try:
            self.kind, self.gpus = _list_gpus(nvml)
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(g.index) for g in self.gpus]
        except Exception as exc:
            log.warning("NVML initialised but could not list GPUs: %s", exc)
            self.kind, self.gpus, self._handles = "none", [], []
        self._index_by_uuid = {g.uuid: g.index for g in self.gpus}
        if self._handles:
            self._start_xid_watch()

    def _start_xid_watch(self) -> None:
        nvml = self._nvml
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except Exception as exc:
            log.warning("NVML events unavailable, XIDs will not be seen: %s", exc)
            return
        registered = 0
        for index, handle in enumerate(self._handles):
            try:
                nvml.nvmlDeviceRegisterEvents(handle, _code(nvml, "nvmlEventTypeXidCriticalError", _XID_EVENT),
                                              self._event_set)
                registered += 1
            except Exception as exc:  # e.g. NOT_SUPPORTED on some boards: that GPU goes unwatched
                log.warning("GPU %d: XID events not supported: %s", index, exc)
        if registered:
            self._thread = threading.Thread(target=self._watch_xids, name="nvml-xid-events", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if not self._initialised:
            return
        self._halt.set()
        if self._thread is not None:
            # The thread wakes at least every event_timeout_ms to look at _halt.
            self._thread.join(self._event_timeout_ms / 1000 * 4 + 1)
            if self._thread.is_alive():
                # Freeing the set or NVML under a thread still waiting on it would be unsafe.
                log.warning("NVML event thread did not stop; leaving it to die with the process")
                return
        if self._event_set is not None:
            try:
                self._nvml.nvmlEventSetFree(self._event_set)
            except Exception as exc:
                log.debug("nvmlEventSetFree: %s", exc)
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown: %s", exc)

    async def __aenter__(self) -> GpuMonitor:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    # ------------------------------------------------------------------ XID events

    def _watch_xids(self) -> None:
        nvml = self._nvml
        timeout = _code(nvml, "NVML_ERROR_TIMEOUT", _TIMEOUT)
        failures = 0
        while not self._halt.is_set():
            try:
                data = nvml.nvmlEventSetWait(self._event_set, self._event_timeout_ms)
            except Exception as exc:
                if getattr(exc, "value", None) == timeout:
                    continue
                failures += 1
                log.log(logging.WARNING if failures == 1 else logging.DEBUG, "waiting for NVML events failed: %s", exc)
                self._halt.wait(1.0)  # do not spin on a broken event set
                continue
            if int(data.eventType) & _code(nvml, "nvmlEventTypeXidCriticalError", _XID_EVENT):
                self._new_xids.append((self._clock(), self._index_of(data.device), int(data.eventData)))

    def _index_of(self, device: Any) -> int:
        # ctypes device handles do not compare by value; their UUID does.
        try:
            return self._index_by_uuid.get(_text(self._nvml.nvmlDeviceGetUUID(device)), -1)
        except Exception:
            return -1

    def recent_xids(self, now: float | None = None) -> dict[int, list[int]]:
        """GPU index (-1: unknown GPU) -> XIDs seen within the hold time, oldest first."""
        now = self._clock() if now is None else now
        with self._lock:
            while self._held and now - self._held[0][0] > self._hold_s:
                self._held.popleft()
            out: dict[int, list[int]] = {}
            for _, index, xid in self._held:
                out.setdefault(index, []).append(xid)
            return out

    # ------------------------------------------------------------------ readings

    def sample(self) -> list[GpuHealth]:
        """Read every GPU now (blocking); each reading's ``xids`` are those since the last sample."""
        if self._stopped:  # NVML is shut down: reading would only produce errors
            return []
        fresh: dict[int, list[int]] = {}
        with self._lock:
            while self._new_xids:
                item = self._new_xids.popleft()
                self._held.append(item)
                fresh.setdefault(item[1], []).append(item[2])
        readings, errors = [], {}
        for info, handle in zip(self.gpus, self._handles):
            try:
                readings.append(self._read(info, handle, fresh.get(info.index, [])))
            except Exception as exc:  # GPU lost, driver gone, ...: the node cannot trust this GPU
                errors[info.index] = described(exc)
                readings.append(GpuHealth(index=info.index, uuid=info.uuid, name=info.name,
                                          memory_total_bytes=info.memory_total_bytes,
                                          xids=fresh.get(info.index, [])))
        self.errors = errors
        return readings

    async def read(self) -> list[GpuHealth]:
        return await asyncio.to_thread(self.sample) if self._handles else []

    def _optional(self, index: int, what: str, fn: Callable[[], Any], default: Any) -> Any:
        """``fn()``, or ``default`` where this GPU lacks the feature (asked once, not every beat)."""
        if (index, what) in self._unsupported:
            return default
        try:
            return fn()
        except AttributeError:  # an older pynvml without this call
            self._unsupported.add((index, what))
            return default
        except Exception as exc:
            if getattr(exc, "value", None) in self._unsupported_codes():
                self._unsupported.add((index, what))
                return default
            raise

    def _read(self, info: GpuInfo, handle: Any, xids: list[int]) -> GpuHealth:
        nvml, i = self._nvml, info.index
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        temp = self._optional(i, "temperature", lambda: self._temperature(handle), 0)
        util = self._optional(i, "utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu, 0)
        power_mw = self._optional(i, "power", lambda: nvml.nvmlDeviceGetPowerUsage(handle), 0)
        ecc = self._optional(i, "ecc", lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, _code(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1), _code(nvml, "NVML_VOLATILE_ECC", 0)), 0)
        _, _, pending, failed = self._optional(i, "remap", lambda: nvml.nvmlDeviceGetRemappedRows(handle),
                                               (0, 0, 0, 0))
        procs = self._optional(i, "processes", lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle), [])
        return GpuHealth(
            index=i, uuid=info.uuid, name=info.name,
            temperature_c=float(temp),
            memory_used_bytes=int(mem.used), memory_total_bytes=int(mem.total),
            utilization_percent=float(util),
            power_w=round(power_mw / 1000, 1),
            ecc_uncorrected_volatile=int(ecc),
            remapped_rows_pending=int(pending), remapped_rows_failed=int(failed),
            xids=xids,
            processes=[self._process(p) for p in procs],
        )

    def _temperature(self, handle: Any) -> float:
        nvml = self._nvml
        sensor = _code(nvml, "NVML_TEMPERATURE_GPU", 0)
        # nvmlDeviceGetTemperature is deprecated (gone in CUDA 14); the V call
        # needs a newer driver.  Try V until it says it cannot, then stay on the old one.
        if self._temperature_v and hasattr(nvml, "nvmlDeviceGetTemperatureV"):
            try:
                return nvml.nvmlDeviceGetTemperatureV(handle, sensor)
            except Exception as exc:
                if getattr(exc, "value", None) not in self._unsupported_codes():
                    raise
                self._temperature_v = False
        return nvml.nvmlDeviceGetTemperature(handle, sensor)

    def _unsupported_codes(self) -> set[int]:
        return {_code(self._nvml, n, d) for n, d in (
            ("NVML_ERROR_NOT_SUPPORTED", _NOT_SUPPORTED), ("NVML_ERROR_NO_PERMISSION", _NO_PERMISSION),
            ("NVML_ERROR_FUNCTION_NOT_FOUND", _FUNCTION_NOT_FOUND),
            ("NVML_ERROR_ARGUMENT_VERSION_MISMATCH", _VERSION_MISMATCH))}

    def scan(self) -> GpuScan:
        """Read NVML now (blocking): which processes use which GPU, MIG modes, MPS clients."""
        out = GpuScan(driver=self.gpus[0].driver_version if self.gpus else "")
        if self._stopped or not self._handles:
            return out
        nvml = self._nvml
        for info, handle in zip(self.gpus, self._handles):
            try:
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception as exc:  # a lost GPU: criu will name a job still mapping it
                log.warning("GPU %d: cannot list its processes: %s", info.index, exc)
                procs = []
            out.processes += [CudaProcess(int(p.pid), info.index, info.uuid, info.name, int(p.usedGpuMemory or 0))
                              for p in procs]
            try:
                if self._optional(info.index, "mig", lambda: nvml.nvmlDeviceGetMigMode(handle)[0], 0):
                    out.mig.add(info.index)
                mps = self._optional(info.index, "mps", lambda: nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle),
                                     [])
                out.mps_pids.update(int(p.pid) for p in mps)
            except Exception as exc:
                log.warning("GPU %d: cannot read its MIG mode or MPS clients: %s", info.index, exc)
        return out

    def _process(self, proc: Any) -> GpuProcess:
        pid = int(proc.pid)
        job = ""
        if self._job_of is not None:
            try:
                job = self._job_of(pid) or ""
            except Exception as exc:  # a broken lookup must not cost the GPU its readings
                log.debug("job lookup for pid %d failed: %s", pid, exc)
        used = proc.usedGpuMemory  # None where the driver cannot tell (NVML_VALUE_NOT_AVAILABLE)
        return GpuProcess(pid=pid, used_memory_bytes=int(used or 0), job=job)
