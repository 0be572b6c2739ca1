"""Agents' job events (exits, vacates, evictions), applied to the job table by the leader;
and their epoch conversions (an older epoch became a delta: its own bytes in the listing).

Durable JetStream consumers, so none is lost across coordinator restarts.  A
leader whose lease is not fresh (its loop stalled) neither applies nor acks: the
events are redelivered, to it or to its successor.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from revenant.common.errors import RevenantError
from revenant.coordinator.table.jobs import JobService
from revenant.messages import EpochEvent, JobEvent, MessageError, decode, subjects

log = logging.getLogger(__name__)

CONSUMER = "revenant-coordinator-jobs"
# (-2: its filter is the node-stamped subjects'; the first one's never matches them.)
EPOCHS_CONSUMER = "revenant-coordinator-epochs-3"


async def _nak(msg, delay_s: float = 1.0) -> None:
    try:
        await msg.nak(delay=delay_s)
    except nats.errors.Error:
        pass  # redelivered after ack_wait anyway


class JobEventConsumer:
    def __init__(self, js: JetStreamContext, jobs: JobService,
                 on_evicted: Callable[[str, str, str], None], subject: str = subjects.JOB_EVENTS_ALL,
                 durable: str = CONSUMER, refused: Callable[[], None] = lambda: None) -> None:
        """``on_evicted(job, node, why)``: a job its node stopped (drained, fenced), to recover.
        ``subject``, ``durable``: what this consumer reads (job events, or epochs converted).
        ``refused()``: counts an event ignored for naming another node than its subject's."""
        self.js = js
        self.refused = refused
        self.jobs = jobs
        self.on_evicted = on_evicted
        self.subject = subject
        self.durable = durable

    async def run(self) -> None:
        sub = await self.js.pull_subscribe(
            self.subject, durable=self.durable,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_wait=30, max_ack_pending=1000))
        try:
            await self._consume(sub)
        finally:
            try:
                await sub.unsubscribe()  # or the connection's drain waits on it
            except nats.errors.Error:
                pass

    async def _consume(self, sub) -> None:
        while True:
            try:
                msgs = await sub.fetch(64, timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except nats.errors.Error as exc:
                log.warning("job event fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            if not self.jobs.leader.fresh():
                for msg in msgs:
                    await _nak(msg)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                if await self._apply(msg):
                    await msg.ack()
                else:
                    await _nak(msg)

    async def _apply(self, msg) -> bool:
        """False: not applied (the store did not answer, or this one no longer leads)."""
        try:
            event = decode(msg.data)
            sender = subjects.event_node(msg.subject)
            if sender is not None and getattr(event, "node", sender) != sender:
                # The server lets a node's credential publish only on subjects ending with its name:
                # an event that names another node is a node speaking for another's job.
                log.warning("ignored %s on %s: it names node %s, but came from node %s", type(event).__name__,
                            msg.subject, getattr(event, "node", ""), sender)
                self.refused()
            elif isinstance(event, JobEvent) and await self.jobs.apply_event(event):
                self.on_evicted(event.job, event.node, event.reason or "evicted")
            elif isinstance(event, EpochEvent) and event.kind == "converted":
                await self.jobs.apply_converted(event)
        except MessageError as exc:
            log.warning("bad job event on %s: %s", msg.subject, exc)
        except RevenantError as exc:
            log.warning("job event on %s not applied yet: %s", msg.subject, exc)
            return False
        return True
