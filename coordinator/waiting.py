"""Jobs waiting for room: the leader starts each once a node has room for what it asked.

A submit that no node has room for now (``--cpus``, ``--mem``, ``--gpus`` against what each
node's other jobs have taken) is recorded pending with no node and generation 0
(:func:`revenant.coordinator.table.lifecycle.queued`), its reason in the record.  Each tick this
loop tries them oldest first; a job that fits starts, one that does not keeps waiting and its
reason is brought up to date.  A later job that fits where an earlier one does not starts first
(backfill): a large job can wait behind a stream of small ones (docs/cli.md says so).
"""

from __future__ import annotations

import asyncio
import logging

from revenant.common.errors import RevenantError
from revenant.coordinator.table import lifecycle as lc
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.placement import NoNodeAvailable

log = logging.getLogger(__name__)


class WaitingJobs:
    def __init__(self, jobs: JobService, tick_s: float = 1.0) -> None:
        self.jobs = jobs
        self.tick_s = tick_s
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        # Starts in flight are not cancelled with this loop: each must reach its reply or failure.
        while True:
            await self.tick()
            await asyncio.sleep(self.tick_s)

    async def tick(self) -> list[str]:
        """Place every waiting job that fits now (oldest first); returns those started."""
        waiting = sorted((r for r in self.jobs.jobs.values() if lc.queued(r)),
                         key=lambda r: (r.created_at, len(r.spec.id), r.spec.id))
        started = []
        for rec in waiting:
            job = rec.spec.id
            if job in self._tasks:
                continue
            try:
                node, gpus = self.jobs.place(rec.spec)
            except NoNodeAvailable as exc:
                await self.jobs.step(job, lc.Waiting(f"waiting for room: {exc}"))
                continue
            decision = await self.jobs.step(job, lc.Placed(node, gpus))
            if not decision.commands:
                continue  # cancelled meanwhile
            log.info("job %s: room on %s; starting it", job, node)
            task = asyncio.create_task(self._start(job, decision.commands[0]), name=f"start-waiting-{job}")
            self._tasks[job] = task
            task.add_done_callback(lambda _t, job=job: self._tasks.pop(job, None))
            started.append(job)
        return started

    async def _start(self, job: str, cmd: lc.Command) -> None:
        try:
            await self.jobs.start(job, cmd)
        except RevenantError as exc:
            log.warning("job %s did not start: %s", job, exc)
