"""A held file whose name was removed while the file keeps another name: what every POSIX
semaphore looks like (glibc's sem_open makes it under a temporary name, then links it to its
own), and so every Lock and Queue of Python's multiprocessing under the spawn and forkserver
start methods (agent/files/relink.py).  In the job's private /dev/shm it is given the name criu looks
for while criu dumps, the job comes back from a checkpoint that left it running, its output
exact, and neither the running job nor the restored one keeps that name; anywhere else it is
refused before the dump in one line, and the job runs on."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import msgspec
import pytest

from helpers import until

from revenant.agent.files.relink import RELINKED
from revenant.agent.processes.procs import signal_tree
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import RevenantError
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu

# The system's python, the script beside the workdir: a job whose command line names a path
# under /tmp keeps the host's /tmp (agent/running/launcher.py), and a checkout may lie under /tmp.
PYTHON = shutil.which("python3", path="/usr/bin:/bin")

WORKERS = """import multiprocessing as mp, sys, time
def work(q, lock, n):
    while True:
        with lock:
            n.value += 1
            q.put(n.value)
        time.sleep(0.02)
if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    q, lock, n = ctx.Queue(), ctx.Lock(), ctx.RawValue("i", 0)
    ctx.Process(target=work, args=(q, lock, n), daemon=True).start()
    while True:
        print(q.get(), flush=True)
"""

LINKED = """import os, sys, time
f = open("a", "w+")
os.link("a", "b")
os.unlink("a")
n = 0
while True:
    n += 1
    print(n, flush=True)
    time.sleep(0.02)
"""


@pytest.fixture
def wd():
    base = Path(tempfile.mkdtemp(prefix="revenant-linked-", dir="/var/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def relinked_names(pid: int) -> list[str]:
    return [n for n in os.listdir(f"/proc/{pid}/root/dev/shm") if n.endswith(" (deleted)")]


def assert_named_once(sup) -> None:
    """The newest epoch named each semaphore in /dev/shm by its removed name and one suffix."""
    files = JobFiles(sup.storage, "1")
    made = msgspec.json.decode((files.epoch_dir(files.committed()[-1]) / RELINKED).read_bytes())
    assert made and all(d == "/dev/shm" and n.startswith("sem.") and n.count(" (deleted)") == 1
                        for d, n, *_ in made), made


def numbers(out: Path) -> list[int]:
    return [int(x) for x in out.read_text().split()]


# Root's jobs: a user's job takes the same path, but cannot be dumped where the agent lacks
# CAP_SYS_RESOURCE, as here (tests/test_job_user.py).
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
async def test_python_multiprocessing_workers_come_back_from_a_checkpoint_that_left_them_running(
        wd, supervisors, method):
    (wd / "job.py").write_text(WORKERS)
    sup = supervisors("n1", storage=wd / "storage", allow_root_jobs=True)
    spec = JobSpec(id="1", argv=[PYTHON, str(wd / "job.py"), method], workdir=str(wd), user="root")
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, "1").output
    await until(lambda: len(numbers(out)) >= 10)
    await sup.checkpoint("1", 1, stop=False)
    assert_named_once(sup)
    assert not relinked_names(sup.jobs["1"].pid)  # gone from the running job again
    at = len(numbers(out))
    await until(lambda: len(numbers(out)) >= at + 10)  # on, past the epoch: the restore takes it back
    signal_tree(sup.jobs["1"].pid, 9)  # the node dies
    await until(lambda: "1" not in sup.jobs)
    await sup.restore(spec, 2)
    await until(lambda: len(numbers(out)) >= at + 30)
    assert not relinked_names(sup.jobs["1"].pid)  # nor in the restored one
    # Again from a restored job: it holds each file by the very name it held before, never a
    # longer one, however often it moves.
    for generation in (2, 3):
        await sup.checkpoint("1", generation, stop=True)
        assert_named_once(sup)
        await until(lambda: "1" not in sup.jobs)
        await sup.restore(spec, generation + 1)
        at = len(numbers(out))
        await until(lambda: len(numbers(out)) >= at + 10)
    got = numbers(out)
    assert got == list(range(1, len(got) + 1)), got  # nothing lost, nothing twice


async def test_a_linked_file_outside_the_jobs_own_tmpfs_is_refused_and_the_job_runs_on(wd, supervisors):
    (wd / "job.py").write_text(LINKED)
    sup = supervisors("n1", storage=wd / "storage", allow_root_jobs=True)
    spec = JobSpec(id="1", argv=[PYTHON, str(wd / "job.py")], workdir=str(wd), user="root")
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, "1").output
    await until(lambda: len(numbers(out)) >= 5)
    with pytest.raises(RevenantError) as refused:
        await sup.checkpoint("1", 1, stop=False)
    why = str(refused.value)
    assert why.startswith(f"checkpoint of 1 refused: the job holds {wd}/a, a file whose name was removed "
                          "while it keeps another name"), why
    assert "only in the job's own /tmp or /dev/shm" in why and len(why.splitlines()) == 1, why
    assert JobFiles(sup.storage, "1").committed() == []
    at = len(numbers(out))
    await until(lambda: len(numbers(out)) >= at + 5)  # resumed, unharmed
