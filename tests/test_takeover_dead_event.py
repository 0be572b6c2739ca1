"""A failover decided by a new leader publishes the node's `dead` event (issue 9, finding 10: a
standby took over a failover and the node's `dead` event was never published), once, against a
real nats-server; and no log line names an empty node."""

from __future__ import annotations

import asyncio
import time

import pytest

from helpers import connect_as, coordinator_config, wait_for
from revenant.common.messaging import bus
from revenant.common.messaging.kv import open_bucket
from revenant.common.settings import security
from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.coordinator import Coordinator
from revenant.coordinator.nodes.detector import FailureDetector
from revenant.coordinator.nodes.leader import KEY
from revenant.coordinator.recovery.takeover import announce_dead, announced
from revenant.coordinator.table.store import KvJobStore
from revenant.messages import (
    Capabilities,
    CriuInfo,
    EpochInfo,
    Heartbeat,
    JobRecord,
    JobSpec,
    NodeEvent,
    decode_as,
    encode,
    subjects,
)

WORKING = Capabilities(criu=CriuInfo(path="/usr/sbin/criu", version="4.1.1", ok=True))


async def node_events(js, node: str, kind: str) -> list[NodeEvent]:
    out = []
    sub = await js.subscribe(subjects.node_event(node, kind), ordered_consumer=True)
    try:
        while True:
            try:
                out.append(decode_as((await sub.next_msg(timeout=0.5)).data, NodeEvent))
            except Exception:  # nats TimeoutError: no more
                return out
    finally:
        await sub.unsubscribe()


@pytest.mark.nats
async def test_a_standby_that_takes_over_a_failover_publishes_the_nodes_dead_event(nats_url, caplog):
    nc = await connect_as(nats_url, security.COORDINATOR, "old-leader")
    node = await connect_as(nats_url, security.agent_identity("node-1"), "node-1")
    js = nc.jetstream()
    await bus.ensure_event_stream(js)
    lease = await open_bucket(js, subjects.LEADER_BUCKET, 1.5)

    gone = asyncio.Event()

    async def old_leader() -> None:  # holds the lease: the coordinator under test is a standby
        while not gone.is_set():  # (a flag, not a cancel: a put's wait_for may swallow one)
            await lease.put(KEY, b"old 0123456789abcdef")
            await asyncio.sleep(0.3)

    old = asyncio.create_task(old_leader())
    # The old leader was failing node-1's job over when it died: the job is restoring, on no node.
    store = KvJobStore(js)
    await store.open()
    await store.save(JobRecord(spec=JobSpec(id="1", argv=["true"]), state="restoring", node="", generation=2,
                               epochs=[EpochInfo(n=1)]))
    config = coordinator_config(nats_url, http_port=-1, name="standby", leader_lease_s=1.5,
                                suspect_timeout_s=0.5, node_timeout_s=0.6, probe_timeout_s=0.2,
                                requeue_timeout_s=1.0)
    coord = Coordinator(config)
    task = asyncio.create_task(coord.run())
    try:
        for seq in range(1, 6):  # node-1 heartbeats, then dies
            await node.publish(subjects.heartbeat("node-1"), encode(Heartbeat(
                node="node-1", seq=seq, sent_at=time.time(), incarnation="inc-1", interval_s=0.2,
                capabilities=WORKING)))
            await asyncio.sleep(0.2)
        await wait_for(lambda: _true(coord.detector.nodes["node-1"].state == "dead"), timeout=10)
        await asyncio.sleep(0.5)
        assert not coord.leader and await node_events(js, "node-1", "dead") == []  # a standby says nothing
        gone.set()
        await old
        await lease.delete(KEY)  # the old leader is gone
        await asyncio.wait_for(coord.ready.wait(), 10)
        events = await wait_for(lambda: node_events(js, "node-1", "dead"), timeout=10)
        assert len(events) == 1
        assert events[0].incarnation == "inc-1" and "new leader" in events[0].reason
        assert events[0].silence_s > 1.0
        await asyncio.sleep(1.5)  # the take-over's recovery runs (and fails: no node to take it)
        assert len(await node_events(js, "node-1", "dead")) == 1
        assert not [r for r in caplog.records if " 's " in r.getMessage() or "node  " in r.getMessage()]
    finally:
        gone.set()
        await old
        coord.stop()
        await asyncio.wait_for(task, 10)
        await nc.close()
        await node.close()


@pytest.mark.nats
async def test_a_dead_event_already_out_is_not_published_again(nats_url):
    nc = await connect_as(nats_url, security.COORDINATOR, "old-leader")
    js = nc.jetstream()
    await bus.ensure_event_stream(js)
    from revenant.common.messaging.events import EventPublisher

    events = EventPublisher(js)
    events.start()
    now = time.time()
    try:
        # node-1: the old leader published its death; node-2: died, came back (joined), died again
        # unannounced; node-3: alive in this coordinator's table, never to be declared dead here.
        await bus.publish_event(js, subjects.node_event("node-1", "dead"),
                                NodeEvent(node="node-1", kind="dead", at=now - 5), 2)
        await bus.publish_event(js, subjects.node_event("node-2", "dead"),
                                NodeEvent(node="node-2", kind="dead", at=now - 60), 2)
        await bus.publish_event(js, subjects.node_event("node-2", "joined"),
                                NodeEvent(node="node-2", kind="joined", at=now - 30), 2)
        detector = FailureDetector(CoordinatorConfig())
        detector.heartbeat(Heartbeat(node="node-3", seq=1, sent_at=now, incarnation="i3"), 100.0)
        published = await announce_dead(js, events, detector, ["node-1", "node-2", "node-3"],
                                        clock=lambda: 100.0, wall=time.time)
        assert published == ["node-2"]
        await events.stop()
        assert len(await node_events(js, "node-1", "dead")) == 1
        assert len(await node_events(js, "node-2", "dead")) == 2
        assert await node_events(js, "node-3", "dead") == []
    finally:
        await nc.close()


@pytest.mark.unit
def test_announced_means_a_dead_event_newer_than_the_last_sign_of_life():
    assert announced(10.0, 5.0)
    assert not announced(5.0, 10.0)
    assert not announced(0.0, 0.0)  # none in the stream
    assert not announced(None, 0.0)  # the stream could not be read: publish (a second beats none)


@pytest.mark.unit
def test_a_recovery_log_line_never_names_an_empty_node():
    from revenant.coordinator.recovery.failover import Failover

    f = Failover(CoordinatorConfig(), None, None, None, lambda: [], lambda node: 10.0 if node == "node-1" else None,
                 clock=lambda: 12.5)
    assert f._since_words("node-1") == "2.50 s after node node-1's last heartbeat"
    assert f._since_words("node-9") == "(node node-9: no heartbeat seen by this coordinator)"
    assert f._since_words("") == "(taken over from the previous leader)"


async def _true(value: bool) -> bool:
    return value
