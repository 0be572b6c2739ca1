"""A job's checkpoint policy (JobSpec.policy) around the engine, on the agent.

Before a checkpoint: the load gate (agent/checkpointing/load.py).  A scheduled checkpoint of a
``load_aware`` job is refused while the node is over a threshold (a ``skipped``
epoch event, and CheckpointSkipped to the coordinator, which tries again on
schedule); after more than three in a row one is taken anyway (a ``forced``
event); a manual one always goes ahead, with a warning in its reply's notes.

After a checkpoint committed: retention, then, for an ``incremental`` job, the
epochs the new one superseded become deltas (agent/storage/packs.py), in a task of their
own once the checkpoint has replied: never while the job is frozen, never on
the reply's path.

Retention, each conversion, pack collection, restores and a purge of one job are
serialised by the job's lock: an asyncio lock within the agent, and an flock on
``epochs/.lock`` across nodes (the job's previous node may still be converting
when it has moved).  The lock is taken per epoch converted, so a checkpoint's
retention or a restore waits for one epoch's conversion at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from typing import AsyncIterator, Callable

from revenant.agent.checkpointing.checkpoints import CheckpointBook, Why
from revenant.agent.checkpointing.load import LoadGate, LoadSampler
from revenant.agent.storage import packs
from revenant.agent.storage.epochs import CorruptEpoch, JobFiles, Manifest
from revenant.agent.storage.private import PRIVATE_FILE
from revenant.common.errors import CheckpointSkipped
from revenant.messages import CheckpointPolicy, EpochInfo, Message

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
_LOCK_POLL_S = 0.05


def try_storage_lock(files: JobFiles) -> int | None:
    """The job's lock on shared storage (flock on ``epochs/.lock``), without waiting: its
    descriptor, None while another holds it, -1 for a job with no epochs (nothing to guard) or
    on storage that cannot lock (ENOLCK: an NFS mount without its lock manager; then only this
    agent's own lock serialises, and docs/configuration.md says to give the storage locks)."""
    try:
        fd = os.open(files.epochs_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
    except FileNotFoundError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as exc:
        os.close(fd)
        log.warning("job %s: %s cannot be locked (%s); going on without the storage's lock", files.job,
                    files.epochs_dir / LOCK_FILE, exc)
        return -1


class PolicyRunner:
    def __init__(self, node: str, book: CheckpointBook, emit: Callable[[str, Message], None],
                 sampler: LoadSampler | None = None, gate: LoadGate | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.node = node
        self.book = book
        self.emit = emit
        self.sampler = sampler or LoadSampler()
        self.gate = gate or LoadGate()
        self.wall_clock = wall_clock
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def lock(self, files: JobFiles) -> AsyncIterator[None]:
        """The job's lock: this agent's first, then the storage's (polled: cancellable)."""
        async with self._locks.setdefault(files.job, asyncio.Lock()):
            while (fd := try_storage_lock(files)) is None:
                await asyncio.sleep(_LOCK_POLL_S)
            try:
                yield
            finally:
                if fd >= 0:
                    os.close(fd)

    def event(self, job: str, kind: str, generation: int, **kw) -> None:
        self.book._epoch_event(job, kind, generation, **kw)

    def forget(self, job: str) -> None:
        self.gate.forget(job)
        lock = self._locks.get(job)
        if lock is not None and not lock.locked():
            del self._locks[job]

    # ------------------------------------------------------------------ before

    def admit(self, job: str, generation: int, policy: CheckpointPolicy, *, scheduled: bool,
              force: bool) -> list[str]:
        """Whether the checkpoint goes ahead under the node's load: raises CheckpointSkipped, or
        returns the warnings its reply carries."""
        decision = self.gate.decide(job, scheduled=scheduled, force=force, averages=self.sampler.averages(),
                                    policy=policy)
        if decision.skip:
            self.event(job, "skipped", generation, reason=decision.reason)
            raise CheckpointSkipped(f"scheduled checkpoint of job {job} skipped: node {self.node} is over a "
                                    f"load threshold ({decision.reason}); the next is tried on schedule")
        if decision.forced:
            log.warning("job %s: %s", job, decision.reason)
            self.event(job, "forced", generation, reason=decision.reason)
        return [f"warning: {decision.reason}"] if decision.reason else []

    # ------------------------------------------------------------------ after

    async def committed(self, files: JobFiles, generation: int, manifest: Manifest, max_epochs: int,
                        policy: CheckpointPolicy, why: Why | None = None
                        ) -> tuple[EpochInfo, list[int], list[EpochInfo], int]:
        """Record the epoch and apply retention (under the job's lock); start the conversion of
        the epochs it superseded (after a vacate too: the job's next node waits on the lock for
        at most one epoch's conversion).  The epoch's info, the numbers pruned, every kept
        epoch's info and the job's storage bytes."""
        async with self.lock(files):
            info, pruned = await self.book.committed(files, generation, manifest, max_epochs, **(why or {}))
            if pruned and not policy.incremental and files.packs_dir.is_dir():
                # the working directory's packs only the pruned epochs read (an incremental job's:
                # after its conversions)
                await asyncio.to_thread(packs.gc, files)
            kept, storage = await asyncio.to_thread(self.listing, files)
        if policy.incremental and not manifest.encryption:  # encrypted epochs are kept whole (sealed.py)
            task = asyncio.create_task(self._convert(files, generation, policy.full_every, policy.pack_compression),
                                       name=f"convert-{files.job}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return info, pruned, kept, storage

    def listing(self, files: JobFiles) -> tuple[list[EpochInfo], int]:
        """Every kept epoch's info with its own bytes, and the job's storage (shared pages once)."""
        storage, own, where = packs.usage_detail(files)
        out = []
        for n in files.committed():
            try:
                m = files.read_manifest(n)
            except CorruptEpoch:
                continue
            info = files.info(m)
            info.own_bytes = own.get(n, info.bytes)
            info.incremental = packs.converted(m)
            info.plain_bytes, info.packed_bytes, info.newer_bytes = where.get(n, [0, 0, 0])
            out.append(info)
        return out, storage

    async def described(self, files: JobFiles, m: Manifest) -> EpochInfo:
        """Epoch ``m``'s info with its own bytes, as a listing has it (a restore's reply), from its
        manifest: the whole listing resolves every delta's pages, which would delay the reply by a
        second or so per GiB-epoch.  A plain epoch's (a failover's: the newest) are its files; a
        delta's are not counted (0), and the job table keeps what its conversion reported."""
        info = files.info(m)
        if packs.converted(m):
            info.incremental = True
            return info
        info.own_bytes = sum(f.size for f in m.files.values())
        info.plain_bytes = sum(f.size for name, f in m.files.items() if packs.is_pages(name))
        return info

    async def _convert(self, files: JobFiles, generation: int, full_every: int, compression: str) -> None:
        done = []
        try:
            for n in files.committed()[:-1]:  # the newest stays plain: failover restores it at full speed
                async with self.lock(files):  # one epoch at a time: a commit or a restore gets in between
                    if n == files.committed()[-1]:
                        break  # pruned meanwhile, down to this one: it is the newest now
                    result = await asyncio.to_thread(packs.convert, files, n, full_every, None,
                                                     "" if compression == "none" else compression, False)
                if result.converted:
                    log.info("job %s: epoch %d is a delta now (%d of %d pages new, %.2f s)",
                             files.job, n, result.new_pages, result.pages, result.seconds)
                    done.append(result)
                elif result.note and result.note != "already converted":
                    log.warning("job %s: epoch %d not converted: %s", files.job, n, result.note)
            async with self.lock(files):
                await asyncio.to_thread(packs.gc, files)
                storage, own, where = await asyncio.to_thread(packs.usage_detail, files)
        except (OSError, IndexError) as exc:
            log.warning("job %s: converting its older epochs failed (they stay as they are): %s", files.job, exc)
            return
        for result in done:  # the coordinator's listing follows these (own bytes, the job's storage)
            self.event(files.job, "converted", generation, n=result.epoch, bytes=own.get(result.epoch, 0),
                       duration_s=result.seconds, storage_bytes=storage, placement=where)

    async def idle(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the conversions under way (an agent stopping lets them
        finish, so their events go out; one cut short is harmless, see agent/storage/packs.py)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
