"""Each job's own mount namespace with a private tmpfs /tmp and /dev/shm (agent/running/launcher.py), dumped
and restored by criu (agent/pipeline/criu.py): the rules without processes, then real jobs with real criu,
restored by a second supervisor (another node) on the same storage.

The criu tests keep their storage and workdirs under /var/tmp: a job whose storage lies under /tmp
(pytest's tmp_path) keeps the host's /tmp, by the launcher's rule."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from helpers import until

from revenant.agent.pipeline.criu import DUMP_MOUNTS, RESTORE_MOUNTS, dump_argv, restore_argv
from revenant.agent.running.jobs import Supervisor
from revenant.agent.storage.epochs import JobFiles
from revenant.agent.running.launcher import (INIT_NAME, INIT_SCRIPT, SCRATCH_EXIT, SCRATCH_NAME, given_paths, init_argv, scratch_plan,
                                     scratch_script)
from revenant.agent.processes.procs import signal_tree
from revenant.common.errors import ConfigError
from revenant.common.settings.config import AgentConfig, load_config
from revenant.messages import JobSpec

SIZES = {"/tmp": "8M", "/dev/shm": "4M"}

# Writes a token to its /tmp and /dev/shm, tries to overfill its 8 MiB /tmp, then prints both
# files' contents every 50 ms, numbered.
SCRATCH_JOB = r"""
import os, sys, time
tmp, shm = (f"{d}/revenant-scratch-{sys.argv[1]}" for d in ("/tmp", "/dev/shm"))
for path in (tmp, shm):
    with open(path, "w") as f:
        f.write(sys.argv[1])
try:
    with open("/tmp/too-big", "wb") as f:
        f.write(b"x" * (9 << 20))
    print("big write: fits", flush=True)
except OSError as exc:
    print("big write:", os.strerror(exc.errno), flush=True)
os.remove("/tmp/too-big")
i = 0
while True:
    with open(tmp) as a, open(shm) as b:
        print(f"tick {i} {a.read()} {b.read()}", flush=True)
    i += 1
    time.sleep(0.05)
"""

# Two processes meeting in /dev/shm: a shared memory block and two POSIX semaphores (which
# multiprocessing unlinks at once, keeping only the mappings).  Each round the worker adds 1 to
# the shared counter: "round N shared N", or the two went out of step.
MP_JOB = r"""
import multiprocessing as mp, sys, time
from multiprocessing import shared_memory

def worker(go, done, name):
    shm = shared_memory.SharedMemory(name=name)
    while True:
        go.acquire()
        shm.buf[:8] = (int.from_bytes(shm.buf[:8], "little") + 1).to_bytes(8, "little")
        done.release()

if __name__ == "__main__":
    shm = shared_memory.SharedMemory(create=True, size=4096, name=sys.argv[1])
    go, done = mp.Semaphore(0), mp.Semaphore(0)
    mp.Process(target=worker, args=(go, done, sys.argv[1]), daemon=True).start()
    i = 0
    while True:
        go.release()
        done.acquire()
        i += 1
        print(f"round {i} shared {int.from_bytes(shm.buf[:8], 'little')}", flush=True)
        time.sleep(0.02)
"""


# ------------------------------------------------------------------ the rules, without processes

@pytest.mark.unit
def test_a_tmpfs_that_would_hide_the_workdir_or_the_storage_stays_the_host_s():
    scratch = {"/tmp": "1G", "/dev/shm": "512M"}
    assert scratch_plan(scratch, ["/home/u/exp", "/var/lib/revenant"]) == (scratch, [])
    assert scratch_plan(scratch, ["/", "/srv/storage"]) == (scratch, [])  # / holds /tmp, and stays visible
    mounts, shared = scratch_plan(scratch, ["/home/u/exp", "/tmp/pytest-of-root/p0/storage"])
    assert mounts == {"/dev/shm": "512M"}
    assert shared == ["/tmp stays the host's: the job needs /tmp/pytest-of-root/p0/storage, which a private "
                      "/tmp would hide"]
    assert scratch_plan(scratch, ["/tmp", "/dev/shm/../shm/x"])[0] == {}  # itself, or under it once resolved
    assert scratch_plan({}, ["/tmp/w"]) == ({}, [])
    # The job's program and the absolute paths it is given that exist here count too (a virtual
    # environment in a checkout under /tmp): a private /tmp would hide them.
    program = os.path.realpath(sys.executable)
    assert given_paths([sys.executable, "-c", "/not/there", program], {"PATH": os.environ["PATH"]}) == [
        sys.executable, program]
    assert given_paths(["sh", "-c", "true"], {"PATH": "/usr/bin:/bin"})[0] in ("/usr/bin/sh", "/bin/sh")


@pytest.mark.unit
def test_the_scratch_script_mounts_each_tmpfs_then_becomes_the_init(tmp_path):
    out = tmp_path / "jobs" / "1" / "output.log"
    script = scratch_script({"/tmp": "1G", "/dev/shm": "10%"}, str(out))
    lines = script.splitlines()
    assert lines[0] == f"exec 2>>{out}" and lines[-1] == 'exec "$@"'
    assert "/bin/mount -t tmpfs -o size=1G,mode=1777,nosuid,nodev revenant-tmp /tmp || fail /tmp" in lines
    assert "/bin/mount -t tmpfs -o size=10%,mode=1777,nosuid,nodev revenant-shm /dev/shm || fail /dev/shm" \
        in lines
    files = JobFiles(tmp_path, "1")
    argv = init_argv(files.output, files.stamp, 1.2, ["python3", "train.py"], "/w", 600, script)
    assert argv[:9] == ["unshare", "--mount", "--propagation", "private", "--ipc", "--pid", "--fork",
                        "--kill-child", "setsid"]
    assert argv[9:17] == ["/bin/sh", "-c", script, SCRATCH_NAME, "/bin/sh", "-c", INIT_SCRIPT, INIT_NAME]
    assert argv[17:] == init_argv(files.output, files.stamp, 1.2, ["python3", "train.py"], "/w", 600)[10:]
    # criu: the host's mounts are external, bound again from the restoring node, its / the root.
    dump = dump_argv("criu", pid=7, images=Path("i"), workdir=Path("w"), action_script=Path("a"),
                     leave_running=True)
    restore = restore_argv("criu", images=Path("i"), workdir=Path("w"), pidfile=Path("p"))
    assert DUMP_MOUNTS == ("--external", "mnt[]") and " ".join(DUMP_MOUNTS) in " ".join(dump)
    assert RESTORE_MOUNTS == ("--root", "/", "--external", "mnt[]") and " ".join(RESTORE_MOUNTS) in " ".join(restore)


@pytest.mark.unit
def test_scratch_sizes_and_the_switch_are_agent_settings_with_one_line_errors():
    assert AgentConfig().job_scratch() == {"/tmp": "1G", "/dev/shm": "1G"}
    cfg = load_config(AgentConfig, "agent", environ={"REVENANT_AGENT_JOB_TMP_SIZE": "1073741824",
                                                     "REVENANT_AGENT_JOB_SHM_SIZE": "25%"})
    assert cfg.job_scratch() == {"/tmp": "1073741824", "/dev/shm": "25%"}
    assert AgentConfig(job_tmp_size=64 << 20, job_shm_size="512m").job_scratch() == {"/tmp": "67108864",
                                                                                     "/dev/shm": "512m"}
    off = load_config(AgentConfig, "agent", environ={"REVENANT_AGENT_JOB_PRIVATE_SCRATCH": "false"})
    assert off.job_scratch() == {}
    for bad in ("0", "1.5G", "1 GB", "-1", "200%", "lots"):
        with pytest.raises(ConfigError) as info:
            load_config(AgentConfig, "agent", environ={"REVENANT_AGENT_JOB_SHM_SIZE": bad})
        assert "\n" not in str(info.value)
        assert str(info.value).startswith("[agent] job_shm_size must be a tmpfs size") and repr(bad) in str(info.value)


# ------------------------------------------------------------------ real jobs, real criu

# The interpreter itself, not the virtual environment's link to it: a checkout (and its .venv) may
# lie under /tmp, and a job given a program there keeps the host's /tmp (launcher.given_paths).
PYTHON = os.path.realpath(sys.executable)

@pytest.fixture
def base():
    """Storage and workdirs outside /tmp (see above), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="revenant-test-scratch-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def nodes(supervisors, base):
    """Supervisors ("n1", "n2", ...) sharing one storage, as nodes would; their jobs get SIZES."""
    def make(node: str, storage: Path | None = None, scratch: dict[str, str] | None = None,
             events: list | None = None) -> Supervisor:
        return supervisors(node, storage or base / "storage", events, scratch=SIZES if scratch is None else scratch)
    return make



def mounts(pid: int) -> dict[str, tuple[str, str, str]]:
    """The topmost mount at each mountpoint the process sees: (fstype, source, options)."""
    found = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        rest = fields[fields.index("-") + 1:]
        found[fields[4]] = (rest[0], rest[1], fields[5] + "," + rest[2])
    return found


async def start(sup: Supervisor, workdir: Path, argv: list[str], job: str = "1") -> JobSpec:
    spec = JobSpec(id=job, argv=argv, workdir=str(workdir))
    await sup.start(spec, 1)
    return spec


def lines_of(sup: Supervisor, job: str = "1") -> list[str]:
    return JobFiles(sup.storage, job).output.read_text().splitlines()


def node_dies(sup: Supervisor, job: str = "1") -> None:
    signal_tree(sup.jobs[job].pid, signal.SIGKILL)


def own_images(sup: Supervisor, job: str, epoch: int) -> list[str]:
    """The tmpfs contents criu dumped into the epoch."""
    return sorted(p.name for p in JobFiles(sup.storage, job).epoch_dir(epoch).glob("tmpfs-dev-*.tar.gz.img"))


@pytest.mark.criu
async def test_the_job_s_tmp_and_shm_are_its_own_and_come_back_intact_on_another_node(base, nodes):
    n1, n2 = nodes("n1"), nodes("n2")
    token = uuid.uuid4().hex
    host_files = [Path(f"/tmp/revenant-scratch-{token}"), Path(f"/dev/shm/revenant-scratch-{token}")]
    (base / "wd").mkdir()
    spec = await start(n1, base / "wd", [PYTHON, "-c", SCRATCH_JOB, token])
    await until(lambda: sum(ln.startswith("tick") for ln in lines_of(n1)) >= 5)
    assert lines_of(n1)[0] == "big write: No space left on device"  # job_tmp_size holds
    assert [p.exists() for p in host_files] == [False, False]  # the host never sees them
    pid = n1.jobs["1"].pid
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    seen = mounts(pid)
    assert seen["/tmp"][:2] == ("tmpfs", "revenant-tmp") and "size=8192k" in seen["/tmp"][2]
    assert seen["/dev/shm"][:2] == ("tmpfs", "revenant-shm") and "size=4096k" in seen["/dev/shm"][2]
    assert "nosuid" in seen["/tmp"][2] and "nodev" in seen["/dev/shm"][2]

    reply = await n1.checkpoint("1", 1, stop=False)
    # Only the job's own tmpfs are in the epoch, not the host's /dev/shm, cgroup tmpfs...
    assert len(own_images(n1, "1", reply.epoch.n)) == 2
    at_dump = int([ln for ln in lines_of(n1) if ln.startswith("tick")][-1].split()[1])
    await until(lambda: int(lines_of(n1)[-1].split()[1]) >= at_dump + 10)
    node_dies(n1)
    await until(lambda: "1" not in n1.jobs)

    restored = await n2.restore(spec, 2)
    assert restored.epoch.n == reply.epoch.n
    pid = n2.jobs["1"].pid
    n = len(lines_of(n2))
    await until(lambda: len(lines_of(n2)) >= n + 10)
    ticks = [ln.split() for ln in lines_of(n2) if ln.startswith("tick")]
    # One unbroken count (the output was cut back to the dump), each line reading both files whole.
    assert [int(t[1]) for t in ticks] == list(range(len(ticks)))
    assert all(t[2:] == [token, token] for t in ticks)
    seen = mounts(pid)
    assert seen["/tmp"][:2] == ("tmpfs", "revenant-tmp") and "size=8192k" in seen["/tmp"][2]
    assert seen["/dev/shm"][:2] == ("tmpfs", "revenant-shm") and "size=4096k" in seen["/dev/shm"][2]
    assert [p.exists() for p in host_files] == [False, False]
    # And it dumps again from its new node.
    assert (await n2.checkpoint("1", 2, stop=False)).epoch.n == reply.epoch.n + 1


@pytest.mark.criu
async def test_a_network_namespace_the_host_lets_go_after_the_job_started_does_not_spoil_its_epochs(base, nodes):
    """``ip netns add`` (a CNI plugin's, a container's: an nsfs mount at /run/netns/NAME) before
    the job starts, deleted after its epoch: the job's namespace never held it, so criu recorded no
    mount the restoring node lacks ("Can't stat mountpoint" otherwise)."""
    if shutil.which("ip") is None:
        pytest.fail("ip (iproute2) is missing: make setup installs it")
    name = f"rv-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        n1, n2 = nodes("n1"), nodes("n2")
        (base / "wd").mkdir()
        spec = await start(n1, base / "wd", [PYTHON, "-c", SCRATCH_JOB, "ns"])
        await until(lambda: sum(ln.startswith("tick") for ln in lines_of(n1)) >= 3)
        assert "nsfs" not in {fstype for fstype, _, _ in mounts(n1.jobs["1"].pid).values()}
        await n1.checkpoint("1", 1, stop=True)
        await until(lambda: "1" not in n1.jobs)
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)
    ticks = len(lines_of(n1))
    await n2.restore(spec, 2)
    await until(lambda: len(lines_of(n2)) >= ticks + 5)
    count = [int(ln.split()[1]) for ln in lines_of(n2) if ln.startswith("tick")]
    assert count == list(range(len(count)))  # one unbroken count, on from the vacate


@pytest.mark.criu
async def test_multiprocessing_shared_memory_and_semaphores_survive_a_restore(base, nodes):
    n1, n2 = nodes("n1"), nodes("n2")
    name = f"revenant-test-{uuid.uuid4().hex[:12]}"
    spec = await start(n1, Path("/"), [PYTHON, "-c", MP_JOB, name])
    await until(lambda: len(lines_of(n1)) >= 20)
    assert not Path("/dev/shm", name).exists()
    await n1.checkpoint("1", 1, stop=True)  # a vacate: dumped, then stopped
    await until(lambda: "1" not in n1.jobs)
    rounds = len(lines_of(n1))

    await n2.restore(spec, 2)
    await until(lambda: len(lines_of(n2)) >= rounds + 30)
    for i, line in enumerate(lines_of(n2), 1):
        assert line == f"round {i} shared {i}"  # both processes, the block and the semaphores in step
    assert not Path("/dev/shm", name).exists()


@pytest.mark.criu
async def test_storage_under_tmp_keeps_the_host_s_tmp_and_the_switch_turns_it_all_off(tmp_path, nodes, caplog):
    caplog.set_level(logging.WARNING, logger="revenant.agent.running.launcher")
    under_tmp = nodes("n1", storage=tmp_path / "storage")
    await start(under_tmp, Path("/"), ["sleep", "60"])
    pid = under_tmp.jobs["1"].pid
    # The namespace's pid 1 mounts its scratch before it execs the init: wait for it to be done.
    await until(lambda: mounts(pid).get("/proc", ("",))[1:2] == ("revenant-proc",))
    seen = mounts(pid)
    assert seen["/dev/shm"][1] == "revenant-shm" and seen.get("/tmp", ("",))[0] != "tmpfs"
    assert (f"job 1: /tmp stays the host's: the job needs {tmp_path / 'storage' / 'jobs' / '1'}, which a private "
            "/tmp would hide") in caplog.text

    off = nodes("n2", scratch={})
    await start(off, Path("/"), ["sleep", "60"])
    assert os.readlink(f"/proc/{off.jobs['1'].pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt")
    assert (await off.checkpoint("1", 1, stop=False)).epoch.n == 1  # the same criu options, no namespace


@pytest.mark.criu
async def test_a_scratch_that_cannot_be_mounted_ends_the_job_saying_why(base, nodes):
    events: list = []
    sup = nodes("n1", scratch={"/revenant-no-such-mountpoint": "1M"}, events=events)
    await start(sup, Path("/"), ["sleep", "60"])
    await until(lambda: any(e.kind == "exited" for e in events))
    [ended] = [e for e in events if e.kind == "exited"]
    assert ended.exit_code == SCRATCH_EXIT
    assert "revenant: cannot set up this job's private /revenant-no-such-mountpoint" in "\n".join(lines_of(sup))
