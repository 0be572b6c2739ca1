"""The two ways to suspend and resume a process's CUDA state: the driver API and ``cuda-checkpoint``.

Both drive one state machine, per process, kept by the NVIDIA driver::

    running --lock--> locked --checkpoint--> checkpointed --restore--> locked --unlock--> running

``lock`` blocks the process's CUDA calls and waits (up to a timeout) for work already submitted;
``checkpoint`` copies device memory into host memory and releases the GPU, so criu can dump the
process; ``restore`` reacquires a GPU (optionally another one, by UUID), copies the memory back to
the same addresses and rebuilds streams and contexts; ``unlock`` lets CUDA calls run again.

:class:`DriverApi` calls libcuda through ctypes (driver r570 and later: CUDA 12.8's
``cuCheckpointProcess*``; GPU remapping with CUDA 13.0's ``CUcheckpointRestoreArgs.gpuPairs``,
driver r580).  The structures below are NVIDIA's published ``cuda.h`` (CUDA 12.8 and 13.0, "CUDA
Checkpointing", group__CUDA__CHECKPOINT): every argument structure is 64 bytes, and 13.0's restore
arguments put ``gpuPairs``/``gpuPairsCount`` where 12.8 had zeroed reserved words, so zeroed
arguments mean "no remapping" to both.  :class:`Binary` runs NVIDIA's ``cuda-checkpoint`` utility
(``--action`` from r570, ``--toggle`` alone before that).  :func:`detect` picks the driver API
where libcuda has it, the binary otherwise, and says why when neither works.

Every call blocks (a lock waits for kernels): the engine step (agent/gpus/gpustep.py) calls them from
worker threads.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
import uuid as uuidlib
from typing import Protocol

from revenant.common.errors import RevenantError

log = logging.getLogger(__name__)

RUNNING, LOCKED, CHECKPOINTED, FAILED = "running", "locked", "checkpointed", "failed"
_STATES = {0: RUNNING, 1: LOCKED, 2: CHECKPOINTED, 3: FAILED}  # CUprocessState

# CUresult values (cuda.h) revenant tells apart.
CUDA_SUCCESS, CUDA_ERROR_TIMEOUT = 0, 909
# cuDriverGetVersion of CUDA 12.8 (driver r570: the checkpoint API) and 13.0 (r580: GPU remapping).
CHECKPOINT_API_VERSION, REMAP_API_VERSION = 12080, 13000


class CudaError(RevenantError):
    """A CUDA checkpoint call failed; the message carries the driver's or the tool's own words."""

    code = "gpu_checkpoint_failed"


class _LockArgs(ctypes.Structure):  # CUcheckpointLockArgs
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _Reserved(ctypes.Structure):  # CUcheckpointCheckpointArgs, CUcheckpointUnlockArgs
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _GpuPair(ctypes.Structure):  # CUcheckpointGpuPair: two CUuuid (16 bytes each)
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class _RestoreArgs(ctypes.Structure):  # CUcheckpointRestoreArgs (CUDA 13.0 layout)
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * (52 - 8)), ("reserved1", ctypes.c_uint64)]


for _s in (_LockArgs, _Reserved, _RestoreArgs):
    assert ctypes.sizeof(_s) == 64, _s


def uuid_bytes(gpu_uuid: str) -> bytes:
    """NVML's "GPU-8a1c...-..." as the 16 raw bytes of a CUuuid."""
    return uuidlib.UUID(gpu_uuid.removeprefix("GPU-").removeprefix("MIG-")).bytes


class Mechanism(Protocol):
    name: str
    remap: bool  # restore can move the process to other GPUs (by UUID)

    def state(self, pid: int) -> str: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int, remap: dict[str, str] | None = None) -> None: ...
    def unlock(self, pid: int) -> None: ...
    def restore_tid(self, pid: int) -> int: ...


class DriverApi:
    """``cuCheckpointProcess*`` from libcuda, through ctypes."""

    name = "driver_api"

    def __init__(self, lib: ctypes.CDLL, version: int) -> None:
        self.lib = lib
        self.version = version
        self.remap = version >= REMAP_API_VERSION
        for fn in ("cuCheckpointProcessGetState", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                   "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock", "cuCheckpointProcessGetRestoreThreadId"):
            getattr(lib, fn).restype = ctypes.c_int
            getattr(lib, fn).argtypes = [ctypes.c_int, ctypes.c_void_p]

    @classmethod
    def load(cls, path: str) -> DriverApi:
        """libcuda at ``path`` (a soname is looked up like the dynamic loader does); CudaError why not."""
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise CudaError(f"cannot load {path}: {exc}") from None
        version = ctypes.c_int(0)
        try:
            lib.cuDriverGetVersion.restype = ctypes.c_int
            rc = lib.cuDriverGetVersion(ctypes.byref(version))
        except AttributeError:
            raise CudaError(f"{path} has no cuDriverGetVersion: not a CUDA driver library") from None
        if rc != CUDA_SUCCESS:
            raise CudaError(f"cuDriverGetVersion failed: {_error_text(lib, rc)}")
        if version.value < CHECKPOINT_API_VERSION or not hasattr(lib, "cuCheckpointProcessLock"):
            raise CudaError(f"the driver's CUDA version {_cuda_text(version.value)} has no checkpoint API "
                            "(needs 12.8, driver 570 or later)")
        rc = lib.cuInit(0)  # a restore needs the driver initialised in the caller (or persistence mode)
        if rc != CUDA_SUCCESS:
            raise CudaError(f"cuInit failed: {_error_text(lib, rc)}")
        return cls(lib, version.value)

    def _call(self, what: str, pid: int, fn: str, args: object) -> None:
        rc = getattr(self.lib, fn)(pid, ctypes.byref(args) if args is not None else None)
        if rc != CUDA_SUCCESS:
            raise CudaError(f"CUDA {what} of pid {pid} failed: {_error_text(self.lib, rc)}")

    def state(self, pid: int) -> str:
        out = ctypes.c_int(-1)
        self._call("state query", pid, "cuCheckpointProcessGetState", out)
        return _STATES.get(out.value, f"unknown state {out.value}")

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._call("lock", pid, "cuCheckpointProcessLock", _LockArgs(timeoutMs=timeout_ms))

    def checkpoint(self, pid: int) -> None:
        self._call("checkpoint", pid, "cuCheckpointProcessCheckpoint", _Reserved())

    def restore(self, pid: int, remap: dict[str, str] | None = None) -> None:
        args = _RestoreArgs()
        if remap:
            if not self.remap:
                raise CudaError(f"restoring pid {pid} onto other GPUs needs CUDA 13.0 (driver 580); this "
                                f"driver is CUDA {_cuda_text(self.version)}")
            pairs = (_GpuPair * len(remap))()
            for pair, (old, new) in zip(pairs, sorted(remap.items())):
                pair.oldUuid[:] = list(uuid_bytes(old))
                pair.newUuid[:] = list(uuid_bytes(new))
            args.gpuPairs, args.gpuPairsCount = pairs, len(remap)
        self._call("restore", pid, "cuCheckpointProcessRestore", args)

    def unlock(self, pid: int) -> None:
        self._call("unlock", pid, "cuCheckpointProcessUnlock", _Reserved())

    def restore_tid(self, pid: int) -> int:
        """The thread of ``pid`` the driver restores CUDA through (it must be running for a restore)."""
        tid = ctypes.c_int(0)
        self._call("restore thread query", pid, "cuCheckpointProcessGetRestoreThreadId", tid)
        return tid.value


class Binary:
    """NVIDIA's ``cuda-checkpoint`` utility; ``toggle`` for one that only has ``--toggle`` (before r570)."""

    name = "binary"

    def __init__(self, path: str, *, toggle: bool = False, remap: bool = False, timeout_s: float = 600.0) -> None:
        self.path = path
        self.toggle = toggle
        self.remap = remap
        self.timeout_s = timeout_s

    @classmethod
    def find(cls, path: str) -> Binary:
        found = shutil.which(path)
        if found is None:
            raise CudaError(f"{path} not found")
        try:
            done = subprocess.run([found, "--help"], capture_output=True, text=True, errors="replace", timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CudaError(f"{found} --help failed: {exc}") from None
        text = done.stdout + done.stderr
        if "--action" not in text and "--toggle" not in text:
            raise CudaError(f"{found} does not look like cuda-checkpoint: {_last_line(text)}")
        return cls(found, toggle="--action" not in text, remap="--device-map" in text)

    def _run(self, what: str, pid: int, *args: str) -> str:
        argv = [self.path, *args, "--pid", str(pid)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise CudaError(f"CUDA {what} of pid {pid}: cuda-checkpoint did not answer in {self.timeout_s:g} s")
        except OSError as exc:
            raise CudaError(f"CUDA {what} of pid {pid}: cannot run {self.path}: {exc}") from None
        if done.returncode != 0:
            why = _last_line(done.stderr) or _last_line(done.stdout) or f"exit status {done.returncode}"
            raise CudaError(f"CUDA {what} of pid {pid} failed: {why}")
        return done.stdout

    def state(self, pid: int) -> str:
        out = self._run("state query", pid, "--get-state").strip().lower()
        return out if out in _STATES.values() else f"unknown state {out!r}"

    def lock(self, pid: int, timeout_ms: int) -> None:
        if not self.toggle:  # --toggle locks and checkpoints in one go, in checkpoint()
            self._run("lock", pid, "--action", "lock", "--timeout", str(timeout_ms))

    def checkpoint(self, pid: int) -> None:
        self._run("checkpoint", pid, *(["--toggle"] if self.toggle else ["--action", "checkpoint"]))

    def restore(self, pid: int, remap: dict[str, str] | None = None) -> None:
        if remap and not self.remap:
            raise CudaError(f"restoring pid {pid} onto other GPUs: {self.path} has no --device-map")
        if self.toggle:
            self._run("restore", pid, "--toggle")
            return
        extra = ["--device-map", ",".join(f"{o}={n}" for o, n in sorted(remap.items()))] if remap else []
        self._run("restore", pid, "--action", "restore", *extra)

    def unlock(self, pid: int) -> None:
        if not self.toggle:
            self._run("unlock", pid, "--action", "unlock")

    def restore_tid(self, pid: int) -> int:
        out = self._run("restore thread query", pid, "--get-restore-tid").strip()
        try:
            return int(out.split()[-1])
        except (ValueError, IndexError):
            raise CudaError(f"cuda-checkpoint --get-restore-tid for pid {pid} said {out!r}") from None


def detect(choice: str, libcuda: str, binary: str) -> tuple[Mechanism | None, str]:
    """The mechanism ``choice`` (auto | driver_api | binary | off) gives on this node, and a note:
    why there is none, or why auto passed over the driver API."""
    if choice == "off":
        return None, "GPU checkpoints are off (gpu_checkpoint = off)"
    why: list[str] = []
    if choice in ("auto", "driver_api"):
        try:
            return DriverApi.load(libcuda), ""
        except CudaError as exc:
            why.append(f"driver API: {exc}")
    if choice in ("auto", "binary"):
        try:
            found = Binary.find(binary)
            return found, "; ".join(why)
        except CudaError as exc:
            why.append(f"cuda-checkpoint: {exc}")
    return None, "; ".join(why)


def _error_text(lib: ctypes.CDLL, rc: int) -> str:
    """cuGetErrorName and cuGetErrorString for ``rc``, as the driver words them."""
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    try:
        lib.cuGetErrorName(rc, ctypes.byref(name))
        lib.cuGetErrorString(rc, ctypes.byref(text))
    except AttributeError:
        pass
    parts = [p.decode(errors="replace") for p in (name.value, text.value) if p]
    return ": ".join(parts) if parts else f"CUresult {rc}"


def _cuda_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""
