"""Job ids survive a burst: 200 submits sent at the same instant, from one client and from 20,
all get a job (40 at once used to give 15 "counter is contended" failures), with distinct ids."""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import VENV_BIN
from helpers import agent_config, connect_as, coordinator_config, running, wait_for
from revenant.agent.node.agent import Agent
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.coordinator.coordinator import Coordinator
from revenant.messages import JobReply, SubmitRequest, subjects

pytestmark = [pytest.mark.nats, pytest.mark.criu]

BURST = 200


async def _ready(coord: Coordinator) -> bool:
    nodes = coord.detector.snapshot(time.monotonic())
    return sum(n.state == "alive" and n.capabilities.criu.ok for n in nodes) == 2


async def _submit(nc) -> str:
    reply = await bus.request(nc, subjects.coordinator("submit"), SubmitRequest(argv=["true"], workdir="/"),
                              JobReply, 120)
    return reply.job.spec.id


async def _ended(coord: Coordinator) -> bool:
    return all(r.state == "completed" for r in coord.jobs.jobs.values())


@pytest.mark.parametrize("clients", [1, 20])
async def test_simultaneous_submits_all_get_a_job(nats_url, tmp_path, clients):
    criu = str(VENV_BIN / "criu")
    agents = [Agent(agent_config(nats_url, tmp_path / n, node=n, criu_path=criu)) for n in ("node-1", "node-2")]
    async with running(Coordinator(coordinator_config(nats_url, http_port=0))) as coord, \
            running(agents[0]), running(agents[1]):
        await wait_for(lambda: _ready(coord), timeout=30)
        conns = [await connect_as(nats_url, security.ADMIN, f"client-{i}") for i in range(clients)]
        try:
            took = time.monotonic()
            results = await asyncio.gather(*(_submit(conns[i % clients]) for i in range(BURST)),
                                           return_exceptions=True)
            took = time.monotonic() - took
            failed = [str(r) for r in results if isinstance(r, BaseException)]
            assert not failed, f"{len(failed)} of {BURST} failed, e.g. {failed[:3]}"
            assert sorted(map(int, results)) == list(range(1, BURST + 1))
            print(f"{BURST} simultaneous submits from {clients} client(s): all succeeded in {took:.2f} s")
            await wait_for(lambda: _ended(coord), timeout=60)
        finally:
            for nc in conns:
                await nc.close()
