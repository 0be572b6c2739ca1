"""A fake GPU for tests: libcuda.so.1, libnvidia-ml.so.1 and cuda-checkpoint stand-ins.

``build(dest)`` compiles fakecuda.c / fakenvml.c (cached by a hash of the sources) and returns a
:class:`FakeGpu`: its ``env()`` is what an agent process and a job need (LD_LIBRARY_PATH to the
fake libraries, REVENANT_FAKEGPU_DIR to the state dir).  The fake CUDA processes are
tests/jobs/gpucounter.py: their CUDA state lives in the process itself, so it survives criu.

State dir layout (shared with the C sources and gpucounter.py):
  config                    "driver V", "cuda N", "gpu <uuid> <bytes> <name>", "mig <i> <cur> <pend>",
                            "mps <i> <pid>...", "lost <i>", "temp <i> <celsius>"
  fail/<call>               "code times leave_state delay_ms": the next `times` calls fail
  gpu-<uuid>/<ctx>.mem      a process's device memory (8-byte counter + payload) while on a GPU
  ctx/<ctx>/                requests to the process's in-process driver
  xids                      pending XID events, "<index> <xid>" lines
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("fakecuda.c", "fakenvml.c")
GPUCOUNTER = HERE.parent / "jobs" / "gpucounter.py"

# CUresult values (cuda.h) and CUprocessState names.
CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED = 0, 1, 3
CUDA_ERROR_NO_DEVICE, CUDA_ERROR_ILLEGAL_STATE, CUDA_ERROR_NOT_SUPPORTED = 100, 401, 801
CUDA_ERROR_TIMEOUT, CUDA_ERROR_UNKNOWN = 909, 999
STATES = ("running", "locked", "checkpointed", "failed")
CALLS = ("lock", "checkpoint", "restore", "unlock", "get_state", "get_restore_tid")

DEFAULT_GPUS = [("GPU-8e7f3a52-1c4b-4d2e-9f60-0a1b2c3d4e01", "NVIDIA H100 80GB HBM3", 80 * 1024**3)]


class FakeGpuError(RuntimeError):
    """The kit cannot be built here (no compiler) or was misused."""


def _compile(out: Path, source: Path, *flags: str) -> None:
    argv = ["cc", "-O1", "-Wall", *flags, "-o", str(out), str(source)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FakeGpuError(f"compiling {source.name} failed:\n{proc.stderr}")


def _build_into(out: Path, digest: str) -> None:
    """Compile into a private directory, then move it into place (concurrent builds are safe)."""
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    lib, old, bindir = tmp / "lib", tmp / "lib-noapi", tmp / "bin"
    for d in (lib, old, bindir):
        d.mkdir(parents=True)
    cuda, nvml = HERE / "fakecuda.c", HERE / "fakenvml.c"
    _compile(lib / "libcuda.so.1", cuda, "-shared", "-fPIC")
    _compile(lib / "libnvidia-ml.so.1", nvml, "-shared", "-fPIC")
    _compile(old / "libcuda.so.1", cuda, "-shared", "-fPIC", "-DFAKECUDA_NO_API")
    shutil.copy(lib / "libnvidia-ml.so.1", old / "libnvidia-ml.so.1")
    _compile(bindir / "cuda-checkpoint", cuda, "-DFAKECUDA_MAIN")
    (tmp / "done").write_text(digest)
    try:
        tmp.rename(out)
    except OSError:  # another build got there first
        shutil.rmtree(tmp, ignore_errors=True)


def build(dest: Path, state: Path | None = None) -> FakeGpu:
    """Compile the fake GPU into ``dest`` (reused while the sources are unchanged) with its state
    dir ``state`` (default ``dest``/state), configured with one default GPU if it has no config."""
    if shutil.which("cc") is None:
        raise FakeGpuError("the fake GPU needs a C compiler: cc not found (apt-get install gcc libc6-dev)")
    dest = Path(dest)
    digest = hashlib.sha256(b"".join((HERE / s).read_bytes() for s in SOURCES)).hexdigest()[:16]
    out = dest / f"fakegpu-{digest}"
    lib, old = out / "lib", out / "lib-noapi"
    binary = out / "bin" / "cuda-checkpoint"
    if not (out / "done").exists():
        _build_into(out, digest)
    gpu = FakeGpu(libdir=lib, cuda_checkpoint=binary, dir=Path(state) if state else dest / "state",
                  libdir_noapi=old)
    gpu.dir.mkdir(parents=True, exist_ok=True)
    if (gpu.dir / "config").exists():
        gpu._read_config()
    else:
        gpu.set_gpus(DEFAULT_GPUS)
    return gpu


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _Args(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _Pair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(_Pair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * 44), ("reserved1", ctypes.c_uint64)]


def uuid_bytes(uuid: str) -> bytes:
    """"GPU-xxxxxxxx-xxxx-..." -> the 16 raw bytes of a CUuuid."""
    return bytes.fromhex(uuid.removeprefix("GPU-").replace("-", ""))


@dataclass
class FakeGpu:
    libdir: Path
    cuda_checkpoint: Path
    dir: Path
    libdir_noapi: Path  # a libcuda without the cuCheckpoint* symbols (a driver before r570)
    _gpus: list[tuple[str, str, int]] = field(default_factory=list)
    _driver: tuple[str, int] = ("570.86.10", 12080)
    _extra: dict[str, list[str]] = field(default_factory=dict)

    @property
    def libcuda(self) -> Path:
        return self.libdir / "libcuda.so.1"

    def env(self) -> dict[str, str]:
        return {"LD_LIBRARY_PATH": str(self.libdir), "REVENANT_FAKEGPU_DIR": str(self.dir)}

    # ------------------------------------------------------------ configuration

    def _write_config(self) -> None:
        lines = [f"driver {self._driver[0]}", f"cuda {self._driver[1]}"]
        lines += [f"gpu {uuid} {int(mem)} {name}" for uuid, name, mem in self._gpus]
        for kind in ("mig", "mps", "lost", "temp"):
            lines += self._extra.get(kind, [])
        tmp = self.dir / "config.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.dir / "config")

    def _read_config(self) -> None:
        for line in (self.dir / "config").read_text().splitlines():
            words = line.split()
            if words[:1] == ["driver"]:
                self._driver = (words[1], self._driver[1])
            elif words[:1] == ["cuda"]:
                self._driver = (self._driver[0], int(words[1]))
            elif words[:1] == ["gpu"]:
                self._gpus.append((words[1], " ".join(words[3:]), int(words[2])))
            elif words:
                self._extra.setdefault(words[0], []).append(line)

    def set_gpus(self, gpus: list[tuple[str, str, int]]) -> None:
        """[(uuid, name, memory_bytes), ...] in index order."""
        self._gpus = [(u, n, int(m)) for u, n, m in gpus]
        self._write_config()

    @property
    def gpus(self) -> list[tuple[str, str, int]]:
        return list(self._gpus)

    def set_driver(self, version: str = "570.86.10", cuda: int = 12080) -> None:
        self._driver = (version, cuda)
        self._write_config()

    def set_mig(self, index: int, on: bool, pending: bool | None = None) -> None:
        pend = on if pending is None else pending
        self._extra["mig"] = [ln for ln in self._extra.get("mig", []) if ln.split()[1] != str(index)]
        self._extra["mig"].append(f"mig {index} {int(on)} {int(pend)}")
        self._write_config()

    def set_mps(self, pids: list[int], index: int = 0) -> None:
        """MPS clients NVML lists on GPU ``index``."""
        self._extra["mps"] = [ln for ln in self._extra.get("mps", []) if ln.split()[1] != str(index)]
        if pids:
            self._extra["mps"].append(f"mps {index} " + " ".join(map(str, pids)))
        self._write_config()

    def set_lost(self, index: int, lost: bool = True) -> None:
        """NVML answers GPU_IS_LOST for every query about GPU ``index``."""
        self._extra["lost"] = [ln for ln in self._extra.get("lost", []) if ln.split()[1] != str(index)]
        if lost:
            self._extra["lost"].append(f"lost {index}")
        self._write_config()

    def set_temperature(self, index: int, celsius: int) -> None:
        self._extra["temp"] = [ln for ln in self._extra.get("temp", []) if ln.split()[1] != str(index)]
        self._extra["temp"].append(f"temp {index} {int(celsius)}")
        self._write_config()

    def xid(self, index: int, xid: int) -> None:
        """An XID event NVML delivers on GPU ``index`` to a registered event set."""
        with open(self.dir / "xids", "a") as f:
            f.write(f"{index} {xid}\n")

    def fail(self, call: str, code: int = CUDA_ERROR_UNKNOWN, times: int = 1, leave_state: str | None = None,
             delay_s: float = 0.0) -> None:
        """The next ``times`` (-1: every) ``call``s fail with ``code`` without reaching the process;
        with ``leave_state`` the process is first put in that state (e.g. a checkpoint that fails
        half-way: "failed"); ``delay_s``: the call takes that long before it fails."""
        if call not in CALLS:
            raise FakeGpuError(f"unknown call {call!r} (one of {', '.join(CALLS)})")
        if leave_state is not None and leave_state not in STATES:
            raise FakeGpuError(f"unknown state {leave_state!r} (one of {', '.join(STATES)})")
        (self.dir / "fail").mkdir(exist_ok=True)
        (self.dir / "fail" / call).write_text(f"{code} {times} {leave_state or '-'} {int(delay_s * 1000)}\n")

    def hang_lock(self, seconds: float, code: int = CUDA_ERROR_TIMEOUT) -> None:
        """The next lock blocks for ``seconds`` and then fails with ``code`` (a driver that hangs)."""
        self.fail("lock", code=code, delay_s=seconds)

    def clear_failures(self) -> None:
        shutil.rmtree(self.dir / "fail", ignore_errors=True)

    # ------------------------------------------------------------ reading it back

    def api(self) -> CudaApi:
        """The fake libcuda's checkpoint calls in this process (ctypes, as the product loads it).
        The library reads REVENANT_FAKEGPU_DIR from this process's environment on every call."""
        if os.environ.get("REVENANT_FAKEGPU_DIR") != str(self.dir):
            raise FakeGpuError("the fake libcuda reads REVENANT_FAKEGPU_DIR: set it to FakeGpu.dir in this "
                               "process (monkeypatch.setenv) before calling it in-process")
        return CudaApi(ctypes.CDLL(str(self.libcuda)))

    def state(self, pid: int) -> str:
        """The CUDA state of ``pid`` through the cuda-checkpoint binary ("running", ...);
        raises FakeGpuError with the binary's message when it fails."""
        out = self.checkpoint_tool("--get-state", "--pid", str(pid))
        if out.returncode != 0:
            raise FakeGpuError(out.stderr.strip())
        return out.stdout.strip()

    def checkpoint_tool(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run the fake cuda-checkpoint with this state dir."""
        return subprocess.run([str(self.cuda_checkpoint), *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env()})

    def device_memory(self) -> dict[str, list[Path]]:
        """GPU uuid -> the device memory files on it (one per CUDA process holding memory there)."""
        return {uuid: sorted((self.dir / f"gpu-{uuid}").glob("*.mem")) for uuid, _, _ in self._gpus}

    def device_processes(self) -> dict[str, list[tuple[int, int]]]:
        """GPU uuid -> [(pid, used bytes)] as NVML reports them (through the fake libnvidia-ml)."""
        code = ("import json, pynvml\npynvml.nvmlInit()\nout = {}\n"
                "for i in range(pynvml.nvmlDeviceGetCount()):\n"
                "    h = pynvml.nvmlDeviceGetHandleByIndex(i)\n"
                "    out[pynvml.nvmlDeviceGetUUID(h)] = [(p.pid, p.usedGpuMemory) for p in "
                "pynvml.nvmlDeviceGetComputeRunningProcesses(h)]\n"
                "print(json.dumps(out))\n")
        import json
        import sys

        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                             env={**os.environ, **self.env()})
        return {k: [tuple(p) for p in v] for k, v in json.loads(out.stdout).items()}

    @staticmethod
    def counter(mem: Path) -> int:
        """The counter in a device memory file."""
        return int.from_bytes(mem.read_bytes()[:8], "little", signed=True)


class CudaApi:
    """Thin ctypes calls into (fake or real) libcuda: each returns the CUresult, getters a pair."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def error_name(self, code: int) -> str:
        p = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(p))
        return (p.value or b"?").decode()

    def driver_version(self) -> int:
        v = ctypes.c_int()
        self.lib.cuDriverGetVersion(ctypes.byref(v))
        return v.value

    def get_state(self, pid: int) -> tuple[int, str]:
        s = ctypes.c_int(-1)
        rc = self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(s))
        return rc, (STATES[s.value] if rc == 0 else "")

    def lock(self, pid: int, timeout_ms: int = 0) -> int:
        args = _LockArgs(timeoutMs=timeout_ms)
        return self.lib.cuCheckpointProcessLock(pid, ctypes.byref(args))

    def checkpoint(self, pid: int) -> int:
        return self.lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(_Args()))

    def restore(self, pid: int, remap: dict[str, str] | None = None) -> int:
        args = _RestoreArgs()
        pairs = (_Pair * max(1, len(remap or {})))()
        for i, (old, new) in enumerate((remap or {}).items()):
            pairs[i].oldUuid[:] = list(uuid_bytes(old))
            pairs[i].newUuid[:] = list(uuid_bytes(new))
        if remap:
            args.gpuPairs, args.gpuPairsCount = pairs, len(remap)
        return self.lib.cuCheckpointProcessRestore(pid, ctypes.byref(args))

    def unlock(self, pid: int) -> int:
        return self.lib.cuCheckpointProcessUnlock(pid, ctypes.byref(_Args()))

    def restore_tid(self, pid: int) -> tuple[int, int]:
        tid = ctypes.c_int(0)
        rc = self.lib.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid))
        return rc, tid.value


def free_port(span: int = 1) -> int:
    """A UDP port on 127.0.0.1 free now, with the ``span - 1`` above it (a counter's children)."""
    import socket

    for _ in range(50):
        socks = []
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            for i in range(1, span):
                t = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                t.bind(("127.0.0.1", port + i))
                socks.append(t)
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free UDP port")


def counter_request(port: int, command: str = "inc", timeout: float = 10) -> str:
    """One command to a gpucounter.py on 127.0.0.1:``port``, and its reply ("101", ...).  Sent
    with a request id and sent again every half second until answered: the counter answers a
    retried request again and never runs it twice (a restore drops a datagram queued at the
    dump: criu keeps no UDP queue).  Raises TimeoutError when none comes in time."""
    import socket
    import time
    import uuid

    rid = uuid.uuid4().hex
    deadline = time.monotonic() + timeout
    # Bound first, never to the counter's port: the request may go out before the counter has
    # bound it, and a socket the kernel gave that very port would hear its own request.
    unlucky = []
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        if sock.getsockname()[1] != port:
            break
        unlucky.append(sock)  # held (so the next bind gets another port), closed below
    for other in unlucky:
        other.close()
    with sock as s:
        s.settimeout(0.5)
        while time.monotonic() < deadline:
            s.sendto(f"{command} {rid}".encode(), ("127.0.0.1", port))
            try:
                return s.recv(64).decode().strip()
            except (socket.timeout, ConnectionRefusedError):
                continue
    raise TimeoutError(f"gpucounter on port {port} did not answer {command!r} within {timeout:g}s")
