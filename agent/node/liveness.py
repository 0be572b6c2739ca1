"""Liveness on a thread of its own: heartbeats, probe replies, the lease and the
jobs' dead man's switches.

The agent's event loop runs commands, checkpoints and health probes.  If it is
busy or stuck, it must not look dead: a false verdict would move healthy jobs.
So this thread has its own event loop and its own NATS connection.  It reports
the main loop's stall in the health it publishes (RED past ``loop_lag_red_s``),
and it is the thread that fences: when it cannot renew the lease it freezes the
jobs itself, since the main loop may be the thing that is stuck.

It knows the agent only through what its constructor is given: the values it
publishes (read through callables, each safe from this thread) and three lease
callbacks, which run on this thread:

* ``on_renewed()``: the lease was renewed; reset the jobs' dead man's switches;
* ``on_fence(stale_s)``: the lease went unrenewed too long; freeze every job now;
* ``on_lease_back()``: renewed again after a fence; report it and reconcile
  (the callback hands that to the main loop).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from typing import Callable

import msgspec
import nats.errors
import uvloop
from nats.aio.client import Client
from nats.aio.msg import Msg

from revenant.agent.node.lease import LeaseKeeper
from revenant.common.errors import described
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.common.settings.config import AgentConfig
from revenant.messages import (
    Capabilities,
    HealthSummary,
    Heartbeat,
    HeartbeatRequest,
    MessageError,
    Probe,
    ProbeReply,
    decode_as,
    encode,
    subjects,
)

log = logging.getLogger(__name__)


def published_health(health: HealthSummary, stuck_s: float, fenced: bool, red_after_s: float) -> HealthSummary:
    """The main loop's latest health as this thread publishes it: RED if that loop has been
    stuck for ``red_after_s`` or more (its own health is then stale), or if the node is fenced."""
    if stuck_s >= red_after_s:
        health = msgspec.structs.replace(health, state="RED", loop_lag_s=round(stuck_s, 3),
                                         reasons=[*health.reasons, f"event loop stuck for {stuck_s:.1f} s"])
    if fenced:
        health = msgspec.structs.replace(health, state="RED",
                                         reasons=[*health.reasons, "self-fenced: lease not renewed"])
    return health


def next_beat_at(scheduled: float, now: float, interval_s: float, jitter: float,
                 uniform: Callable[[float, float], float] = random.uniform) -> float:
    """When the heartbeat after one due at ``scheduled`` is due: one interval (+/- jitter) later,
    or one interval from ``now`` if the thread fell behind (never a burst to catch up)."""
    due = scheduled + interval_s * (1 + uniform(-jitter, jitter))
    if due < now:
        due = now + interval_s * (1 + uniform(-jitter, jitter))
    return due


FULL_FIRST = 3  # an agent's first heartbeats are full: a coordinator hears its capabilities at once


class FullBeats:
    """Which heartbeats carry health and capabilities in full (see :class:`Heartbeat`): one whose
    verdict (state, reasons, findings) or capabilities changed since the last full one, the
    first ``FULL_FIRST``, the first after a reconnect (a coordinator may have started meanwhile),
    a leaving one, and at least every ``every`` heartbeats (for the readings)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._key = b""
        self._since = 0
        self._sent = 0
        self.force = False

    def shape(self, health: HealthSummary, capabilities: Capabilities,
              leaving: bool = False) -> tuple[HealthSummary | None, Capabilities | None]:
        key = msgspec.msgpack.encode((health.state, health.reasons, health.findings, capabilities))
        self._since += 1
        if (self._sent < FULL_FIRST or self.force or leaving or key != self._key
                or self._since >= self.every):
            self._key, self._since, self.force = key, 0, False
            self._sent += 1
            return health, capabilities
        return None, None


class Liveness:
    def __init__(self, config: AgentConfig, node: str, incarnation: str, *,
                 health: Callable[[], HealthSummary],
                 capabilities: Callable[[], Capabilities],
                 stuck_for: Callable[[float], float],
                 on_renewed: Callable[[], None],
                 on_fence: Callable[[float], None],
                 on_lease_back: Callable[[], None],
                 on_heartbeat: Callable[[], None] = lambda: None,
                 on_term: Callable[[int], None] = lambda term: None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.node = node
        self.incarnation = incarnation
        self._health = health
        self._capabilities = capabilities
        self._stuck_for = stuck_for
        self._on_renewed = on_renewed
        self._on_fence = on_fence
        self._on_lease_back = on_lease_back
        self._on_heartbeat = on_heartbeat
        self._on_term = on_term
        self.clock = clock
        self.wall_clock = wall_clock
        self.seq = 0
        self._full = FullBeats(config.heartbeat_full_every)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._nc: Client | None = None
        self.lease: LeaseKeeper | None = None

    @property
    def fenced(self) -> bool:
        return self.lease is not None and self.lease.fenced

    def holds_lease(self) -> bool:
        """Whether the lease is held now: renewed within the fence's timeout, and not fenced.
        Only then may a frozen job thaw (its dead man's switch is reset only by renewals)."""
        lease = self.lease
        return lease is not None and not lease.fenced and not lease.fence.must_fence(self.clock())

    # ------------------------------------------------------------------ lifecycle (called from the main loop)

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=f"liveness-{self.node}", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._started.wait)
        if self._error is not None:
            raise self._error

    async def stop(self) -> None:
        """Say goodbye (a last ``leaving`` heartbeat) and drain; idempotent, and safe before start()."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, self.config.shutdown_grace_s + 2)

    # ------------------------------------------------------------------ the thread

    def _main(self) -> None:
        try:
            uvloop.run(self._run())
        except BaseException as exc:  # report start-up failures to start(); later ones are logged
            if not self._started.is_set():
                self._error = exc
            else:
                log.exception("liveness thread failed")
        finally:
            self._started.set()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        cfg = self.config
        self._nc = nc = await bus.connect(cfg.nats_url, f"revenant-agent-{self.node}-liveness",
                                          ping_interval_s=cfg.liveness_ping_interval_s,
                                          max_outstanding_pings=cfg.liveness_max_outstanding_pings,
                                          connect_timeout_s=cfg.liveness_connect_timeout_s,
                                          reconnect_wait_s=cfg.reconnect_wait_s,
                                          on_reconnect=self._reconnected,
                                          **security.credentials(security.agent_identity(self.node),
                                                                 cfg.nats_creds))
        self.lease = LeaseKeeper(nc.jetstream(), self.node, self.incarnation, ttl_s=cfg.lease_ttl_s,
                                 renew_s=cfg.lease_renew_s, fence_timeout_s=cfg.fence_timeout_s,
                                 on_fence=self._fence, on_renewed_after_fence=self._lease_back,
                                 on_renewed=self._on_renewed, clock=self.clock, wall_clock=self.wall_clock,
                                 replicas=bus.replicas_for(nc, cfg.nats_replicas))
        await nc.subscribe(subjects.probe(self.node), cb=self._on_probe)
        await nc.subscribe(subjects.HEARTBEAT_REQUESTS, cb=self._on_heartbeat_request)
        self._started.set()
        try:
            async with asyncio.TaskGroup() as tasks:
                beat = tasks.create_task(self._beat(), name="heartbeat")
                lease = tasks.create_task(self.lease.run(until=self._stop), name="lease")
                await self._stop.wait()
                beat.cancel()
                lease.cancel()
        finally:
            if nc.is_connected and self._stop.is_set():  # asked to stop: say goodbye (not when it broke)
                await self._publish(leaving=True)
            await bus.close(nc, cfg.shutdown_grace_s, "liveness")

    # ------------------------------------------------------------------ heartbeats and probes

    def health(self) -> HealthSummary:
        """The main loop's latest health, made RED here if that loop is stuck."""
        return published_health(self._health(), self._stuck_for(self.clock()), self.fenced,
                                self.config.loop_lag_red_s)

    async def _beat(self) -> None:
        interval, jitter = self.config.heartbeat_interval_s, self.config.heartbeat_jitter
        due = self.clock()
        stop = self._stop
        # Ends on the stop flag too: a cancellation that lands as a flush returns can be swallowed
        # (Python 3.11's wait_for), and a heartbeat loop that lives on would hold up the stop.
        while stop is None or not stop.is_set():
            assert self.lease is not None
            await self.lease.check()  # a paused agent fences before it says anything
            await self._publish()
            now = self.clock()
            due = next_beat_at(due, now, interval, jitter)
            await asyncio.sleep(due - now)

    async def _publish(self, leaving: bool = False) -> None:
        nc = self._nc
        assert nc is not None
        self.seq += 1
        health, capabilities = self._full.shape(self.health(), self._capabilities(), leaving)
        hb = Heartbeat(node=self.node, seq=self.seq, sent_at=self.wall_clock(), incarnation=self.incarnation,
                       pid=os.getpid(), interval_s=self.config.heartbeat_interval_s,
                       capabilities=capabilities, health=health, leaving=leaving)
        try:
            await nc.publish(subjects.heartbeat(self.node), encode(hb))
            self._on_heartbeat()
            if leaving:
                await nc.flush(timeout=1)
        except nats.errors.OutboundBufferLimitError:
            # Disconnected: drop it.  A heartbeat is only true when it is sent.
            log.debug("heartbeat %d dropped: not connected", self.seq)
            self._full.force = True
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("heartbeat %d not sent: %s", self.seq, described(exc))
            self._full.force = True

    async def _reconnected(self) -> None:
        # On another server, or the same one back: say so at once (the silence so far counts
        # toward a dead verdict), and in full (the coordinator may be a new one); fenced first if the
        # lease is stale (a heartbeat says the node is alive: its jobs must be frozen by then).
        self._full.force = True
        assert self.lease is not None
        await self.lease.check()
        await self._publish()

    async def _on_heartbeat_request(self, msg: Msg) -> None:
        """A coordinator (re)started or got its heartbeats back: the next heartbeat is full."""
        try:
            req = decode_as(msg.data, HeartbeatRequest)
        except MessageError as exc:
            log.debug("ignored a bad heartbeat request: %s", exc)
            return
        self._full.force = True
        if req.term:  # a new leader's announcement (only a coordinator may publish one)
            self._on_term(req.term)

    async def _on_probe(self, msg: Msg) -> None:
        try:
            decode_as(msg.data, Probe)
            reply = encode(ProbeReply(node=self.node, incarnation=self.incarnation, seq=self.seq,
                                      sent_at=self.wall_clock(), health=self.health()))
        except MessageError as exc:
            reply = bus.error_reply(exc)
        if msg.reply:
            try:
                await msg.respond(reply)
            except nats.errors.Error as exc:
                log.debug("probe reply not sent: %s", exc)

    # ------------------------------------------------------------------ lease and fence

    async def _fence(self, stale_s: float) -> None:
        self._on_fence(stale_s)  # freezes from this thread: the main loop may be the very thing that is stuck

    async def _lease_back(self) -> None:
        self._on_lease_back()
