"""Leader election through a KV lease: one coordinator acts, standbys wait.

The leader holds key ``leader`` in the bucket ``revenant_leader``, whose TTL is
the lease.  It renews with a compare-and-set on the key's revision every third
of the lease; a standby tries to create the key, which succeeds only once the
leader's entry has expired.  A leader that fails to renew steps down at once,
before its lease can expire, so two leaders never act together.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from revenant.common.kv import open_bucket
from revenant.messages import subjects

log = logging.getLogger(__name__)

KEY = "leader"


class Leadership:
    def __init__(self, js: JetStreamContext, name: str, lease_s: float, *,
                 on_elected: Callable[[], Awaitable[None]], on_deposed: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.js = js
        self.name = name
        self.lease_s = lease_s
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.clock = clock
        self.leader = False
        self._revision = 0
        self._renewed_at = 0.0
        # What this coordinator writes into the key: its name and a token of this run, so that
        # even two coordinators given the same name never mistake each other's term for theirs.
        self.value = f"{name} {secrets.token_hex(8)}".encode()
        self._kv = None

    def fresh(self) -> bool:
        """Whether this coordinator may act now: it leads, and renewed within 2/3 of the lease
        (on its own clock).  A leader whose loop stalled past that wakes up unable to act
        before its renew loop notices, and a successor is elected only once the whole lease
        has run out since the last renewal (the store's TTL): a third of it is the margin."""
        return self.leader and self.clock() - self._renewed_at < self.lease_s * 2 / 3

    def step_down(self, why: str) -> None:
        """Another coordinator leads (the store says so): stop acting at once."""
        if self.leader:
            log.error("stepping down: %s", why)
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
        kv = self._kv = await open_bucket(self.js, subjects.LEADER_BUCKET, self.lease_s)
        while True:
            if self.leader:
                try:
                    self._revision = await asyncio.wait_for(
                        kv.update(KEY, self.value, last=self._revision), self.lease_s / 3)
                    self._renewed_at = self.clock()
                except (nats.errors.Error, asyncio.TimeoutError) as exc:
                    if self.clock() - self._renewed_at > self.lease_s / 2:
                        self.step_down(f"lost the leader lease ({exc or type(exc).__name__})")
                        return
            else:
                try:
                    self._revision = await asyncio.wait_for(kv.create(KEY, self.value), self.lease_s / 3)
                    self._renewed_at = self.clock()
                    self.leader = True
                    log.warning("coordinator %s is the leader", self.name)
                    await self.on_elected()
                except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError):
                    pass  # someone else leads
                except (nats.errors.Error, asyncio.TimeoutError) as exc:
                    log.debug("leader election: %s", exc or type(exc).__name__)
            await asyncio.sleep(self.lease_s / 3 if self.leader else min(0.5, self.lease_s / 3))
