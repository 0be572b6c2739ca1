"""Publishing events to the JetStream stream without blocking the caller.

``emit`` only enqueues (bounded; a full queue drops and counts), a background
task publishes with retries, and ``stop`` flushes what is queued.
"""

from __future__ import annotations

import asyncio
import logging

from nats.js import JetStreamContext

from revenant.common import bus
from revenant.common.errors import BusError
from revenant.messages import Message

log = logging.getLogger(__name__)


class EventPublisher:
    def __init__(self, js: JetStreamContext, *, timeout_s: float = 2.0, max_queued: int = 10_000,
                 attempts: int = 3) -> None:
        self._js = js
        self._timeout_s = timeout_s
        self._attempts = attempts
        self._queue: asyncio.Queue[tuple[str, Message]] = asyncio.Queue(max_queued)
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.published = 0

    def emit(self, subject: str, msg: Message) -> None:
        try:
            self._queue.put_nowait((subject, msg))
        except asyncio.QueueFull:
            self.dropped += 1
            log.error("event queue full: dropped %s", subject)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="event-publisher")

    async def stop(self, flush_timeout_s: float = 3.0) -> None:
        """Publish what is queued (within ``flush_timeout_s``), then stop; idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        try:
            await asyncio.wait_for(self._drain(), flush_timeout_s)
        except asyncio.TimeoutError:
            log.error("%d events not published at shutdown", self._queue.qsize())

    async def _drain(self) -> None:
        while not self._queue.empty():
            await self._publish(*self._queue.get_nowait())

    async def _run(self) -> None:
        while True:
            subject, msg = await self._queue.get()
            await self._publish(subject, msg)

    async def _publish(self, subject: str, msg: Message) -> None:
        for attempt in range(self._attempts):
            try:
                await bus.publish_event(self._js, subject, msg, self._timeout_s)
                self.published += 1
                return
            except BusError as exc:
                if attempt == self._attempts - 1:
                    self.dropped += 1
                    log.error("event lost: %s", exc)
                else:
                    await asyncio.sleep(0.2 * (attempt + 1))
