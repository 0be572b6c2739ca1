"""Where the job table lives: JetStream KV ``revenant_jobs``, behind a small Protocol.

Finished jobs move, after ``job_retention_s``, to the bucket ``revenant_jobs_archive``
(:mod:`revenant.coordinator.table.archive`), where ``show job`` still finds them; a purge removes
a job's record from either.

Every write is a compare-and-set against the revision this coordinator last read
or wrote, so a deposed leader (say, one whose loop stalled past its lease) can
never overwrite what its successor wrote: the write raises :class:`WriteConflict`
with the record the store holds now, and the next :meth:`JobStore.save` of that
job is a compare-and-set against it.  Who is right is the lifecycle's rule
(:func:`revenant.coordinator.table.lifecycle.moved_on`), applied by the shell.

:class:`MemoryJobStore` keeps the same contract in a dict, for the lifecycle's tests.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Awaitable, Callable, Protocol, TypeVar

import msgspec
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from revenant.common.errors import BusError, RevenantError
from revenant.common.messaging.bus import map_exceptions
from revenant.common.messaging.kv import open_bucket
from revenant.messages import JobRecord, subjects

log = logging.getLogger(__name__)

ARCHIVE_BUCKET = "revenant_jobs_archive"
NEXT_ID_KEY = "next-id"
# An operator's `revenant failover pause`, kept with the job table so that it outlives the leader.
HOLD_KEY = "failover-hold"
_RESERVED = (NEXT_ID_KEY, HOLD_KEY)
# Id allocation is a compare-and-set on NEXT_ID_KEY.  This coordinator allocates one id at a
# time (so its own submits never contend), and retries with jittered exponential backoff
# against another coordinator's (a deposed leader's) allocations: NEXT_ID_ATTEMPTS tries
# over about two seconds at most.
NEXT_ID_ATTEMPTS = 12
# Loading the table: the longest wait for the next record before giving up.
LOAD_STALL_S = 10.0
# A table read empty while its stream lists keys: how often it is read again, and how many keys
# are looked at to tell live records from deleted ones.
EMPTY_READ_ATTEMPTS = 20
EMPTY_READ_PROBES = 50
NEXT_ID_BACKOFF_S = (0.002, 0.25)

# How long a write of what a node already did waits for a job table that does not answer (a
# JetStream stream whose leader died elects another within seconds: 4 to 10 s seen), asking
# again after the first delay, then twice as long each time up to the second.
PATIENCE_S = 30.0
PATIENCE_DELAYS_S = (0.25, 2.0)

T = TypeVar("T")

_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(JobRecord)


class WriteConflict(RevenantError):
    """The record changed in the store since this coordinator last read or wrote it."""

    code = "write_conflict"
    retriable = True

    def __init__(self, job: str, stored: JobRecord | None, revision: int | None) -> None:
        super().__init__(f"job {job} was changed in the job table by another coordinator")
        self.job = job
        self.stored = stored
        # The stored record's revision (None: the key is gone).
        self.revision = revision


class JobStore(Protocol):
    async def load(self) -> dict[str, JobRecord]: ...

    async def save(self, rec: JobRecord) -> None:
        """Compare-and-set against the revision last read or written; :class:`WriteConflict` if
        the record changed since (the revision expected stays as it was)."""

    def accept(self, conflict: WriteConflict) -> None:
        """Take the conflicting record's revision as the one the next save compares against."""


    async def archive(self, rec: JobRecord) -> None:
        """Copy ``rec`` to the archive, then remove it from the live table (compare-and-set:
        :class:`WriteConflict` if it changed since, and then it stays live)."""

    async def load_archived(self, job: str) -> JobRecord | None: ...

    async def remove(self, job: str) -> None:
        """Remove the job's record from the live table (compare-and-set, as :meth:`save`) and
        from the archive."""

    async def next_id(self) -> str: ...
    async def load_hold(self) -> bool: ...
    async def save_hold(self, held: bool) -> None: ...


class Unsettled(BusError):
    """A write that met another coordinator's (moved on, or changing): the caller's to decide,
    never asked again blindly."""


async def patiently(write: Callable[[], Awaitable[T]], what: str, patience_s: float = PATIENCE_S, *,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> T:
    """``write()``, tried again for up to ``patience_s`` while the store does not answer
    (:class:`BusError`: its stream electing a leader, say).  For what a node already did (a
    launch, a dump, a restore), which the record must learn: given up at once, the job would stay
    "checkpointing" or "restoring" for the rest of the leader's term.  Any other error (this
    coordinator does not lead, the job is gone) is raised at once."""
    (delay, most), deadline = PATIENCE_DELAYS_S, clock() + patience_s
    while True:
        try:
            return await write()
        except Unsettled:
            raise
        except BusError as exc:
            if clock() + delay > deadline:
                raise
            log.warning("%s: the job table does not answer (%s); trying again", what, exc)
        await sleep(delay)
        delay = min(delay * 2, most)


class KvJobStore:
    def __init__(self, js: JetStreamContext, replicas: int = 1) -> None:
        self.js = js
        # The buckets' replicas: an existing bucket with fewer is raised to this many.
        self.replicas = replicas
        self.kv: KeyValue | None = None
        self.archive_kv: KeyValue | None = None
        self._revisions: dict[str, int] = {}
        self._id_lock = asyncio.Lock()

    async def open(self) -> None:
        self.kv = await open_bucket(self.js, subjects.JOBS_BUCKET, None, history=5, replicas=self.replicas,
                                    owner=True)
        self.archive_kv = await open_bucket(self.js, ARCHIVE_BUCKET, None, history=1, replicas=self.replicas,
                                            owner=True)

    async def load(self) -> dict[str, JobRecord]:
        """Every job's newest record.  A server that has just restarted may report a stream with
        nothing pending to a new reader for a moment, and the read would end at once: a table read
        empty is read again while the stream holds a live record, then refused (never led blind)."""
        for attempt in range(EMPTY_READ_ATTEMPTS):
            jobs = await self._read()
            if jobs or not await self._holds_a_record():
                return jobs
            log.warning("the job table read empty but its stream holds records; reading it again")
            await asyncio.sleep(0.5)
        raise BusError("cannot read the job table: its stream holds records, but reading it returned none")

    async def _holds_a_record(self) -> bool:
        """Whether some key of the job table (not a reserved one) has a live value."""
        assert self.kv is not None
        with map_exceptions("cannot read the job table"):
            info = await self.js.stream_info(f"KV_{subjects.JOBS_BUCKET}",
                                             subjects_filter=f"$KV.{subjects.JOBS_BUCKET}.>")
            keys = [s.split(".", 2)[2] for s in (info.state.subjects or {})]
            for key in [k for k in keys if k not in _RESERVED][:EMPTY_READ_PROBES]:
                try:
                    await self.kv.get(key)
                    return True
                except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                    continue
        return False

    async def _read(self) -> dict[str, JobRecord]:
        if self.kv is None:
            await self.open()
        assert self.kv is not None
        jobs: dict[str, JobRecord] = {}
        revisions: dict[str, int] = {}
        with map_exceptions("cannot read the job table"):
            # One ordered pass over every key's newest value (a get per key would take minutes
            # for 100,000 jobs); the watcher's first None marks the end of what is stored.
            watcher = await self.kv.watchall(ignore_deletes=True)
            try:
                while (entry := await watcher.updates(timeout=LOAD_STALL_S)) is not None:
                    if entry.key in _RESERVED:
                        continue
                    try:
                        jobs[entry.key] = _DEC.decode(entry.value)
                        revisions[entry.key] = entry.revision
                    except msgspec.DecodeError as exc:
                        log.error("job table entry %s unreadable: %s", entry.key, exc)
            finally:
                await watcher.stop()
        # What was read is all this coordinator knows: a key removed meanwhile has no revision.
        self._revisions = revisions
        return jobs

    async def save(self, rec: JobRecord) -> None:
        assert self.kv is not None
        key = rec.spec.id
        value = _ENC.encode(rec)
        last = self._revisions.get(key)
        with map_exceptions(f"cannot save job {key}"):
            try:
                if last is None:
                    self._revisions[key] = await self.kv.create(key, value)
                else:
                    self._revisions[key] = await self.kv.update(key, value, last=last)
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                pass
            try:
                entry = await self.kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                raise WriteConflict(key, None, None) from None
        try:
            stored = _DEC.decode(entry.value)
        except msgspec.DecodeError as exc:
            raise BusError(f"cannot save job {key}: the stored record is unreadable ({exc})") from None
        raise WriteConflict(key, stored, entry.revision)

    def accept(self, conflict: WriteConflict) -> None:
        if conflict.revision is None:
            self._revisions.pop(conflict.job, None)
        else:
            self._revisions[conflict.job] = conflict.revision

    async def archive(self, rec: JobRecord) -> None:
        assert self.kv is not None and self.archive_kv is not None
        key = rec.spec.id
        with map_exceptions(f"cannot archive job {key}"):
            await self.archive_kv.put(key, _ENC.encode(rec))
        try:
            await self._remove_live(key)
        except WriteConflict:
            with map_exceptions(f"cannot archive job {key}"):
                await self.archive_kv.purge(key)  # the live record, newer, stays the only one
            raise

    async def load_archived(self, job: str) -> JobRecord | None:
        assert self.archive_kv is not None
        with map_exceptions(f"cannot read the job archive for job {job}"):
            try:
                entry = await self.archive_kv.get(job)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError, nats.js.errors.InvalidKeyError):
                return None
        try:
            return _DEC.decode(entry.value)
        except msgspec.DecodeError as exc:
            raise BusError(f"job {job}: its archived record is unreadable ({exc})") from None

    async def remove(self, job: str) -> None:
        assert self.archive_kv is not None
        if job in self._revisions:
            try:
                await self._remove_live(job)
            except WriteConflict as conflict:
                if conflict.stored is not None:
                    raise
        with map_exceptions(f"cannot remove job {job} from the archive"):
            await self.archive_kv.purge(job)

    async def _remove_live(self, key: str) -> None:
        """Purge ``key`` (its history too) if its revision is still the one last read or written."""
        assert self.kv is not None
        last = self._revisions.get(key)
        headers = {"KV-Operation": "PURGE", api.Header.ROLLUP: "sub",
                   api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last or 0)}
        with map_exceptions(f"cannot remove job {key} from the job table"):
            try:
                await self.js.publish(f"$KV.{subjects.JOBS_BUCKET}.{key}", b"", headers=headers)
                self._revisions.pop(key, None)
                return
            except nats.js.errors.APIError as exc:
                if exc.err_code not in (10071, 10164):  # wrong last sequence
                    raise
            try:
                entry = await self.kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                self._revisions.pop(key, None)
                raise WriteConflict(key, None, None) from None  # removed by another coordinator
        try:
            stored = _DEC.decode(entry.value)
        except msgspec.DecodeError as exc:
            raise BusError(f"cannot remove job {key}: the stored record is unreadable ({exc})") from None
        raise WriteConflict(key, stored, entry.revision)

    async def next_id(self) -> str:
        assert self.kv is not None
        async with self._id_lock:
            delay_s, most_s = NEXT_ID_BACKOFF_S
            for _ in range(NEXT_ID_ATTEMPTS):
                with map_exceptions("cannot allocate a job id"):
                    try:
                        entry = await self.kv.get(NEXT_ID_KEY)
                        n = int(entry.value or b"1")
                        await self.kv.update(NEXT_ID_KEY, str(n + 1).encode(), last=entry.revision)
                        return str(n)
                    except nats.js.errors.KeyNotFoundError:
                        try:
                            await self.kv.create(NEXT_ID_KEY, b"2")
                            return "1"
                        except nats.js.errors.KeyWrongLastSequenceError:
                            pass
                    except nats.js.errors.KeyWrongLastSequenceError:
                        pass
                # Another coordinator allocated meanwhile: back off (full jitter) and try again.
                await asyncio.sleep(random.uniform(0, delay_s))
                delay_s = min(delay_s * 2, most_s)
        raise BusError(f"cannot allocate a job id: another coordinator kept changing the counter "
                       f"({NEXT_ID_ATTEMPTS} attempts); try again", retriable=True)

    async def save_hold(self, held: bool) -> None:
        assert self.kv is not None
        with map_exceptions("cannot record the failover hold"):
            if held:
                await self.kv.put(HOLD_KEY, b"held")
            else:
                await self.kv.delete(HOLD_KEY)

    async def load_hold(self) -> bool:
        assert self.kv is not None
        with map_exceptions("cannot read the failover hold"):
            try:
                return (await self.kv.get(HOLD_KEY)).value == b"held"
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                return False


class MemoryJobStore:
    """The same contract in memory: revisions, compare-and-set, conflicts."""

    def __init__(self) -> None:
        self.records: dict[str, tuple[int, bytes]] = {}
        self.archived: dict[str, bytes] = {}
        self._seen: dict[str, int] = {}
        self._revision = 0
        self._next_id = 1
        self.held = False

    def write_behind_my_back(self, rec: JobRecord) -> None:
        """Another coordinator's write (for tests)."""
        self._revision += 1
        self.records[rec.spec.id] = (self._revision, _ENC.encode(rec))

    async def load(self) -> dict[str, JobRecord]:
        self._seen = {k: rev for k, (rev, _) in self.records.items()}
        return {k: _DEC.decode(v) for k, (_, v) in self.records.items()}

    async def save(self, rec: JobRecord) -> None:
        key = rec.spec.id
        current = self.records.get(key)
        if (current[0] if current else None) != self._seen.get(key):
            if current is None:
                raise WriteConflict(key, None, None)
            raise WriteConflict(key, _DEC.decode(current[1]), current[0])
        self._revision += 1
        self.records[key] = (self._revision, _ENC.encode(rec))
        self._seen[key] = self._revision

    def accept(self, conflict: WriteConflict) -> None:
        if conflict.revision is None:
            self._seen.pop(conflict.job, None)
        else:
            self._seen[conflict.job] = conflict.revision

    def _check_unchanged(self, key: str) -> None:
        current = self.records.get(key)
        if (current[0] if current else None) != self._seen.get(key):
            if current is None:
                raise WriteConflict(key, None, None)
            raise WriteConflict(key, _DEC.decode(current[1]), current[0])

    async def archive(self, rec: JobRecord) -> None:
        key = rec.spec.id
        self._check_unchanged(key)
        self.archived[key] = _ENC.encode(rec)
        self.records.pop(key, None)
        self._seen.pop(key, None)

    async def load_archived(self, job: str) -> JobRecord | None:
        data = self.archived.get(job)
        return None if data is None else _DEC.decode(data)

    async def remove(self, job: str) -> None:
        if job in self._seen:
            try:
                self._check_unchanged(job)
            except WriteConflict as conflict:
                if conflict.stored is not None:
                    raise
            self.records.pop(job, None)
            self._seen.pop(job, None)
        self.archived.pop(job, None)

    async def next_id(self) -> str:
        n, self._next_id = self._next_id, self._next_id + 1
        return str(n)

    async def load_hold(self) -> bool:
        return self.held

    async def save_hold(self, held: bool) -> None:
        self.held = held
