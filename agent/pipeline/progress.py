"""How far a long dump or restore has come, told to whoever watches it (``revenant checkpoint``
on a terminal): a ``progress.v1`` on ``revenant.progress.<user>.<job>`` about twice a second.

Best effort by design: core NATS, no reply, no retry.  A reading that cannot be taken or a
publish that fails is skipped, and never touches the dump or restore it describes.

What is measured, from outside criu (it says nothing while it runs):

* a dump: the bytes in the directory the epoch is being written to (criu's images, a
  pre-dump's, the job's own files), against the job's resident memory (the RSS of its
  processes) as the estimate of the whole;
* a restore: the memory criu has put back so far, the resident memory of the tasks it forks to
  become the job's (each reads its own pages), against the epoch's size.  (Those reads do not
  show in the tasks' /proc/<pid>/io ``rchar``: measured with criu 4.1.1.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Awaitable, Callable

import psutil

from revenant.common.errors import described
from revenant.messages import MessageError, Progress, encode, subjects

log = logging.getLogger(__name__)

# Publishes ``data`` on ``subject`` (core NATS, fire and forget).
Publish = Callable[[str, bytes], Awaitable[None]]
INTERVAL_S = 0.5


def dir_bytes(path: Path) -> int:
    """The size of the regular files under ``path`` (links not followed); what vanishes meanwhile
    counts as nothing."""
    total, pending = 0, [str(path)]
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            pending.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


class RestoredBytes:
    """How much of a job criu has restored so far: the resident memory of the tasks it is
    restoring.  Those are below ``parent`` (the agent: a restored job's root is its child), show
    no command line while criu builds them, and hold criu's log in ``workdir`` (its own, unique
    to this restore) open; each counts as last seen so, once it has become the job's process."""

    def __init__(self, workdir: Path, parent: int | None = None) -> None:
        self.workdir = str(workdir)
        self.parent = os.getpid() if parent is None else parent
        self.seen: dict[int, int] = {}
        self._others: set[int] = set()  # tasks another criu is restoring

    def __call__(self) -> int:
        try:
            below = psutil.Process(self.parent).children(recursive=True)
        except psutil.Error:
            below = []
        for proc in below:
            try:
                if proc.pid in self._others or proc.cmdline():  # criu itself, or a process that runs
                    continue
                if proc.pid not in self.seen and not self._restoring_here(proc.pid):
                    self._others.add(proc.pid)
                    continue
                self.seen[proc.pid] = proc.memory_info().rss
            except psutil.Error:
                continue
        return sum(self.seen.values())

    def _restoring_here(self, pid: int) -> bool:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return False
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(self.workdir + os.sep):
                    return True
            except OSError:
                continue
        return False


class Watch:
    """One operation's reports, until :meth:`stop`.  ``op`` may change on the way (dump, then commit)."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.task: asyncio.Task[None] | None = None

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()


class Reporter:
    """Publishes the progress of this node's dumps and restores; without ``publish``, nothing."""

    def __init__(self, node: str, publish: Publish | None = None, *, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.publish = publish
        self.interval_s = interval_s
        self.clock = clock

    def watch(self, job: str, user: str, op: str, measure: Callable[[], int],
              total: Callable[[], int] | int = 0) -> Watch:
        """Start reporting ``op`` of ``job`` (owned by ``user``): ``measure()`` the bytes so far and
        ``total`` (or ``total()``, once) the estimate of the whole; both are called off the loop."""
        watch = Watch(op)
        try:
            subject = subjects.progress(user, job)
        except MessageError:  # a user or job that cannot be a subject token: nothing to tell
            return watch
        if self.publish is not None:
            watch.task = asyncio.create_task(self._run(self.publish, watch, subject, job, measure, total),
                                             name=f"progress-{job}")
        return watch

    async def _run(self, publish: Publish, watch: Watch, subject: str, job: str, measure: Callable[[], int],
                   total: Callable[[], int] | int) -> None:
        started, failed = self.clock(), False
        whole = total if isinstance(total, int) else None
        while True:
            try:
                if whole is None:
                    whole = 0  # asked once: a failure leaves it unknown
                    whole = await asyncio.to_thread(total)  # type: ignore[arg-type]
                done = await asyncio.to_thread(measure)
                msg = Progress(job=job, op=watch.op, node=self.node, bytes=done, total_bytes=whole,
                               elapsed_s=round(self.clock() - started, 3))
                await asyncio.wait_for(publish(subject, encode(msg)), self.interval_s)
            except Exception as exc:  # best effort: a lost report changes nothing
                if not failed:
                    log.debug("job %s: progress not published: %s", job, described(exc))
                failed = True
            await asyncio.sleep(self.interval_s)
