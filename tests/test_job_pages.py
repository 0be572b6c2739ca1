"""Pages of the job table: every list reply fits one message, a listing sees each job once, and
`revenant jobs` lists 5,000 jobs (a table that broke at about 800 jobs as one reply)."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest

from conftest import revenant_cli
from helpers import cli_env, connect_as, coordinator_config, running
from revenant.common.settings import security
from revenant.coordinator.coordinator import Coordinator
from revenant.coordinator.table.paging import JOBS_PAGE_MAX, PAGE_BYTES, JobPages, fitting, job_sort_key, shown
from revenant.coordinator.table.store import KvJobStore
from revenant.messages import MAX_MESSAGE_BYTES, JobRecord, JobSpec, encode

SEEDED = 5_000


def record(job: str, argv_bytes: int = 0, state: str = "completed") -> JobRecord:
    argv = ["python3", "train.py", "--lr", "0.001"] + (["x" * argv_bytes] if argv_bytes else [])
    return JobRecord(spec=JobSpec(id=job, argv=argv, name="train.py", workdir="/home/user/experiments"),
                     state=state, node="node-1", pid=4242, generation=1, exit_code=0,
                     output=f"/shared/storage/jobs/{job}/output.log", created_at=1.8e9, updated_at=1.8e9)


def table(n: int, **kw) -> dict[str, JobRecord]:
    return {str(i): record(str(i), **kw) for i in range(1, n + 1)}


def listing(pages: JobPages, jobs: dict[str, JobRecord], limit: int = JOBS_PAGE_MAX) -> list[list[str]]:
    out: list[list[str]] = []
    after = ""
    while True:
        reply = pages.page(jobs, after, limit)
        assert len(encode(reply)) <= MAX_MESSAGE_BYTES
        out.append([r.spec.id for r in reply.jobs])
        if not reply.more:
            return out
        after = reply.jobs[-1].spec.id


@pytest.mark.unit
def test_pages_fit_one_message_and_list_every_job_once_in_id_order():
    jobs = table(3_000)
    pages = listing(JobPages(), jobs)
    ids = [j for page in pages for j in page]
    assert ids == [str(i) for i in range(1, 3_001)]
    assert len(pages) > 3  # the table is larger than one message
    assert JobPages().page(jobs, "", 10).jobs[-1].spec.id == "10"
    assert JobPages().page({}, "").jobs == []


@pytest.mark.unit
def test_big_records_make_smaller_pages_and_an_oversized_one_is_cut_to_fit():
    jobs = table(20, argv_bytes=60_000)
    pages = listing(JobPages(), jobs)
    assert all(1 <= len(p) <= 4 for p in pages) and sum(map(len, pages)) == 20
    # A record stored before submit checked sizes (two 130 KB arguments) is shown cut short.
    huge = record("7", argv_bytes=130_000)
    huge.spec.argv.append("y" * 130_000)
    huge.spec.env = {"A": "b"}
    cut = shown(huge)
    assert len(msgspec.msgpack.encode(cut)) < PAGE_BYTES
    assert cut.spec.argv[0].startswith("python3 train.py") and "too large to show" in cut.spec.argv[0]
    assert cut.spec.env == {} and cut.state == huge.state and shown(record("8")) == record("8")
    assert [r.spec.id for r in JobPages().page({"7": huge, "8": record("8")}).jobs] == ["7", "8"]


@pytest.mark.unit
def test_a_job_removed_between_pages_shifts_nothing():
    jobs = table(100)
    pages = JobPages()
    first = pages.page(jobs, "", 10)
    for gone in ("3", "11", "12"):  # archived or purged meanwhile: one already listed, two not yet
        del jobs[gone]
    second = pages.page(jobs, first.jobs[-1].spec.id, 10)
    assert [r.spec.id for r in second.jobs] == [str(i) for i in range(13, 23)]
    assert second.total == 97 and second.more


@pytest.mark.unit
def test_ids_sort_numerically_and_odd_cursors_are_harmless():
    assert sorted(["10", "9", "abc", "100"], key=job_sort_key) == ["9", "10", "100", "abc"]
    assert job_sort_key("²")[0] == job_sort_key("9" * 5000)[0] == 1 << 62  # never int() of those
    jobs = table(5)
    assert [r.spec.id for r in JobPages().page(jobs, "2").jobs] == ["3", "4", "5"]
    assert JobPages().page(jobs, "zzz").jobs == JobPages().page(jobs, "9" * 5000).jobs == []
    assert len(JobPages().page(jobs, "", -5).jobs) == 1  # a limit is at least 1


@pytest.mark.unit
def test_fitting_keeps_a_prefix_within_the_budget():
    items = [record(str(i), argv_bytes=1_000) for i in range(50)]
    size = len(msgspec.msgpack.encode(items[0])) + 1
    assert len(fitting(items, 10 * size)) == 10
    assert len(fitting(items[:3])) == 3
    assert len(fitting(items, 1)) == 1  # at least one: too large alone, it fails loudly


@pytest.mark.nats
async def test_revenant_jobs_lists_5000_jobs(nats_url):
    nc = await connect_as(nats_url, security.COORDINATOR)  # the job table, as the coordinator writes it
    try:
        store = KvJobStore(nc.jetstream())
        await store.open()
        seeded = time.monotonic()
        for start in range(1, SEEDED + 1, 500):  # straight into the store, 500 writes at a time
            batch = [store.save(record(str(i), state="completed")) for i in range(start, min(start + 500, SEEDED + 1))]
            await asyncio.gather(*batch)
        seeded = time.monotonic() - seeded
        async with running(Coordinator(coordinator_config(nats_url, http_port=0))) as coord:
            assert len(coord.jobs.jobs) == SEEDED
            took = time.monotonic()
            # In a thread: the coordinator answers from this process's event loop.
            out = await asyncio.to_thread(revenant_cli, "jobs", "--nats", nats_url, "--timeout", "10",
                                          env=cli_env(nats_url))
            took = time.monotonic() - took
            assert out.returncode == 0, out.stderr
            lines = out.stdout.splitlines()
            assert lines[0].split()[:3] == ["ID", "NAME", "STATE"] and len(lines) == SEEDED + 1
            assert [line.split()[0] for line in lines[1:]] == [str(i) for i in range(1, SEEDED + 1)]
            print(f"seeded {SEEDED} jobs in {seeded:.2f} s; `revenant jobs` listed them in {took:.2f} s")
            assert took < 2.0, f"`revenant jobs` took {took:.2f} s for {SEEDED} jobs"
            as_json = await asyncio.to_thread(revenant_cli, "jobs", "--json", "--nats", nats_url, "--timeout", "10",
                                              env=cli_env(nats_url))
            assert [j["id"] for j in json.loads(as_json.stdout)] == [str(i) for i in range(1, SEEDED + 1)]
    finally:
        await nc.close()

