"""Where the job table lives: JetStream KV ``revenant_jobs``, behind a small Protocol.

Every write is a compare-and-set against the revision this coordinator last read
or wrote, so a deposed leader (say, one whose loop stalled past its lease) can
never overwrite what its successor wrote: the write raises :class:`WriteConflict`
with the record the store holds now, and the next :meth:`JobStore.save` of that
job is a compare-and-set against it.  Who is right is the lifecycle's rule
(:func:`revenant.coordinator.lifecycle.moved_on`), applied by the shell.

:class:`MemoryJobStore` keeps the same contract in a dict, for the lifecycle's tests.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Protocol

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from revenant.common.bus import map_exceptions
from revenant.common.errors import BusError, RevenantError
from revenant.common.kv import open_bucket
from revenant.messages import JobRecord, subjects

log = logging.getLogger(__name__)

NEXT_ID_KEY = "next-id"
# An operator's `revenant failover pause`, kept with the job table so that it outlives the leader.
HOLD_KEY = "failover-hold"
_RESERVED = (NEXT_ID_KEY, HOLD_KEY)

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


    async def next_id(self) -> str: ...
    async def load_hold(self) -> bool: ...
    async def save_hold(self, held: bool) -> None: ...


class KvJobStore:
    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self.kv: KeyValue | None = None
        self._revisions: dict[str, int] = {}

    async def open(self) -> None:
        self.kv = await open_bucket(self.js, subjects.JOBS_BUCKET, None, history=5)

    async def load(self) -> dict[str, JobRecord]:
        if self.kv is None:
            await self.open()
        assert self.kv is not None
        jobs: dict[str, JobRecord] = {}
        with map_exceptions("cannot read the job table"):
            try:
                keys = await self.kv.keys()
            except nats.js.errors.NoKeysError:
                keys = []
            for key in keys:
                if key in _RESERVED:
                    continue
                try:
                    entry = await self.kv.get(key)
                    jobs[key] = _DEC.decode(entry.value)
                    self._revisions[key] = entry.revision
                except (nats.js.errors.KeyNotFoundError, msgspec.DecodeError) as exc:
                    log.error("job table entry %s unreadable: %s", key, exc)
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

    async def next_id(self) -> str:
        assert self.kv is not None
        for attempt in range(20):
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
            await asyncio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
        raise BusError("cannot allocate a job id: the counter is contended")

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

    async def next_id(self) -> str:
        n, self._next_id = self._next_id, self._next_id + 1
        return str(n)

    async def load_hold(self) -> bool:
        return self.held

    async def save_hold(self, held: bool) -> None:
        self.held = held
