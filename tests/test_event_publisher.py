"""The event publisher (common/messaging/events.py) against a real nats-server: ordering, stop, and an outage."""

from __future__ import annotations

import asyncio

import pytest

from helpers import connect_as, credentials
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.messages import NodeEvent, decode_as, subjects

pytestmark = pytest.mark.nats

# Every node's events, as the coordinator's publisher sends them: only its identity may.


async def test_event_bursts_are_published_in_order_per_subject(nats_url):
    from revenant.common.messaging.events import EventPublisher

    nc = await connect_as(nats_url, security.COORDINATOR)
    js = nc.jetstream()
    await bus.ensure_event_stream(js)
    pub = EventPublisher(js)
    pub.start()
    for i in range(3000):
        node = f"n{i % 50}"
        pub.emit(subjects.node_event(node, "joined"), NodeEvent(node=node, kind="joined", at=float(i)))
    await pub.stop(flush_timeout_s=60)
    assert pub.dropped == 0 and pub.published == 3000
    seen: dict[str, list[float]] = {}
    sub = await js.subscribe(subjects.EVENTS_ALL, ordered_consumer=True)
    for _ in range(3000):
        ev = decode_as((await sub.next_msg(timeout=5)).data, NodeEvent)
        seen.setdefault(ev.node, []).append(ev.at)
    assert all(times == sorted(times) for times in seen.values())
    await nc.close()


async def test_a_publisher_on_its_own_connection_keeps_a_burst_off_the_callers(nats_url):
    """The coordinator's publisher: 20,000 joins go out on its connection, none on the caller's
    (whose leader-lease renewals must not wait behind them), and it closes that one at stop."""
    from revenant.common.messaging.events import EventPublisher

    nc = await connect_as(nats_url, security.COORDINATOR, "caller")
    js = nc.jetstream()
    await bus.ensure_event_stream(js)
    pub = await EventPublisher.on_own_connection(nats_url, "caller-events",
                                                  credentials(nats_url, security.COORDINATOR))
    own = pub._own
    assert own is not None and own is not nc and own.is_connected
    pub.start()
    sent_before = nc.stats["out_msgs"]
    for i in range(20_000):
        pub.emit(subjects.node_event(f"n{i}", "joined"), NodeEvent(node=f"n{i}", kind="joined", at=float(i)),
                 acked=False)
    await nc.flush()
    await pub.stop(flush_timeout_s=60)
    assert pub.published == 20_000 and pub.dropped == 0
    assert nc.stats["out_msgs"] - sent_before < 10 and own.stats["out_msgs"] >= 20_000
    assert own.is_closed
    stored = 0
    for _ in range(100):  # written without acks: the stream stores them a moment later
        stored = (await js.stream_info(subjects.EVENTS_STREAM)).state.messages
        if stored >= 20_000:
            break
        await asyncio.sleep(0.1)
    assert stored == 20_000
    await nc.close()


async def test_events_in_flight_at_stop_are_published_and_stop_returns(nats_url):
    """A publish under way when the publisher stops is finished, not cancelled (which lost the
    event, and could leave a worker that never ended)."""
    import time

    from revenant.common.messaging.events import EventPublisher

    nc = await connect_as(nats_url, security.COORDINATOR)
    js = nc.jetstream()
    await bus.ensure_event_stream(js)
    for round_ in range(20):
        pub = EventPublisher(js)
        pub.start()
        await asyncio.sleep(0.01 * (round_ % 3))
        pub.emit(subjects.node_event("n1", "joined"), NodeEvent(node="n1", kind="joined", at=float(round_)))
        await asyncio.sleep(0.0005 * round_)  # stop at every stage of the publish
        started = time.monotonic()
        await pub.stop(flush_timeout_s=5)
        assert time.monotonic() - started < 5
        assert pub.published == 1 and pub.dropped == 0 and pub.queued == 0
    await nc.close()


async def test_events_emitted_while_nats_is_down_are_published_once_it_is_back(nats_server):
    """A self-fence happens exactly when NATS is out of reach: its reports must wait, not drop."""
    from revenant.common.messaging.events import EventPublisher

    # Node n1's agent: its own node events.
    nc = await connect_as(nats_server.url, security.agent_identity("n1"), "n1", reconnect_wait_s=0.2,
                          endless_reconnect=True)
    js = nc.jetstream()
    await bus.ensure_event_stream(js)
    pub = EventPublisher(js, timeout_s=0.5)
    pub.start()
    try:
        nats_server.kill()
        pub.emit(subjects.node_event("n1", "fenced"), NodeEvent(node="n1", kind="fenced", at=1.0))
        await asyncio.sleep(2.0)  # several failed attempts
        assert pub.published == 0 and pub.dropped == 0
        nats_server.restart()
        for _ in range(100):
            if pub.published:
                break
            await asyncio.sleep(0.1)
        assert pub.published == 1 and pub.dropped == 0
        reader = await connect_as(nats_server.url, security.ADMIN)  # an agent may not read the stream
        sub = await reader.jetstream().subscribe(subjects.EVENTS_ALL, ordered_consumer=True)
        ev = decode_as((await sub.next_msg(timeout=5)).data, NodeEvent)
        assert (ev.node, ev.kind) == ("n1", "fenced")
        await reader.close()
    finally:
        await pub.stop(flush_timeout_s=1)
        await nc.close()
