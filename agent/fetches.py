"""Lazily restored jobs whose pages are still arriving (agent/engine.py ``LazyFetch``).

A lazy restore hands the job back running while criu's lazy-pages daemon fetches its memory
on demand and in the background, and the page data is checked against the epoch's checksums
alongside (agent/lazy.py).  Here, per job:

* all pages in and verified: a ``restore_completed`` job event (seconds, bytes);
* the fetch failed (the daemon died or ended short: the missing pages would read as zeros) or the
  page data is corrupt: the job is killed at once and reported ``evicted``, so the coordinator
  restores it again.  A corrupt epoch is moved out of the way first (as retention deletes a
  corrupt epoch), so that restore falls back to the next older epoch that verifies; a failed
  fetch retries the same epoch.  A job never goes on running on memory it does not have;
* a checkpoint waits for the fetch (a dump of a half-fetched job would hold zero pages).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from revenant.common.errors import RevenantError

if TYPE_CHECKING:
    from revenant.agent.engine import LazyFetch
    from revenant.agent.epochs import JobFiles

log = logging.getLogger(__name__)

# How long a checkpoint waits for a lazily restored job's last page (a GiB takes about a second).
FETCH_WAIT_S = 300.0


@dataclass
class _Fetch:
    generation: int
    task: asyncio.Task[None]
    done: asyncio.Event = field(default_factory=asyncio.Event)


def set_aside(files: JobFiles, n: int) -> bool:
    """Move epoch ``n`` out of the listing (then delete it): its page data is corrupt."""
    trash = files.epochs_dir / f".trash-{n}-{secrets.token_hex(4)}"
    try:
        os.rename(files.epoch_dir(n), trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


class PageFetches:
    """``sup``: the job supervisor (agent/jobs.py): its ``jobs``, ``_event`` and ``_kill``."""

    def __init__(self, sup: Any) -> None:
        self.sup = sup
        self._fetches: dict[str, _Fetch] = {}

    def start(self, rt: Any, fetch: LazyFetch | None) -> None:
        if fetch is None:
            return
        # The job's exit is held back until the fetch has ended: one on zero pages is the fetch's failure.
        rt.vacating = True
        self._fetches[rt.spec.id] = f = _Fetch(rt.generation, asyncio.create_task(self._run(rt, fetch)))
        f.task.add_done_callback(lambda _: f.done.set())

    async def wait(self, job: str, timeout_s: float) -> None:
        """Return once ``job``'s pages are all in (at once if it was not restored lazily)."""
        f = self._fetches.get(job)
        if f is None or f.done.is_set():
            return
        try:
            await asyncio.wait_for(f.done.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise RevenantError(f"job {job} is still fetching its pages after a lazy restore ({timeout_s:g} s); "
                                "its checkpoint is not taken before they are all in", code="busy",
                                retriable=True) from None

    async def stop(self) -> None:
        """Cancel every fetch (the agent stops: its jobs die with it)."""
        tasks = [f.task for f in self._fetches.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, rt: Any, fetch: LazyFetch) -> None:
        try:
            await self._finish(rt, fetch)
        finally:
            f = self._fetches.get(rt.spec.id)
            if f is not None and f.generation == rt.generation:
                del self._fetches[rt.spec.id]
            self._release(rt)

    def _release(self, rt: Any) -> None:
        """Report the exit held back while the pages arrived, if the job has ended."""
        if rt.vacating:
            rt.vacating = False
            if rt.exited.is_set():
                self.sup._report_exit(rt)

    async def _finish(self, rt: Any, fetch: LazyFetch) -> None:
        job, n = rt.spec.id, fetch.manifest.epoch
        try:
            result = await fetch.wait()
        except BaseException:
            await asyncio.shield(fetch.abort())
            raise
        if result.ok:
            if not rt.exited.is_set():
                log.info("job %s: all pages of epoch %d in, %.1f MiB in %.3f s", job, n, result.bytes / 2**20,
                         result.seconds)
                self.sup._event(rt, "restore_completed", epoch=n, duration_s=result.seconds, bytes=result.bytes)
            return
        if rt.killing:
            return  # killed on purpose (a kill, a newer generation) while its pages came: that is its end
        why = f"lazy restore of epoch {n} failed: {result.error}"
        if result.corrupt and await asyncio.to_thread(set_aside, rt.files, n):
            why += f"; epoch {n} set aside, the next restore falls back to an older one"
        log.error("job %s: %s; killing it", job, why)
        rt.evicted = True  # however it ends now, the coordinator restores it again
        rt.kill_reason = rt.kill_reason or why
        if not rt.exited.is_set():
            self._release(rt)
            await self.sup._kill(rt, why)
