"""Periodic checkpoints: each running job whose interval has passed gets one (one at a time).

They are sent as *scheduled*: a node over a load threshold may skip one for a job whose policy is
load-aware, answering :class:`~revenant.common.errors.CheckpointSkipped` (code
``checkpoint_skipped``).  That is no failure of the job, logged at info; like a failed attempt,
it makes the job's next try come a full interval later, never at once (the node's load is averaged
over a few seconds: asking again at the next tick would only meet the same load)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable, Mapping

from revenant.common.errors import CheckpointSkipped, RevenantError
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.lifecycle import State
from revenant.messages import JobRecord, NodeStatus

log = logging.getLogger(__name__)


def due(jobs: list[JobRecord], alive: set[str], busy: set[str], tried_at: Mapping[str, float],
        now: float) -> list[str]:
    """The jobs whose periodic checkpoint is due at wall time ``now``: a full interval after the
    last checkpoint, or after the last attempt that took none (failed, or skipped by its node
    under load: never at once again)."""
    out = []
    for rec in jobs:
        interval = rec.spec.checkpoint_interval_s
        last = max(rec.last_checkpoint_at, tried_at.get(rec.spec.id, 0.0))
        if (interval and rec.state == State.RUNNING and rec.node in alive and rec.spec.id not in busy
                and now - last >= interval):
            out.append(rec.spec.id)
    return out


class PeriodicCheckpoints:
    def __init__(self, jobs: JobService, nodes: Callable[[], Iterable[NodeStatus]], tick_s: float,
                 wall: Callable[[], float]) -> None:
        self.jobs = jobs
        self.nodes = nodes
        self.tick_s = tick_s
        self.wall = wall
        self._busy: set[str] = set()
        # Per job: when its last attempt that took no checkpoint (failed or skipped) ended.
        self._tried_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        # Checkpoints in flight are not cancelled with this loop: a dump half done must reach its
        # reply (or failure), or the job would stay "checkpointing" for the rest of this term.
        while True:
            self.tick()
            await asyncio.sleep(self.tick_s)

    def tick(self) -> list[asyncio.Task[None]]:
        """Start the periodic checkpoints due now, one task each (returned)."""
        records = list(self.jobs.jobs.values())
        if not any(r.spec.checkpoint_interval_s for r in records):
            return []
        alive = {n.name for n in self.nodes() if n.state == "alive"}
        started = []
        for job in due(records, alive, self._busy, self._tried_at, self.wall()):
            self._busy.add(job)
            task = asyncio.create_task(self._one(job), name=f"periodic-checkpoint-{job}")
            self._tasks.add(task)  # kept (a bare task may be garbage-collected)
            task.add_done_callback(self._tasks.discard)
            started.append(task)
        return started

    async def _one(self, job: str) -> None:
        try:
            await self.jobs.checkpoint(job, stop=False, scheduled=True, cause="schedule")
            self._tried_at.pop(job, None)
        except RevenantError as exc:
            # By its code: the refusal arrives over the bus as a RemoteError carrying it.
            if exc.code == CheckpointSkipped.code:
                log.info("periodic checkpoint of job %s skipped by its node: %s", job, exc)
            else:
                log.warning("periodic checkpoint of job %s failed: %s", job, exc)
            self._tried_at[job] = self.wall()  # try again after a full interval, not at once
        finally:
            self._busy.discard(job)
