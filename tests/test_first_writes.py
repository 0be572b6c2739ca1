"""A file of the working directory that nobody wrote since the job started is recorded by its
identity only (agent/files/workdir.py); the job's first write to it after an epoch is journaled as
it happens (agent/files/gate/firstwrites.py), and a restore of that epoch cuts it back where it
only grew: a log left by an earlier run that the job appends to after the epoch comes back
without those lines, and never gets them twice.  Another process's appends to such a file are
not the job's, and are left as they are."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from helpers import until
from test_project_dirs import older_than_the_job

from revenant.agent.files import workdir as wdsnap
from revenant.agent.files.gate import firstwrites
from revenant.agent.processes.procs import signal_tree
from revenant.agent.storage.epochs import JobFiles
from revenant.messages import JobSpec

pytestmark = pytest.mark.criu

# Counts in its output; once "go" exists, appends "appended <n>" to old.log at each step.
JOB = """import os, time
n = 0
while True:
    n += 1
    print(f"step {n}", flush=True)
    if os.path.exists("go"):
        with open("old.log", "a") as f:
            f.write(f"appended {n}\\n")
    time.sleep(0.02)
"""
OLD = "a log of an earlier run\n" * 100


def appended(text: str) -> list[int]:
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("appended ")]


async def test_a_log_first_appended_to_after_the_epoch_is_cut_back_and_another_processs_lines_stay(
        tmp_path, supervisors):
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "job.py").write_text(JOB)
    (wd / "old.log").write_text(OLD)
    (wd / "other.log").write_text(OLD)
    older_than_the_job(wd / "job.py", wd / "old.log", wd / "other.log")
    n1, n2 = supervisors("n1"), supervisors("n2")
    spec = JobSpec(id="1", argv=[sys.executable, str(wd / "job.py")], workdir=str(wd))
    await n1.start(spec, 1)
    out = JobFiles(n1.storage, "1").output
    await until(lambda: out.read_bytes().count(b"step ") >= 5)
    reply = await n1.checkpoint("1", 1, stop=False)
    files = JobFiles(n1.storage, "1")
    recorded = wdsnap.read(files.epoch_dir(reply.epoch.n))
    assert recorded["old.log"].copy == "" and recorded["other.log"].copy == ""  # by identity: never written
    (wd / "go").touch()  # the job's first write to old.log, after the epoch
    subprocess.run(["/bin/sh", "-c", "echo another process >> other.log"], cwd=wd, check=True, timeout=30)
    await until(lambda: len(appended((wd / "old.log").read_text())) >= 10)
    journal = firstwrites.first_writes(files.dir / firstwrites.JOURNAL, 0)
    assert set(journal) == {"old.log"}, journal  # the job's; not the other process's
    signal_tree(n1.jobs["1"].pid, signal.SIGKILL)  # the node dies
    await until(lambda: "1" not in n1.jobs or n1.jobs["1"].exited.is_set())

    restored = await n2.restore(spec, 2)
    assert restored.epoch.n == reply.epoch.n
    notes = " | ".join(restored.notes)
    assert f"cut back 1 files of {wd} to their size at epoch 1: the job first wrote them after it" in notes, notes
    assert (wd / "old.log").read_text() == OLD  # as at the epoch: none of the lines written after it
    assert (wd / "other.log").read_text() == OLD + "another process\n"  # not the job's: left
    assert not (wd / "go").exists()  # appeared after the epoch: moved aside
    # The restored job appends again from the epoch on: each line once.
    (wd / "go").touch()
    await until(lambda: len(appended((wd / "old.log").read_text())) >= 10)
    lines = appended((wd / "old.log").read_text())
    assert lines == sorted(set(lines)) and lines == list(range(lines[0], lines[0] + len(lines))), lines
    await n2.kill("1", 2, "test over")
