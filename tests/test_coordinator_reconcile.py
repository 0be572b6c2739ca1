"""The leader's answer to an agent's reconcile request, against a real nats-server: which of the
agent's jobs moved on, from the job table the leader holds."""

from __future__ import annotations

import asyncio

import pytest

from helpers import connect_as, coordinator_config, running
from revenant.common.errors import NoResponders, RemoteError
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.coordinator.coordinator import Coordinator
from revenant.coordinator.table.store import KvJobStore
from revenant.messages import JobRecord, JobSpec, LocalJob, ReconcileReply, ReconcileRequest, subjects

pytestmark = pytest.mark.nats


async def ask_leader(nc, ask: ReconcileRequest) -> ReconcileReply:
    """nats-server may answer "no responders" just after a subscription made on another
    connection (even after its flush): asked again for a moment, as an agent does."""
    for _ in range(20):
        try:
            return await bus.request(nc, subjects.coordinator("reconcile"), ask, ReconcileReply, 5)
        except NoResponders:
            await asyncio.sleep(0.1)
    return await bus.request(nc, subjects.coordinator("reconcile"), ask, ReconcileReply, 5)


async def test_the_leader_names_the_stale_jobs_and_only_those(nats_url):
    # The job table is seeded as the coordinator writes it; node-1's agent asks.
    nc = await connect_as(nats_url, security.COORDINATOR, "seed")
    agent = await connect_as(nats_url, security.agent_identity("node-1"), "node-1")
    try:
        store = KvJobStore(nc.jetstream())
        await store.open()
        for job, generation, node in (("1", 3, "node-2"), ("2", 1, "node-1"), ("3", 2, "node-1")):
            await store.save(JobRecord(spec=JobSpec(id=job, argv=["true"]), state="running",
                                       generation=generation, node=node))
        async with running(Coordinator(coordinator_config(nats_url, http_port=0))) as coord:
            ask = ReconcileRequest(node="node-1", jobs=[
                LocalJob(job="1", generation=2),   # moved on to generation 3 on node-2: stale
                LocalJob(job="2", generation=1),   # its own: kept
                LocalJob(job="3", generation=3),   # newer than the table knows: never killed on its word
                LocalJob(job="9", generation=1),   # unknown to the leader: left alone
            ])
            reply = await ask_leader(agent, ask)
            assert [(s.job, s.generation) for s in reply.stale] == [("1", 2)]
            assert "generation 3 on node-2" in reply.stale[0].reason
            # A leader whose lease is not fresh (its loop stalled) says nothing an agent would act on.
            coord.leadership.fresh = lambda: False
            with pytest.raises(RemoteError, match="not fresh"):
                await ask_leader(agent, ask)
    finally:
        await nc.close()
        await agent.close()
