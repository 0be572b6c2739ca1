"""An agent whose event loop is stuck keeps heartbeating from its liveness thread: a real
`revenant coordinator` process watches an in-process agent and never declares it dead."""

from __future__ import annotations

import time

import nats
import pytest

from helpers import _states, agent_config, connect_as, creds, running, wait_for
from revenant.agent.node.agent import Agent
from revenant.common.errors import NoResponders, RemoteError
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.messages import Heartbeat, NodesReply, NodesRequest, decode, decode_as, subjects

pytestmark = pytest.mark.cluster


async def test_stuck_event_loop_is_red_but_never_dead(nats_url, tmp_path):
    import subprocess

    from conftest import VENV_BIN

    coord = subprocess.Popen([str(VENV_BIN / "revenant"), "coordinator", "--nats", nats_url, "--http-port", "0",
                              "--creds", creds(nats_url, security.COORDINATOR)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        nc = await connect_as(nats_url, security.ADMIN)  # the node table and the events, as an operator
        hearing = await connect_as(nats_url, security.COORDINATOR, "heartbeats")  # only it hears them
        sub = await hearing.subscribe(subjects.heartbeat("node-1"))
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
        assert any(b.health is not None and b.health.state == "RED"  # a new verdict: a full heartbeat
                   and any("event loop stuck" in r for r in b.health.reasons) for b in beats), [b.health for b in beats]
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
        await hearing.close()
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
