"""The GPU engine step's logic against a state-machine double of the driver: which processes it
suspends, what it refuses before locking anything, and how each failure point is undone.
(tests/test_gpu_checkpoint.py runs the same step through the fake libcuda and cuda-checkpoint,
with real criu.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from revenant.agent.gpus.cuda import CHECKPOINTED, FAILED, LOCKED, RUNNING, CudaError
from revenant.agent.gpus.gpu import CudaProcess, GpuScan
from revenant.agent.gpus.gpustep import GpuStep, device_mappers, unsupported
from revenant.agent.pipeline.blockers import NotCheckpointable
from revenant.agent.pipeline.steps import DumpContext, RestoreContext
from revenant.agent.storage.epochs import EpochError, JobFiles, Manifest
from revenant.messages import Capabilities, GpuInfo, JobGpu

pytestmark = pytest.mark.unit

H200 = "NVIDIA H200"
U0, U1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"
TRANSITIONS = {("lock", RUNNING): LOCKED, ("checkpoint", LOCKED): CHECKPOINTED,
               ("restore", CHECKPOINTED): LOCKED, ("unlock", LOCKED): RUNNING}


class Driver:
    """The driver's per-process state machine; ``fail[(call, pid)]`` makes that call fail
    (``leave`` the state it leaves behind: by default the state does not change)."""

    name = "driver_api"
    remap = True

    def __init__(self, pids: list[int]) -> None:
        self.states = {pid: RUNNING for pid in pids}
        self.calls: list[tuple[str, int]] = []
        self.fail: dict[tuple[str, int], str | None] = {}
        self.remaps: list[dict[str, str] | None] = []

    def state(self, pid: int) -> str:
        if pid not in self.states:  # as the driver answers for a process with no CUDA state
            raise CudaError(f"cuCheckpointProcessGetState of pid {pid} failed: CUDA_ERROR_NOT_FOUND")
        return self.states[pid]

    def _do(self, call: str, pid: int) -> None:
        self.calls.append((call, pid))
        if (call, pid) in self.fail:
            leave = self.fail.pop((call, pid))
            if leave:
                self.states[pid] = leave
            raise CudaError(f"CUDA {call} of pid {pid} failed: CUDA_ERROR_{'TIMEOUT' if call == 'lock' else 'UNKNOWN'}")
        nxt = TRANSITIONS.get((call, self.states[pid]))
        if nxt is None:
            raise CudaError(f"CUDA {call} of pid {pid} failed: CUDA_ERROR_ILLEGAL_STATE")
        self.states[pid] = nxt

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._do("lock", pid)

    def checkpoint(self, pid: int) -> None:
        self._do("checkpoint", pid)

    def restore(self, pid: int, remap: dict[str, str] | None = None) -> None:
        self.remaps.append(remap)
        self._do("restore", pid)

    def unlock(self, pid: int) -> None:
        self._do("unlock", pid)

    def restore_tid(self, pid: int) -> int:
        if ("restore_tid", pid) in self.fail:
            raise CudaError(f"CUDA restore thread query of pid {pid} failed: CUDA_ERROR_INVALID_VALUE")
        return pid


def _caps(*uuids: str, remap: bool = True, mechanism: str = "driver_api") -> Capabilities:
    return Capabilities(hostname="n2", gpu_checkpoint=mechanism, gpu_remap=remap,
                        gpus=[GpuInfo(index=i, name=H200, uuid=u, driver_version="570.86.10")
                              for i, u in enumerate(uuids)])


def _step(driver: Driver | None, scan: GpuScan, *, tree: list[int], maps: dict[int, str] | None = None,
          caps: Capabilities | None = None) -> GpuStep:
    return GpuStep(driver, "no libcuda here", lambda: scan, lambda: caps or _caps(U0), lock_timeout_s=10,
                   maps=lambda pid: (maps or {}).get(pid, ""), to_ns_pid=lambda pid: pid - 1000,
                   tree=lambda root: tree, kill=KILLED.append)


KILLED: list[int] = []


def _scan(*pids: int, mig: set[int] | None = None, mps: set[int] | None = None) -> GpuScan:
    return GpuScan([CudaProcess(pid, 0, U0, H200, 2**30) for pid in pids], mig or set(), mps or set(), "570.86.10")


def _ctx(tmp_path: Path, stop: bool = False) -> DumpContext:
    files = JobFiles(tmp_path / "storage", "j1")
    m = Manifest(job="j1", epoch=0, generation=1, node="n1", created_at=0.0, criu_version="4.1.1", kernel="k")
    return DumpContext(job="j1", generation=1, pid=os.getpid(), files=files, workdir=tmp_path, stop=stop, manifest=m)


async def test_a_job_without_cuda_processes_is_left_alone(tmp_path: Path) -> None:
    driver = Driver([2001])
    step = _step(driver, _scan(2001), tree=[1001, 1002])  # the CUDA process is another job's
    ctx = _ctx(tmp_path)
    await step.before_dump(ctx)
    await step.after_dump(ctx)
    assert driver.calls == [] and ctx.manifest.gpus == []


async def test_every_process_is_locked_before_any_is_checkpointed_and_resumed_after_the_dump(tmp_path: Path) -> None:
    driver = Driver([1002, 1003])
    step = _step(driver, _scan(1002, 1003), tree=[1001, 1002, 1003])
    ctx = _ctx(tmp_path)
    await step.before_dump(ctx)
    assert driver.calls == [("lock", 1002), ("lock", 1003), ("checkpoint", 1002), ("checkpoint", 1003)]
    assert driver.states == {1002: CHECKPOINTED, 1003: CHECKPOINTED}
    assert ctx.manifest.gpus == [JobGpu(index=0, uuid=U0, name=H200, memory_bytes=2 * 2**30)]
    assert ctx.manifest.gpu_driver == "570.86.10" and ctx.manifest.cuda_pids == {2: [U0], 3: [U0]}
    assert any("CUDA suspended in 2 process(es)" in n for n in ctx.notes)
    await step.after_dump(ctx)  # leave running: back on the GPU at once, same GPUs
    assert driver.states == {1002: RUNNING, 1003: RUNNING} and driver.remaps == [None, None]


async def test_a_vacate_leaves_the_job_suspended_for_the_kill(tmp_path: Path) -> None:
    driver = Driver([1002])
    step = _step(driver, _scan(1002), tree=[1001, 1002])
    ctx = _ctx(tmp_path, stop=True)
    await step.before_dump(ctx)
    await step.after_dump(ctx)
    assert driver.states == {1002: CHECKPOINTED}


@pytest.mark.parametrize("call, pid, leave, expect_calls_after", [
    # lock of the second fails: the first is unlocked, the second was never locked
    ("lock", 1003, None, [("unlock", 1002)]),
    # checkpoint of the second fails, leaving it locked: first restored and unlocked, second unlocked
    ("checkpoint", 1003, None, [("restore", 1002), ("unlock", 1002), ("unlock", 1003)]),
    # the driver half-did it: checkpoint failed but the process reports checkpointed
    ("checkpoint", 1003, CHECKPOINTED, [("restore", 1002), ("unlock", 1002), ("restore", 1003), ("unlock", 1003)]),
])
async def test_a_failed_suspend_brings_every_process_back_from_the_state_it_is_in(
        tmp_path: Path, call: str, pid: int, leave: str | None, expect_calls_after: list) -> None:
    driver = Driver([1002, 1003])
    driver.fail[(call, pid)] = leave
    step = _step(driver, _scan(1002, 1003), tree=[1001, 1002, 1003])
    ctx = _ctx(tmp_path)
    with pytest.raises(CudaError) as err:
        await step.before_dump(ctx)
    if call == "lock":
        assert "gpu_lock_timeout_s = 10 s" in str(err.value)
    before = len(driver.calls)
    await step.on_dump_failed(ctx)
    assert driver.calls[before:] == expect_calls_after
    assert set(driver.states.values()) == {RUNNING}


async def test_a_failed_criu_dump_or_commit_resumes_every_process(tmp_path: Path) -> None:
    for stop in (False, True):
        driver = Driver([1002, 1003])
        step = _step(driver, _scan(1002, 1003), tree=[1001, 1002, 1003])
        ctx = _ctx(tmp_path, stop=stop)
        await step.before_dump(ctx)
        if not stop:
            await step.after_dump(ctx)  # a commit that fails afterwards finds them running: nothing to do
        await step.on_dump_failed(ctx)
        assert set(driver.states.values()) == {RUNNING}


async def test_a_failed_resume_after_the_dump_fails_the_checkpoint_and_is_retried_by_the_undo(tmp_path: Path) -> None:
    driver = Driver([1002])
    step = _step(driver, _scan(1002), tree=[1001, 1002])
    ctx = _ctx(tmp_path)
    await step.before_dump(ctx)
    driver.fail[("restore", 1002)] = None
    with pytest.raises(CudaError):
        await step.after_dump(ctx)
    await step.on_dump_failed(ctx)
    assert driver.states == {1002: RUNNING}


async def test_what_only_the_driver_can_refuse_comes_back_in_its_words_with_a_hint(tmp_path: Path) -> None:
    class Managed(Driver):
        def checkpoint(self, pid: int) -> None:
            self.calls.append(("checkpoint", pid))
            raise CudaError(f"CUDA checkpoint of pid {pid} failed: CUDA_ERROR_NOT_SUPPORTED: operation not supported")

    driver = Managed([1002])
    step = _step(driver, _scan(1002), tree=[1001, 1002])
    ctx = _ctx(tmp_path)
    with pytest.raises(CudaError, match="CUDA_ERROR_NOT_SUPPORTED: operation not supported .*managed/UVM"):
        await step.before_dump(ctx)
    await step.on_dump_failed(ctx)
    assert driver.states == {1002: RUNNING}


async def test_a_process_in_the_failed_state_is_reported_not_looped_on(tmp_path: Path) -> None:
    driver = Driver([1002])
    step = _step(driver, _scan(1002), tree=[1001, 1002])
    ctx = _ctx(tmp_path)
    await step.before_dump(ctx)
    driver.states[1002] = FAILED
    KILLED.clear()
    with pytest.raises(CudaError, match="was killed, its CUDA state could not be resumed .*state is failed"):
        await step.on_dump_failed(ctx)
    assert KILLED == [ctx.pid]  # wedged for ever otherwise: restored from its newest epoch instead


async def test_a_transition_the_driver_does_not_confirm_is_an_error(tmp_path: Path) -> None:
    class Liar(Driver):
        def lock(self, pid: int, timeout_ms: int) -> None:
            self.calls.append(("lock", pid))  # says yes, does nothing

    driver = Liar([1002])
    step = _step(driver, _scan(1002), tree=[1001, 1002])
    with pytest.raises(CudaError, match="reports running, not locked"):
        await step.before_dump(_ctx(tmp_path))


async def test_a_node_without_a_mechanism_refuses_a_gpu_job_before_touching_it(tmp_path: Path) -> None:
    step = _step(None, _scan(1002), tree=[1001, 1002])
    with pytest.raises(CudaError, match="cannot checkpoint CUDA: no libcuda here"):
        await step.before_dump(_ctx(tmp_path))


@pytest.mark.parametrize("scan, maps, pids, toggle, words", [
    (_scan(1002, mig={0}), {}, [1002], False, "MIG mode"),
    (_scan(1002, mps={1002}), {}, [1002], False, "MPS"),
    (_scan(1002, 1003), {1003: "7f00-7f10 r-xp 0 08:01 9 /usr/lib/libnccl.so.2\n"}, [1002, 1003], False,
     "multi-process NCCL"),
    (_scan(1002, 1003), {}, [1002, 1003], True, "only toggles one process"),
])
async def test_unsupported_jobs_are_refused_before_anything_is_locked(tmp_path: Path, scan, maps, pids, toggle,
                                                                     words) -> None:
    driver = Driver(pids)
    driver.toggle = toggle  # type: ignore[attr-defined]
    step = _step(driver, scan, tree=[1001, *pids], maps=maps)
    with pytest.raises(CudaError, match=words):
        await step.before_dump(_ctx(tmp_path))
    assert driver.calls == []
    procs = [p for p in scan.processes]
    assert words.split()[0] in (unsupported("j1", procs, scan, maps, driver) or "")


def _restored(tmp_path: Path, pid: int, remap: dict[str, str]) -> RestoreContext:
    files = JobFiles(tmp_path / "storage", "j1")
    m = Manifest(job="j1", epoch=3, generation=2, node="n1", created_at=0.0, criu_version="4.1.1", kernel="k",
                 gpus=[JobGpu(index=0, uuid=U0, name=H200, memory_bytes=2**30)], gpu_driver="570.86.10",
                 cuda_pids={2: [U0]})
    return RestoreContext(job="j1", generation=2, files=files, epoch_dir=tmp_path, workdir=tmp_path, manifest=m,
                          pid=pid, checked={"gpu": remap})


async def test_a_restore_resumes_the_restored_processes_found_by_their_pid_in_the_job_namespace(
        tmp_path: Path) -> None:
    driver = Driver([5002])
    driver.states[5002] = CHECKPOINTED  # as criu brings it back
    step = GpuStep(driver, "", lambda: GpuScan(), lambda: _caps(U1), to_ns_pid=lambda pid: {5001: 1, 5002: 2}[pid],
                   tree=lambda root: [5001, 5002])
    remap = step.check_restore(_restored(tmp_path, 5001, {}).manifest, tmp_path)
    assert remap == {U0: U1}  # this node's GPU has another UUID
    ctx = _restored(tmp_path, 5001, remap)
    await step.after_restore(ctx)
    assert driver.states == {5002: RUNNING} and driver.remaps == [{U0: U1}]
    assert any("remapped" in n for n in ctx.notes)


async def test_a_restore_without_the_process_or_onto_an_unfit_node_is_refused(tmp_path: Path) -> None:
    driver = Driver([5002])
    step = GpuStep(driver, "", lambda: GpuScan(), lambda: _caps(U1, remap=False), to_ns_pid=lambda pid: 7,
                   tree=lambda root: [5001])
    manifest = _restored(tmp_path, 5001, {}).manifest
    with pytest.raises(EpochError, match="needs GPU remapping"):
        step.check_restore(manifest, tmp_path)
    with pytest.raises(CudaError, match="has no process 2"):
        await step.after_restore(_restored(tmp_path, 5001, {}))
    none = GpuStep(None, "cuda-checkpoint not found", lambda: GpuScan(), lambda: _caps(U0))
    with pytest.raises(EpochError, match="cuda-checkpoint not found"):
        none.check_restore(manifest, tmp_path)
    assert step.check_restore(Manifest(job="j1", epoch=1, generation=1, node="n1", created_at=0.0,
                                       criu_version="4.1.1", kernel="k"), tmp_path) == {}


def test_a_remapping_names_every_checkpointed_gpu_those_that_stay_too(tmp_path: Path) -> None:
    u2 = "GPU-22222222-2222-2222-2222-222222222222"
    step = GpuStep(Driver([]), "", lambda: GpuScan(), lambda: _caps(U1, u2))
    m = Manifest(job="j1", epoch=3, generation=2, node="n1", created_at=0.0, criu_version="4.1.1", kernel="k",
                 gpus=[JobGpu(index=0, uuid=U0, name=H200), JobGpu(index=1, uuid=U1, name=H200)],
                 gpu_driver="570.86.10")
    assert step.check_restore(m, tmp_path) == {U0: u2, U1: U1}


async def test_a_suspend_cancelled_mid_lock_is_undone_after_the_lock_ends(tmp_path: Path) -> None:
    import asyncio
    import threading
    import time

    started = threading.Event()

    class Slow(Driver):
        def lock(self, pid: int, timeout_ms: int) -> None:
            started.set()
            time.sleep(0.3)  # a lock waiting for submitted work, in its worker thread
            super().lock(pid, timeout_ms)

    driver = Slow([1002])
    step = _step(driver, _scan(1002), tree=[1001, 1002])
    ctx = _ctx(tmp_path)
    task = asyncio.create_task(step.before_dump(ctx))
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()  # a drain's deadline, say
    with pytest.raises(asyncio.CancelledError):
        await task
    await step.on_dump_failed(ctx)  # waits for the lock still running, then unlocks
    assert driver.calls == [("lock", 1002), ("unlock", 1002)] and driver.states == {1002: RUNNING}


async def test_each_restored_process_gets_the_pairs_of_its_own_gpus(tmp_path: Path) -> None:
    u2 = "GPU-22222222-2222-2222-2222-222222222222"
    driver = Driver([5002, 5003])
    driver.states = {5002: CHECKPOINTED, 5003: CHECKPOINTED}
    step = GpuStep(driver, "", lambda: GpuScan(), lambda: _caps(U1, u2),
                   to_ns_pid=lambda pid: {5001: 1, 5002: 2, 5003: 3}[pid], tree=lambda root: [5001, 5002, 5003])
    ctx = _restored(tmp_path, 5001, {})
    ctx.manifest.gpus = [JobGpu(index=0, uuid=U0, name=H200), JobGpu(index=1, uuid=U1, name=H200)]
    ctx.manifest.cuda_pids = {2: [U0], 3: [U1]}
    ctx.checked["gpu"] = step.check_restore(ctx.manifest, tmp_path)
    await step.after_restore(ctx)
    assert driver.remaps == [{U0: u2}, None]  # the second process's GPU stays: no pairs for it
    assert set(driver.states.values()) == {RUNNING}


async def test_a_process_the_driver_does_not_know_is_refused_before_anything_is_locked(tmp_path: Path) -> None:
    driver = Driver([1002, 1003])
    driver.fail[("restore_tid", 1003)] = None
    step = _step(driver, _scan(1002, 1003), tree=[1001, 1002, 1003])
    with pytest.raises(CudaError, match="restore thread query of pid 1003 failed"):
        await step.before_dump(_ctx(tmp_path))
    assert driver.calls == []


UVM = "200600000-200800000 rw-s 00000000 00:05 612 /dev/nvidia-uvm\n"
LIBC = ("7f00-7f10 r-xp 00000000 08:01 9 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f10-7f20 rw-p 00000000 00:00 0 \n7f20-7f30 rw-p 00000000 00:00 0\n")


def test_the_processes_that_map_an_nvidia_device_are_found_by_their_maps() -> None:
    maps = {1: LIBC, 2: LIBC + UVM, 3: "7f00-7f10 rw-s 00000000 00:05 7 /dev/nvidiactl\n", 4: ""}
    assert device_mappers([1, 2, 3, 4], lambda pid: maps[pid]) == {2: "/dev/nvidia-uvm", 3: "/dev/nvidiactl"}


async def test_a_process_nvml_does_not_list_but_the_driver_knows_is_suspended_and_resumed_too(
        tmp_path: Path) -> None:
    driver = Driver([1002, 1003])
    step = _step(driver, _scan(1002), tree=[1001, 1002, 1003], maps={1003: LIBC + UVM})
    ctx = _ctx(tmp_path)
    await step.before_dump(ctx)
    assert driver.states == {1002: CHECKPOINTED, 1003: CHECKPOINTED}
    assert ctx.manifest.cuda_pids == {2: [U0], 3: []}
    await step.after_dump(ctx)
    assert driver.states == {1002: RUNNING, 1003: RUNNING}


async def test_a_forked_child_that_maps_the_gpu_without_cuda_state_is_refused_before_anything_is_locked(
        tmp_path: Path) -> None:
    driver = Driver([1002])  # 1003 maps the GPU (a DataLoader worker forked after CUDA started)
    step = _step(driver, _scan(1002), tree=[1001, 1002, 1003], maps={1003: LIBC + UVM})
    with pytest.raises(NotCheckpointable, match=r"process 1003 \(.*\) maps /dev/nvidia-uvm.*CUDA_ERROR_NOT_FOUND"
                                                r".*'spawn' or 'forkserver'"):
        await step.before_dump(_ctx(tmp_path))
    assert driver.calls == [] and driver.states == {1002: RUNNING}


async def test_a_job_whose_only_gpu_process_nvml_missed_is_restored_onto_the_gpu(tmp_path: Path) -> None:
    driver = Driver([1002])
    step = _step(driver, _scan(), tree=[1001, 1002], maps={1002: UVM})
    ctx = _ctx(tmp_path, stop=True)
    await step.before_dump(ctx)
    assert driver.states == {1002: CHECKPOINTED} and ctx.manifest.cuda_pids == {2: []}
    restored = _restored(tmp_path, 5001, {})
    restored.manifest.gpus, restored.manifest.cuda_pids = [], ctx.manifest.cuda_pids
    driver.states = {5002: CHECKPOINTED}
    step.ns_pid = lambda pid: pid - 5000
    step.tree = lambda root: [5001, 5002]
    await step.after_restore(restored)
    assert driver.states == {5002: RUNNING}
