"""A coordinator that loses the leader lease steps down in-process and leads again later, against a
real nats-server: it never exits, its leader-only work stops as a group, a new term reloads the
job table, and each change of leader is a cluster_event.v1."""

from __future__ import annotations

import asyncio

import pytest

from helpers import connect_as, coordinator_config, wait_for
from revenant.common.errors import NoResponders, RemoteError
from revenant.common.messaging import bus
from revenant.common.messaging.kv import open_bucket
from revenant.common.serving.service import ServiceStatus
from revenant.common.settings import security
from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.coordinator import Coordinator
from revenant.coordinator.nodes.leader import KEY
from revenant.coordinator.table.store import KvJobStore
from revenant.messages import ClusterEvent, JobReply, JobRecord, JobRequest, JobSpec, decode_as, subjects

pytestmark = pytest.mark.nats


def config(url: str, **kw) -> CoordinatorConfig:
    return coordinator_config(url, http_port=-1, name="c1", **kw)


async def start(coord: Coordinator) -> asyncio.Task:
    task = asyncio.create_task(coord.run())
    await asyncio.wait_for(coord.ready.wait(), 15)
    return task


async def leader_events(js) -> list[tuple[str, str]]:
    """(kind, coordinator) of every leader_* cluster event in the stream, in order."""
    out = []
    sub = await js.subscribe(f"{subjects.EVENTS_PREFIX}.cluster.>", ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except Exception:  # nats TimeoutError: no more
                break
            ev = decode_as(msg.data, ClusterEvent)
            if ev.kind.startswith("leader_"):
                out.append((ev.kind, ev.coordinator))
    finally:
        await sub.unsubscribe()
    return out


async def job(nc, job_id: str) -> JobRecord:
    return (await bus.request(nc, subjects.coordinator("job"), JobRequest(job=job_id), JobReply, 2)).job


async def served_job(nc, job_id: str) -> JobRecord:
    """The job, once the leader answers: nats-server may answer "no responders" for a moment
    after a subscription on another connection (1 in ~300 here, flushed or not)."""
    async def answer() -> JobRecord | None:
        try:
            return await job(nc, job_id)
        except NoResponders:
            return None

    return await wait_for(answer, timeout=5)


async def test_a_leader_whose_key_is_taken_steps_down_keeps_running_and_leads_again(nats_url):
    nc = await connect_as(nats_url, security.COORDINATOR)  # the other coordinator
    js = nc.jetstream()
    coord = Coordinator(config(nats_url, leader_lease_s=1.5))
    task = await start(coord)
    try:
        store = KvJobStore(js)
        await store.open()
        kv = await open_bucket(js, subjects.LEADER_BUCKET, 1.5)

        done = asyncio.Event()

        async def other_leader() -> None:  # another coordinator's term holds the key, renewing it
            while not done.is_set():  # (a flag, not a cancel: a put's wait_for may swallow one)
                await kv.put(KEY, b"c2 0123456789abcdef")
                await asyncio.sleep(0.3)

        other = asyncio.create_task(other_leader())
        try:
            # The leader's next renewal finds the key changed: it steps down.
            await wait_for(lambda: _true(not coord.leader and not coord.ready.is_set()), timeout=5)
            assert coord.status is ServiceStatus.RUNNING and not task.done()  # no exit
            assert coord.step_downs == 1 and "c2" in coord.leadership.why
            # Its leader-only work stopped as a group: nobody answers requests now.
            await wait_for(lambda: _no_responders(nc), timeout=5)
            # A job written meanwhile (by the other leader) ...
            await store.save(JobRecord(spec=JobSpec(id="7", argv=["true"]), state="vacated"))
            await asyncio.sleep(1.0)
            assert not coord.leader and coord.step_downs == 1  # it stands by, campaigning
        finally:
            done.set()
            await other
        # ... is in the table once this one leads again (a new term reloads it).
        await kv.delete(KEY)
        await asyncio.wait_for(coord.ready.wait(), 10)
        assert coord.leader and coord.leadership.terms == 2
        assert (await served_job(nc, "7")).state == "vacated"
        # Each change of leader is an event.
        await wait_for(lambda: _events_are(js, [("leader_elected", "c1"), ("leader_stepped_down", "c1"),
                                                ("leader_elected", "c1")]), timeout=5)
    finally:
        coord.stop()
        await asyncio.wait_for(task, 10)
        await nc.close()


async def test_a_write_conflict_with_a_newer_leader_steps_down_in_process(nats_url):
    """JobService._resolve: the store says another coordinator leads, so this one steps down
    without writing, and stays up to campaign again.  The lease is long, so no renewal notices
    first: the conflict alone deposes it."""
    nc = await connect_as(nats_url, security.COORDINATOR)  # the other coordinator
    js = nc.jetstream()
    store = KvJobStore(js)
    await store.open()
    await store.save(JobRecord(spec=JobSpec(id="1", argv=["true"]), state="running", node="node-1",
                               generation=1))
    coord = Coordinator(config(nats_url, leader_lease_s=30.0))
    task = await start(coord)
    try:
        kv = await open_bucket(js, subjects.LEADER_BUCKET, 30.0)
        await kv.put(KEY, b"c2 0123456789abcdef")  # a newer term ...
        other = KvJobStore(js)
        rec = (await other.load())["1"]
        rec.generation = 2
        await other.save(rec)  # ... wrote the job behind this one's back
        async def checkpoint() -> RemoteError | None:
            try:
                await bus.request(nc, subjects.coordinator("checkpoint"), JobRequest(job="1"), JobReply, 5)
            except NoResponders:
                return None  # (see served_job)
            except RemoteError as exc:
                return exc
            raise AssertionError("the checkpoint went ahead")

        assert "stepped down" in str(await wait_for(checkpoint, timeout=5))
        assert not coord.leader and coord.step_downs == 1 and not coord.ready.is_set()
        assert coord.status is ServiceStatus.RUNNING and not task.done()
        await kv.delete(KEY)
        await asyncio.wait_for(coord.ready.wait(), 10)
        assert (await served_job(nc, "1")).generation == 2  # the new term read what the other wrote
    finally:
        coord.stop()
        await asyncio.wait_for(task, 10)
        await nc.close()


async def test_a_leader_cut_off_from_nats_steps_down_and_leads_again_when_it_is_back(nats_server):
    """Finding 1 of issue 9: the leader exited 1.85 s into a NATS outage."""
    coord = Coordinator(config(nats_server.url, leader_lease_s=1.5))
    task = await start(coord)
    try:
        nats_server.kill()
        await wait_for(lambda: _true(coord.step_downs == 1), timeout=5)
        await asyncio.sleep(1.0)
        assert coord.status is ServiceStatus.RUNNING and not task.done() and not coord.ready.is_set()
        nats_server.restart()
        await asyncio.wait_for(coord.ready.wait(), 15)
        assert coord.leader and coord.leadership.terms == 2
    finally:
        coord.stop()
        await asyncio.wait_for(task, 10)


async def _true(value: bool) -> bool:
    return value


async def _no_responders(nc) -> bool:
    try:
        await job(nc, "7")
    except NoResponders:
        return True
    except RemoteError:
        pass  # still subscribed for a moment: answered "not the leader"
    return False


async def _events_are(js, want) -> bool:
    return await leader_events(js) == want
