"""Finished jobs leave the live table after job_retention_s and stay readable from the archive;
a purge removes a job's record (live or archived), not only its checkpoints."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from conftest import revenant_cli
from helpers import HeldLease, agent_config, cli_env, connect_as, coordinator_config, running, wait_for
from revenant.agent.node.agent import Agent
from revenant.common.errors import UnknownJob
from revenant.common.settings import security
from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.coordinator import Coordinator
from revenant.coordinator.table.archive import Archiver, due_for_archive, is_due, pass_interval_s
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.store import KvJobStore, MemoryJobStore, WriteConflict
from revenant.messages import AgentJobReply, JobRecord, JobSpec, NodeStatus

DAY = 86400.0
WEEK = 7 * DAY
NOW = 1.8e9


def rec(job: str, state: str, updated_at: float) -> JobRecord:
    return JobRecord(spec=JobSpec(id=job, argv=["true"]), state=state, updated_at=updated_at,
                     exit_code=0 if state == "completed" else None)


# ---------------------------------------------------------------------- the rule (pure)


@pytest.mark.unit
def test_only_ended_jobs_unchanged_for_the_retention_are_due_oldest_first():
    jobs = {
        "1": rec("1", "completed", NOW - WEEK - 5),   # due
        "2": rec("2", "failed", NOW - 30 * DAY),      # due, and longer ago
        "3": rec("3", "completed", NOW - WEEK + 1),   # a second short
        "4": rec("4", "running", NOW - 90 * DAY),     # never while it may run
        "5": rec("5", "vacated", NOW - 90 * DAY),     # may be restarted: stays
        "6": rec("6", "completed", NOW - WEEK),       # exactly the retention: due
    }
    assert due_for_archive(jobs, NOW, WEEK) == ["2", "1", "6"]
    assert due_for_archive(jobs, NOW + 1, WEEK) == ["2", "1", "6", "3"]
    assert due_for_archive(jobs, NOW, 365 * DAY) == []
    assert is_due(jobs["1"], NOW, WEEK) and not is_due(jobs["4"], NOW, WEEK)
    assert pass_interval_s(WEEK) == 60.0 and pass_interval_s(1.0) == 0.1 and pass_interval_s(0.01) == 0.1


# ---------------------------------------------------------------------- the store's contract (memory)


@pytest.mark.unit
async def test_memory_store_archives_and_removes_with_compare_and_set():
    store = MemoryJobStore()
    await store.save(rec("1", "completed", NOW))
    await store.save(rec("2", "completed", NOW))
    await store.archive(rec("1", "completed", NOW))
    assert set(await store.load()) == {"2"} and (await store.load_archived("1")).state == "completed"
    # Changed behind this coordinator's back: the archive refuses, and the record stays live.
    store.write_behind_my_back(rec("2", "failed", NOW + 1))
    with pytest.raises(WriteConflict) as conflict:
        await store.archive(rec("2", "completed", NOW))
    assert conflict.value.stored.state == "failed" and await store.load_archived("2") is None
    with pytest.raises(WriteConflict):
        await store.remove("2")
    await store.load()
    await store.remove("2")
    await store.remove("1")
    assert await store.load() == {} and await store.load_archived("1") is None


# ---------------------------------------------------------------------- the shell (memory store)


class Agents:
    def __init__(self) -> None:
        self.purged: list[str] = []

    async def send(self, node, verb, msg, timeout_s):
        self.purged.append(msg.job)
        return AgentJobReply(job=msg.job, generation=0, node=node, freed_bytes=123)


class Events:
    def __init__(self) -> None:
        self.kinds: list[tuple[str, str]] = []

    def emit(self, subject, msg) -> None:
        self.kinds.append((msg.job, msg.kind))


def shell(store: MemoryJobStore, now: list[float]) -> JobService:
    alive = [NodeStatus(name="node-1", state="alive")]
    return JobService(store, Agents(), CoordinatorConfig(), Events(), lambda: alive, HeldLease(), wall=lambda: now[0])


@pytest.mark.unit
async def test_the_archiver_moves_due_jobs_and_purge_removes_records():
    store, now = MemoryJobStore(), [NOW]
    for job, state, at in (("1", "completed", NOW - WEEK), ("2", "failed", NOW - DAY), ("3", "running", NOW - WEEK)):
        await store.save(rec(job, state, at))
    jobs = shell(store, now)
    await jobs.open()
    archiver = Archiver(jobs, WEEK, wall=lambda: now[0])
    assert await archiver.archive_due() == ["1"]
    assert set(jobs.jobs) == {"2", "3"} and set(await store.load()) == {"2", "3"}
    assert (await store.load_archived("1")).state == "completed"
    now[0] += WEEK
    assert await archiver.archive_due() == ["2"] and set(jobs.jobs) == {"3"}
    # purge: the checkpoints, then the record, wherever it is
    rec1, notes = await jobs.purge("1")
    assert rec1.spec.id == "1" and "freed 123 bytes" in notes[0]
    assert await store.load_archived("1") is None and jobs.agents.purged == ["1"]
    assert ("1", "purged") in jobs.events.kinds
    with pytest.raises(UnknownJob):
        await jobs.purge("1")


@pytest.mark.unit
async def test_purge_removes_a_live_finished_record():
    store, now = MemoryJobStore(), [NOW]
    await store.save(rec("1", "completed", NOW))
    jobs = shell(store, now)
    await jobs.open()
    await jobs.purge("1")
    assert jobs.jobs == {} and await store.load() == {}
    with pytest.raises(UnknownJob):
        jobs.get("1")


# ---------------------------------------------------------------------- end to end (real nats-server)


async def _cli(*args: str, url: str):
    # In a thread: the coordinator answers from this process's event loop.  As root's CLI: admin.
    return await asyncio.to_thread(revenant_cli, *args, "--nats", url, "--timeout", "10", env=cli_env(url))


@pytest.mark.nats
async def test_a_finished_job_is_archived_after_retention_and_still_shown(nats_url, tmp_path):
    nc = await connect_as(nats_url, security.COORDINATOR)  # the job table, as the coordinator writes it
    try:
        store = KvJobStore(nc.jetstream())
        await store.open()
        now = time.time()
        await store.save(rec("1", "completed", now - WEEK - 60))   # finished over a week ago
        await store.save(rec("2", "completed", now - 60))          # finished a minute ago
        await store.save(rec("3", "vacated", now - 30 * DAY))     # vacated a month ago: may be restarted
        async with running(Coordinator(coordinator_config(nats_url, http_port=0))) as coord:
            await wait_for(lambda: _gone_from(coord, "1"), timeout=10)
            listed = await _cli("jobs", "--json", url=nats_url)
            assert [j["id"] for j in json.loads(listed.stdout)] == ["2", "3"]
            shown = await _cli("show", "job", "1", "--json", url=nats_url)
            assert shown.returncode == 0, shown.stderr
            assert json.loads(shown.stdout)["state"] == "completed" and "archived" in shown.stderr
        # Out of the live table for good: a new leader does not load it.
        assert set(await KvJobStore(nc.jetstream()).load()) == {"2", "3"}
        assert (await store.load_archived("1")).state == "completed"
    finally:
        await nc.close()


async def _gone_from(coord: Coordinator, job: str) -> bool:
    return job not in coord.jobs.jobs


@pytest.mark.nats
async def test_purge_removes_the_record_live_or_archived(nats_url, tmp_path):
    nc = await connect_as(nats_url, security.COORDINATOR)
    try:
        store = KvJobStore(nc.jetstream())
        await store.open()
        now = time.time()
        await store.save(rec("1", "completed", now - WEEK - 60))  # archived at once
        await store.save(rec("2", "failed", now - 60))
        epoch = tmp_path / "storage" / "jobs" / "2" / "epochs" / "1"
        epoch.mkdir(parents=True)
        (epoch / "pages-1.img").write_bytes(b"x" * 4096)
        config = coordinator_config(nats_url, http_port=0)
        async with running(Coordinator(config)) as coord, running(Agent(agent_config(nats_url, tmp_path))):
            await wait_for(lambda: _gone_from(coord, "1"), timeout=10)
            await wait_for(lambda: _alive(coord), timeout=10)
            for job in ("1", "2"):
                out = await _cli("job", "purge", job, url=nats_url)
                assert out.returncode == 0, out.stderr
                shown = await _cli("show", "job", job, url=nats_url)
                assert shown.returncode == 1 and f"unknown job {job}" in shown.stderr, shown.stderr
            assert not epoch.exists()
            assert (await _cli("jobs", url=nats_url)).stdout.strip() == "no jobs"
        assert await KvJobStore(nc.jetstream()).load() == {}
        assert await store.load_archived("1") is None
    finally:
        await nc.close()


async def _alive(coord: Coordinator) -> bool:
    return any(n.state == "alive" for n in coord.detector.snapshot(time.monotonic()))
