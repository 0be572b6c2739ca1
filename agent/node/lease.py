"""The agent's lease and its self-fence.

Each agent holds a key ``<node>`` in the JetStream KV bucket ``revenant_leases``
and renews it every ``lease_renew_s``.  If it cannot renew for
``fence_timeout_s`` (shorter than the lease), measured on its own monotonic
clock, it freezes its jobs before the coordinator, which waits for the lease to
expire plus a margin, can restore them elsewhere.  That is the self-fence; the
jobs thaw only on the leader's word (agent/node/reconcile.py).

:class:`FenceClock` is the rule, free of I/O; :class:`LeaseKeeper` renews.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from revenant.common.errors import BusError, described
from revenant.common.messaging.kv import open_bucket
from revenant.messages import LeaseValue, subjects

log = logging.getLogger(__name__)


@dataclass
class FenceClock:
    """Has the lease gone unrenewed for longer than the fence timeout?"""

    fence_timeout_s: float
    last_renewed: float

    def renewed(self, now: float) -> None:
        self.last_renewed = now

    def stale_for(self, now: float) -> float:
        return now - self.last_renewed

    def must_fence(self, now: float) -> bool:
        return self.stale_for(now) > self.fence_timeout_s


class LeaseKeeper:
    def __init__(self, js: JetStreamContext, node: str, incarnation: str, *, ttl_s: float, renew_s: float,
                 fence_timeout_s: float, on_fence: Callable[[float], Awaitable[None]],
                 on_renewed_after_fence: Callable[[], Awaitable[None]],
                 on_renewed: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, replicas: int = 1) -> None:
        self._on_renewed = on_renewed
        # The bucket's replicas, where this agent creates it (one with fewer is only logged:
        # agents may not update a stream, the coordinator raises them).
        self.replicas = replicas
        self.js = js
        self.node = node
        self.incarnation = incarnation
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self.clock = clock
        self.wall_clock = wall_clock
        self.fence = FenceClock(fence_timeout_s, clock())
        self.fenced = False
        self._on_fence = on_fence
        self._on_renewed_after_fence = on_renewed_after_fence
        self._kv: KeyValue | None = None
        self._seq = 0

    async def check(self) -> bool:
        """Fence now if the lease is stale; True while fenced.  Cheap: call it before acting."""
        now = self.clock()
        if not self.fenced and self.fence.must_fence(now):
            self.fenced = True
            stale = self.fence.stale_for(now)
            log.error("lease not renewed for %.1f s (fence %.1f s): self-fencing, freezing every job",
                      stale, self.fence.fence_timeout_s)
            await self._on_fence(stale)
        return self.fenced

    async def run(self, until: asyncio.Event | None = None) -> None:
        """Renew until cancelled, or until ``until`` is set (which a cancellation swallowed by a
        request in flight cannot defeat)."""
        while until is None or not until.is_set():
            await self.check()
            if await self._renew():
                now = self.clock()
                late = self.fence.stale_for(now)
                self.fence.renewed(now)
                if not self.fenced and late > self.fence.fence_timeout_s:
                    # Renewed, but only past the fence deadline (a slow bus, a stalled thread): the jobs'
                    # dead man's switches froze them meanwhile.  Fence now, so that they thaw the one
                    # way a frozen job thaws: on the leader's word (else nothing would ever thaw them).
                    self.fenced = True
                    log.error("lease renewed only after %.1f s (fence %.1f s): treated as a self-fence",
                              late, self.fence.fence_timeout_s)
                    await self._on_fence(late)
                if self._on_renewed is not None:
                    # Every renewal resets the switches, the first after a fence too: a job the
                    # leader lets thaw before the next renewal must not find its switch stale.
                    self._on_renewed()
                if self.fenced:
                    self.fenced = False
                    log.warning("lease renewed again after a self-fence")
                    await self._on_renewed_after_fence()
            await asyncio.sleep(self.renew_s)

    async def _renew(self) -> bool:
        try:
            if self._kv is None:
                self._kv = await asyncio.wait_for(
                    open_bucket(self.js, subjects.LEASES_BUCKET, self.ttl_s, replicas=self.replicas),
                    self.renew_s * 2)
            self._seq += 1
            value = msgspec.msgpack.encode(LeaseValue(node=self.node, incarnation=self.incarnation, seq=self._seq,
                                                      at=self.wall_clock()))
            await asyncio.wait_for(self._kv.put(self.node, value), self.renew_s * 2)
            return True
        except (asyncio.TimeoutError, nats.errors.Error, BusError) as exc:
            log.debug("lease renewal failed: %s", described(exc))
            return False
