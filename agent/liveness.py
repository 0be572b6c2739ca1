"""Liveness on a thread of its own: heartbeats, probe replies, the lease and the
jobs' dead man's switches.

The agent's event loop runs commands, checkpoints and health probes.  If it is
busy or stuck, it must not look dead: a false verdict would move healthy jobs.
So this thread has its own event loop and its own NATS connection.  It reports
the main loop's stall in the health it publishes (RED past ``loop_lag_red_s``),
and it is the thread that fences: when it cannot renew the lease it kills the
jobs itself, since the main loop may be the thing that is stuck.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from typing import TYPE_CHECKING

import msgspec
import nats.errors
import uvloop
from nats.aio.client import Client
from nats.aio.msg import Msg

from revenant.agent.lease import LeaseKeeper
from revenant.common import bus
from revenant.messages import HealthSummary, Heartbeat, MessageError, Probe, ProbeReply, decode_as, encode, subjects

if TYPE_CHECKING:
    from revenant.agent.agent import Agent

log = logging.getLogger(__name__)


class Liveness:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.config = agent.config
        self.seq = 0
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

    # ------------------------------------------------------------------ lifecycle (called from the main loop)

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=f"liveness-{self.agent.node}", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._started.wait)
        if self._error is not None:
            raise self._error

    async def stop(self) -> None:
        """Say goodbye (a last ``leaving`` heartbeat) and drain; idempotent."""
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
        self._nc = nc = await bus.connect(cfg.nats_url, f"revenant-agent-{self.agent.node}-liveness",
                                          ping_interval_s=cfg.ping_interval_s,
                                          max_outstanding_pings=cfg.max_outstanding_pings,
                                          reconnect_wait_s=cfg.reconnect_wait_s)
        self.lease = LeaseKeeper(nc.jetstream(), self.agent.node, self.agent.incarnation, ttl_s=cfg.lease_ttl_s,
                                 renew_s=cfg.lease_renew_s, fence_timeout_s=cfg.fence_timeout_s,
                                 on_fence=self._fence, on_renewed_after_fence=self._after_fence,
                                 on_renewed=self._touch_stamps)
        await nc.subscribe(subjects.probe(self.agent.node), cb=self._on_probe)
        self._started.set()
        tasks = [asyncio.create_task(self._beat()), asyncio.create_task(self.lease.run())]
        try:
            await self._stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                if nc.is_connected:
                    await self._publish(leaving=True)
                    await asyncio.wait_for(nc.drain(), cfg.shutdown_grace_s)
                else:
                    await nc.close()
            except (asyncio.TimeoutError, nats.errors.Error) as exc:
                log.warning("liveness drain did not finish cleanly: %s", exc or type(exc).__name__)
                await nc.close()

    # ------------------------------------------------------------------ heartbeats and probes

    def health(self) -> HealthSummary:
        """The main loop's latest health, made RED here if that loop is stuck."""
        health = self.agent.health
        stuck = self.agent.loop_monitor.stuck_for(time.monotonic())
        if stuck >= self.config.loop_lag_red_s:
            health = msgspec.structs.replace(health, state="RED", loop_lag_s=round(stuck, 3),
                                             reasons=[*health.reasons, f"event loop stuck for {stuck:.1f} s"])
        if self.fenced:
            health = msgspec.structs.replace(health, state="RED",
                                             reasons=[*health.reasons, "self-fenced: lease not renewed"])
        return health

    async def _beat(self) -> None:
        interval, jitter = self.config.heartbeat_interval_s, self.config.heartbeat_jitter
        next_at = time.monotonic()
        while True:
            assert self.lease is not None
            await self.lease.check()  # a paused agent fences before it says anything
            await self._publish()
            next_at += interval * (1 + random.uniform(-jitter, jitter))
            now = time.monotonic()
            if next_at < now:  # fell behind (the process was stopped): do not burst to catch up
                next_at = now + interval * (1 + random.uniform(-jitter, jitter))
            await asyncio.sleep(next_at - now)

    async def _publish(self, leaving: bool = False) -> None:
        nc = self._nc
        assert nc is not None
        self.seq += 1
        hb = Heartbeat(node=self.agent.node, seq=self.seq, sent_at=time.time(), incarnation=self.agent.incarnation,
                       pid=os.getpid(), interval_s=self.config.heartbeat_interval_s,
                       capabilities=self.agent.capabilities, health=self.health(), leaving=leaving)
        try:
            await nc.publish(subjects.heartbeat(self.agent.node), encode(hb))
            self.agent.metrics.heartbeats.inc()
            if leaving:
                await nc.flush(timeout=1)
        except nats.errors.OutboundBufferLimitError:
            # Disconnected: drop it.  A heartbeat is only true when it is sent.
            log.debug("heartbeat %d dropped: not connected", self.seq)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("heartbeat %d not sent: %s", self.seq, exc or type(exc).__name__)

    async def _on_probe(self, msg: Msg) -> None:
        try:
            decode_as(msg.data, Probe)
            reply = encode(ProbeReply(node=self.agent.node, incarnation=self.agent.incarnation, seq=self.seq,
                                      sent_at=time.time(), health=self.health()))
        except MessageError as exc:
            reply = bus.error_reply(exc)
        if msg.reply:
            try:
                await msg.respond(reply)
            except nats.errors.Error as exc:
                log.debug("probe reply not sent: %s", exc)

    # ------------------------------------------------------------------ lease and fence

    def _touch_stamps(self) -> None:
        if self.agent.supervisor is not None:
            self.agent.supervisor.touch_stamps()

    async def _fence(self, stale_s: float) -> None:
        # Kill from this thread: the main loop may be the very thing that is stuck.
        sup = self.agent.supervisor
        killed = sup.kill_all(f"self-fenced: lease not renewed for {stale_s:.1f} s") if sup is not None else []
        self.agent.fence_report = (f"lease not renewed for {stale_s:.1f} s; killed "
                                   f"{', '.join(killed) or 'no jobs'}")

    async def _after_fence(self) -> None:
        main = self.agent.main_loop
        if main is not None and not main.is_closed():
            asyncio.run_coroutine_threadsafe(self.agent.after_fence(), main)
