"""The launcher's checks and its start deadline (agent/running/launcher.py), without starting a job."""

from __future__ import annotations

import os

import psutil
import pytest

from revenant.agent.running.jobuser import SYS_PATH
from revenant.agent.running.launcher import LaunchError, Launcher
from revenant.messages import JobSpec

pytestmark = pytest.mark.unit


def test_a_job_that_cannot_start_here_is_refused_with_why(tmp_path):
    launcher = Launcher("n1", tmp_path / "storage", 1.2)
    with pytest.raises(LaunchError, match="empty command"):
        launcher.check(JobSpec(id="1", argv=[], workdir="/"))
    with pytest.raises(LaunchError, match=r"job 1 cannot run in /nope on n1: it cannot be read \(No such file"):
        launcher.check(JobSpec(id="1", argv=["true"], workdir="/nope"))
    with pytest.raises(LaunchError, match="command not found on n1: no-such-command-here"):
        launcher.check(JobSpec(id="1", argv=["no-such-command-here"], workdir="/"))
    env = launcher.check(JobSpec(id="1", argv=["true"], workdir="/", env={"SEED": "7"}))
    assert env["SEED"] == "7" and env["PATH"] == SYS_PATH  # nothing of the agent's own environment
    # A script in the workdir, named by a relative path.
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "run.sh").write_text("#!/bin/sh\n")
    launcher.check(JobSpec(id="1", argv=["./run.sh"], workdir=str(tmp_path / "wd")))


async def test_a_fresh_start_empties_the_output_and_gives_a_new_stamp(tmp_path):
    launcher = Launcher("n1", tmp_path, 1.2)
    files = await launcher.prepare("4", fresh=False)
    files.output.write_bytes(b"earlier run\n")
    stamp = files.stamp.stat().st_ino
    assert (await launcher.prepare("4", fresh=False)).output.read_bytes() == b"earlier run\n"
    assert files.stamp.stat().st_ino != stamp
    assert (await launcher.prepare("4", fresh=True)).output.read_bytes() == b""


class _Wrapper:
    """An unshare whose namespace never comes up: a pid with no process, never exiting."""

    def __init__(self) -> None:
        self.pid = next(p for p in range(4_000_000, 3_000_000, -1) if not psutil.pid_exists(p))

    def poll(self) -> None:
        return None


async def test_a_namespace_that_does_not_come_up_in_time_fails_the_start(tmp_path):
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0  # each look costs a second
        return now[0]

    launcher = Launcher("n1", tmp_path, 1.2, start_timeout_s=5.0, clock=clock)
    with pytest.raises(LaunchError, match="the job's namespace did not start within 5 s"):
        await launcher._namespace_init(_Wrapper())  # type: ignore[arg-type]
    assert now[0] == 6.0  # the deadline set at 1 s, looks at 2..5 s, and 6 s is past it
