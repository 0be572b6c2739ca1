"""Heartbeats in: from the bus to the failure detector, at the cost of what changed.

Every node's heartbeat arrives once a second, so this is the coordinator's hottest path: at
100,000 nodes, 100,000 heartbeats a second.  It takes each read's messages in one call straight
from the :class:`~revenant.common.messaging.rawsub.RawSubscriber` (no per-message object, queue or
coroutine), decodes each as a :class:`~revenant.messages.HeartbeatView` (capabilities left
encoded), records a slim one of a node it knows alive in place
(:meth:`~revenant.coordinator.nodes.detector.FailureDetector.beat`), and decodes capabilities only
when a heartbeat has them (the first ones, and a change: most heartbeats are slim, see
:class:`~revenant.messages.Heartbeat`) and their bytes differ from the ones the node's record
holds.
Counters are plain integers, handed to Prometheus when ``/metrics`` is rendered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from revenant.common.errors import described
from revenant.common.messaging.rawsub import Batch
from revenant.coordinator.nodes.detector import FailureDetector, Transition
from revenant.messages import HeartbeatRequest, MessageError, decode_capabilities, decode_heartbeat, encode, subjects
from revenant.messages.codec import LEFT_OUT, MAX_MESSAGE_BYTES, NIL, decode_heartbeat_view

log = logging.getLogger(__name__)

PREFIX = (subjects.HEARTBEAT_PREFIX + ".").encode()


class HeartbeatIntake:
    """Takes a read's heartbeats (:data:`~revenant.common.messaging.rawsub.Batch`) at one time, the clock
    read once: each decoded as a view; a slim one of a known alive node recorded in place
    (:meth:`FailureDetector.beat`), anything else (a first, full, leaving or malformed one)
    through the whole path (:meth:`_one`)."""

    def __init__(self, detector: FailureDetector, clock: Callable[[], float],
                 emit: Callable[[list[Transition]], None]) -> None:
        self.detector = detector
        self._clock = clock
        self._emit = emit
        self.received = 0
        self.malformed = 0
        self._reported = (0, 0)

    def __call__(self, batch: Batch) -> None:
        now = self._clock()
        decode, beat = decode_heartbeat_view, self.detector.beat
        fast = 0
        try:
            for subject, data in batch:
                try:
                    hb = decode(data)
                except (msgspec.DecodeError, TypeError, ValueError, OverflowError, RecursionError):
                    hb = None  # _one says what is wrong with it
                if hb is not None and (hb.capabilities is LEFT_OUT or hb.capabilities == LEFT_OUT) \
                        and len(data) <= MAX_MESSAGE_BYTES and subject == PREFIX + hb.node.encode() and beat(hb, now):
                    fast += 1
                    continue
                try:
                    self._one(subject, data, now)
                except Exception:  # a bug on the whole path loses this heartbeat, not the read's others
                    log.exception("handling a heartbeat on %s failed", subject.decode(errors="replace"))
        finally:
            self.received += fast

    def _one(self, subject: bytes, data: bytes, now: float) -> None:
        if not subject.startswith(PREFIX):
            return self._bad(subject, "not a heartbeat subject")
        node = subject[len(PREFIX):].decode(errors="replace")
        rec = self.detector.nodes.get(node)
        if rec is None and subjects.node_from_heartbeat(subject.decode(errors="replace")) is None:
            return self._bad(subject, "not a valid node name")  # checked once per node, at its first heartbeat
        try:
            hb = decode_heartbeat(data)
            raw = bytes(hb.capabilities)
            if raw == NIL:
                caps = None  # as the node's last full heartbeat had them
            else:
                caps = rec.capabilities if rec is not None and rec.capabilities_raw == raw else decode_capabilities(raw)
        except MessageError as exc:
            return self._bad(subject, str(exc))
        if hb.node != node:
            return self._bad(subject, f"heartbeat for {hb.node!r}")
        self.received += 1
        transitions = self.detector.heartbeat(hb, now, caps, raw)
        if transitions:
            self._emit(transitions)

    def _bad(self, subject: bytes, why: str) -> None:
        self.malformed += 1
        if self.malformed & (self.malformed - 1) == 0:  # log 1, 2, 4, 8, ...
            log.warning("dropped bad heartbeat on %s (%d so far): %s", subject.decode(errors="replace"),
                        self.malformed, why)

    def counts_since_last(self) -> tuple[int, int]:
        """(heartbeats, malformed ones) since the last call: for the Prometheus counters."""
        now = (self.received, self.malformed)
        last, self._reported = self._reported, now
        return now[0] - last[0], now[1] - last[1]


async def ask_full_heartbeats(nc: Client, sender: str, at: float, term: int = 0) -> None:
    """Every agent's next heartbeat full (heartbeat_request.v1): a verdict that changed while a
    coordinator did not listen (it was starting, or its heartbeat connection was down) is heard
    at once, not at the agent's next periodic full heartbeat.  ``term``: a new leader's, announced."""
    try:
        await nc.publish(subjects.HEARTBEAT_REQUESTS, encode(HeartbeatRequest(sender=sender, sent_at=at, term=term)))
    except nats.errors.Error as exc:
        log.warning("could not ask the agents for full heartbeats: %s", described(exc))


class ClientSubscription:
    """Heartbeats through the NATS client library, for a bus reached over TLS (which
    :class:`~revenant.common.messaging.rawsub.RawSubscriber` does not speak): the same intake, at the
    library's per-message cost (about 12 µs a heartbeat more on a small machine)."""

    def __init__(self, nc: Client, subject: str, on_messages: Callable[[Batch], None]) -> None:
        self._nc, self._subject, self._on = nc, subject, on_messages
        self._sub = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._subject, cb=self._deliver, pending_msgs_limit=1_000_000)

    async def _deliver(self, msg: Msg) -> None:
        self._on([(msg.subject.encode(), msg.data)])

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    @property
    def backlogged(self) -> bool:
        """More than 2,000 heartbeats wait unread in the subscription."""
        return self._sub is not None and self._sub.pending_msgs > BACKLOG_MSGS

    async def close(self) -> None:
        pass  # it ends with the connection


BACKLOG_MSGS = 2_000


class TransitionLog:
    """Node transitions in the coordinator's log: each one, except in a burst (a coordinator
    starting amid 100,000 nodes hears them all join within a second).  Past ``per_second`` of a
    kind in one second, the rest are counted and summed up in one line when the second is over;
    each of them is still on the event stream and in the node table."""

    def __init__(self, clock: Callable[[], float], per_second: int = 200) -> None:
        self._clock = clock
        self.per_second = per_second
        self._since = -1.0
        self._counts: dict[str, int] = {}
        self._hidden: dict[str, int] = {}

    def log(self, t: Transition) -> None:
        self.flush()
        n = self._counts[t.kind] = self._counts.get(t.kind, 0) + 1
        if n > self.per_second:
            self._hidden[t.kind] = self._hidden.get(t.kind, 0) + 1
            return
        log.log(_level(t.kind), "node %s %s (silent %.2f s%s)", t.node, t.kind, t.silence_s,
                f", {t.reason}" if t.reason else "")

    def flush(self) -> None:
        """Close the second if it is over: one line per kind that went past the limit."""
        now = self._clock()
        if now - self._since < 1.0:
            return
        for kind, n in sorted(self._hidden.items()):
            log.log(_level(kind), "%d more nodes %s in the last second (not logged one by one; each is "
                    "on the event stream)", n, kind)
        self._since, self._counts, self._hidden = now, {}, {}


def _level(kind: str) -> int:
    return logging.WARNING if kind in ("suspect", "dead") else logging.INFO
