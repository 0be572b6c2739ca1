"""The agent in-process against a real nats-server: probes, its lifecycle, and its HTTP endpoints."""

from __future__ import annotations

import asyncio
import time

import pytest

from helpers import agent_config, connect_as, running, wait_for
from revenant.agent.node.agent import Agent
from revenant.common.errors import NoResponders
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.messages import ErrorReply, Probe, ProbeReply, decode, subjects

pytestmark = pytest.mark.nats


async def test_agent_answers_probes_and_rejects_garbage(nats_url, tmp_path):
    async with running(Agent(agent_config(nats_url, tmp_path))) as agent:
        nc = await connect_as(nats_url, security.COORDINATOR)  # probes are the coordinator's
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


async def test_agent_stop_is_idempotent_and_safe_before_run(nats_url, tmp_path):
    agent = Agent(agent_config(nats_url, tmp_path))
    agent.stop()
    agent.stop()
    await asyncio.wait_for(agent.run(), 5)  # returns at once: it was stopped before it started


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
