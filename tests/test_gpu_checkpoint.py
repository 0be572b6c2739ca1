"""GPU jobs through the real engine and real criu, with the driver stood in (tests/fakegpu):
the fake libcuda loaded by the product's own ctypes code, or the fake cuda-checkpoint run by its
own subprocess code.  Every failure point leaves the job running on its GPU and the epoch failed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fakegpu import build, counter_request, free_port
from revenant.agent.gpus import cuda
from revenant.agent.gpus.gpu import CudaProcess, GpuScan
from revenant.agent.gpus.gpustep import GpuStep
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import RevenantError
from revenant.messages import Capabilities, EpochEvent, GpuInfo, JobEvent, JobSpec

pytestmark = pytest.mark.criu

GPUCOUNTER = Path(__file__).parent / "jobs" / "gpucounter.py"
NEW_UUID = "GPU-99999999-8888-7777-6666-555555555555"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    gpu = build(tmp_path / "fakegpu")
    for k, v in gpu.env().items():
        if k != "LD_LIBRARY_PATH":  # the product loads the fake libcuda by path here
            monkeypatch.setenv(k, v)
    return gpu


def _caps(fake, remap: bool = True, mechanism: str = "driver_api") -> Capabilities:
    return Capabilities(hostname="n1", gpu_checkpoint=mechanism, gpu_remap=remap,
                        gpus=[GpuInfo(index=i, name=name, uuid=u, memory_total_bytes=mem, driver_version=fake._driver[0])
                              for i, (u, name, mem) in enumerate(fake.gpus)])


def _scan(fake) -> GpuScan:
    """What NVML would list (the fake NVML itself is driven through pynvml by the agent in
    tests/test_gpu_cluster.py; in this process pynvml cannot be pointed at it)."""
    index = {u: (i, name) for i, (u, name, _) in enumerate(fake.gpus)}
    procs = [CudaProcess(pid, index[u][0], u, index[u][1], used)
             for u, held in fake.device_processes().items() if u in index for pid, used in held]
    return GpuScan(procs, set(), set(), fake._driver[0])


def _mechanism(fake, kind: str) -> cuda.Mechanism:
    return cuda.DriverApi.load(str(fake.libcuda)) if kind == "driver_api" else cuda.Binary.find(str(fake.cuda_checkpoint))


class Job:
    def __init__(self, sup, fake, tmp_path: Path, kind: str, remap: bool = True, job: str = "g1") -> None:
        self.sup, self.fake, self.job = sup, fake, job
        self.port = free_port()
        (tmp_path / "wd").mkdir(exist_ok=True)
        self.caps = _caps(fake, remap)
        self.step = GpuStep(_mechanism(fake, kind), "", lambda: _scan(fake), lambda: self.caps, lock_timeout_s=1.0)
        sup.engine.steps.insert(0, self.step)
        self.spec = JobSpec(id=job, argv=[sys.executable, str(GPUCOUNTER), "--port", str(self.port),
                                          "--device-mib", "2"], workdir=str(tmp_path / "wd"),
                            env={"REVENANT_FAKEGPU_DIR": fake.env()["REVENANT_FAKEGPU_DIR"]})
        self.generation = 1

    async def start(self) -> None:
        await self.sup.start(self.spec, self.generation)
        assert self.ask("peek", 30) == "100"

    def ask(self, command: str = "inc", timeout: float = 20) -> str:
        return counter_request(self.port, command, timeout=timeout)

    def pid(self) -> int:
        return self.sup.jobs[self.job].pid

    def cuda_pids(self) -> list[int]:
        return [pid for held in self.fake.device_processes().values() for pid, _ in held]


def _events(events: list, kind: str) -> list[EpochEvent]:
    return [e for e in events if isinstance(e, EpochEvent) and e.kind == kind]


@pytest.mark.parametrize("kind", ["driver_api", "binary"])
async def test_checkpoint_vacate_and_restore_keep_the_gpu_counter(tmp_path, supervisors, fake, kind):
    events: list = []
    j = Job(supervisors(scratch={}, events=events), fake, tmp_path, kind)
    await j.start()
    assert j.ask() == "101"
    await j.sup.checkpoint(j.job, 1, stop=False)  # leave running: back on its GPU at once
    (created,) = _events(events, "created")
    assert [g.uuid for g in created.gpus] == [fake.gpus[0][0]] and created.gpu_driver == "570.86.10"
    assert created.gpus[0].memory_bytes >= 2 * 2**20
    assert fake.state(j.cuda_pids()[0]) == "running" and j.ask() == "102"
    await j.sup.checkpoint(j.job, 1, stop=True)  # vacate at 102
    assert j.cuda_pids() == [] and j.job not in j.sup.jobs
    manifest = JobFiles(j.sup.storage, j.job).verify(2)
    assert manifest.gpus and manifest.cuda_pids
    (vacated,) = [e for e in events if isinstance(e, JobEvent) and e.kind == "vacated"]
    assert (vacated.epoch, vacated.gpus, vacated.gpu_driver) == (2, manifest.gpus, manifest.gpu_driver)
    await j.sup.restore(j.spec, 2)
    assert fake.state(j.cuda_pids()[0]) == "running"
    assert j.ask() == "103"


async def test_a_restore_onto_another_gpu_remaps_it_and_one_that_cannot_is_refused(tmp_path, supervisors, fake):
    fake.set_driver("580.65.06", 13000)  # CUDA 13.0: the restore arguments carry GPU pairs
    j = Job(supervisors(scratch={}), fake, tmp_path, "driver_api", remap=False)
    await j.start()
    assert j.ask() == "101"
    await j.sup.checkpoint(j.job, 1, stop=True)
    (_, name, mem), = fake.gpus
    fake.set_gpus([(NEW_UUID, name, mem)])  # the node now has another GPU of the same model
    j.caps = _caps(fake, remap=False)
    with pytest.raises(RevenantError, match="needs GPU remapping"):
        await j.sup.restore(j.spec, 2)
    j.caps = _caps(fake, remap=True)
    await j.sup.restore(j.spec, 3)
    assert list(fake.device_processes()) == [NEW_UUID]
    assert j.ask() == "102"


async def _fails_and_runs_on(j: Job, events: list, stop: bool, words: str) -> None:
    with pytest.raises(RevenantError) as err:
        await j.sup.checkpoint(j.job, 1, stop=stop)
    assert words in str(err.value)
    assert words in _events(events, "failed")[-1].error
    assert j.job in j.sup.jobs and JobFiles(j.sup.storage, j.job).committed() == []
    pids = j.cuda_pids()
    assert pids and j.fake.state(pids[0]) == "running"  # back on its GPU


@pytest.mark.parametrize("kind", ["driver_api", "binary"])
@pytest.mark.parametrize("stop", [False, True])
@pytest.mark.parametrize("call, leave, words", [
    ("get_restore_tid", None, "CUDA_ERROR_UNKNOWN"),  # refused before anything is locked
    ("lock", None, "CUDA_ERROR_UNKNOWN"),
    ("checkpoint", None, "CUDA_ERROR_UNKNOWN"),
    ("checkpoint", "checkpointed", "CUDA_ERROR_UNKNOWN"),  # the driver half-did it
])
async def test_a_failed_suspend_leaves_the_job_running_on_its_gpu(tmp_path, supervisors, fake, kind, stop, call,
                                                                 leave, words):
    events: list = []
    j = Job(supervisors(scratch={}, events=events), fake, tmp_path, kind)
    await j.start()
    fake.fail(call, leave_state=leave)
    await _fails_and_runs_on(j, events, stop, words)
    assert j.ask() == "101"


async def test_a_kernel_that_never_ends_times_the_lock_out(tmp_path, supervisors, fake):
    events: list = []
    j = Job(supervisors(scratch={}, events=events), fake, tmp_path, "driver_api")
    await j.start()
    j.ask("hang")
    await _fails_and_runs_on(j, events, True, "gpu_lock_timeout_s = 1 s")
    j.ask("unhang")
    assert j.ask() == "101"


@pytest.mark.parametrize("stop", [False, True])
async def test_a_failed_criu_dump_resumes_the_gpu(tmp_path, supervisors, fake, stop):
    events: list = []
    j = Job(supervisors(scratch={}, events=events), fake, tmp_path, "driver_api")
    await j.start()
    criu = tmp_path / "failing-criu"
    criu.write_text("#!/bin/sh\necho 'Error (criu/cr-dump.c:2093): Dumping FAILED on purpose' >&2\nexit 1\n")
    criu.chmod(0o755)
    j.sup.engine.criu = str(criu)
    await _fails_and_runs_on(j, events, stop, "Dumping FAILED on purpose")
    assert j.ask() == "101"


async def test_a_failed_resume_after_the_dump_fails_the_epoch_and_the_undo_resumes(tmp_path, supervisors, fake):
    events: list = []
    j = Job(supervisors(scratch={}, events=events), fake, tmp_path, "driver_api")
    await j.start()
    fake.fail("restore")  # the leave-running resume's restore
    await _fails_and_runs_on(j, events, False, "CUDA_ERROR_UNKNOWN")
    assert j.ask() == "101"


async def test_a_gpu_that_cannot_be_resumed_after_a_restore_kills_what_criu_restored(tmp_path, supervisors, fake):
    j = Job(supervisors(scratch={}), fake, tmp_path, "driver_api")
    await j.start()
    assert j.ask() == "101"
    await j.sup.checkpoint(j.job, 1, stop=True)
    fake.fail("restore")
    with pytest.raises(RevenantError, match="CUDA_ERROR_UNKNOWN"):
        await j.sup.restore(j.spec, 2)
    assert j.job not in j.sup.jobs and j.cuda_pids() == []  # nothing half-restored left running
    await j.sup.restore(j.spec, 3)
    assert j.ask() == "102"


async def test_a_gpu_job_is_restored_eagerly_on_a_node_that_restores_lazily(tmp_path, supervisors, fake):
    events: list = []
    j = Job(supervisors(scratch={}, events=events), fake, tmp_path, "driver_api")
    j.sup.engine.lazy = True
    await j.start()
    assert j.ask() == "101"
    await j.sup.checkpoint(j.job, 1, stop=True)
    await j.sup.restore(j.spec, 2)
    assert fake.state(j.cuda_pids()[0]) == "running" and j.ask() == "102"
    assert not [e for e in events if isinstance(e, JobEvent) and e.kind == "restore_completed"]
