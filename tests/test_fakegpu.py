"""The fake GPU kit (tests/fakegpu, tests/jobs/gpucounter.py): the CUDA checkpoint state machine
through the fake libcuda and the fake cuda-checkpoint, failure injection, GPU remapping, the
fake NVML through pynvml, and a real criu dump and restore of a checkpointed CUDA process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakegpu import (CUDA_ERROR_ILLEGAL_STATE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NO_DEVICE,
                     CUDA_ERROR_TIMEOUT, GPUCOUNTER, FakeGpu, FakeGpuError, build, counter_request, free_port)

pytestmark = pytest.mark.criu

REPO = Path(__file__).resolve().parent.parent
CRIU = str(Path(sys.executable).parent / "criu")
GPU_A = ("GPU-11111111-2222-3333-4444-555555555555", "NVIDIA H100 80GB HBM3", 80 * 1024**3)
GPU_B = ("GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "NVIDIA H100 80GB HBM3", 80 * 1024**3)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fakegpu-build")


@pytest.fixture
def gpu(build_dir, tmp_path, monkeypatch) -> FakeGpu:
    fake = build(build_dir, state=tmp_path / "gpu")
    fake.set_gpus([GPU_A, GPU_B])
    monkeypatch.setenv("REVENANT_FAKEGPU_DIR", str(fake.dir))
    return fake


def send(port: int, message: str = "inc", timeout: float = 10) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(message.encode(), ("127.0.0.1", port))
        return s.recv(100).decode().strip()


def wait_for(cond, timeout: float = 30, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class App:
    """gpucounter.py in a session of its own, stdio to files (so criu needs no --shell-job)."""

    def __init__(self, gpu: FakeGpu, tmp: Path, *args: str) -> None:
        self.port = free_port(4)
        self.out = tmp / f"app-{self.port}.out"
        self.err = tmp / f"app-{self.port}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(GPUCOUNTER), "--port", str(self.port), *args],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         start_new_session=True, env={**os.environ, **gpu.env()})
        self.pid = self.proc.pid
        wait_for(lambda: self._ready(gpu), what=f"gpucounter to start: {self.err}")

    def _ready(self, gpu: FakeGpu) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"gpucounter exited: {self.err.read_text()}")
        try:
            return gpu.state(self.pid) == "running"
        except FakeGpuError:
            return False

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)


@pytest.fixture
def apps(gpu, tmp_path):
    started: list[App] = []

    def start(*args: str) -> App:
        app = App(gpu, tmp_path, *args)
        started.append(app)
        return app

    yield start
    for app in started:
        app.kill()


def tool(gpu: FakeGpu, *args: str) -> subprocess.CompletedProcess:
    return gpu.checkpoint_tool(*args)


# ------------------------------------------------------------------ the state machine


def test_state_machine_through_the_library_keeps_the_counter(gpu, apps):
    app = apps("--device-mib", "2")
    cuda, pid = gpu.api(), app.pid
    assert cuda.driver_version() == 12080
    assert cuda.error_name(CUDA_ERROR_TIMEOUT) == "CUDA_ERROR_TIMEOUT"
    assert send(app.port) == "101"
    assert cuda.get_state(pid) == (0, "running")
    # Only running -lock-> locked -checkpoint-> checkpointed -restore-> locked -unlock-> running.
    assert cuda.checkpoint(pid) == cuda.unlock(pid) == cuda.restore(pid) == CUDA_ERROR_ILLEGAL_STATE
    assert cuda.lock(pid, 5000) == 0
    assert cuda.get_state(pid) == (0, "locked")
    assert cuda.lock(pid) == cuda.restore(pid) == CUDA_ERROR_ILLEGAL_STATE
    (mem,) = gpu.device_memory()[GPU_A[0]]
    assert mem.stat().st_size == 8 + 2 * 1024 * 1024 and gpu.counter(mem) == 101
    assert cuda.checkpoint(pid) == 0
    assert cuda.get_state(pid) == (0, "checkpointed")
    assert not mem.exists()  # the GPU is released: device memory is in the process
    assert cuda.checkpoint(pid) == cuda.unlock(pid) == cuda.lock(pid) == CUDA_ERROR_ILLEGAL_STATE
    assert cuda.restore(pid) == 0 and cuda.get_state(pid) == (0, "locked")
    assert gpu.counter(mem) == 101
    assert cuda.unlock(pid) == 0 and cuda.get_state(pid) == (0, "running")
    assert send(app.port) == "102"
    rc, tid = cuda.restore_tid(pid)
    assert rc == 0 and tid != pid and (Path(f"/proc/{pid}/task/{tid}")).exists()
    # Not a CUDA process, no process at all: the real driver's answer.
    assert cuda.get_state(os.getpid())[0] == CUDA_ERROR_INVALID_VALUE
    assert cuda.lock(2**22 + 12345) == CUDA_ERROR_INVALID_VALUE


def test_the_app_blocks_while_locked(gpu, apps):
    app = apps()
    cuda = gpu.api()
    assert cuda.lock(app.pid, 5000) == 0
    with pytest.raises(socket.timeout):
        send(app.port, timeout=0.5)  # its kernel waits for the unlock
    assert cuda.unlock(app.pid) == 0
    # The blocked increment ran after the unlock; the next one follows it.
    assert send(app.port) == "102"
    assert app.out.read_text().split() == ["101", "102"]


def test_the_binary_drives_the_same_state_machine(gpu, apps):
    app = apps()
    pid = str(app.pid)
    help_text = tool(gpu, "--help").stdout
    assert "Version 570.86.10" in help_text and "--action" in help_text and "--device-map" in help_text
    assert tool(gpu, "--get-state", "--pid", pid).stdout == "running\n"
    bad = tool(gpu, "--action", "unlock", "--pid", pid)
    assert bad.returncode == 1 and bad.stderr == f"Could not unlock process {pid}: CUDA_ERROR_ILLEGAL_STATE\n"
    for action, state in (("lock", "locked"), ("checkpoint", "checkpointed"), ("restore", "locked"),
                          ("unlock", "running")):
        assert tool(gpu, "--action", action, "--pid", pid).returncode == 0
        assert tool(gpu, "--get-state", "--pid", pid).stdout == f"{state}\n"
    assert tool(gpu, "--toggle", "--pid", pid).returncode == 0
    assert gpu.state(app.pid) == "checkpointed"
    assert tool(gpu, "--toggle", "--pid", pid).returncode == 0
    assert gpu.state(app.pid) == "running"
    tid = tool(gpu, "--get-restore-tid", "--pid", pid)
    assert tid.returncode == 0 and Path(f"/proc/{pid}/task/{tid.stdout.strip()}").exists()
    assert send(app.port) == "101"
    nobody = tool(gpu, "--get-state", "--pid", str(os.getpid()))
    assert nobody.returncode == 1 and "CUDA_ERROR_INVALID_VALUE" in nobody.stderr


def test_an_old_driver_offers_only_toggle(gpu, apps):
    app = apps()
    gpu.set_driver("550.54.15", 12040)
    help_text = tool(gpu, "--help").stdout
    assert "Version 550.54.15" in help_text and "--toggle" in help_text and "--action" not in help_text
    refused = tool(gpu, "--action", "lock", "--pid", str(app.pid))
    assert refused.returncode == 1 and "--action" in refused.stderr
    assert tool(gpu, "--toggle", "--pid", str(app.pid)).returncode == 0
    # An older libcuda lacks the checkpoint entry points altogether.
    import ctypes

    old = ctypes.CDLL(str(gpu.libdir_noapi / "libcuda.so.1"))
    assert not hasattr(old, "cuCheckpointProcessLock") and hasattr(old, "cuDriverGetVersion")


def test_a_hung_kernel_makes_the_lock_time_out(gpu, apps):
    app = apps()
    assert send(app.port, "hang") == "hang"
    out = tool(gpu, "--action", "lock", "--pid", str(app.pid), "--timeout", "200")
    assert out.returncode == 1 and out.stderr == f"Could not lock process {app.pid}: CUDA_ERROR_TIMEOUT\n"
    assert gpu.state(app.pid) == "running"
    assert send(app.port) == "101"  # it keeps running
    assert send(app.port, "unhang") == "unhang"
    assert gpu.api().lock(app.pid, 2000) == 0


def test_failure_injection(gpu, apps):
    app = apps()
    cuda, pid = gpu.api(), app.pid
    gpu.fail("lock", code=999, times=2)
    assert cuda.lock(pid) == cuda.lock(pid) == 999
    assert cuda.get_state(pid) == (0, "running")
    assert cuda.lock(pid) == 0
    # A checkpoint that fails leaves the process locked, as a refused step does...
    gpu.fail("checkpoint", code=CUDA_ERROR_NO_DEVICE)
    assert cuda.checkpoint(pid) == CUDA_ERROR_NO_DEVICE and cuda.get_state(pid) == (0, "locked")
    # ... or, if asked, in the state a half-done one leaves.
    gpu.fail("checkpoint", code=999, leave_state="failed")
    assert cuda.checkpoint(pid) == 999 and cuda.get_state(pid) == (0, "failed")
    assert cuda.unlock(pid) == CUDA_ERROR_ILLEGAL_STATE
    gpu.fail("get_state", code=3)
    out = tool(gpu, "--get-state", "--pid", str(pid))
    assert out.returncode == 1 and "CUDA_ERROR_NOT_INITIALIZED" in out.stderr
    with pytest.raises(FakeGpuError, match="unknown call"):
        gpu.fail("freeze")


def test_restore_remaps_device_memory_to_another_gpu(gpu, apps):
    app = apps()
    cuda, pid = gpu.api(), app.pid
    assert send(app.port) == "101"
    assert cuda.lock(pid) == 0 and cuda.checkpoint(pid) == 0
    unknown = "GPU-99999999-9999-9999-9999-999999999999"
    gpu.set_gpus([GPU_B])  # the GPU it was on is gone
    assert cuda.restore(pid) == CUDA_ERROR_NO_DEVICE
    assert cuda.restore(pid, {GPU_A[0]: unknown}) == CUDA_ERROR_NO_DEVICE
    assert cuda.get_state(pid) == (0, "checkpointed")
    assert cuda.restore(pid, {GPU_A[0]: GPU_B[0]}) == 0
    (mem,) = gpu.device_memory()[GPU_B[0]]
    assert gpu.counter(mem) == 101
    assert cuda.unlock(pid) == 0 and send(app.port) == "102"
    # The binary's --device-map does the same (back to A).
    gpu.set_gpus([GPU_A, GPU_B])
    for action in ("lock", "checkpoint"):
        assert tool(gpu, "--action", action, "--pid", str(pid)).returncode == 0
    out = tool(gpu, "--action", "restore", "--pid", str(pid), "--device-map", f"{GPU_B[0]}={GPU_A[0]}")
    assert out.returncode == 0, out.stderr
    assert gpu.device_memory() == {GPU_A[0]: [mem.parent.parent / f"gpu-{GPU_A[0]}" / mem.name], GPU_B[0]: []}


# ------------------------------------------------------------------ NVML


def test_nvml_lists_the_processes_holding_device_memory(gpu, apps):
    app = apps("--children", "1", "--device-mib", "1")
    child = wait_for(lambda: [p for p in subprocess.run(["pgrep", "-P", str(app.pid)], capture_output=True,
                                                        text=True).stdout.split()], what="the child")
    child_pid = int(child[0])
    wait_for(lambda: _state_or_none(gpu, child_pid) == "running", what="the child's context")
    assert send(app.port + 1) == "101" and send(app.port) == "101"
    procs = gpu.device_processes()
    assert sorted(pid for pid, _ in procs[GPU_A[0]]) == sorted([app.pid, child_pid]) and procs[GPU_B[0]] == []
    assert all(used == 8 + 1024 * 1024 for _, used in procs[GPU_A[0]])
    cuda = gpu.api()
    assert cuda.lock(app.pid) == 0 and cuda.checkpoint(app.pid) == 0
    assert [pid for pid, _ in gpu.device_processes()[GPU_A[0]]] == [child_pid]  # released
    assert gpu.state(child_pid) == "running"


def _state_or_none(gpu: FakeGpu, pid: int) -> str | None:
    try:
        return gpu.state(pid)
    except FakeGpuError:
        return None


MONITOR = """
import json
from revenant.agent.gpus.gpu import GpuMonitor, discover_gpus
kind, gpus = discover_gpus()
m = GpuMonitor()
m.start()
r = m.sample()
import pynvml
h = pynvml.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({"kind": kind, "names": [g.name for g in gpus], "driver": gpus[0].driver_version,
                  "monitor": m.kind, "errors": {str(k): v for k, v in m.errors.items()},
                  "temps": [x.temperature_c for x in r], "used": [x.memory_used_bytes for x in r],
                  "procs": [[p.pid for p in x.processes] for x in r], "xids": m.recent_xids(),
                  "mig": pynvml.nvmlDeviceGetMigMode(h),
                  "mps": [p.pid for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h)]}))
m.stop()
"""


def test_gpu_monitor_reads_the_fake_nvml(gpu, apps):
    app = apps()
    gpu.set_mig(0, False, pending=True)
    gpu.set_mps([4242, 4343])
    gpu.set_temperature(1, 91)
    out = subprocess.run([sys.executable, "-c", MONITOR], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **gpu.env()})
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["kind"] == doc["monitor"] == "nvml" and doc["names"] == [GPU_A[1], GPU_B[1]]
    assert doc["driver"] == "570.86.10" and doc["errors"] == {}
    assert doc["temps"] == [40.0, 91.0] and doc["used"] == [8 + 1024 * 1024, 0]
    assert doc["procs"] == [[app.pid], []]
    assert doc["mig"] == [0, 1] and doc["mps"] == [4242, 4343]


def test_without_a_state_dir_nvml_and_the_app_say_no_gpu(gpu, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REVENANT_FAKEGPU_DIR"}
    code = "from revenant.agent.gpus.gpu import discover_gpus; print(discover_gpus()[0])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**env, "LD_LIBRARY_PATH": str(gpu.libdir)})
    assert out.stdout.strip() == "none"
    app = subprocess.run([sys.executable, str(GPUCOUNTER), "--port", str(free_port())], capture_output=True,
                         text=True, timeout=60, env=env)
    assert app.returncode != 0 and "REVENANT_FAKEGPU_DIR is not set" in app.stderr
    assert app.stderr.count("\n") == 1


# ------------------------------------------------------------------ criu


def _criu(images: Path, *args: str) -> None:
    out = subprocess.run([CRIU, *args], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in images.glob("*.log"))
        raise AssertionError(f"criu {args[0]} failed: {out.stderr}\n{logs}")


def test_criu_dump_and_restore_of_a_checkpointed_cuda_process(gpu, apps, tmp_path):
    # Requests over UDP, as the seed's counter takes them: criu (4.2 or later) carries the socket.
    app = apps("--device-mib", "4")
    cuda, pid = gpu.api(), app.pid
    assert counter_request(app.port) == "101"
    assert cuda.lock(pid, 5000) == 0 and cuda.checkpoint(pid) == 0
    assert gpu.device_processes()[GPU_A[0]] == []
    images = tmp_path / "images"
    images.mkdir()
    _criu(images, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v2")
    app.proc.wait(10)  # criu dump kills the tree
    pidfile = tmp_path / "restored.pid"
    _criu(images, "restore", "-D", str(images), "-o", "restore.log", "-v2", "--restore-detached",
          "--pidfile", str(pidfile))
    new_pid = app.pid = int(pidfile.read_text())  # the fixture kills the restored tree
    # The CUDA state came back with the process's memory: checkpointed, device memory inside.
    assert cuda.get_state(new_pid) == (0, "checkpointed")
    assert gpu.device_memory()[GPU_A[0]] == []
    assert cuda.restore(new_pid) == 0 and cuda.unlock(new_pid) == 0
    assert counter_request(app.port) == "102"
    assert [pid for pid, _ in gpu.device_processes()[GPU_A[0]]] == [new_pid]
    assert app.out.read_text().split() == ["101", "102"]
