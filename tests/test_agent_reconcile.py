"""The agent's reconcile against a real nats-server, with a stand-in leader: it asks which of
its jobs moved on and kills exactly those; with no leader answering it leaves them alone."""

from __future__ import annotations

import asyncio
import logging

import pytest

from helpers import agent_config, running, wait_for
from revenant.agent.node.agent import Agent
from revenant.common.errors import NoResponders
from revenant.common.messaging import bus
from revenant.messages import (
    AgentJobReply,
    JobEvent,
    JobSpec,
    LocalJob,
    ReconcileReply,
    ReconcileRequest,
    StaleJob,
    StartJob,
    decode_as,
    encode,
    subjects,
)

pytestmark = pytest.mark.nats


async def _start(nc, job: str, generation: int) -> None:
    spec = JobSpec(id=job, argv=["sleep", "60"], workdir="/")

    async def start():
        try:
            return await bus.request(nc, subjects.node_command("node-1", "start"),
                                     StartJob(spec=spec, generation=generation), AgentJobReply, 10)
        except NoResponders:  # the agent's subscription has not reached the server yet
            return None

    await wait_for(start)


async def test_reconcile_kills_the_jobs_the_leader_says_moved_on(nats_url, tmp_path):
    nc = await bus.connect(nats_url, "test", endless_reconnect=False)
    asked: list[ReconcileRequest] = []
    started: list[ReconcileRequest] = []

    async def leader(msg):
        req = decode_as(msg.data, ReconcileRequest)
        if req.started:  # the agent's word at start-up that it runs nothing yet
            started.append(req)
            await msg.respond(encode(ReconcileReply()))
            return
        asked.append(req)
        await msg.respond(encode(ReconcileReply(stale=[
            StaleJob(job="1", generation=1, reason="superseded by generation 2 on node-2"),
            StaleJob(job="2", generation=7, reason="a generation this node does not run"),
            StaleJob(job="9", generation=1, reason="a job this node does not run"),
        ])))

    await nc.subscribe(subjects.coordinator("reconcile"), cb=leader)
    killed = await nc.subscribe(subjects.job_event("1", "killed"))
    # drain_timeout_s=0: no checkpoint at shutdown, the jobs are simply killed.
    async with running(Agent(agent_config(nats_url, tmp_path, drain_timeout_s=0))) as agent:
        await _start(nc, "1", 1)
        await _start(nc, "2", 3)
        await agent.reconcile()
        assert [(r.node, r.incarnation) for r in asked] == [("node-1", agent.incarnation)]
        assert [(r.node, r.incarnation, r.jobs) for r in started] == [("node-1", agent.incarnation, [])]
        assert sorted(asked[0].jobs, key=lambda j: j.job) == [LocalJob(job="1", generation=1),
                                                               LocalJob(job="2", generation=3)]
        event = decode_as((await killed.next_msg(timeout=5)).data, JobEvent)
        assert (event.job, event.generation, event.reason) == ("1", 1, "superseded by generation 2 on node-2")
        assert "1" not in agent.supervisor.jobs
        assert agent.supervisor.jobs["2"].generation == 3  # the leader judged a generation not running here
    await nc.close()


async def test_without_a_leader_reconcile_leaves_the_jobs_alone(nats_url, tmp_path, caplog, monkeypatch):
    from revenant.agent.node import reconcile

    monkeypatch.setattr(reconcile, "RECONCILE_RETRY_FOR_S", 1.5)  # asks again for 60 s by default
    nc = await bus.connect(nats_url, "test", endless_reconnect=False)
    async with running(Agent(agent_config(nats_url, tmp_path, drain_timeout_s=0))) as agent:
        await _start(nc, "1", 1)
        with caplog.at_level(logging.WARNING, logger="revenant.agent.node.reconcile"):
            await agent.reconcile()
        assert any("cannot reconcile" in r.getMessage() for r in caplog.records)
        assert "1" in agent.supervisor.jobs
        await wait_for(lambda: _alive(agent, "1"))
    await nc.close()


async def _alive(agent, job) -> bool:
    return job in agent.supervisor.jobs and not agent.supervisor.jobs[job].exited.is_set()


async def test_a_thaw_waits_until_the_nodes_lease_is_back(nats_url, tmp_path, monkeypatch):
    """A reconcile after the connection came back can come before the lease does: the agent then
    does not ask to thaw (the leader's thaw would void a failover begun before it, and nothing
    would stop one begun after it), and asks again once the lease is held."""
    nc = await bus.connect(nats_url, "test", endless_reconnect=False)
    asked: list[ReconcileRequest] = []

    async def leader(msg):
        req = decode_as(msg.data, ReconcileRequest)
        asked.append(req)
        await msg.respond(encode(ReconcileReply(thaw=[LocalJob(job=j.job, generation=j.generation)
                                                      for j in req.jobs if j.frozen])))

    await nc.subscribe(subjects.coordinator("reconcile"), cb=leader)
    async with running(Agent(agent_config(nats_url, tmp_path, drain_timeout_s=0))) as agent:
        await _start(nc, "1", 1)
        agent.supervisor.freeze_all("a test's fence")
        held = False
        monkeypatch.setattr(agent.liveness, "holds_lease", lambda: held)
        asked.clear()
        task = asyncio.create_task(agent.reconcile(reconnected=True))
        while not asked:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        assert agent.supervisor.jobs["1"].frozen_at is not None and len(asked) == 1
        held = True  # the lease is back: the declined thaw is asked for again, and applied
        await asyncio.wait_for(task, 10)
        assert len(asked) == 2 and agent.supervisor.jobs["1"].frozen_at is None
        # Without its lease the node did not ask to thaw (the leader's thaw would void a failover).
        assert [r.jobs[0].frozen for r in asked] == [False, True]
    await nc.close()


async def test_a_thaw_answered_after_a_new_fence_is_not_applied(nats_url, tmp_path, monkeypatch):
    """The leader's thaw answers the fence in force when the agent asked.  An answer that arrives
    after the node fenced again (held up by the very cut that brought the new fence) is void: a
    failover that began after the leader answered may have restored the job elsewhere.  The job
    stays frozen and the agent asks again, whose answer decides."""
    nc = await bus.connect(nats_url, "test", endless_reconnect=False)
    asked: list[ReconcileRequest] = []
    agent_ref: list[Agent] = []

    async def leader(msg):
        req = decode_as(msg.data, ReconcileRequest)
        asked.append(req)
        if len(asked) == 1:
            agent_ref[0].supervisor.freeze_all("a test's second fence")  # while the answer is on its way
        await msg.respond(encode(ReconcileReply(thaw=[LocalJob(job=j.job, generation=j.generation)
                                                      for j in req.jobs if j.frozen])))

    await nc.subscribe(subjects.coordinator("reconcile"), cb=leader)
    async with running(Agent(agent_config(nats_url, tmp_path, drain_timeout_s=0))) as agent:
        agent_ref.append(agent)
        await _start(nc, "1", 1)
        agent.supervisor.freeze_all("a test's fence")
        monkeypatch.setattr(agent.liveness, "holds_lease", lambda: True)
        asked.clear()
        fences = agent.supervisor.fences
        await asyncio.wait_for(agent.reconcile(), 10)
        assert agent.supervisor.fences == fences + 1
        # Asked twice: the first answer came after the second fence and thawed nothing.
        assert len(asked) == 2 and all(r.jobs[0].frozen for r in asked)
        assert agent.supervisor.jobs["1"].frozen_at is None  # the second answer, after the fence, did
    await nc.close()
