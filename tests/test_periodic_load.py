"""The coordinator's periodic checkpoints (coordinator/table/periodic.py) are sent as scheduled; a node's
refusal under load (code "checkpoint_skipped") is no failure of the job, and its next try comes
on schedule, a full interval later."""

from __future__ import annotations

import asyncio
import logging

import pytest

from revenant.common.errors import CheckpointSkipped, CriuError, RemoteError, RevenantError
from revenant.coordinator.table.periodic import PeriodicCheckpoints
from revenant.messages import JobRecord, JobSpec, NodeStatus

pytestmark = pytest.mark.unit

INTERVAL = 60.0


class Wall:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Jobs:
    """The JobService as the periodic loop sees it: its records and ``checkpoint``, each call
    answered by the next outcome (None: a checkpoint committed now)."""

    def __init__(self, wall: Wall, *outcomes: RevenantError | None) -> None:
        spec = JobSpec(id="7", argv=["true"], checkpoint_interval_s=INTERVAL)
        self.jobs = {"7": JobRecord(spec=spec, state="running", node="node-1", generation=1, last_checkpoint_at=100.0)}
        self.wall = wall
        self.outcomes = list(outcomes)
        self.calls: list[tuple[str, dict]] = []

    async def checkpoint(self, job: str, **kw) -> tuple[JobRecord, list[str]]:
        self.calls.append((job, kw))
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise outcome
        self.jobs[job].last_checkpoint_at = self.wall()
        return self.jobs[job], []


def loop(*outcomes: RevenantError | None) -> tuple[PeriodicCheckpoints, Jobs, Wall]:
    wall = Wall(100.0)
    jobs = Jobs(wall, *outcomes)
    nodes = [NodeStatus(name="node-1", state="alive")]
    return PeriodicCheckpoints(jobs, lambda: nodes, tick_s=1.0, wall=wall), jobs, wall  # type: ignore[arg-type]


async def tick_at(periodic: PeriodicCheckpoints, wall: Wall, now: float) -> int:
    """One tick of the loop at wall time ``now``, its checkpoints run to their end: how many it started."""
    wall.now = now
    started = periodic.tick()
    await asyncio.gather(*started)
    return len(started)


SKIPPED_OVER_THE_BUS = RemoteError("cpu 0.97 > 0.95", code="checkpoint_skipped", retriable=True)


@pytest.mark.parametrize("refusal", [SKIPPED_OVER_THE_BUS, CheckpointSkipped("cpu 0.97 > 0.95")],
                         ids=["remote-error", "checkpoint-skipped"])
async def test_a_skipped_periodic_checkpoint_is_logged_at_info_and_tried_again_a_full_interval_later(refusal, caplog):
    caplog.set_level(logging.DEBUG, logger="revenant.coordinator.table.periodic")
    periodic, jobs, wall = loop(refusal, None)
    assert await tick_at(periodic, wall, 159.0) == 0
    assert await tick_at(periodic, wall, 160.0) == 1
    # Sent as scheduled: only these may be skipped under load.
    assert jobs.calls == [("7", {"stop": False, "scheduled": True, "cause": "schedule"})]
    [rec] = caplog.records
    assert rec.levelno == logging.INFO
    assert rec.getMessage() == "periodic checkpoint of job 7 skipped by its node: cpu 0.97 > 0.95"
    # Not at once again: on schedule, a full interval after the skip.
    assert await tick_at(periodic, wall, 161.0) == 0
    assert await tick_at(periodic, wall, 219.0) == 0
    assert await tick_at(periodic, wall, 220.0) == 1
    assert jobs.jobs["7"].last_checkpoint_at == 220.0
    # Taken: the next one is a full interval after it.
    assert await tick_at(periodic, wall, 279.0) == 0
    assert len(jobs.calls) == 2 and not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_failed_periodic_checkpoint_still_warns_and_waits_a_full_interval(caplog):
    caplog.set_level(logging.DEBUG, logger="revenant.coordinator.table.periodic")
    periodic, jobs, wall = loop(CriuError("criu dump failed: Error (criu/sk-inet.c:188): Unsupported socket"), None)
    assert await tick_at(periodic, wall, 160.0) == 1
    [rec] = caplog.records
    assert rec.levelno == logging.WARNING and rec.getMessage().startswith("periodic checkpoint of job 7 failed: ")
    assert await tick_at(periodic, wall, 219.0) == 0
    assert await tick_at(periodic, wall, 220.0) == 1
    assert jobs.calls[-1] == ("7", {"stop": False, "scheduled": True, "cause": "schedule"})


async def test_one_periodic_checkpoint_at_a_time_per_job():
    periodic, jobs, wall = loop(None)
    release = asyncio.Event()
    checkpoint = jobs.checkpoint

    async def slow(job: str, **kw):
        await release.wait()
        return await checkpoint(job, **kw)

    jobs.checkpoint = slow  # type: ignore[method-assign]
    wall.now = 160.0
    [first] = periodic.tick()
    assert periodic.tick() == []  # still in flight
    release.set()
    await first
    assert jobs.calls == [("7", {"stop": False, "scheduled": True, "cause": "schedule"})]
