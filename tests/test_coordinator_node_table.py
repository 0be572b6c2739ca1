"""The coordinator in-process against a real nats-server: the node table it builds from
heartbeats (with in-process agents), the node events it publishes, bad heartbeats, and paging."""

from __future__ import annotations

import msgpack
import pytest

from helpers import _states, agent_config, connect_as, coordinator_config, running, wait_for
from revenant.agent.node.agent import Agent
from revenant.common.errors import NoResponders, RemoteError
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.coordinator.coordinator import Coordinator
from revenant.messages import Heartbeat, HeartbeatRequest, NodeEvent, NodesReply, NodesRequest, Probe, decode_as, encode, subjects

pytestmark = pytest.mark.nats


async def test_coordinator_tracks_nodes_and_publishes_events(nats_url, tmp_path):
    cfg = coordinator_config(nats_url, http_port=0)
    async with running(Coordinator(cfg)):
        nc = await connect_as(nats_url, security.ADMIN)  # the node table and the event stream, as an operator

        async def nodes():
            try:
                return (await bus.request(nc, subjects.coordinator("nodes"), NodesRequest(), NodesReply, 1)).nodes
            except NoResponders:
                return None

        async with running(Agent(agent_config(nats_url, tmp_path, "node-a"))):
            async with running(Agent(agent_config(nats_url, tmp_path, "node-b"))):
                table = await wait_for(lambda: _all_alive(nodes, {"node-a", "node-b"}))
                assert {n.name for n in table} == {"node-a", "node-b"}
                assert all(n.capabilities.criu.ok and n.pid > 0 for n in table)
        table = await wait_for(lambda: _states(nodes, {"node-a": "left", "node-b": "left"}))

        js = nc.jetstream()
        # Node events only: the stream also holds the coordinator's own leader_elected cluster event.
        sub = await js.subscribe(f"{subjects.EVENTS_PREFIX}.node.>", ordered_consumer=True)
        seen = []
        while len(seen) < 4:
            msg = await sub.next_msg(timeout=5)
            seen.append(decode_as(msg.data, NodeEvent))
            assert msg.subject == subjects.node_event(seen[-1].node, seen[-1].kind)
        assert sorted((e.node, e.kind) for e in seen) == [
            ("node-a", "joined"), ("node-a", "left"), ("node-b", "joined"), ("node-b", "left")]
        # Consumers in any language can read the stream: plain msgpack.
        assert msgpack.unpackb(msg.data)["type"] == "node_event.v1"
        await nc.close()


async def _all_alive(nodes, names):
    table = await nodes()
    if table and {n.name for n in table if n.state == "alive"} == names:
        return table
    return None


async def test_coordinator_survives_malformed_and_spoofed_heartbeats(nats_url, tmp_path):
    async with running(Coordinator(coordinator_config(nats_url, http_port=0))) as coord:
        # Node-x's own identity sends the junk (no other may publish on its heartbeat subject).
        spoofer = await connect_as(nats_url, security.agent_identity("node-x"), "node-x")
        nc = await connect_as(nats_url, security.ADMIN)
        await spoofer.publish(subjects.heartbeat("node-x"), b"\xc1\xc1")
        await spoofer.publish(subjects.heartbeat("node-x"), msgpack.packb({"type": "heartbeat.v1", "seq": "x"}))
        await spoofer.publish(subjects.heartbeat("node-x"),
                              encode(Heartbeat(node="other", seq=1, sent_at=0, incarnation="i")))
        await spoofer.publish(subjects.heartbeat("node-x"), b"x" * 300_000)
        await spoofer.flush()
        await spoofer.close()
        await wait_for(lambda: _true(coord.malformed_heartbeats >= 4), timeout=3)
        # Still serving.
        reply = await wait_for(lambda: _nodes_or_none(nc))
        assert reply.nodes == []
        with pytest.raises(RemoteError, match="expected nodes_request.v1"):
            await bus.request(nc, subjects.coordinator("nodes"), Probe(sent_at=0), NodesReply, 2)
        await nc.close()


async def test_a_coordinator_that_starts_asks_every_agent_for_a_full_heartbeat(nats_url):
    nc = await connect_as(nats_url, security.agent_identity("node-1"), "node-1")  # what every agent hears
    sub = await nc.subscribe(subjects.HEARTBEAT_REQUESTS)
    async with running(Coordinator(coordinator_config(nats_url, http_port=0, name="c1"))):
        req = decode_as((await sub.next_msg(timeout=10)).data, HeartbeatRequest)
    assert req.sender == "c1"
    await nc.close()


async def _true(value):
    return value


async def _nodes_or_none(nc):
    try:
        return await bus.request(nc, subjects.coordinator("nodes"), NodesRequest(), NodesReply, 1)
    except NoResponders:
        return None


async def test_a_large_node_table_comes_in_pages(nats_url):
    from revenant.cli.client import request_nodes

    async with running(Coordinator(coordinator_config(nats_url, http_port=0))):
        # 1200 nodes' heartbeats from one connection: only the coordinator's identity may publish
        # on every node's heartbeat subject.  The table is asked for as an operator.
        agents = await connect_as(nats_url, security.COORDINATOR, "1200-agents")
        nc = await connect_as(nats_url, security.ADMIN)
        caps = {"hostname": "h" * 40, "criu": {"path": "/usr/sbin/criu", "version": "4.1.1", "ok": True,
                                               "features": {f"feature_{i}": True for i in range(5)}}}
        for i in range(1200):  # ~600 KB of node statuses: more than one message may carry
            hb = msgpack.packb({"type": "heartbeat.v1", "node": f"n{i:04d}", "seq": 1, "sent_at": 0.0,
                                "incarnation": "i", "capabilities": caps})
            await agents.publish(subjects.heartbeat(f"n{i:04d}"), hb)
        await agents.flush()
        await agents.close()
        reply = await wait_for(lambda: _full_table(nc, request_nodes, 1200), timeout=15)
        assert [n.name for n in reply.nodes] == [f"n{i:04d}" for i in range(1200)]
        assert reply.total == 1200
        await nc.close()


async def _full_table(nc, request_nodes, want):
    try:
        reply = await request_nodes(nc, 2)
    except NoResponders:
        return None
    return reply if len(reply.nodes) == want else None
