"""The engine's storage guard: a dump the storage cannot hold is refused before it starts.

A dump that runs out of space halfway has already frozen the job and written GiBs
for nothing (and criu's failure is the only notice).  Before criu runs, the image
size is estimated (the job tree's resident memory, its GPU memory where the node
knows it) and compared with the free space where the images go (the epoch's
storage, and the staging directory too when there is one).  Short of the estimate
plus a margin, the checkpoint fails with both numbers; the job keeps running and
its earlier epochs are untouched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import psutil

from revenant.agent.pipeline.steps import BaseStep, DumpContext
from revenant.agent.processes.procs import tree_pids
from revenant.common.errors import RevenantError

# Room kept on top of the estimate: a tenth of it, and at least this much (criu's own
# images, the job's file copies, the manifest).
MARGIN_FRACTION = 0.10
MIN_MARGIN_BYTES = 64 * 1024**2


class NotEnoughSpace(RevenantError):
    code = "no_space"


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def resident_bytes(pid: int) -> int:
    """The resident memory of ``pid`` and its descendants (what criu's pages-*.img will hold,
    at most: shared pages counted in each process, as criu dumps them in each)."""
    total = 0
    for p in tree_pids(pid):
        try:
            total += psutil.Process(p).memory_info().rss
        except psutil.Error:
            continue  # exited meanwhile
    return total


def needed_bytes(estimate: int) -> int:
    return estimate + max(int(estimate * MARGIN_FRACTION), MIN_MARGIN_BYTES)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class StorageGuard(BaseStep):
    name = "storage-guard"

    def __init__(self, gpu_bytes: Callable[[str], int] | None = None,
                 resident: Callable[[int], int] = resident_bytes, free: Callable[[Path], int] = free_bytes) -> None:
        # gpu_bytes(job): the GPU memory the job's processes hold, from the node's latest
        # readings (0 where unknown).
        self.gpu_bytes = gpu_bytes
        self.resident = resident
        self.free = free

    async def before_dump(self, ctx: DumpContext) -> None:
        memory = self.resident(ctx.pid)
        gpu = self.gpu_bytes(ctx.job) if self.gpu_bytes is not None else 0
        need = needed_bytes(memory + gpu)
        for place in sorted({ctx.epoch_tmp, ctx.files.epochs_dir}):  # staging, and the storage
            try:
                free = self.free(place)
            except OSError:
                continue  # the dump itself will say what is wrong with it
            if free < need:
                what = f"resident memory {_gib(memory)}" + (f" + GPU memory {_gib(gpu)}" if gpu else "")
                raise NotEnoughSpace(
                    f"not enough space for the checkpoint of job {ctx.job}: {place} has {free} bytes "
                    f"({_gib(free)}) free, the checkpoint needs about {need} bytes ({_gib(need)}: {what} "
                    f"and a margin); the job keeps running")
