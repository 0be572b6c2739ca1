"""The file gate of a real agent, stopped and killed in the middle of a checkpoint (issue 44):
nothing outside the job waits on it for more than a second, and nothing is left in state D.

tests/test_cowgate.py holds the gate's own rules with a gate in a forked process; here it is the
agent of `revenant up`, its gate armed on a file the job wrote (so copied after the thaw, while
gated), caught in the act by the fanotify mark on that file's inode in the agent's fdinfo."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from conftest import wait_until
from test_cowgate import _timed_open
from test_project_dirs import Outsider

pytestmark = pytest.mark.cluster

# Writes 3 GiB of real content into its workdir after it starts (so every epoch must copy it, after
# the thaw, gated), then ticks.
WRITER = r"""
import os, sys, time
block = os.urandom(1 << 20)
with open("big.bin", "wb") as f:
    for i in range(3 << 10):
        f.write(block)
    f.flush()
    os.fsync(f.fileno())
print("ready", flush=True)
i = 0
while True:
    with open("ticks.log", "a") as log:
        log.write(f"{i}\n")
    print("tick", i, flush=True)
    i += 1
    time.sleep(0.05)
"""


def gated_inodes(pid: int) -> set[int]:
    """The inodes the fanotify groups of process ``pid`` mark (its fdinfo's ``fanotify ino:`` lines)."""
    found: set[int] = set()
    for info in Path(f"/proc/{pid}/fdinfo").iterdir():
        try:
            text = info.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("fanotify ino:"):
                found.add(int(line.split()[1].split(":")[1], 16))
    return found


def keepers_of(pid: int) -> list[int]:
    """The gate keepers among process ``pid``'s children (a child that just exited, a zombie not
    reaped yet, has no command line: it is none)."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            if "keeper.py" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def project():
    """A workdir outside /tmp (the job gets a /tmp of its own), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="revenant-test-gate-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(300)
def test_an_agent_stopped_then_killed_mid_checkpoint_never_holds_an_outsiders_open_past_a_second(
        make_cluster, project):
    cluster = make_cluster(1)
    (project / "README").write_text("a project\n")
    job = cluster.cli("submit", "--workdir", str(project), "--", sys.executable, "-c", WRITER).stdout.strip()
    output = cluster.dir / "storage" / "jobs" / job / "output.log"
    assert wait_until(lambda: output.exists() and b"tick" in output.read_bytes(), timeout=120), "the job never wrote"
    big = project / "big.bin"
    agent = next(pid for name, pid in cluster.pids().items() if "node-1" in name)
    root = cluster.job(job)["pid"]  # the job's own opens may wait for their copy: not watched
    outsider = Outsider([big, project / "README", project / "ticks.log"], jobs=lambda: [root])
    creating = subprocess.Popen([sys.executable, "-m", "revenant.cli", "checkpoint", "create", job],
                                cwd=cluster.dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **cluster.env()})
    stopped = killed = False
    keepers: list[int] = []
    try:
        # The gate holds the file the job wrote while its copy is made (after the thaw).
        assert wait_until(lambda: big.stat().st_ino in gated_inodes(agent), timeout=120, interval=0.005), \
            f"the agent never gated {big}: {creating.poll()}"
        keepers = keepers_of(agent)
        assert keepers, "the agent's gate has no keeper"
        os.kill(agent, signal.SIGSTOP)
        stopped = True
        time.sleep(1.0)  # the agent's heartbeat to its keeper is stale by now
        waits = [_timed_open(big, os.O_RDWR) for _ in range(3)] + [_timed_open(project / "README")]
        assert max(waits) < 1.0, waits
        os.kill(agent, signal.SIGKILL)
        killed = True
        assert _timed_open(big, os.O_RDWR) < 0.5
    finally:
        if stopped and not killed:
            os.kill(agent, signal.SIGKILL)
        outsider.stop()
        creating.kill()
        creating.communicate(timeout=30)
    assert outsider.opens > 50 and outsider.longest < 1.0, (outsider.opens, outsider.longest)
    assert not outsider.in_d, (outsider.in_d, outsider._proc.pid, root, creating.pid)
    # The kill left no group behind: the agent's keeper, which holds the group too, went with it.
    assert wait_until(lambda: not any(psutil.pid_exists(k) and psutil.Process(k).status() != "zombie"
                                      for k in keepers), timeout=30), keepers
    # And the cluster takes commands again from its restarted agent.
    assert wait_until(lambda: cluster.cli("nodes", "--json", check=False).returncode == 0, timeout=60)
