"""Periodic checkpoints: each running job whose interval has passed gets one (one at a time)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Mapping

from revenant.common.errors import RevenantError
from revenant.coordinator.jobs import JobService
from revenant.coordinator.lifecycle import State
from revenant.messages import JobRecord, NodeStatus

log = logging.getLogger(__name__)


def due(jobs: list[JobRecord], alive: set[str], busy: set[str], failed_at: Mapping[str, float],
        now: float) -> list[str]:
    """The jobs whose periodic checkpoint is due at wall time ``now``: a full interval after the
    last checkpoint, or after the last failed attempt (never at once again)."""
    out = []
    for rec in jobs:
        interval = rec.spec.checkpoint_interval_s
        last = max(rec.last_checkpoint_at, failed_at.get(rec.spec.id, 0.0))
        if (interval and rec.state == State.RUNNING and rec.node in alive and rec.spec.id not in busy
                and now - last >= interval):
            out.append(rec.spec.id)
    return out


class PeriodicCheckpoints:
    def __init__(self, jobs: JobService, nodes: Callable[[], list[NodeStatus]], tick_s: float,
                 wall: Callable[[], float]) -> None:
        self.jobs = jobs
        self.nodes = nodes
        self.tick_s = tick_s
        self.wall = wall
        self._busy: set[str] = set()
        self._failed_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        # Checkpoints in flight are not cancelled with this loop: a dump half done must reach its
        # reply (or failure), or the job would stay "checkpointing" for the rest of this term.
        while True:
            records = list(self.jobs.jobs.values())
            if any(r.spec.checkpoint_interval_s for r in records):
                alive = {n.name for n in self.nodes() if n.state == "alive"}
                for job in due(records, alive, self._busy, self._failed_at, self.wall()):
                    self._busy.add(job)
                    task = asyncio.create_task(self._one(job), name=f"periodic-checkpoint-{job}")
                    self._tasks.add(task)  # kept (a bare task may be garbage-collected)
                    task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(self.tick_s)

    async def _one(self, job: str) -> None:
        try:
            await self.jobs.checkpoint(job, stop=False)
            self._failed_at.pop(job, None)
        except RevenantError as exc:
            log.warning("periodic checkpoint of job %s failed: %s", job, exc)
            self._failed_at[job] = self.wall()  # retry after a full interval, not at once
        finally:
            self._busy.discard(job)
