"""Lazily restored jobs whose pages are still arriving (agent/checkpointing/engine.py ``LazyFetch``).

A lazy restore hands the job back running while criu's lazy-pages daemon fetches its memory
on demand and in the background, and the page data is checked against the epoch's checksums
alongside (agent/lazyrestore/lazy.py).  Here, per job:

* all pages in and verified: a ``restore_completed`` job event (seconds, bytes);
* the page data fails its checksum, or the daemon died or ended short (its missing pages would
  read as zeros): the job is SIGKILLed as soon as that is known, then reported ``evicted``, so
  the coordinator restores it again.  A corrupt epoch is deleted first (retention's rule for a
  corrupt epoch, with its ``pruned`` event), so that restore falls back to the next older one;
  after any other failure the job's next restore is eager.  The check reads whole files: a page
  read before its file's check ends was served unchecked, and the restore that follows rolls
  back whatever the job wrote meanwhile (a delta's pages are each checked before they are
  served: agent/lazyrestore/deltaserve.py);
* the job's exit is held back until then (one on zero pages is the fetch's failure), and a
  checkpoint waits for the fetch (a dump of a half-fetched job would hold zero pages);
* the job's storage lock is held, so no conversion or purge touches the epoch being served.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from revenant.agent.lazyrestore import lazy
from revenant.agent.processes.procs import signal_tree
from revenant.common.errors import JobNotRunning, RevenantError

if TYPE_CHECKING:
    from revenant.agent.lazyrestore.lazy import LazyFetch

log = logging.getLogger(__name__)

# How long a checkpoint waits for a lazily restored job's last page (a GiB takes about a second).
FETCH_WAIT_S = 300.0
# A job that exits while its pages arrive: how long its exit waits for the fetch's verdict (an
# exit on zero pages is the fetch's failure, and the daemon's death is seen within this).
EXIT_GRACE_S = 1.0


@dataclass
class _Fetch:
    generation: int
    task: asyncio.Task[None]
    done: asyncio.Event = field(default_factory=asyncio.Event)


class PageFetches:
    """``sup``: the job supervisor (agent/running/jobs.py): its ``jobs``, ``policies``, ``book``,
    ``_event``, ``_kill`` and ``_report_exit``."""

    def __init__(self, sup: Any) -> None:
        self.sup = sup
        self._fetches: dict[str, _Fetch] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, rt: Any, fetch: LazyFetch | None) -> None:
        if fetch is None:
            return
        rt.vacating = True  # its exit is held back until the fetch has ended
        task = asyncio.create_task(self._run(rt, fetch))
        self._fetches[rt.spec.id] = f = _Fetch(rt.generation, task)
        self._tasks.add(task)
        task.add_done_callback(lambda t: (f.done.set(), self._tasks.discard(t)))

    async def wait(self, rt: Any, timeout_s: float) -> None:
        """Return once ``rt``'s pages are all in (at once if it was not restored lazily); raise if
        the job did not come out of it running as it was."""
        f = self._fetches.get(rt.spec.id)
        if f is None or f.done.is_set():
            return
        try:
            await asyncio.wait_for(f.done.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise RevenantError(f"job {rt.spec.id} is still fetching its pages after a lazy restore "
                                f"({timeout_s:g} s); no checkpoint before they are all in", code="busy",
                                retriable=True) from None
        if self.sup.jobs.get(rt.spec.id) is not rt or rt.exited.is_set():
            raise JobNotRunning(f"job {rt.spec.id} ended while its pages arrived")
        if rt.frozen_at is not None:
            raise RevenantError(f"job {rt.spec.id} is frozen (node {self.sup.node}'s lease lapsed); it can be "
                                "checkpointed once the leader lets it thaw", code="frozen", retriable=True)

    async def stop(self) -> None:
        """Cancel every fetch (the agent stops: its jobs die with it)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, rt: Any, fetch: LazyFetch) -> None:
        try:
            async with self.sup.policies.lock(rt.files):
                await self._finish(rt, fetch)
        finally:
            await asyncio.shield(fetch.close())
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

    async def _verdict(self, rt: Any, fetch: LazyFetch) -> lazy.LazyResult | None:
        """The fetch's outcome, or None when the job ended first and the fetch had nothing
        against it within EXIT_GRACE_S (its exit is then its own)."""
        result = asyncio.ensure_future(fetch.wait())
        ended = asyncio.ensure_future(rt.exited.wait())
        try:
            await asyncio.wait({result, ended}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                await asyncio.wait({result}, timeout=EXIT_GRACE_S)
            if result.done():
                return result.result()
            return None
        finally:
            ended.cancel()
            if not result.done():
                result.cancel()
                await asyncio.shield(fetch.abort())

    async def _finish(self, rt: Any, fetch: LazyFetch) -> None:
        job, n = rt.spec.id, fetch.manifest.epoch
        try:
            result = await self._verdict(rt, fetch)
        except BaseException:
            await asyncio.shield(fetch.abort())
            raise
        if result is None or (result.ok and rt.exited.is_set()):
            return
        if result.ok:
            log.info("job %s: all pages of epoch %d in, %.1f MiB in %.3f s", job, n, result.bytes / 2**20,
                     result.seconds)
            self.sup._event(rt, "restore_completed", epoch=n, duration_s=result.seconds, bytes=result.bytes)
            return
        on_purpose = rt.killing  # killed (a kill, a newer generation) while its pages came: that is its end
        if not on_purpose:
            rt.evicted = True  # however it ends now, the coordinator restores it again
            if not rt.exited.is_set():
                signal_tree(rt.pid, signal.SIGKILL)  # first of all: it must not run on without its pages
        pointer = await fetch.failed()
        if on_purpose:
            return
        why = f"lazy restore of epoch {n} failed: {result.error}{pointer}"
        if result.corrupt and await asyncio.to_thread(rt.files.delete_epoch, n):
            why += f"; epoch {n} deleted, the next restore falls back to an older one"
            self.sup.book._epoch_event(job, "pruned", rt.generation, n=n)
        elif not result.corrupt:
            await asyncio.to_thread(lazy.mark_eager_next, rt.files)
            why += "; its next restore is eager"
        log.error("job %s: %s; killed", job, why)
        rt.kill_reason = rt.kill_reason or why
        if not rt.exited.is_set():
            self._release(rt)
            await self.sup._kill(rt, why)
