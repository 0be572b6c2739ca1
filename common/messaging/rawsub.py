"""A subscriber for one high-rate subject, without a client library's per-message work.

nats-py turns every message into a ``Msg`` object, queues it and awaits a callback coroutine:
about 12 µs a message on a small machine, more than a 100,000-node cluster's heartbeats
(100,000 a second) leave a coordinator.  :class:`RawSubscriber` speaks the client protocol's
subscriber side on a connection of its own: it parses ``MSG`` frames straight from the
socket's data (``asyncio.Protocol.data_received``) and hands every whole message of a read, as
a list of ``(subject, payload)``, to a plain function: a microsecond or so a message.

What it keeps from a client: the same URLs (a cluster's, tried in turn), the same credential
(a seed file or a JWT ``.creds`` file, the server's nonce signed), PINGs (a connection whose
PING is unanswered for ``ping_interval_s`` times ``max_outstanding_pings`` is dropped as stale),
and endless reconnects (``on_reconnect`` is called after each).  A PING goes out every quarter
second when none is in flight: its PONG comes after every message queued before it, so its
round trip says how far behind the reader is (``behind_s``).  It sends nothing but CONNECT, SUB,
PING and PONG.  The first connection must succeed (a one-line :class:`BusError` if not); later
outages are retried forever, as the main connection's are.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable


from revenant.common.cancelling import cancel_until_done
from revenant.common.errors import BusError, described
from revenant.common.messaging.handshake import signed_connect

log = logging.getLogger(__name__)

MAX_CONTROL_LINE = 4096
# A PING waits behind every message the server has queued for this reader, so its round trip is
# how far behind the reader is: measured every LAG_PING_S, behind by BACKLOG_S or more is
# ``RawSubscriber.backlogged``.
LAG_PING_S = 0.25
BACKLOG_S = 0.5
# MSG <subject> <sid> [reply-to] <#bytes>: one C call per frame for a subscriber's hottest line.
_MSG = re.compile(rb"MSG[ \t]+([^ \t\r\n]+)[ \t]+[^ \t\r\n]+[ \t]+(?:[^ \t\r\n]+[ \t]+)?([0-9]{1,10})[ \t]*\r\n")
# What a read delivers: its whole messages, (subject, payload) each.
Batch = list[tuple[bytes, bytes]]


def starting_with(url: str, netloc: str) -> str:
    """``url``'s servers with the one at ``netloc`` (host:port) first, if it is one of them: a
    second connection of a process goes to the server its first one uses."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    mine = [u for u in servers if _netloc(u) == netloc]
    return ",".join(mine + [u for u in servers if u not in mine])


def _netloc(url: str) -> str:
    return urllib.parse.urlsplit(url if "://" in url else f"nats://{url}").netloc


class _Broken(Exception):
    """The server sent what ends the connection (the reason, one line)."""


class _Connection(asyncio.Protocol):
    """One connection: the handshake, then MSG frames to ``deliver``."""

    def __init__(self, owner: RawSubscriber) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pings: deque[float] = deque()  # when each PING not yet answered was sent
        self._info_seen = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self._end(str(exc) if exc else "closed by the server")

    def _end(self, why: str) -> None:
        """The connection is over: a handshake still waiting fails, ``closed`` says why."""
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(why))
            self.ready.exception()  # retrieved here too: nobody may be waiting any more
        if not self.closed.done():
            self.closed.set_result(why)

    def ping(self) -> None:
        self.transport.write(b"PING\r\n")
        self.pings.append(time.monotonic())

    def data_received(self, data: bytes) -> None:
        owner = self.owner
        buf = self.buf + data if self.buf else data
        batch: Batch = []
        broken = None
        try:
            self.buf = buf[self._frames(buf, batch):]
        except _Broken as exc:
            broken = str(exc)
        if batch:  # the messages before a broken line are delivered all the same
            try:
                owner.deliver(batch)
            except Exception:  # a bug in the handler loses these messages, never the connection
                log.exception("handling %d message(s) on %r failed", len(batch), batch[0][0])
        if broken is not None:
            self._fail(broken)

    def _frames(self, buf: bytes, batch: Batch) -> int:
        """Append ``buf``'s whole messages to ``batch`` and answer its control lines; returns
        where the unread rest starts.  Raises :class:`_Broken` for what the server must not send."""
        pos, n, match = 0, len(buf), _MSG.match
        while pos < n:
            m = match(buf, pos)
            if m is not None:
                start = m.end()
                stop = start + int(m[2])
                if stop + 2 > n:
                    break  # the payload is not all here yet
                batch.append((m[1], buf[start:stop]))
                pos = stop + 2
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if n - pos > MAX_CONTROL_LINE:
                    raise _Broken("a protocol line longer than 4096 bytes")
                break
            line = buf[pos:end]
            pos = end + 2
            if line.startswith(b"MSG"):
                raise _Broken(f"malformed MSG line {line[:80]!r}")
            if line.startswith(b"PING"):
                self.transport.write(b"PONG\r\n")
            elif line.startswith(b"PONG"):
                if self.pings:
                    self.owner.lag_s = time.monotonic() - self.pings.popleft()
                if not self.ready.done():
                    self.ready.set_result(None)
            elif line.startswith(b"INFO "):
                try:
                    info = json.loads(line[5:])
                except ValueError:
                    if self._info_seen:
                        continue  # a later one (a change in the cluster) is only advice
                    raise _Broken(f"unreadable INFO from the server: {line[:80]!r}") from None
                if isinstance(info, dict):
                    self.owner.discovered(info.get("connect_urls"))
                if not self._info_seen:
                    self._info_seen = True
                    self._hello(info)
                    if self.closed.done():
                        return n
            elif line.startswith(b"-ERR"):
                raise _Broken(line[5:].strip(b" '").decode(errors="replace") or "-ERR")
            # +OK needs nothing
        return pos

    def _hello(self, info: dict) -> None:
        owner = self.owner
        if info.get("tls_required"):
            return self._fail("the server requires TLS: give tls:// URLs (the heartbeat connection then "
                              "uses the NATS client library)")
        try:
            connect = signed_connect(info, owner.name, owner.creds)
        except BusError as exc:
            return self._fail(str(exc))
        self.transport.write(b"CONNECT " + json.dumps(connect).encode() + b"\r\n"
                             + f"SUB {owner.subject} 1\r\n".encode())
        self.ping()  # its PONG: connected

    def _fail(self, why: str) -> None:
        self._end(why)
        if self.transport is not None:
            self.transport.close()


class RawSubscriber:
    """Subscribe ``subject`` on ``url`` (comma-separated servers) and call ``on_messages(batch)``
    with each read's whole messages, ``[(subject, payload), ...]`` (bytes, bytes) in the order
    they came, from the event loop, never concurrently."""

    def __init__(self, url: str, name: str, subject: str, on_messages: Callable[[Batch], None], *,
                 creds: str | None = None, ping_interval_s: float = 2.0, max_outstanding_pings: int = 2,
                 reconnect_wait_s: float = 0.5, connect_timeout_s: float = 3.0,
                 on_reconnect: Callable[[], Awaitable[None]] | None = None) -> None:
        self.servers = [u.strip() for u in url.split(",") if u.strip()]
        self.name, self.subject, self.creds = name, subject, creds
        self.deliver = on_messages
        self.ping_interval_s = ping_interval_s
        self.max_outstanding_pings = max_outstanding_pings
        self.reconnect_wait_s = reconnect_wait_s
        self.connect_timeout_s = connect_timeout_s
        self.on_reconnect = on_reconnect
        self.reconnects = 0
        # The last PING's round trip: how long a message waited for this reader then.
        self.lag_s = 0.0
        self._conn: _Connection | None = None
        self._next = 0
        self._task: asyncio.Task[None] | None = None

    def discovered(self, urls: object) -> None:
        """The servers a server says its cluster has (INFO ``connect_urls``): tried, after the
        ones given, when the connection is lost.  A ``nats_url`` naming one server of a cluster
        then survives that server, as the client library's connections do."""
        if not isinstance(urls, list):
            return
        known = {_netloc(u) for u in self.servers}
        for url in urls:
            if isinstance(url, str) and url and _netloc(url) not in known:
                known.add(_netloc(url))
                self.servers.append(url if "://" in url else f"nats://{url}")
                log.info("nats (%s): the cluster has server %s too", self.name, url)

    @property
    def behind_s(self) -> float:
        """How long messages wait for this reader: the last PING's round trip, or longer if the
        PING in flight has been out longer (0 while not connected)."""
        c = self._conn
        if c is None:
            return 0.0
        return max(self.lag_s, time.monotonic() - c.pings[0]) if c.pings else self.lag_s

    @property
    def backlogged(self) -> bool:
        """Behind by half a second or more: messages wait unread that long."""
        return self.behind_s >= BACKLOG_S

    @property
    def connected(self) -> bool:
        c = self._conn
        return c is not None and c.ready.done() and c.ready.exception() is None and not c.closed.done()

    async def start(self) -> None:
        """Connect (each server once, in turn), or raise a one-line :class:`BusError`."""
        errors = []
        for _ in self.servers:
            try:
                await self._connect()
                break
            except (OSError, ConnectionError, asyncio.TimeoutError) as exc:
                errors.append(f"{self.servers[(self._next - 1) % len(self.servers)]}: {described(exc)}")
        else:
            raise BusError(f"cannot subscribe to {self.subject}: {'; '.join(errors)}")
        self._task = asyncio.create_task(self._keep(), name=f"rawsub-{self.subject}")
        self._task.add_done_callback(self._kept)

    def _kept(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("nats (%s): %s subscription stopped for good: %r (the coordinator is blind)",
                      self.name, self.subject, task.exception())

    async def close(self) -> None:
        if self._task is not None:
            task = self._task
            await cancel_until_done([task], f"nats ({self.name})")
            if not task.cancelled():
                task.exception()  # already logged by its done callback
            self._task = None
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._conn = None

    async def _connect(self) -> None:
        url = self.servers[self._next % len(self.servers)]
        self._next += 1
        u = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
        loop = asyncio.get_running_loop()
        conn = _Connection(self)
        try:
            await asyncio.wait_for(loop.create_connection(lambda: conn, u.hostname, u.port or 4222),
                                   self.connect_timeout_s)
            await asyncio.wait_for(asyncio.shield(conn.ready), self.connect_timeout_s)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            raise
        self._conn = conn

    async def _keep(self) -> None:
        """Watch the connection; when it is lost or stale, connect again (forever).  Nothing that
        goes wrong while watching one connection ends the subscription: it is a lost connection."""
        while True:
            conn = self._conn
            assert conn is not None
            try:
                why = await self._watch(conn)
            except Exception as exc:
                log.exception("nats (%s): watching the %s subscription failed", self.name, self.subject)
                why = repr(exc)
            if conn.transport is not None and not conn.transport.is_closing():
                conn.transport.close()
            log.warning("nats (%s): %s subscription lost (%s); reconnecting", self.name, self.subject, why)
            await self._reconnect()

    async def _watch(self, conn: _Connection) -> str:
        """Until the connection ends or goes stale (why): a PING whenever none is in flight, at
        most every ``LAG_PING_S`` (how far behind the reader is), and the connection stale when
        one is unanswered for ``ping_interval_s`` times ``max_outstanding_pings``."""
        self.lag_s = 0.0
        stale_s = self.ping_interval_s * self.max_outstanding_pings
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(conn.closed), min(LAG_PING_S, self.ping_interval_s))
            except asyncio.TimeoutError:
                pass
            if conn.transport.is_closing():  # closed, and told so in a moment (connection_lost)
                return "closed"
            if conn.pings and time.monotonic() - conn.pings[0] >= stale_s:
                return f"no PONG in {stale_s:g} s"
            if not conn.pings:
                conn.ping()

    async def _reconnect(self) -> None:
        self._conn = None
        failures = 0
        while True:
            await asyncio.sleep(self.reconnect_wait_s)
            try:
                await self._connect()
            except Exception as exc:  # whatever a connection attempt meets, the next one is made
                failures += 1
                if failures & (failures - 1) == 0:  # 1, 2, 4, 8, ...: loud, not a flood
                    log.warning("nats (%s): %s subscription still lost after %d attempt(s): %s", self.name,
                                self.subject, failures, described(exc))
                continue
            self.reconnects += 1
            log.info("nats (%s): %s subscription back", self.name, self.subject)
            if self.on_reconnect is not None:
                try:
                    await self.on_reconnect()
                except Exception:  # the subscription stays up whatever its listener does
                    log.exception("nats (%s): reconnect handler failed", self.name)
            return
