"""The engine step for the policy's pre-dump (``CRIU_PreDump``, ``CRIU_PreDumpDelay``).

With ``pre_dump``, ``criu pre-dump`` copies the job's memory while it keeps running,
``pre_dump_delay_s`` before the real dump; the dump then writes only the pages
dirtied since (``--track-mem --prev-images-dir predump``), so the job is frozen
for less.  The pre-dump's images live inside the epoch (``<epoch>/predump/``,
linked from ``<epoch>/parent``): the epoch stays self-contained.

Where the kernel has that tracking, an ``incremental`` job gets the same pre-dump
without asking: criu's own incremental dump, within the epoch.  (A chain of criu
images across epochs, ``--prev-images-dir`` to the previous epoch, is never made:
the newest epoch would then need the older ones, and failover restores the newest.)

Both need the kernel's soft-dirty tracking (criu's feature ``mem_dirty_track``).
Where it is missing, the checkpoint goes ahead as a full dump, and the job's
first such checkpoint says why in a ``degraded`` epoch event (once per job, never a
crash, never a silent no-op).  docs/configuration.md says this path is unverified
on machines without the feature, which is all of those revenant is tested on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from revenant.agent.pipeline import criu
from revenant.agent.pipeline.steps import BaseStep, DumpContext
from revenant.agent.processes import procs
from revenant.agent.storage.private import DUMP_UMASK, private_dir
from revenant.common.errors import CriuError

log = logging.getLogger(__name__)

NO_TRACKING = ("pre-dump needs the kernel's soft-dirty memory tracking (criu check --feature "
               "mem_dirty_track fails on this node): checkpoints are full dumps")


class PreDumpStep(BaseStep):
    name = "pre-dump"

    def __init__(self, criu_path: str, dirty_tracking: bool, degraded: Callable[[str, int, str], None],
                 timeout_s: float = 3600.0, sleep: Callable[[float], object] = asyncio.sleep) -> None:
        self.criu = criu_path
        self.dirty_tracking = dirty_tracking
        # degraded(job, generation, why): the agent's "degraded" epoch event.
        self.degraded = degraded
        self.timeout_s = timeout_s
        self.sleep = sleep
        self._told: set[str] = set()

    def forget(self, job: str) -> None:
        self._told.discard(job)

    async def before_dump(self, ctx: DumpContext) -> None:
        policy = ctx.policy
        if policy is None or not (policy.pre_dump or (policy.incremental and self.dirty_tracking)):
            return
        if not self.dirty_tracking:
            if ctx.job not in self._told:
                self._told.add(ctx.job)
                self.degraded(ctx.job, ctx.generation, NO_TRACKING)
            return
        images = private_dir(ctx.epoch_tmp / criu.PREDUMP_DIR)
        argv = criu.predump_argv(self.criu, pid=ctx.pid, images=images, workdir=ctx.workdir)
        done = await procs.run(argv, self.timeout_s, umask=DUMP_UMASK)
        if done.returncode != 0:
            text = criu.read_log(ctx.workdir / criu.PREDUMP_LOG, done.output)
            raise CriuError(f"criu pre-dump failed: {criu.error_line(text)}")
        await self.sleep(policy.pre_dump_delay_s)
        ctx.dump_args += criu.incremental_args()
        ctx.notes.append(f"pre-dumped {policy.pre_dump_delay_s:g} s before the dump")
