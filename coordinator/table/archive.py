"""Finished jobs leave the live job table after ``job_retention_s``.

The live table is loaded whole by every new leader and listed by ``revenant jobs``, so it
must not grow for ever.  A job that ended (completed or failed) and has not changed for
``job_retention_s`` moves to the archive bucket (:meth:`JobStore.archive`), where
``revenant show job`` still finds it and ``revenant job purge`` removes it.

:func:`due_for_archive` is the rule, pure, with the time passed in; :class:`Archiver` is the
leader's background task that applies it, one job at a time under the job's lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Mapping

from revenant.common.errors import RevenantError
from revenant.coordinator.table import lifecycle as lc
from revenant.coordinator.table.agents import check_may_act
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.store import WriteConflict
from revenant.messages import JobRecord

log = logging.getLogger(__name__)

# How often the archiver looks: a tenth of the retention, between these bounds.
MIN_PASS_INTERVAL_S = 0.1
MAX_PASS_INTERVAL_S = 60.0


def is_due(rec: JobRecord, now: float, retention_s: float) -> bool:
    """An ended job whose record has not changed for ``retention_s``."""
    return rec.state in lc.ENDED and now - rec.updated_at >= retention_s


def due_for_archive(jobs: Mapping[str, JobRecord], now: float, retention_s: float) -> list[str]:
    """The jobs to archive now, longest-finished first."""
    due = [(rec.updated_at, job) for job, rec in jobs.items() if is_due(rec, now, retention_s)]
    return [job for _, job in sorted(due)]


def pass_interval_s(retention_s: float) -> float:
    return min(max(retention_s / 10, MIN_PASS_INTERVAL_S), MAX_PASS_INTERVAL_S)


class Archiver:
    """Moves the jobs :func:`due_for_archive` names out of the live table (leader only)."""

    def __init__(self, jobs: JobService, retention_s: float, *, wall: Callable[[], float] = time.time) -> None:
        self.jobs = jobs
        self.retention_s = retention_s
        self.wall = wall
        self.archived = 0

    async def run(self) -> None:
        while True:
            await self.archive_due()
            await asyncio.sleep(pass_interval_s(self.retention_s))

    async def archive_due(self) -> list[str]:
        """One pass: archive every job due now; returns those archived."""
        done: list[str] = []
        for job in due_for_archive(self.jobs.jobs, self.wall(), self.retention_s):
            try:
                if await self.archive(job):
                    done.append(job)
            except RevenantError as exc:
                log.warning("job %s: not archived (%s); the next pass tries again", job, exc)
                break  # a bus or leadership problem: the rest would fail alike
        if done:
            log.info("archived %d finished job(s) (%s%s)", len(done), ", ".join(done[:10]),
                     ", ..." if len(done) > 10 else "")
        self.archived += len(done)
        return done

    async def archive(self, job: str) -> bool:
        """Archive ``job`` if it is (still) due; whether it was."""
        async with self.jobs.lock(job):
            rec = self.jobs.jobs.get(job)
            if rec is None or not is_due(rec, self.wall(), self.retention_s):
                return False  # restarted or purged since the pass began
            check_may_act(self.jobs.leader.fresh)
            try:
                await self.jobs.store.archive(rec)
            except WriteConflict as conflict:
                # Another coordinator wrote it: the same rule as for any write decides whose
                # record stands; either way it stays live for now.
                await self.jobs._resolve(conflict, rec)  # noqa: SLF001 (the shell's own rule)
                return False
            self.jobs.jobs.pop(job, None)
        return True
