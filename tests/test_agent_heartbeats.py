"""The agent in-process against a real nats-server: what its heartbeats carry (sequence,
capabilities, health) and how real conditions (no criu, a stalled loop, memory pressure) show in them."""

from __future__ import annotations

import time

import pytest

from helpers import agent_config, connect_as, running
from revenant.agent.node.agent import Agent
from revenant.agent.node.liveness import FULL_FIRST
from revenant.common.settings import security
from revenant.messages import Heartbeat, HeartbeatRequest, decode_as, encode, subjects

pytestmark = pytest.mark.nats


async def _listener(nats_url):
    """Heartbeats (and asking for a full one) are the coordinator's to hear (and ask): the test listens as it."""
    return await connect_as(nats_url, security.COORDINATOR)


async def test_heartbeats_carry_sequence_capabilities_and_health(nats_url, tmp_path):
    nc = await _listener(nats_url)
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


async def test_agent_with_missing_criu_still_heartbeats_and_reports_red(nats_url, tmp_path):
    nc = await _listener(nats_url)
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


async def test_injected_loop_stall_makes_the_node_yellow(nats_url, tmp_path):
    nc = await _listener(nats_url)
    sub = await nc.subscribe(subjects.heartbeat("node-1"))
    async with running(Agent(agent_config(nats_url, tmp_path))):
        await sub.next_msg(timeout=5)
        time.sleep(0.6)  # block the agent's event loop, as a runaway callback would
        # Heartbeats kept coming from the liveness thread during the stall; the ones after it report it.
        beats = [decode_as((await sub.next_msg(timeout=5)).data, Heartbeat) for _ in range(10)]
    await nc.close()
    # A slim heartbeat (health None) says nothing changed; the stall changes the verdict, so the
    # heartbeat that carries it is full.
    stalled = [b for b in beats if b.health is not None and b.health.loop_stalls >= 1]
    assert stalled, [b.health for b in beats]
    assert any(b.health.state == "YELLOW" and any("event loop" in r for r in b.health.reasons) for b in stalled)


async def test_memory_pressure_makes_the_node_yellow(nats_url, tmp_path):
    import psutil

    used = psutil.virtual_memory().percent
    nc = await _listener(nats_url)
    sub = await nc.subscribe(subjects.heartbeat("node-1"))
    # The real memory probe against a threshold this machine is already above.
    cfg = agent_config(nats_url, tmp_path, memory_yellow_percent=max(1.0, used / 2), memory_red_percent=99.9)
    async with running(Agent(cfg)):
        hb = decode_as((await sub.next_msg(timeout=5)).data, Heartbeat)
        hb = decode_as((await sub.next_msg(timeout=5)).data, Heartbeat)
    await nc.close()
    assert hb.health.state == "YELLOW"
    assert any(r.startswith("memory") for r in hb.health.reasons)


async def test_a_coordinators_request_makes_the_next_heartbeat_full(nats_url, tmp_path):
    """Between full heartbeats the agent sends slim ones; a heartbeat_request.v1 (a coordinator
    that started, or got its heartbeats back) makes the next one full at once."""
    nc = await _listener(nats_url)
    sub = await nc.subscribe(subjects.heartbeat("node-1"))
    async with running(Agent(agent_config(nats_url, tmp_path, heartbeat_full_every=60))):
        beats = [decode_as((await sub.next_msg(timeout=5)).data, Heartbeat) for _ in range(5)]
        assert [b.health is not None for b in beats][:FULL_FIRST] == [True] * FULL_FIRST
        await nc.publish(subjects.HEARTBEAT_REQUESTS, encode(HeartbeatRequest(sender="c", sent_at=0.0)))
        await nc.flush()
        after = [decode_as((await sub.next_msg(timeout=5)).data, Heartbeat) for _ in range(2)]
    await nc.close()
    assert any(b.health is None for b in beats[FULL_FIRST:]), beats  # slim ones before the request
    assert any(b.health is not None and b.capabilities is not None for b in after), after
