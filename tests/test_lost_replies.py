"""What a NATS server's death costs the coordinator's bookkeeping, in-process: a write of what a
node already did waits out a job table electing a leader (store.patiently), and a request whose
reply can no longer come fails at once instead of waiting out its timeout (an hour for a dump or
a restore) when the coordinator's connection, or the node's, broke and came back.
tests/test_nats_faults.py breaks real servers."""

from __future__ import annotations

import asyncio

import pytest

from revenant.common.errors import BusError, RevenantError
from revenant.coordinator.table import store
from revenant.coordinator.table.agents import AgentClient, NodeLost, NotLeader
from revenant.coordinator.table.store import patiently
from revenant.messages import CheckpointJob, SubmitRequest
from test_lifecycle import shell

pytestmark = pytest.mark.unit


class Clock:
    """A clock that a fake sleep moves on."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def failing(times: int, error: Exception):
    """A write that raises ``error`` ``times`` times, then returns how many calls it took."""
    calls = []

    async def write() -> int:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return len(calls)
    return write


async def test_a_write_is_tried_again_while_the_job_table_does_not_answer():
    clock = Clock()
    assert await patiently(failing(5, BusError("no response from stream")), "job 1", clock=clock,
                           sleep=clock.sleep) == 6
    assert clock.slept == [0.25, 0.5, 1.0, 2.0, 2.0]  # doubling, up to the longest delay


async def test_past_its_patience_the_last_error_is_raised():
    clock = Clock()
    with pytest.raises(BusError, match="no response"):
        await patiently(failing(100, BusError("no response from stream")), "job 1", 10.0, clock=clock,
                        sleep=clock.sleep)
    assert clock.now <= 10.0


@pytest.mark.parametrize("error", [NotLeader("not fresh"), RevenantError("unknown job 1")])
async def test_any_other_error_is_raised_at_once(error):
    clock = Clock()
    with pytest.raises(type(error)):
        await patiently(failing(1, error), "job 1", clock=clock, sleep=clock.sleep)
    assert clock.slept == []


async def test_a_dump_whose_record_the_job_table_could_not_take_at_first_is_recorded(monkeypatch):
    """Given up, the job would stay "checkpointing": never checkpointed again, every request
    refused as busy."""
    monkeypatch.setattr(store, "PATIENCE_DELAYS_S", (0.001, 0.001))
    jobs, table, _, _ = shell()
    await jobs.submit(SubmitRequest(argv=["sleep", "100"]))
    saves = []
    save = table.save

    async def electing(rec):  # the write asking for the dump lands, the next two do not
        saves.append(rec.state)
        if len(saves) in (2, 3):
            raise BusError("cannot save job 1: nats: no response from stream")
        await save(rec)
    monkeypatch.setattr(table, "save", electing)
    rec, _ = await jobs.checkpoint("1", stop=False)
    assert saves == ["checkpointing", "running", "running", "running"]
    assert (rec.state, [e.n for e in rec.epochs]) == ("running", [1])
    assert (await store.MemoryJobStore.load(table))["1"].state == "running"


class Silent:
    """A NATS connection that never answers (the reply was lost with a server)."""

    async def request(self, subject, payload, timeout):
        await asyncio.Event().wait()


async def test_a_broken_connection_fails_every_request_in_flight():
    agents = AgentClient(Silent(), lambda: True)
    asked = [asyncio.create_task(agents.send(node, "checkpoint", CheckpointJob(job="1", generation=1), 3600))
             for node in ("node-1", "node-2")]
    await asyncio.sleep(0)
    agents.connection_lost()
    for task in asked:
        with pytest.raises(NodeLost, match="connection to NATS broke") as lost:
            await task
        assert lost.value.retriable


async def test_a_node_that_reconnected_fails_only_its_own_requests():
    agents = AgentClient(Silent(), lambda: True)
    mine = asyncio.create_task(agents.send("node-1", "restore", CheckpointJob(job="1", generation=2), 3600))
    other = asyncio.create_task(agents.send("node-2", "checkpoint", CheckpointJob(job="2", generation=1), 3600))
    await asyncio.sleep(0)
    agents.node_lost("node-1", "reconnected to NATS")
    with pytest.raises(NodeLost, match="node node-1 reconnected to NATS during restore"):
        await mine
    assert not other.done()
    other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other


async def test_an_agent_that_has_just_started_keeps_what_was_asked_of_it_and_loses_what_an_earlier_one_was():
    """Its first reconcile comes again until answered, after the leader may have given it work."""
    incarnation = {"node-1": "old"}
    agents = AgentClient(Silent(), lambda: True, lambda node: incarnation[node])
    earlier = asyncio.create_task(agents.send("node-1", "checkpoint", CheckpointJob(job="1", generation=1), 3600))
    await asyncio.sleep(0)
    incarnation["node-1"] = "new"  # its heartbeats name the new agent
    asked = asyncio.create_task(agents.send("node-1", "restore", CheckpointJob(job="2", generation=2), 3600))
    await asyncio.sleep(0)
    agents.node_lost("node-1", "restarted", spare="new")
    with pytest.raises(NodeLost, match="node node-1 restarted during checkpoint"):
        await earlier
    assert not asked.done()
    agents.node_lost("node-1", "reconnected to NATS")  # a reconnect spares none
    with pytest.raises(NodeLost, match="reconnected to NATS during restore"):
        await asked


def test_an_agent_reconciling_names_the_jobs_it_is_starting_or_restoring_too():
    """Else a leader whose table has one there would have it evicted while it comes up."""
    from types import SimpleNamespace

    from revenant.agent.running.jobs import Launch
    from revenant.agent.node.reconcile import local_jobs
    from revenant.messages import LocalJob

    sup = SimpleNamespace(jobs={"1": SimpleNamespace(generation=3, frozen_at=None)},
                          launching={"1": Launch(4), "2": Launch(2)})
    assert local_jobs(sup) == [LocalJob(job="1", generation=3), LocalJob(job="2", generation=2)]
