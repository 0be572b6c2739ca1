"""A minimal ctypes binding of the CUDA driver API (libcuda) for revenant's GPU checks.

Only what tests/gpu/ needs: contexts, memory, a PTX module, a launch, and the checkpoint
calls.  The entry points are the ones cuda.h's #defines resolve to (``cuMemAlloc_v2``,
``cuMemcpyDtoH_v2``, ``cuModuleGetGlobal_v2``, ...), since libcuda exports both names.

The checkpoint argument structs follow cuda.h of CUDA 12.8 (driver r570) and CUDA 13.0
(driver r580): each is 64 bytes; ``CUcheckpointLockArgs`` {unsigned int timeoutMs;
unsigned int reserved0; cuuint64_t reserved1[7]}, ``CUcheckpointCheckpointArgs`` and
``CUcheckpointUnlockArgs`` {cuuint64_t reserved[8]}, ``CUcheckpointRestoreArgs``
{CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount; char reserved[52 - 8];
cuuint64_t reserved1} (13.0; in 12.8 all reserved: zero means no GPU remapping).
"""

from __future__ import annotations

import ctypes
from ctypes import byref, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p

CUdeviceptr = c_uint64

PROCESS_STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


class LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", c_uint), ("reserved0", c_uint), ("reserved1", c_uint64 * 7)]


class CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", c_uint64 * 8)]


class UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", c_uint64 * 8)]


class GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(GpuPair)), ("gpuPairsCount", c_uint),
                ("reserved", ctypes.c_char * 44), ("reserved1", c_uint64)]


for _s in (LockArgs, CheckpointArgs, UnlockArgs, RestoreArgs):
    assert ctypes.sizeof(_s) == 64, (_s.__name__, ctypes.sizeof(_s))


class CudaError(Exception):
    """A failed driver call: ``call`` is the entry point, ``code`` the CUresult (-1: the
    library lacks the entry point), and the message the call plus cuGetErrorName and
    cuGetErrorString, verbatim."""

    def __init__(self, call: str, code: int, message: str):
        super().__init__(message)
        self.call = call
        self.code = code


class Driver:
    def __init__(self, path: str = "libcuda.so.1"):
        self.path = path
        self.lib = ctypes.CDLL(path)  # OSError when there is no driver

    def describe(self, code: int) -> str:
        name, text = c_char_p(), c_char_p()
        try:
            self.lib.cuGetErrorName(c_int(code), byref(name))
            self.lib.cuGetErrorString(c_int(code), byref(text))
        except AttributeError:
            pass
        n = name.value.decode() if name.value else f"CUresult {code}"
        t = text.value.decode() if text.value else "no description"
        return f"{n} ({t})"

    def call(self, name: str, *args) -> None:
        try:
            fn = getattr(self.lib, name)
        except AttributeError:
            raise CudaError(name, -1, f"{name}: not exported by {self.path} (driver too old?)") from None
        fn.restype = c_int
        code = fn(*args)
        if code != 0:
            raise CudaError(name, code, f"{name}: {self.describe(code)}")

    # -- information ----------------------------------------------------------------------
    def driver_version(self) -> int:
        v = c_int()
        self.call("cuDriverGetVersion", byref(v))
        return v.value

    def init(self, ordinal: int = 0) -> int:
        """cuInit, then the device ``ordinal``'s primary context, made current. Returns the device."""
        dev = c_int()
        ctx = c_void_p()
        self.call("cuInit", c_uint(0))
        self.call("cuDeviceGet", byref(dev), c_int(ordinal))
        self.call("cuDevicePrimaryCtxRetain", byref(ctx), dev)
        self.call("cuCtxSetCurrent", ctx)
        self.device = dev.value
        return dev.value

    def device_name(self, dev: int) -> str:
        buf = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", buf, c_int(256), c_int(dev))
        return buf.value.decode(errors="replace")

    def total_mem(self, dev: int) -> int:
        n = c_size_t()
        self.call("cuDeviceTotalMem_v2", byref(n), c_int(dev))
        return n.value

    def mem_info(self) -> tuple[int, int]:
        free, total = c_size_t(), c_size_t()
        self.call("cuMemGetInfo_v2", byref(free), byref(total))
        return free.value, total.value

    # -- memory ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        p = CUdeviceptr()
        self.call("cuMemAlloc_v2", byref(p), c_size_t(nbytes))
        return p.value

    def free(self, dptr: int) -> None:
        self.call("cuMemFree_v2", CUdeviceptr(dptr))

    def alloc_host(self, nbytes: int) -> int:
        p = c_void_p()
        self.call("cuMemAllocHost_v2", byref(p), c_size_t(nbytes))
        return p.value

    def free_host(self, ptr: int) -> None:
        self.call("cuMemFreeHost", c_void_p(ptr))

    def memset32(self, dptr: int, value: int, count: int) -> None:
        self.call("cuMemsetD32_v2", CUdeviceptr(dptr), c_uint(value), c_size_t(count))

    def dtoh(self, host: int, dptr: int, nbytes: int) -> None:
        self.call("cuMemcpyDtoH_v2", c_void_p(host), CUdeviceptr(dptr), c_size_t(nbytes))

    def htod(self, dptr: int, host: int, nbytes: int) -> None:
        self.call("cuMemcpyHtoD_v2", CUdeviceptr(dptr), c_void_p(host), c_size_t(nbytes))

    def synchronize(self) -> None:
        self.call("cuCtxSynchronize")

    # -- modules and launches -------------------------------------------------------------
    def load_ptx(self, ptx: str) -> int:
        mod = c_void_p()
        self.call("cuModuleLoadData", byref(mod), c_char_p(ptx.encode() + b"\0"))
        return mod.value

    def function(self, mod: int, name: str) -> int:
        fn = c_void_p()
        self.call("cuModuleGetFunction", byref(fn), c_void_p(mod), c_char_p(name.encode()))
        return fn.value

    def global_(self, mod: int, name: str) -> tuple[int, int]:
        p, size = CUdeviceptr(), c_size_t()
        self.call("cuModuleGetGlobal_v2", byref(p), byref(size), c_void_p(mod), c_char_p(name.encode()))
        return p.value, size.value

    def launch1(self, fn: int) -> None:
        """One thread of a kernel that takes no parameters, on the default stream."""
        one = c_uint(1)
        self.call("cuLaunchKernel", c_void_p(fn), one, one, one, one, one, one, c_uint(0), c_void_p(None),
                  c_void_p(None), c_void_p(None))

    # -- checkpoints (no cuInit needed) ---------------------------------------------------
    def get_state(self, pid: int) -> str:
        s = c_int(-1)
        self.call("cuCheckpointProcessGetState", c_int(pid), byref(s))
        return PROCESS_STATES.get(s.value, f"unknown({s.value})")

    def lock(self, pid: int, timeout_ms: int = 10000) -> None:
        self.call("cuCheckpointProcessLock", c_int(pid), byref(LockArgs(timeoutMs=timeout_ms)))

    def checkpoint(self, pid: int) -> None:
        self.call("cuCheckpointProcessCheckpoint", c_int(pid), byref(CheckpointArgs()))

    def restore(self, pid: int) -> None:
        self.call("cuCheckpointProcessRestore", c_int(pid), byref(RestoreArgs()))

    def unlock(self, pid: int) -> None:
        self.call("cuCheckpointProcessUnlock", c_int(pid), byref(UnlockArgs()))
