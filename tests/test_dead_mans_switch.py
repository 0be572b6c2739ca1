"""The dead man's switch, agent side, without processes: revenant-init's command line, the
stamps the lease resets, and the switch timing the supervisor keeps (on a fake clock)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from revenant.agent.processes.exits import SWITCH_EXIT, JobEnd
from revenant.agent.running.jobs import JobRuntime, Launch, Supervisor
from revenant.agent.running.launcher import INIT_NAME, INIT_SCRIPT, init_argv, new_stamp, reset_stamp
from revenant.agent.storage.epochs import JobFiles
from revenant.messages import JobSpec

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self, now: float = 500.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_init_gets_the_switch_timeouts_in_milliseconds_freezes_then_exits_251(tmp_path):
    # Its switch fires SWITCH_SKEW_MS after the agent's own fence (1.2 s): never first.
    files = JobFiles(tmp_path, "3")
    argv = init_argv(files.output, files.stamp, 1.2, ["python3", "train.py"], max_frozen_s=600)
    assert argv[:6] == ["unshare", "--ipc", "--pid", "--fork", "--kill-child", "setsid"]
    assert argv[6:10] == ["/bin/sh", "-c", INIT_SCRIPT, INIT_NAME]
    assert argv[10:] == [str(files.output), str(files.stamp), "1300", "600000", "python3", "train.py"]
    assert "kill -STOP -1" in INIT_SCRIPT and f"exit {SWITCH_EXIT}\n" in INIT_SCRIPT
    assert 'fence_ms=$3; max_frozen_ms=$4' in INIT_SCRIPT


def test_a_new_stamp_is_a_new_inode_and_a_reset_touches_it(tmp_path):
    files = JobFiles(tmp_path, "3")
    files.dir.mkdir(parents=True)
    files.stamp.write_bytes(b"")
    old = files.stamp.stat().st_ino
    with open(files.stamp) as held:  # what a stale copy's init holds as fd 3
        new_stamp(files)
        assert files.stamp.stat().st_ino != old and os.fstat(held.fileno()).st_ino == old
    os.utime(files.stamp, (1, 1))
    reset_stamp(files.stamp)
    assert files.stamp.stat().st_mtime > 1
    reset_stamp(tmp_path / "gone")  # a missing stamp is logged, never raised


def _runtime(storage: Path, job: str) -> JobRuntime:
    files = JobFiles(storage, job)
    files.dir.mkdir(parents=True)
    files.stamp.write_bytes(b"")
    os.utime(files.stamp, (1, 1))
    return JobRuntime(spec=JobSpec(id=job, argv=["true"], workdir="/"), generation=1, pid=0, files=files)


def test_the_lease_resets_every_switch_and_the_supervisor_keeps_the_timing(tmp_path):
    clock = FakeClock()
    sup = Supervisor("n1", tmp_path, None, lambda subject, msg: None, switch_timeout_s=1.2, clock=clock)
    running, starting = _runtime(tmp_path, "1"), _runtime(tmp_path, "2")
    sup.jobs["1"] = running
    sup.launching["2"] = Launch(generation=1, stamp=starting.files.stamp)
    clock.now += 0.35
    sup.touch_stamps()
    # Both switches were reset: the running job's and the one still coming up.
    assert running.files.stamp.stat().st_mtime > 1 and starting.files.stamp.stat().st_mtime > 1
    assert not sup.exits.switch_may_have_fired()
    assert sup.exits.classify(JobEnd(code=SWITCH_EXIT)).kind == "exited"
    # The liveness thread stops renewing (the agent was paused): past 0.8 of the timeout,
    # an exit 251 is the switch firing, and the job is evicted.
    clock.now += 1.0
    assert sup.exits.switch_may_have_fired()
    assert sup.exits.classify(JobEnd(code=SWITCH_EXIT)).kind == "evicted"


def test_a_gap_is_measured_from_the_first_reset_of_a_round_to_the_last_of_the_next():
    """Resetting many stamps on slow storage takes a while: a switch reset last in one round and
    first in the next went unreset longer than the rounds' starts say."""
    clock = FakeClock(100.0)
    sup = Supervisor("n1", Path("/nonexistent"), None, lambda subject, msg: None, switch_timeout_s=1.2, clock=clock)
    started = clock.now
    clock.now += 0.3  # this round's resets took 0.3 s
    assert sup.exits.switches_reset(started) == pytest.approx(0.3)
    clock.now += 0.9
    started = clock.now
    clock.now += 0.2
    assert sup.exits.switches_reset(started) == pytest.approx(1.4)  # from 100.0 to 101.4
    assert sup.exits.may_have_fired_since(100.5)


class Stamps:
    """A supervisor whose switches went unreset for ``gap`` seconds at the next reset."""

    def __init__(self) -> None:
        self.gap = 0.35
        self.frozen: list[str] = []

    def touch_stamps(self) -> float:
        return self.gap

    def freeze_all(self, reason: str) -> list[str]:
        self.frozen.append(reason)
        return ["1"]


def test_switches_reset_too_late_are_a_self_fence_even_when_the_lease_was_renewed(tmp_path):
    from revenant.agent.node.agent import Agent
    from revenant.common.settings.config import AgentConfig

    agent = Agent(AgentConfig(node="n1", storage=str(tmp_path), http_port=-1, image_integrity="crc32"))
    stamps, asked = Stamps(), []
    agent.supervisor = stamps  # type: ignore[assignment]
    agent._lease_back = lambda: asked.append("reconcile")  # type: ignore[method-assign]
    agent._reset_switches()
    assert stamps.frozen == [] and asked == []
    stamps.gap = 1.5  # past the fence timeout (1.2 s): the switches may have fired
    agent._reset_switches()
    assert stamps.frozen == ["self-fenced: dead man's switches not reset for 1.5 s"] and asked == ["reconcile"]
    assert "froze 1" in agent.fence_report
    # The next reset ends that fence's own gap: not a second fence.
    agent._reset_switches()
    assert len(stamps.frozen) == 1
    # A fence of the lease's (renewed too late) is not counted twice either.
    agent._fence(2.0)
    agent._reset_switches()
    assert len(stamps.frozen) == 2 and asked == ["reconcile"]
