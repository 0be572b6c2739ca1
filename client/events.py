"""The event stream as an async iterator of typed events (``Client.events``)."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

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

    def _filters(self) -> list[str]:
        """What this reader's consumers ask the server for: its own jobs' events and every node's and
        the cluster's as a user, everything as admin (subjects.user_events; the server enforces it)."""
        job = next(iter(self.jobs)) if self.jobs is not None and len(self.jobs) == 1 else None
        return subjects.user_events(self.client.user, job)

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
        heard: asyncio.Queue[Any] = asyncio.Queue()
        consumers = _Consumers(js, heard)
        try:
            try:
                await consumers.open(self._filters(), self.start)
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                raise ClientError(f"cannot read the event stream: {described(exc)}", code=BusError.code,
                                  retriable=True) from None
            # What was kept when they opened, merged in the stream's order; then what comes, as it comes.
            for msg in await consumers.history(timeout_s):
                if not self.follow and msg.metadata.sequence.stream > last:
                    return
                if (ev := self._event(msg)) is not None:
                    yield ev
            while self.follow:
                if (ev := self._event(await heard.get())) is not None:
                    yield ev
        finally:
            await consumers.close()

    def _event(self, msg) -> Event | None:
        seq = msg.metadata.sequence.stream
        self.resume_seq = seq + 1
        try:
            ev = Event(seq, msg.subject, decode(msg.data))
        except MessageError as exc:
            ev = Event(seq, msg.subject, None, str(exc))
        return ev if self._wanted(ev) else None


class _Consumers:
    """One push consumer per filter (a user's may have only one filter each: the server checks the
    filter named in its create request against the user's permissions), their messages on ``heard``."""

    def __init__(self, js: Any, heard: asyncio.Queue[Any]) -> None:
        self.js, self.heard = js, heard
        self.subs: list[Any] = []
        self.kept: list[int] = []  # each one's messages kept when it opened: the history to merge
        self.got: list[int] = []

    async def open(self, filters: list[str], start: dict[str, Any]) -> None:
        for f in filters:
            config = ConsumerConfig(name=f"events-{secrets.token_hex(8)}", ack_policy=AckPolicy.NONE,
                                    mem_storage=True, num_replicas=1, inactive_threshold=30.0, **start)
            self.got.append(0)
            sub = await self.js.subscribe(f, stream=subjects.EVENTS_STREAM, config=config, manual_ack=True,
                                          cb=self._heard(len(self.subs)), flow_control=True,
                                          idle_heartbeat=5.0)
            self.subs.append(sub)
            ci = await sub.consumer_info()
            self.kept.append(ci.delivered.consumer_seq + ci.num_pending)

    def _heard(self, i: int) -> Callable[[Any], Awaitable[None]]:
        async def heard(msg: Any) -> None:
            self.got[i] += 1
            await self.heard.put(msg)
        return heard

    async def history(self, timeout_s: float) -> list[Any]:
        """Every message kept when the consumers opened (and any heard meanwhile), in the stream's order."""
        msgs: list[Any] = []
        while any(got < kept for got, kept in zip(self.got, self.kept)) or not self.heard.empty():
            try:
                msgs.append(await asyncio.wait_for(self.heard.get(), timeout_s))
            except asyncio.TimeoutError:
                raise ClientError(f"event stream stalled: no message within {timeout_s:g} s", code=BusError.code,
                                  retriable=True) from None
        return sorted(msgs, key=lambda m: m.metadata.sequence.stream)

    async def close(self) -> None:
        for sub in self.subs:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass
