"""Each job's own IPC namespace (agent/running/launcher.py: ``unshare --ipc``): a job that holds System V
IPC objects (tests/jobs/sysv_shm.py: a shared-memory segment and a semaphore set) is checkpointed
and restored with them, and the host never sees them.  While jobs shared the host's IPC namespace,
criu refused such a job ("SysVIPC shmem map ... doesn't live in IPC ns").

First the engine and supervisor in-process with real criu (two supervisors on one storage, as two
nodes), then the whole cluster through the CLI: vacate, restart on the other node."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, wait_until
from helpers import until

from revenant.agent.storage.epochs import JobFiles
from revenant.messages import JobSpec

SYSV_JOB = REPO / "tests" / "jobs" / "sysv_shm.py"


@pytest.fixture
def key():
    """A System V key no other test run picks at the same time.  Should a job's objects land in
    the host's namespace after all (the failure these tests look for), they are removed."""
    key = random.SystemRandom().randrange(1 << 20, 1 << 30)
    yield key
    for kind, flag in (("shm", "-M"), ("sem", "-S")):
        if key in host_keys(kind):
            subprocess.run(["ipcrm", flag, str(key)], check=False, capture_output=True, timeout=10)


def host_keys(kind: str) -> set[int]:
    """The keys of the host's IPC namespace's ``kind`` objects (shm, sem, msg)."""
    lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
    return {int(line.split()[0]) for line in lines if line.strip()}


def own_ipc_namespace(pid: int) -> bool:
    return os.readlink(f"/proc/{pid}/ns/ipc") != os.readlink("/proc/self/ns/ipc")


def steps(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("step ")]


def expected_steps(n: int) -> list[str]:
    return [f"step {i} sem {i} pattern OK" for i in range(1, n + 1)]


@pytest.mark.criu
async def test_a_job_holding_sysv_shared_memory_and_semaphores_checkpoints_and_restores(supervisors, tmp_path, key):
    n1, n2 = supervisors("n1"), supervisors("n2")
    spec = JobSpec(id="1", argv=[sys.executable, str(SYSV_JOB), str(key), "100000", "0.02"], workdir=str(tmp_path))
    output = JobFiles(n1.storage, "1").output
    await n1.start(spec, 1)
    await until(lambda: len(steps(output.read_text())) >= 5)
    namespace = os.readlink(f"/proc/{n1.jobs['1'].pid}/ns/ipc")
    reply = await n1.checkpoint("1", 1, stop=True)  # a vacate: dumped, then stopped
    assert reply.epoch is not None and reply.epoch.n == 1
    await until(lambda: "1" not in n1.jobs)
    assert namespace != os.readlink("/proc/self/ns/ipc")
    at_dump = len(steps(output.read_text()))

    await n2.restore(spec, 2)
    await until(lambda: len(steps(output.read_text())) >= at_dump + 20)
    assert own_ipc_namespace(n2.jobs["1"].pid)
    # The segment's counter and pattern and the semaphore's count came back: one unbroken count.
    got = steps(output.read_text())
    assert got == expected_steps(len(got))
    assert key not in host_keys("shm") and key not in host_keys("sem")


STEPS = 150


@pytest.mark.cluster
def test_a_sysv_segment_survives_vacate_and_restart_on_another_node(make_cluster, key):
    cluster = make_cluster(2)
    job = cluster.cli("submit", "--node", "node-1", "--", sys.executable, str(SYSV_JOB), str(key), str(STEPS),
                      "0.05").stdout.strip()
    assert job.isdigit()
    output = cluster.storage / "jobs" / job / "output.log"
    assert wait_until(lambda: len(steps(output.read_text())) >= 20, timeout=30), output.read_text()
    running = cluster.job(job)
    assert own_ipc_namespace(running["pid"])
    assert key not in host_keys("shm") and key not in host_keys("sem")

    cluster.cli("checkpoint", "vacate", job)
    vacated = cluster.job(job)
    assert vacated["state"] == "vacated" and len(vacated["epochs"]) == 1
    at_vacate = len(steps(output.read_text()))
    assert at_vacate < STEPS  # the restart below takes over a job half done

    cluster.cli("checkpoint", "restart", job, "--node", "node-2")
    restored = cluster.job(job)
    assert restored["state"] == "running" and restored["node"] == "node-2"
    assert own_ipc_namespace(restored["pid"])
    assert key not in host_keys("shm") and key not in host_keys("sem")
    done = wait_until(lambda: (j := cluster.job(job))["state"] in ("completed", "failed") and j, timeout=60)
    assert done and done["state"] == "completed" and done["exit_code"] == 0, output.read_text()[-500:]

    # The job checked its pattern and its semaphore at every step, before and after the restart;
    # its counter, kept in the segment, went on with no gap and no repeat.
    lines = output.read_text().splitlines()
    assert lines[0].startswith(f"holding shm key {key} id ") and lines[-1] == "done"
    assert lines[1:-1] == expected_steps(STEPS)
    kinds = [e["kind"] for e in cluster.events() if e.get("type") == "job_event.v1" and e["job"] == job]
    assert kinds.count("vacated") == 1 and kinds.count("restored") == 1
    assert key not in host_keys("shm") and key not in host_keys("sem")
