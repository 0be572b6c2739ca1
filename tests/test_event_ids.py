"""Events carry a message id (Nats-Msg-Id), fixed when they are emitted: a retried copy is dropped
by the stream's duplicate window, against a real nats-server."""

from __future__ import annotations

import asyncio

import pytest

from helpers import connect_as
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.common.messaging.events import EventPublisher
from revenant.messages import JobEvent, NodeEvent, subjects

pytestmark = pytest.mark.nats


async def stored(js) -> int:
    return (await js.stream_info(subjects.EVENTS_STREAM)).state.messages


async def test_one_event_published_twice_with_one_id_is_stored_once(nats_url):
    nc = await connect_as(nats_url, security.COORDINATOR)  # the leader's events (no node in their subjects)
    try:
        js = nc.jetstream()
        await bus.ensure_event_stream(js)
        info = await js.stream_info(subjects.EVENTS_STREAM)
        assert info.config.duplicate_window >= 60 + 2  # the publisher's retries, and their last wait
        ev = JobEvent(job="1", kind="evicted", at=1.0, node="node-1", generation=2)
        first = await bus.publish_event(js, subjects.job_event("1", "evicted", user=""), ev, 2.0, msg_id="abc")
        again = await bus.publish_event(js, subjects.job_event("1", "evicted", user=""), ev, 2.0, msg_id="abc")
        assert not first.duplicate and again.duplicate and again.seq == first.seq
        assert await stored(js) == 1
        # Another id is another event.
        await bus.publish_event(js, subjects.job_event("1", "evicted", user=""), ev, 2.0, msg_id="def")
        assert await stored(js) == 2
    finally:
        await nc.close()


async def test_a_publish_whose_ack_came_too_late_is_retried_and_stored_once(nats_url):
    """The first attempt's ack cannot arrive within its timeout (the stream stores the event
    anyway); each retry waits twice as long and carries the same id."""
    nc = await connect_as(nats_url, security.COORDINATOR)
    try:
        js = nc.jetstream()
        await bus.ensure_event_stream(js)
        pub = EventPublisher(js, timeout_s=0.0001)
        pub.start()
        pub.emit(subjects.job_event("1", "evicted", user=""), JobEvent(job="1", kind="evicted", at=1.0, node="node-1"))
        pub.emit(subjects.node_event("node-1", "dead"), NodeEvent(node="node-1", kind="dead", at=1.0))
        for _ in range(300):
            if pub.published == 2:
                break
            await asyncio.sleep(0.05)
        assert pub.published == 2 and pub.dropped == 0
        assert pub.retried >= 2  # the first attempts did time out
        await asyncio.sleep(0.2)
        assert await stored(js) == 2
        await pub.stop()
    finally:
        await nc.close()


def test_events_are_never_retried_past_the_duplicate_window():
    with pytest.raises(ValueError, match="duplicate window"):
        EventPublisher(None, retry_for_s=bus.EVENTS_DUPLICATE_WINDOW_S)  # type: ignore[arg-type]
