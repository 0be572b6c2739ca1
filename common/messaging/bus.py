"""The thin layer between revenant and nats-py: connecting, requests, events.

nats-py errors are mapped to :mod:`revenant.common.errors` here, at the boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import urllib.parse
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import nats
import nats.errors
import nats.js.errors
import nkeys
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from nats.aio.msg import Msg

from revenant.common.errors import BusError, NoResponders, RequestTimeout, RevenantError, described
from revenant.common.messaging import handshake
from revenant.common.messaging.oneshot import reply_of
from revenant.messages import ErrorReply, Message, MessageError, encode
from revenant.messages import subjects

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

EVENTS_MAX_AGE_S = 7 * 24 * 3600
EVENTS_MAX_BYTES = 256 * 1024 * 1024
# Events are a few hundred bytes: the server refuses a bigger one, so junk cannot push history out
# a few big messages at a time.
EVENTS_MAX_MSG_BYTES = 64 * 1024
# The stream drops a message whose Nats-Msg-Id it stored within this window: every retry of
# an event carries the id fixed when it was emitted, and the publisher sends no copy later
# than its retry span (60 s) after the first (common/messaging/events.py refuses a longer span).
EVENTS_DUPLICATE_WINDOW_S = 120.0
MSG_ID_HEADER = "Nats-Msg-Id"


@contextlib.contextmanager
def map_exceptions(what: str, error: type[BusError] = BusError) -> Iterator[None]:
    """The one place where NATS's own errors become revenant's: a failed or timed-out bus
    call raises ``error("<what>: <cause>")``, a one-line error naming what was being done."""
    try:
        yield
    except (nats.errors.Error, asyncio.TimeoutError) as exc:
        raise error(f"{what}: {described(exc)}") from None


async def connect(
    url: str,
    name: str,
    *,
    ping_interval_s: float = 2.0,
    max_outstanding_pings: int = 2,
    reconnect_wait_s: float = 0.5,
    connect_timeout_s: float = 3.0,
    endless_reconnect: bool = True,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    nkey_seed: str | None = None,
    inbox_prefix: str | None = None,
    in_order: bool = False,
) -> Client:
    """Connect with options suited to fast failure detection.

    ``nkey_seed`` (a seed file, common/settings/security.py, or a JWT .creds file) authenticates as that
    identity; ``inbox_prefix`` (``_INBOX_<identity>``) is where its replies come, the only
    inbox its permissions let it subscribe to.  ``in_order``: the servers are tried in the order
    given (a process's second connection goes to its first one's server), not shuffled.

    * a short ping interval, so a dead server is noticed in seconds;
    * endless reconnects: a node agent never gives up on the bus;
    * ``pending_size=0``: while disconnected a publish fails at once instead of
      being buffered, so no stale heartbeat is flushed after a reconnect.
    """

    client: list[Client] = []

    async def on_error(exc: Exception) -> None:
        log.warning("nats (%s): %s", name, described(exc))
        if not client and "authorization violation" in str(exc).lower():
            # Refused at the first connect: a wrong or unknown key stays wrong, so fail now
            # rather than retry forever.  (Later, across a server restart, keep trying.)
            raise _Refused(str(exc))

    async def on_disconnect() -> None:
        if client and not (client[0].is_closed or client[0].is_draining):
            log.warning("nats (%s): disconnected", name)

    async def on_reconnected() -> None:
        log.info("nats (%s): reconnected", name)
        if on_reconnect is not None:
            await on_reconnect()

    servers = [u.strip() for u in url.split(",") if u.strip()]
    nc = Client()
    try:
        await nc.connect(
            servers=servers,
            name=name,
            ping_interval=ping_interval_s,
            max_outstanding_pings=max_outstanding_pings,
            max_reconnect_attempts=-1 if endless_reconnect else 3,
            reconnect_time_wait=reconnect_wait_s,
            connect_timeout=connect_timeout_s,
            allow_reconnect=True,
            dont_randomize=in_order,
            pending_size=0,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnected,
            **_auth_options(nkey_seed, inbox_prefix),
        )
    except _Refused as exc:
        await nc.close()
        raise handshake.refused(url, nkey_seed, str(exc)) from None
    except (OSError, asyncio.TimeoutError, nats.errors.Error, nkeys.NkeysError) as exc:
        await nc.close()
        raise BusError(f"cannot connect to NATS at {url}: {described(exc)}") from None
    client.append(nc)
    return nc


class _Refused(Exception):
    pass


def _auth_options(nkey_seed: str | None, inbox_prefix: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if nkey_seed:
        try:
            with open(nkey_seed, "rb") as f:
                jwt = b"BEGIN NATS USER JWT" in f.read(4096)
        except OSError as exc:
            raise BusError(f"cannot read the NATS credential {nkey_seed}: {exc.strerror or exc}") from None
        # A seed file (revenant up, revenant keys) or a JWT .creds file (operator mode, nsc).
        options["user_credentials" if jwt else "nkeys_seed"] = nkey_seed
    if inbox_prefix:
        options["inbox_prefix"] = inbox_prefix
    return options


async def close(nc: Client | None, grace_s: float, what: str = "") -> None:
    """Drain ``nc`` (flush what was published, end subscriptions) within ``grace_s``, else close
    it; safe to call with a connection that is already closed, or with None."""
    if nc is None or nc.is_closed:
        return
    try:
        if nc.is_connected:
            await asyncio.wait_for(nc.drain(), grace_s)
        else:
            await nc.close()
    except (asyncio.TimeoutError, nats.errors.Error) as exc:
        log.warning("nats%s: drain did not finish cleanly: %s", f" ({what})" if what else "",
                    described(exc))
        await nc.close()


async def request(nc: Client, subject: str, msg: Message, reply_type: type[M], timeout_s: float,
                  headers: dict[str, str] | None = None) -> M:
    """Send a request and decode the typed reply; an ``error.v1`` reply raises :class:`RemoteError`."""
    try:
        resp = await nc.request(subject, encode(msg), timeout=timeout_s, **({"headers": headers} if headers else {}))
    except nats.errors.NoRespondersError:
        raise NoResponders(f"nothing is listening on {subject}") from None
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        raise RequestTimeout(f"no reply on {subject} within {timeout_s:g} s") from None
    except nats.errors.Error as exc:
        raise BusError(f"request on {subject} failed: {described(exc)}") from None
    return reply_of(subject, resp.data, reply_type)


async def answer(msg: Msg, produce: Callable[[], Awaitable[Message]], what: str) -> None:
    """Reply to ``msg`` with what ``produce`` returns, or with an ``error.v1``.

    A bug costs the one request (logged with its traceback), never the process.
    """
    try:
        data = encode(await produce())
    except (RevenantError, MessageError) as exc:
        data = error_reply(exc)
    except Exception as exc:
        log.exception("%s failed", what)
        data = error_reply(RevenantError(f"internal error in {what}: {exc}", code="internal"))
    if msg.reply:
        try:
            await msg.respond(data)
        except nats.errors.Error as exc:
            log.warning("reply to %s not sent: %s", what, exc)


def answer_in_task(tasks: set[asyncio.Task[None]], msg: Msg,
                   handle: Callable[[str, bytes], Awaitable[Message]], what: str) -> None:
    """Answer ``msg`` in a task of its own, so that a long request (a dump) never holds up the
    next; ``handle`` gets the subject's last token (the verb) and the payload.  The task is
    kept in ``tasks`` until it ends, for a shutdown to cancel."""
    verb = msg.subject.rsplit(".", 1)[-1]
    task = asyncio.create_task(answer(msg, lambda: handle(verb, msg.data), what.format(verb=verb)))
    tasks.add(task)
    task.add_done_callback(tasks.discard)


def error_reply(exc: Exception) -> bytes:
    """The wire form of an error, for replying to a request that failed."""
    code = getattr(exc, "code", "internal")
    retriable = bool(getattr(exc, "retriable", False))
    return encode(ErrorReply(code=code, message=described(exc), retriable=retriable))


async def ensure_event_stream(js: JetStreamContext, replicas: int = 1, *, owner: bool = False) -> None:
    """Create or update the replayable event stream (idempotent), with ``replicas`` copies.

    A stream that exists keeps replicas it has beyond ``replicas`` (an update never lowers them).
    One with fewer is logged; the ``owner`` (the coordinator, whose identity may update streams)
    raises them, anyone else uses it as it is."""
    config = StreamConfig(
        name=subjects.EVENTS_STREAM,
        subjects=[subjects.EVENTS_ALL],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=EVENTS_MAX_AGE_S,
        max_bytes=EVENTS_MAX_BYTES,
        max_msg_size=EVENTS_MAX_MSG_BYTES,
        discard=DiscardPolicy.OLD,
        duplicate_window=EVENTS_DUPLICATE_WINDOW_S,
        num_replicas=replicas,
    )
    with map_exceptions(f"cannot create event stream {subjects.EVENTS_STREAM}"):
        try:
            await js.add_stream(config)
            return
        except nats.js.errors.BadRequestError:
            pass  # it exists, with other settings
        have = (await js.stream_info(subjects.EVENTS_STREAM)).config.num_replicas or 1
        config.num_replicas = max(have, replicas) if owner else have
        report_replicas(subjects.EVENTS_STREAM, have, replicas, owner)
        try:
            await js.add_stream(config)  # the settings it has: a no-op that needs no right to update
        except nats.js.errors.BadRequestError:
            await js.update_stream(config)


def report_replicas(stream: str, have: int, wanted: int, raising: bool) -> None:
    """Log a stream that has fewer replicas than configured, and what is done about it."""
    if have >= wanted:
        return
    log.warning("stream %s has %d replica(s), %d configured: %s", stream, have, wanted,
                f"raising it to {wanted}" if raising else "using it as it is (a coordinator raises it)")


def cluster_size(nc: Client) -> int:
    """How many servers the NATS cluster ``nc`` is connected to has, as that server tells its
    clients (its INFO: a cluster name, and every server's client URL); 1 for a server that is
    in no cluster.  nats-py keeps that INFO, though not as public API."""
    info: dict[str, Any] = getattr(nc, "_server_info", None) or {}
    if not info.get("cluster"):
        return 1
    return max(1, len(info.get("connect_urls") or []))


def replicas_for(nc: Client, configured: int) -> int:
    """The replica count for the streams and buckets: ``configured``, or with 0 (auto) 3 on a
    cluster of three servers or more and 1 otherwise."""
    if configured > 0:
        return configured
    return 3 if cluster_size(nc) >= 3 else 1


async def write_event(js: JetStreamContext, subject: str, msg: Message, msg_id: str) -> None:
    """Write an event to the stream's subject without waiting for the stream's ack (a core
    publish: the stream stores it all the same); ``msg_id`` as :func:`publish_event`."""
    with map_exceptions(f"cannot publish event on {subject}"):
        await js._nc.publish(subject, encode(msg), headers={MSG_ID_HEADER: msg_id})


async def publish_event(js: JetStreamContext, subject: str, msg: Message, timeout_s: float,
                        msg_id: str = "") -> Any:
    """Publish an event to JetStream and wait for the stream's ack.  With ``msg_id``, a copy the
    stream already holds (a retry whose first ack was lost) is acked and dropped, not stored."""
    headers = {MSG_ID_HEADER: msg_id} if msg_id else None
    with map_exceptions(f"cannot publish event on {subject}"):
        return await js.publish(subject, encode(msg), timeout=timeout_s, headers=headers)


def route_address(nats_url: str) -> str:
    """This host's own address on its route to the first NATS server of ``nats_url`` (a
    connected UDP socket: no packet is sent), or "" where that cannot be told."""
    first = nats_url.split(",")[0].strip()
    parsed = urllib.parse.urlsplit(first if "://" in first else f"nats://{first}")
    try:
        infos = socket.getaddrinfo(parsed.hostname or "127.0.0.1", parsed.port or 4222, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except (OSError, ValueError, IndexError):
        return ""
