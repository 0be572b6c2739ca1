"""Agent and coordinator in-process against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgpack
import nats
import pytest

from revenant.agent.agent import Agent
from revenant.common import bus
from revenant.common.config import AgentConfig, CoordinatorConfig
from revenant.common.errors import NoResponders, RemoteError
from revenant.coordinator.coordinator import Coordinator
from revenant.messages import (
    ErrorReply,
    Heartbeat,
    NodeEvent,
    NodesReply,
    NodesRequest,
    Probe,
    ProbeReply,
    decode,
    decode_as,
    encode,
    subjects,
)


@contextlib.asynccontextmanager
async def running(service):
    task = asyncio.create_task(service.run())
    ready = asyncio.create_task(service.ready.wait())
    await asyncio.wait([task, ready], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        await task  # raises what made it stop
    assert service.ready.is_set(), "service did not become ready"
    try:
        yield service
    finally:
        service.stop()
        await asyncio.wait_for(task, 10)


def agent_config(nats_url, tmp_path, node="node-1", **kw):
    return AgentConfig(node=node, nats_url=nats_url, storage=str(tmp_path / "storage"),
                       heartbeat_interval_s=0.2, http_port=0, **kw)


async def wait_for(predicate, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await predicate()
        if result:
            return result
        await asyncio.sleep(interval)
    raise AssertionError("condition not met in time")


async def test_heartbeats_carry_sequence_capabilities_and_health(nats_url, tmp_path):
    nc = await nats.connect(nats_url)
    sub = await nc.subscribe(subjects.heartbeat("node-1"))
    async with running(Agent(agent_config(nats_url, tmp_path))):
        beats = [decode_as((await sub.next_msg(timeout=5)).data, Heartbeat) for _ in range(3)]
    await nc.close()
    assert [b.seq for b in beats] == sorted(b.seq for b in beats)
    assert beats[1].seq == beats[0].seq + 1
    hb = beats[-1]
    assert hb.sent_at == pytest.approx(time.time(), abs=5)
    assert hb.capabilities.criu.ok, hb.capabilities.criu.error
    assert hb.capabilities.criu.version >= "4.1"
    assert "mem_dirty_track" in hb.capabilities.criu.features
    assert hb.capabilities.gpu == "none" and hb.capabilities.gpus == []
    assert hb.health.state in ("GREEN", "YELLOW", "RED")
    assert hb.health.storage_free_bytes > 0


async def test_agent_answers_probes_and_rejects_garbage(nats_url, tmp_path):
    async with running(Agent(agent_config(nats_url, tmp_path))) as agent:
        nc = await bus.connect(nats_url, "test", endless_reconnect=False)
        reply = await wait_for(lambda: _probe(nc))
        assert reply.node == "node-1" and reply.incarnation == agent.incarnation
        raw = await nc.request(subjects.probe("node-1"), b"\x00garbage", timeout=2)
        err = decode(raw.data)
        assert isinstance(err, ErrorReply) and err.code == "malformed"
        # The agent is still fine after garbage.
        assert (await _probe(nc)).node == "node-1"
        await nc.close()


async def _probe(nc):
    try:
        return await bus.request(nc, subjects.probe("node-1"), Probe(sent_at=time.time()), ProbeReply, 1.0)
    except NoResponders:
        return None


async def test_coordinator_tracks_nodes_and_publishes_events(nats_url, tmp_path):
    cfg = CoordinatorConfig(nats_url=nats_url, http_port=0)
    async with running(Coordinator(cfg)):
        nc = await bus.connect(nats_url, "test", endless_reconnect=False)

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
        sub = await js.subscribe(subjects.EVENTS_ALL, ordered_consumer=True)
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


async def _states(nodes, want):
    table = await nodes()
    if table and {n.name: n.state for n in table} == want:
        return table
    return None


async def test_coordinator_survives_malformed_and_spoofed_heartbeats(nats_url, tmp_path):
    async with running(Coordinator(CoordinatorConfig(nats_url=nats_url, http_port=0))) as coord:
        nc = await bus.connect(nats_url, "test", endless_reconnect=False)
        await nc.publish(subjects.heartbeat("node-x"), b"\xc1\xc1")
        await nc.publish(subjects.heartbeat("node-x"), msgpack.packb({"type": "heartbeat.v1", "seq": "x"}))
        await nc.publish(subjects.heartbeat("node-x"), encode(Heartbeat(node="other", seq=1, sent_at=0, incarnation="i")))
        await nc.publish(subjects.heartbeat("node-x"), b"x" * 300_000)
        await nc.flush()
        await wait_for(lambda: _true(coord.malformed_heartbeats >= 4), timeout=3)
        # Still serving.
        reply = await wait_for(lambda: _nodes_or_none(nc))
        assert reply.nodes == []
        with pytest.raises(RemoteError, match="expected nodes_request.v1"):
            await bus.request(nc, subjects.coordinator("nodes"), Probe(sent_at=0), NodesReply, 2)
        await nc.close()


async def _true(value):
    return value


async def _nodes_or_none(nc):
    try:
        return await bus.request(nc, subjects.coordinator("nodes"), NodesRequest(), NodesReply, 1)
    except NoResponders:
        return None


async def test_agent_stop_is_idempotent_and_safe_before_run(nats_url, tmp_path):
    agent = Agent(agent_config(nats_url, tmp_path))
    agent.stop()
    agent.stop()
    await asyncio.wait_for(agent.run(), 5)  # returns at once: it was stopped before it started


async def test_agent_with_missing_criu_still_heartbeats_and_reports_red(nats_url, tmp_path):
    nc = await nats.connect(nats_url)
    sub = await nc.subscribe(subjects.heartbeat("node-1"))
    cfg = agent_config(nats_url, tmp_path, criu_path=str(tmp_path / "no-such-criu"))
    async with running(Agent(cfg)):
        hb = decode_as((await sub.next_msg(timeout=5)).data, Heartbeat)
        hb = decode_as((await sub.next_msg(timeout=5)).data, Heartbeat)
    await nc.close()
    assert not hb.capabilities.criu.ok
    assert "criu not found" in hb.capabilities.criu.error
    assert hb.health.state == "RED"
    assert any("criu" in r for r in hb.health.reasons)


async def _http_get(url: str) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    path = "/" + url.removeprefix("http://").split("/", 1)[1]
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


async def test_agent_serves_metrics_health_ready_and_live(nats_url, tmp_path):
    import json

    async with running(Agent(agent_config(nats_url, tmp_path))) as agent:
        url = agent.http.url
        await asyncio.sleep(0.5)  # a heartbeat or two
        status, body = await _http_get(url + "/metrics")
        assert status == 200
        text = body.decode()
        for metric in ("revenant_node_health_state", "revenant_event_loop_lag_seconds",
                       "revenant_checkpoint_duration_seconds_bucket", "revenant_heartbeats_sent_total"):
            assert metric in text
        status, body = await _http_get(url + "/health")
        doc = json.loads(body)
        assert status == 200 and doc["state"] in ("GREEN", "YELLOW") and "memory_percent" in doc["probes"]
        assert doc["node"] == "node-1"
        assert (await _http_get(url + "/ready"))[0] == 200
        assert (await _http_get(url + "/live"))[0] == 200
        assert (await _http_get(url + "/nope"))[0] == 404
        assert agent.capabilities.metrics_url == url


async def test_injected_loop_stall_makes_the_node_yellow(nats_url, tmp_path):
    nc = await nats.connect(nats_url)
    sub = await nc.subscribe(subjects.heartbeat("node-1"))
    async with running(Agent(agent_config(nats_url, tmp_path))):
        await sub.next_msg(timeout=5)
        time.sleep(0.6)  # block the agent's event loop, as a runaway callback would
        # Heartbeats kept coming from the liveness thread during the stall; the ones after it report it.
        beats = [decode_as((await sub.next_msg(timeout=5)).data, Heartbeat) for _ in range(10)]
    await nc.close()
    stalled = [b for b in beats if b.health.loop_stalls >= 1]
    assert stalled, [b.health for b in beats]
    assert any(b.health.state == "YELLOW" and any("event loop" in r for r in b.health.reasons) for b in stalled)


async def test_memory_pressure_makes_the_node_yellow(nats_url, tmp_path):
    import psutil

    used = psutil.virtual_memory().percent
    nc = await nats.connect(nats_url)
    sub = await nc.subscribe(subjects.heartbeat("node-1"))
    # The real memory probe against a threshold this machine is already above.
    cfg = agent_config(nats_url, tmp_path, memory_yellow_percent=max(1.0, used / 2), memory_red_percent=99.9)
    async with running(Agent(cfg)):
        hb = decode_as((await sub.next_msg(timeout=5)).data, Heartbeat)
        hb = decode_as((await sub.next_msg(timeout=5)).data, Heartbeat)
    await nc.close()
    assert hb.health.state == "YELLOW"
    assert any(r.startswith("memory") for r in hb.health.reasons)


async def test_stuck_event_loop_is_red_but_never_dead(nats_url, tmp_path):
    import subprocess

    from conftest import VENV_BIN

    coord = subprocess.Popen([str(VENV_BIN / "revenant"), "coordinator", "--nats", nats_url, "--http-port", "0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        nc = await bus.connect(nats_url, "test", endless_reconnect=False)
        sub = await nc.subscribe(subjects.heartbeat("node-1"))
        async with running(Agent(agent_config(nats_url, tmp_path))):
            await wait_for(lambda: _states(lambda: _nodes(nc), {"node-1": "alive"}), timeout=20)
            time.sleep(3.5)  # the agent's event loop is stuck past node_timeout_s (2.5 s)
            beats = []
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                try:
                    beats.append(decode_as((await sub.next_msg(timeout=0.5)).data, Heartbeat))
                except nats.errors.TimeoutError:
                    pass
            table = {n.name: n for n in await _nodes(nc)}
        assert any(b.health.state == "RED" and any("event loop stuck" in r for r in b.health.reasons)
                   for b in beats), [b.health for b in beats]
        assert table["node-1"].state == "alive"
        js = nc.jetstream()
        kinds = []
        esub = await js.subscribe(subjects.EVENTS_ALL, ordered_consumer=True)
        while True:
            try:
                kinds.append(decode((await esub.next_msg(timeout=1)).data).kind)
            except nats.errors.TimeoutError:
                break
        assert "dead" not in kinds and "suspect" not in kinds, kinds
        await nc.close()
    finally:
        coord.terminate()
        coord.wait(timeout=10)


async def _nodes(nc):
    try:
        return (await bus.request(nc, subjects.coordinator("nodes"), NodesRequest(), NodesReply, 1)).nodes
    except (NoResponders, RemoteError):
        return []
    except Exception:
        return []


async def test_event_bursts_are_published_in_order_per_subject(nats_url):
    from revenant.common.events import EventPublisher

    nc = await bus.connect(nats_url, "test", endless_reconnect=False)
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


async def test_events_in_flight_at_stop_are_published_and_stop_returns(nats_url):
    """A publish under way when the publisher stops is finished, not cancelled (which lost the
    event, and could leave a worker that never ended)."""
    import time

    from revenant.common.events import EventPublisher

    nc = await bus.connect(nats_url, "test", endless_reconnect=False)
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


async def test_events_emitted_while_nats_is_down_are_published_once_it_is_back(tmp_path):
    """A self-fence happens exactly when NATS is out of reach: its reports must wait, not drop."""
    from revenant.common.events import EventPublisher
    from revenant.common.natsserver import start_nats_server

    server = start_nats_server(tmp_path / "nats")
    port = int(server.url.rsplit(":", 1)[1])
    nc = await bus.connect(server.url, "test", reconnect_wait_s=0.2)
    js = nc.jetstream()
    await bus.ensure_event_stream(js)
    pub = EventPublisher(js, timeout_s=0.5)
    pub.start()
    try:
        server.stop()
        pub.emit(subjects.node_event("n1", "fenced"), NodeEvent(node="n1", kind="fenced", at=1.0))
        await asyncio.sleep(2.0)  # several failed attempts
        assert pub.published == 0 and pub.dropped == 0
        server = start_nats_server(tmp_path / "nats", port=port)
        for _ in range(100):
            if pub.published:
                break
            await asyncio.sleep(0.1)
        assert pub.published == 1 and pub.dropped == 0
        sub = await js.subscribe(subjects.EVENTS_ALL, ordered_consumer=True)
        ev = decode_as((await sub.next_msg(timeout=5)).data, NodeEvent)
        assert (ev.node, ev.kind) == ("n1", "fenced")
    finally:
        await pub.stop(flush_timeout_s=1)
        await nc.close()
        server.stop()


async def test_lease_expiry_is_read_from_the_store_only_when_needed(nats_url):
    import msgspec

    from revenant.common.kv import open_bucket
    from revenant.messages import LeaseValue
    from revenant.coordinator.failover import Failover

    nc = await bus.connect(nats_url, "test", endless_reconnect=False)
    js = nc.jetstream()
    cfg = CoordinatorConfig(nats_url=nats_url, lease_ttl_s=0.6, lease_margin_s=0.1)
    fo = Failover(cfg, js, None, None, lambda: [], lambda node: None)
    kv = await open_bucket(js, subjects.LEASES_BUCKET, cfg.lease_ttl_s)

    async def renew(node, inc):
        await kv.put(node, msgspec.msgpack.encode(LeaseValue(node=node, incarnation=inc, seq=1, at=time.time())))

    assert await fo.read_lease("ghost") is None
    assert await fo.wait_for_lease_expiry("1", "ghost", "x")  # no lease at all: nothing to wait for

    await renew("n1", "a")
    started = time.monotonic()
    assert await fo.wait_for_lease_expiry("1", "n1", "a")
    assert time.monotonic() - started >= 0.6  # ttl + margin after the renewal, less the read

    await renew("n2", "a")
    waiter = asyncio.create_task(fo.wait_for_lease_expiry("1", "n2", "a"))
    await asyncio.sleep(0.3)
    await renew("n2", "a")  # the agent is alive after all
    assert await waiter is False

    await renew("n3", "b")  # a restarted agent holds the lease: the old incarnation's is gone
    started = time.monotonic()
    assert await fo.wait_for_lease_expiry("1", "n3", "a")
    assert time.monotonic() - started < 0.3
    await nc.close()


async def test_a_large_node_table_comes_in_pages(nats_url):
    from revenant.cli.client import request_nodes

    async with running(Coordinator(CoordinatorConfig(nats_url=nats_url, http_port=0))):
        nc = await bus.connect(nats_url, "test", endless_reconnect=False)
        caps = {"hostname": "h" * 40, "criu": {"path": "/usr/sbin/criu", "version": "4.1.1", "ok": True,
                                               "features": {f"feature_{i}": True for i in range(5)}}}
        for i in range(1200):  # ~600 KB of node statuses: more than one message may carry
            hb = msgpack.packb({"type": "heartbeat.v1", "node": f"n{i:04d}", "seq": 1, "sent_at": 0.0,
                                "incarnation": "i", "capabilities": caps})
            await nc.publish(subjects.heartbeat(f"n{i:04d}"), hb)
        await nc.flush()
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
