"""The coordinator: membership and failure detection over NATS.

It listens to every heartbeat, drives the sans-IO :class:`FailureDetector`
with a periodic tick, probes suspect nodes directly, publishes node events to
the JetStream event stream and answers ``revenant.coord.nodes``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from revenant.common import bus
from revenant.common.config import CoordinatorConfig
from revenant.common.errors import BusError, RevenantError
from revenant.coordinator.detector import FailureDetector, Transition
from revenant.messages import (
    Heartbeat,
    MessageError,
    NodeEvent,
    NodesReply,
    NodesRequest,
    Probe,
    ProbeReply,
    decode_as,
    encode,
    subjects,
)

log = logging.getLogger(__name__)

EVENT_QUEUE_MAX = 10_000
MAX_PROBES_IN_FLIGHT = 512


class Coordinator:
    def __init__(self, config: CoordinatorConfig, *, clock=time.monotonic, wall=time.time) -> None:
        self.config = config
        self.name = config.name or f"{socket.gethostname()}-{os.getpid()}"
        self.detector = FailureDetector(config)
        self._clock = clock
        self._wall = wall
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._events: asyncio.Queue[NodeEvent] = asyncio.Queue(EVENT_QUEUE_MAX)
        self._probe_slots = asyncio.Semaphore(MAX_PROBES_IN_FLIGHT)
        self._probe_tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        # Set once subscribed and serving; tests and embedders wait on it.
        self.ready = asyncio.Event()
        self._reconnected = False
        self.malformed_heartbeats = 0
        self.events_dropped = 0

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        if self._stopping.is_set():
            return

        async def on_reconnect() -> None:
            self._reconnected = True

        self._nc = await bus.connect(self.config.nats_url, f"revenant-coordinator-{self.name}",
                                     on_reconnect=on_reconnect)
        self._js = self._nc.jetstream()
        try:
            await bus.ensure_event_stream(self._js)
            await self._nc.subscribe(subjects.HEARTBEATS_ALL, cb=self._on_heartbeat)
            await self._nc.subscribe(subjects.coordinator("nodes"), cb=self._on_nodes)
            log.info("coordinator %s up", self.name)
            self.ready.set()
            async with asyncio.TaskGroup() as tg:
                ticker = tg.create_task(self._tick_loop(), name="detector-tick")
                publisher = tg.create_task(self._publish_loop(), name="event-publisher")
                await self._stopping.wait()
                ticker.cancel()
                await self._flush_events()
                publisher.cancel()
        finally:
            for task in list(self._probe_tasks):
                task.cancel()
            nc, self._nc = self._nc, None
            try:
                await asyncio.wait_for(nc.drain(), 3)
            except (asyncio.TimeoutError, nats.errors.Error):
                await nc.close()
            log.info("coordinator %s stopped", self.name)

    def stop(self) -> None:
        self._stopping.set()

    # ------------------------------------------------------------------ inputs

    async def _on_heartbeat(self, msg: Msg) -> None:
        node = subjects.node_from_heartbeat(msg.subject)
        try:
            hb = decode_as(msg.data, Heartbeat)
        except MessageError as exc:
            self.malformed_heartbeats += 1
            if self.malformed_heartbeats & (self.malformed_heartbeats - 1) == 0:  # log 1, 2, 4, 8, ...
                log.warning("dropped bad heartbeat on %s (%d so far): %s", msg.subject, self.malformed_heartbeats, exc)
            return
        if hb.node != node:
            self.malformed_heartbeats += 1
            log.warning("dropped heartbeat for %r published on %s", hb.node, msg.subject)
            return
        self._emit(self.detector.heartbeat(hb, self._clock()))

    async def _on_nodes(self, msg: Msg) -> None:
        try:
            decode_as(msg.data, NodesRequest)
            data = encode(NodesReply(nodes=self.detector.snapshot(self._clock()), coordinator=self.name))
        except (MessageError, RevenantError) as exc:
            data = bus.error_reply(exc)
        await self._respond(msg, data)

    @staticmethod
    async def _respond(msg: Msg, data: bytes) -> None:
        if msg.reply:
            try:
                await msg.respond(data)
            except nats.errors.Error as exc:
                log.debug("reply not sent: %s", exc)

    # ------------------------------------------------------------------ detection

    async def _tick_loop(self) -> None:
        while True:
            now = self._clock()
            if self._nc is None or not self._nc.is_connected:
                # Blind: no verdicts.  The reconnect handler grants a grace period.
                await asyncio.sleep(self.config.tick_interval_s)
                continue
            if self._reconnected:
                self._reconnected = False
                self._emit(self.detector.grace_all(now, "coordinator reconnected to NATS"))
            transitions, probes = self.detector.tick(now)
            self._emit(transitions)
            for node in probes:
                task = asyncio.create_task(self._probe(node))
                self._probe_tasks.add(task)
                task.add_done_callback(self._probe_tasks.discard)
            await asyncio.sleep(self.config.tick_interval_s)

    async def _probe(self, node: str) -> None:
        ok, incarnation = False, None
        async with self._probe_slots:
            try:
                reply = await bus.request(self._nc, subjects.probe(node), Probe(sent_at=self._wall(), sender=self.name),
                                          ProbeReply, self.config.probe_timeout_s)
                ok, incarnation = True, reply.incarnation
            except (BusError, RevenantError, MessageError) as exc:
                log.debug("probe of %s failed: %s", node, exc)
        self._emit(self.detector.probe_result(node, ok, self._clock(), incarnation))

    # ------------------------------------------------------------------ events

    def _emit(self, transitions: list[Transition]) -> None:
        at = self._wall()
        for t in transitions:
            level = logging.WARNING if t.kind in ("suspect", "dead") else logging.INFO
            log.log(level, "node %s %s (silent %.2f s%s)", t.node, t.kind, t.silence_s,
                    f", {t.reason}" if t.reason else "")
            event = NodeEvent(node=t.node, kind=t.kind, at=at, incarnation=t.incarnation,
                              silence_s=round(t.silence_s, 3), reason=t.reason)
            try:
                self._events.put_nowait(event)
            except asyncio.QueueFull:
                self.events_dropped += 1

    async def _publish_loop(self) -> None:
        while True:
            event = await self._events.get()
            await self._publish(event)

    async def _publish(self, event: NodeEvent) -> None:
        assert self._js is not None
        subject = subjects.node_event(event.node, event.kind)
        for attempt in range(3):
            try:
                await bus.publish_event(self._js, subject, event, self.config.event_publish_timeout_s)
                return
            except BusError as exc:
                if attempt == 2:
                    self.events_dropped += 1
                    log.error("event lost: %s", exc)
                else:
                    await asyncio.sleep(0.2 * (attempt + 1))

    async def _flush_events(self) -> None:
        while not self._events.empty():
            await self._publish(self._events.get_nowait())
