"""Publishing events to the JetStream stream without blocking the caller.

``emit`` only enqueues; background workers publish with retries, and ``stop``
flushes what is queued.  Events are sharded over the workers by subject, so
the events of one node or job keep their order while a burst (20,000 nodes
joining at once) is published many at a time.  The queues are bounded: a
full one drops the event and counts it, loudly, rather than grow without end.

Each event gets a message id (``Nats-Msg-Id``) when it is emitted, and every retry
carries that same id: a publish whose ack was lost (it timed out, or the connection
broke after the stream stored it) is retried, and the stream's duplicate window
(``bus.EVENTS_DUPLICATE_WINDOW_S``, longer than the retries last) drops the copy, so
consumers see each event once.

An event emitted with ``acked=False`` (a node's ``joined`` or ``recovered``: every heartbeat
says it again, and the node table is what counts) is written to the stream without waiting
for its ack, a few microseconds instead of a round trip: 100,000 nodes joining a coordinator
that starts cost a second, not minutes of acks.  If it cannot be written at once (no
connection), it takes the acked path with its retries.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import zlib
from typing import Callable

from nats.aio.client import Client
from nats.js import JetStreamContext

from revenant.common.errors import BusError
from revenant.common.messaging import bus
from revenant.messages import Message

log = logging.getLogger(__name__)

# A retry waits longer for its ack than the attempt before it (a slow stream would time out
# every attempt alike), doubling from ``timeout_s`` up to this.
ATTEMPT_TIMEOUT_MAX_S = 8.0


def new_msg_id() -> str:
    return secrets.token_hex(12)


class EventPublisher:
    def __init__(self, js: JetStreamContext, *, timeout_s: float = 2.0, max_queued: int = 200_000,
                 retry_for_s: float = 60.0, workers: int = 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._js = js
        self._clock = clock
        self._timeout_s = timeout_s
        # An event is retried (backing off to 2 s) for this long: a short loss of NATS, the very
        # moment a self-fence stops jobs, must not lose their reports.  Per subject, order holds.
        # No copy is sent later than this after the first, so the stream's duplicate window
        # must be longer.
        if retry_for_s >= bus.EVENTS_DUPLICATE_WINDOW_S:
            raise ValueError(f"events retried for {retry_for_s:g} s would outlive the stream's "
                             f"{bus.EVENTS_DUPLICATE_WINDOW_S:g} s duplicate window")
        self._retry_for_s = retry_for_s
        per_worker = max(1, max_queued // workers)
        self._queues: list[asyncio.Queue[tuple[str, Message, str, bool]]] = [
            asyncio.Queue(per_worker) for _ in range(workers)]
        self._tasks: list[asyncio.Task[None]] = []
        self.dropped = 0
        self.published = 0
        # Attempts that failed and were retried (each with the event's own message id).
        self.retried = 0
        self._stopping = False
        self._own: Client | None = None  # the connection it publishes on, when it is its own

    @classmethod
    async def on_own_connection(cls, url: str, name: str, options: dict, **kwargs) -> EventPublisher:
        """A publisher on a NATS connection of its own, closed by :meth:`stop`: a burst of events
        (100,000 nodes joining) waits in that connection's buffers, not ahead of the caller's
        latency-bound requests (the coordinator's leader lease, its probes and commands), which a
        shared connection writes in order behind megabytes of events.  ``options``: bus.connect's."""
        nc = await bus.connect(url, name, **options)
        publisher = cls(nc.jetstream(), **kwargs)
        publisher._own = nc
        return publisher

    def emit(self, subject: str, msg: Message, msg_id: str = "", acked: bool = True) -> None:
        """Queue ``msg`` for ``subject``.  Its message id is fixed now (``msg_id``, or a new one):
        every retry carries it, and the stream stores the event once.  ``acked=False``: written
        without waiting for the stream's ack (see the module's notes)."""
        queue = self._queues[zlib.crc32(subject.encode()) % len(self._queues)]
        try:
            queue.put_nowait((subject, msg, msg_id or new_msg_id(), acked))
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # log 1, 2, 4, 8, ...
                log.error("event queue full: %d event(s) dropped so far (latest on %s)", self.dropped, subject)

    @property
    def connected(self) -> bool:
        """Its own connection is up (always, on the caller's: the caller watches that one)."""
        return self._own is None or self._own.is_connected

    @property
    def queued(self) -> int:
        return sum(q.qsize() for q in self._queues)

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._run(q), name=f"event-publisher-{i}")
                           for i, q in enumerate(self._queues)]

    async def stop(self, flush_timeout_s: float = 3.0) -> None:
        """Publish what is queued (within ``flush_timeout_s``), then stop; idempotent.

        The workers are not cancelled while they publish: an event taken off its queue
        would be lost, and a cancellation that lands as the ack arrives can be swallowed
        by ``asyncio.wait_for`` (Python 3.11), leaving a worker that never ends.  They
        finish their queues and return; only what is left after the timeout is cancelled.
        """
        tasks, self._tasks = self._tasks, []
        if not tasks:
            try:
                await asyncio.wait_for(asyncio.gather(*(self._drain(q) for q in self._queues)), flush_timeout_s)
            except asyncio.TimeoutError:
                log.error("%d events not published at shutdown", self.queued)
            own, self._own = self._own, None
            await bus.close(own, 3, "event publisher")
            return
        self._stopping = True
        for queue in self._queues:
            if queue.empty():
                queue.put_nowait(None)  # wakes a worker waiting on an empty queue
        _, pending = await asyncio.wait(tasks, timeout=flush_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        if self.queued:
            log.error("%d events not published at shutdown", self.queued)
        own, self._own = self._own, None
        await bus.close(own, 3, "event publisher")

    async def _drain(self, queue: asyncio.Queue) -> None:
        while not queue.empty():
            item = queue.get_nowait()
            if item is not None:
                await self._publish(*item)

    async def _run(self, queue: asyncio.Queue) -> None:
        while True:
            item = await queue.get()
            if item is None:
                return
            await self._publish(*item)
            if self._stopping and queue.empty():
                return

    async def _publish(self, subject: str, msg: Message, msg_id: str, acked: bool = True) -> None:
        if not acked:
            try:
                await bus.write_event(self._js, subject, msg, msg_id)
                self.published += 1
                return
            except BusError:
                pass  # not connected: the acked path retries it
        deadline = self._clock() + self._retry_for_s
        attempt = 0
        while True:
            timeout_s = min(self._timeout_s * 2 ** attempt, max(self._timeout_s, ATTEMPT_TIMEOUT_MAX_S))
            try:
                await bus.publish_event(self._js, subject, msg, timeout_s, msg_id)
                self.published += 1
                return
            except BusError as exc:
                attempt += 1
                backoff_s = min(2.0, 0.2 * 2 ** (attempt - 1))
                if self._clock() + backoff_s >= deadline:
                    self.dropped += 1
                    log.error("event lost after %d attempts: %s", attempt, exc)
                    return
                if attempt == 1:
                    log.warning("event not published yet, retrying: %s", exc)
                self.retried += 1
                await asyncio.sleep(backoff_s)
