"""Leader election through a KV lease: one coordinator acts, standbys wait.

The leader holds key ``leader`` in the bucket ``revenant_leader``, whose TTL is
the lease.  It renews with a compare-and-set on the key's revision every third
of the lease; a standby tries to create the key, which succeeds only once the
leader's entry has expired.  A leader that fails to renew steps down at once,
before its lease can expire, so two leaders never act together.

Stepping down is not the end: the coordinator stays up as a standby (its node
table stays warm) and campaigns again, each term with a token of its own.
:class:`Term` holds what a coordinator does only while it leads, so that a step
down stops all of it at once.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
import time
from typing import Any, Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from revenant.common.errors import BusError, described
from revenant.common.messaging.kv import open_bucket
from revenant.messages import subjects

log = logging.getLogger(__name__)

KEY = "leader"
# A term's tasks are cancelled again at this interval until they have all ended.
REAP_INTERVAL_S = 0.5


class Term:
    """One term as the leader: its tasks and subscriptions, stopped as one when it ends."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.tasks: set[asyncio.Task[Any]] = set()
        self.subscriptions: list[Any] = []
        # Set once the term is over (a step-down or a stop).
        self.over = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None

    def add(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        if self.over.is_set():
            task.cancel()  # too late: the term ended while it was being started
        else:
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return task

    def end(self) -> None:
        """Cancel the term's tasks (idempotent); its subscriptions go with :meth:`unsubscribe`.

        Cancelled again until they have ended: Python 3.11's ``wait_for``, which nats-py awaits
        in, can swallow a cancellation that lands as its result arrives, and a task that
        swallowed one would go on leading in a standby (or hold up a shutdown)."""
        self.over.set()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks and self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap(), name=f"term-{self.number}-reaper")

    async def _reap(self) -> None:
        while self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=REAP_INTERVAL_S)
            for task in pending:
                log.warning("term %d: task %s outlived its cancellation; cancelling it again",
                            self.number, task.get_name())
                task.cancel()

    async def unsubscribe(self) -> None:
        subs, self.subscriptions = self.subscriptions, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass  # the connection is gone: so is the subscription


class Leadership:
    def __init__(self, js: JetStreamContext, name: str, lease_s: float, *,
                 on_elected: Callable[[], Awaitable[None]], on_deposed: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic, replicas: int = 1,
                 quiet_moment: Callable[[], object] = lambda: None) -> None:
        # Called where a pause costs least: right after a renewal, or a campaign someone else won.
        self.quiet_moment = quiet_moment
        self.js = js
        self.replicas = replicas  # of the leader bucket (an existing one with fewer is raised)
        self.name = name
        self.lease_s = lease_s
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.clock = clock
        self.leader = False
        self._revision = 0
        self._renewed_at = 0.0
        # What this coordinator writes into the key: its name and a token of this term, so that
        # even two coordinators given the same name never mistake each other's term for theirs.
        self.value = self._new_value()
        self._kv = None
        # Why it last stepped down; terms won (a step-down ends one, a new election starts the next).
        self.why = ""
        self.terms = 0
        # This leader's term cluster-wide (0: none yet): when the leader bucket was made, in Unix
        # seconds, above the leader key's revision at the election (both only grow; the first
        # still grows if the bucket is made anew, a JetStream store wiped).
        self.term = 0
        self._wake = asyncio.Event()

    def _new_value(self) -> bytes:
        return f"{self.name} {secrets.token_hex(8)}".encode()

    def fresh(self) -> bool:
        """Whether this coordinator may act now: it leads, and renewed within 2/3 of the lease
        (on its own clock).  A leader whose loop stalled past that wakes up unable to act
        before its renew loop notices, and a successor is elected only once the whole lease
        has run out since the last renewal (the store's TTL): a third of it is the margin."""
        return self.leader and self.clock() - self._renewed_at < self.lease_s * 2 / 3

    def step_down(self, why: str) -> None:
        """Another coordinator leads, or this one could not renew: stop acting at once.  It stays
        a standby and campaigns again (:meth:`run`)."""
        if self.leader:
            log.error("stepping down: %s", why)
            self.why = why
            self.value = self._new_value()  # the next term is a new one, even in this process
            self._wake.set()  # campaign again now, not after the leader's sleep
        self.leader = False
        self.on_deposed()

    async def holds(self) -> bool | None:
        """Whether the store says this coordinator leads now (not what it last believed);
        None if the store could not be asked."""
        if self._kv is None or not self.leader:
            return False
        try:
            entry = await asyncio.wait_for(self._kv.get(KEY), self.lease_s / 3)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return False  # expired: nobody leads, and certainly not a leader that failed to renew
        except (nats.errors.Error, asyncio.TimeoutError):
            return None
        return entry.value == self.value

    async def run(self) -> None:
        """Campaign, lead, step down, campaign again: until cancelled.  The bucket is opened
        (retrying) once NATS answers, so a coordinator started during an outage waits."""
        while self._kv is None:
            try:
                self._kv = await open_bucket(self.js, subjects.LEADER_BUCKET, self.lease_s, replicas=self.replicas,
                                             owner=True)
            except BusError as exc:
                log.warning("%s; retrying", exc)
                await asyncio.sleep(min(1.0, self.lease_s / 3))
        while True:
            self._wake.clear()  # before, not after: a wake-up asked for meanwhile is kept
            if self.leader:
                await self._renew(self._kv)
            else:
                await self._campaign(self._kv)
            try:
                await asyncio.wait_for(self._wake.wait(),
                                       self.lease_s / 3 if self.leader else min(0.5, self.lease_s / 3))
            except asyncio.TimeoutError:
                pass

    async def _renew(self, kv) -> None:
        started = self.clock()
        try:
            self._revision = await asyncio.wait_for(kv.update(KEY, self.value, last=self._revision),
                                                    self.lease_s / 3)
            if self.clock() - self._renewed_at > self.lease_s / 2:  # a warning sign, well before the lease is gone
                log.warning("leader lease renewed %.2f s after the last renewal (the update took %.2f s; the "
                            "lease is %.1f s)", self.clock() - self._renewed_at, self.clock() - started, self.lease_s)
            self._renewed_at = self.clock()
            self.quiet_moment()
            return
        except nats.js.errors.KeyWrongLastSequenceError:
            # The key changed: another coordinator took it (or deleted it), or an update of ours
            # that timed out did land after all.  Only the key's value can tell.
            try:
                entry = await asyncio.wait_for(kv.get(KEY), self.lease_s / 3)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                self.step_down("the leader key was deleted")
                return
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                failure = f"the leader key changed and could not be read: {described(exc)}"
            else:
                if entry is not None and entry.value == self.value:
                    self._revision = entry.revision or self._revision
                    self._wake.set()  # renew at once, against the revision that is really there
                    return
                owner = (entry.value or b"").decode(errors="replace").rsplit(" ", 1)[0] if entry else ""
                self.step_down(f"coordinator {owner} holds the leader lease" if owner
                               else "the leader key was deleted")
                return
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            failure = described(exc)
        if self.clock() - self._renewed_at > self.lease_s / 2:
            self.step_down(f"lost the leader lease ({failure})")

    async def _bucket_made(self) -> int:
        """When the leader bucket was made (Unix seconds; 0: unknown)."""
        try:
            info = await asyncio.wait_for(self.js.stream_info(f"KV_{subjects.LEADER_BUCKET}"), self.lease_s / 3)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("cannot read when the leader bucket was made (%s): this term counts from 0", described(exc))
            return 0
        made = info.created
        if isinstance(made, str):  # RFC 3339, to the nanosecond
            made = datetime.datetime.fromisoformat(made[:19]).replace(tzinfo=datetime.timezone.utc)
        return int(made.timestamp()) if isinstance(made, datetime.datetime) else 0

    async def _campaign(self, kv) -> None:
        try:
            self._revision = await asyncio.wait_for(kv.create(KEY, self.value), self.lease_s / 3)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError):
            self.quiet_moment()
            return  # someone else leads
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.debug("leader election: %s", described(exc))
            return
        self._renewed_at = self.clock()
        term = (await self._bucket_made() << 32) | self._revision
        self.term, self.leader = term, True  # never a leader without its term (a read of the bucket waits)
        self.terms += 1
        log.warning("coordinator %s is the leader (term %d here, %d in the cluster)", self.name, self.terms,
                    self.term)
        await self.on_elected()
