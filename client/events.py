"""The event stream as an async iterator of typed events (``Client.events``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Iterable

import nats.errors
import nats.js.errors
from nats.js.api import ConsumerConfig, DeliverPolicy

from revenant.client.errors import ClientError
from revenant.common.errors import BusError, described
from revenant.common.messaging import bus
from revenant.messages import Message, MessageError, decode, subjects


@dataclass(frozen=True)
class Event:
    """One event: its stream sequence, its subject and the message (``JobEvent``, ``EpochEvent``,
    ``NodeEvent``, ``AnomalyEvent`` or ``ClusterEvent``; ``None`` for one this version cannot
    read, with ``error`` saying why)."""

    seq: int
    subject: str
    message: Message | None
    error: str = ""

    @property
    def kind(self) -> str:
        return getattr(self.message, "kind", "") or ("anomaly" if self.subject.endswith(".anomaly") else "")

    @property
    def job(self) -> str:
        return getattr(self.message, "job", "")


def _start(since: int | float | datetime | None) -> dict[str, Any]:
    if since is None:
        return {"deliver_policy": DeliverPolicy.ALL}
    if isinstance(since, bool) or not isinstance(since, (int, float, datetime)):
        raise TypeError(f"since must be a sequence (int), a time (datetime or float) or None, not {since!r}")
    if isinstance(since, int):
        return {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": max(1, since)}
    at = since if isinstance(since, datetime) else datetime.fromtimestamp(since, timezone.utc)
    return {"deliver_policy": DeliverPolicy.BY_START_TIME, "opt_start_time": at}


class EventStream:
    """Made by ``Client.events`` (``client``: that Client, whose connection it reads).
    ``async for ev in rv.events(since=..., jobs=..., kinds=...)``.  :attr:`resume_seq` is the
    sequence to pass as ``since`` to go on after the last event seen (a restart of your program
    misses nothing and sees nothing twice).  Filtering by job or kind happens on the server where
    it can (one job: its subjects only) and here otherwise."""

    def __init__(self, client: Any, since, jobs: Iterable[str] | None, kinds: Iterable[str] | None,
                 follow: bool) -> None:
        self.client, self.follow = client, follow
        self.start = _start(since)
        self.jobs = frozenset(jobs) if jobs is not None else None
        self.kinds = frozenset(kinds) if kinds is not None else None
        # From the first kept (since None), or that sequence; from a time, not known before an event.
        self.resume_seq: int | None = since if isinstance(since, int) else (1 if since is None else None)

    def _subject(self) -> str:
        if self.jobs is not None and len(self.jobs) == 1:
            (job,) = self.jobs
            return f"{subjects.EVENTS_PREFIX}.*.{subjects.check_name(job, 'job id')}.>"
        return subjects.EVENTS_ALL

    def _wanted(self, ev: Event) -> bool:
        if self.jobs is not None and ev.job not in self.jobs:
            return False
        return self.kinds is None or ev.kind in self.kinds

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        timeout_s = self.client.timeout_s
        js = self.client.nc.jetstream(timeout=timeout_s)
        try:
            try:
                info = await js.stream_info(subjects.EVENTS_STREAM)
            except nats.js.errors.NotFoundError:
                if not self.follow:
                    return  # no event yet
                await bus.ensure_event_stream(js)  # a cluster still starting: its first events are to come
                info = await js.stream_info(subjects.EVENTS_STREAM)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise ClientError(f"cannot read the event stream: {described(exc)}", code=BusError.code,
                              retriable=True) from None
        last = info.state.last_seq
        if not self.follow and (info.state.messages == 0 or (self.resume_seq or 0) > last):
            return
        try:
            sub = await js.subscribe(self._subject(), ordered_consumer=True, config=ConsumerConfig(**self.start))
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise ClientError(f"cannot read the event stream: {described(exc)}", code=BusError.code,
                              retriable=True) from None
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=None if self.follow else timeout_s)
                except nats.errors.TimeoutError:
                    if self.kinds is not None or self.jobs is not None or self.start.get("opt_start_time"):
                        return  # filtered or from a time: the last event may not be one of these
                    raise ClientError(f"event stream stalled: no message within {timeout_s:g} s", code=BusError.code,
                                      retriable=True) from None
                except nats.errors.Error as exc:
                    raise ClientError(f"the event stream broke off: {described(exc)}", code=BusError.code,
                                      retriable=True) from None
                seq = msg.metadata.sequence.stream
                self.resume_seq = seq + 1
                try:
                    ev = Event(seq, msg.subject, decode(msg.data))
                except MessageError as exc:
                    ev = Event(seq, msg.subject, None, str(exc))
                if self._wanted(ev):
                    yield ev
                if not self.follow and seq >= last:
                    return
        finally:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass
