"""The agent's reconcile against a real nats-server, with a stand-in leader: it asks which of
its jobs moved on and kills exactly those; with no leader answering it leaves them alone."""

from __future__ import annotations

import asyncio
import logging

import pytest

from helpers import agent_config, connect_as, running, wait_for
from revenant.agent.node.agent import Agent
from revenant.common.errors import NoResponders
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.messages import (
    AgentJobReply,
    HeartbeatRequest,
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
    nc = await connect_as(nats_url, security.COORDINATOR)
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
    killed = await nc.subscribe(subjects.job_event("1", "killed", "node-1", user=""))
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
    nc = await connect_as(nats_url, security.COORDINATOR)
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
    nc = await connect_as(nats_url, security.COORDINATOR)
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
    nc = await connect_as(nats_url, security.COORDINATOR)
    asked: list[ReconcileRequest] = []
    agent_ref: list[Agent] = []
    armed = asyncio.Event()  # not before the test asks: the agent's own first reconcile may come late

    async def leader(msg):
        req = decode_as(msg.data, ReconcileRequest)
        if not armed.is_set():
            await msg.respond(encode(ReconcileReply()))
            return
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
        fences = agent.supervisor.fences
        armed.set()
        await asyncio.wait_for(agent.reconcile(), 10)
        assert agent.supervisor.fences == fences + 1
        # Asked twice: the first answer came after the second fence and thawed nothing.
        assert len(asked) == 2 and all(r.jobs[0].frozen for r in asked)
        assert agent.supervisor.jobs["1"].frozen_at is None  # the second answer, after the fence, did
    await nc.close()


async def test_a_deposed_leaders_late_command_or_answer_is_refused(nats_url, tmp_path):
    """Each command carries its leader's term (subjects.TERM_HEADER): once a node has heard from
    term 7, a command from term 5 (a leader deposed since, its request late) is refused and
    changes nothing, and so is a reconcile answer from term 5; a command without a term (a
    coordinator from before terms) is taken."""
    from revenant.common.errors import RemoteError

    nc = await connect_as(nats_url, security.COORDINATOR)
    answers = {"term": 5}

    async def leader(msg):
        req = decode_as(msg.data, ReconcileRequest)
        stale = [StaleJob(job=j.job, generation=j.generation, reason="moved on") for j in req.jobs]
        await msg.respond(encode(ReconcileReply(stale=stale, term=answers["term"])))

    async def command(job: str, generation: int, term: int | None) -> AgentJobReply:
        spec = JobSpec(id=job, argv=["sleep", "60"], workdir="/")
        headers = {subjects.TERM_HEADER: str(term)} if term is not None else None
        return await bus.request(nc, subjects.node_command("node-1", "start"),
                                 StartJob(spec=spec, generation=generation), AgentJobReply, 10, headers)

    await nc.subscribe(subjects.coordinator("reconcile"), cb=leader)
    async with running(Agent(agent_config(nats_url, tmp_path, drain_timeout_s=0))) as agent:
        await _start(nc, "1", 1)  # no term: taken
        await command("2", 1, 7)
        assert agent.supervisor.leader_term.newest == 7
        with pytest.raises(RemoteError) as refused:
            await command("3", 1, 5)
        assert refused.value.code == "stale_term" and "term 5 refused" in str(refused.value)
        assert "3" not in agent.supervisor.jobs
        await command("4", 1, 8)  # a newer leader's
        await agent.reconcile()  # term 5's answer to kill everything: refused, nothing killed
        assert {"1", "2", "4"} <= set(agent.supervisor.jobs)
        answers["term"] = 8
        await agent.reconcile()  # the current leader's: applied
        # A new leader announces its term as it takes office: from then on term 8's word is refused,
        # before the new leader has sent this node anything.
        await nc.publish(subjects.HEARTBEAT_REQUESTS, encode(HeartbeatRequest(sender="c2", sent_at=1.0, term=20)))

        async def announced() -> bool:
            return agent.supervisor.leader_term.newest == 20

        await wait_for(announced)
        with pytest.raises(RemoteError, match="term 8 refused: this node has heard from term 20"):
            await command("5", 1, 8)
        async def all_killed() -> bool:
            return not agent.supervisor.jobs

        await wait_for(all_killed)
    await nc.close()
