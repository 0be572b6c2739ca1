"""Per-user limits on submits (coordinator/table/userlimits.py): the jobs a user may have that are not
finished, and a token bucket of submits per user.  A submit past either is refused before
anything happens (no job id, no record, nothing started) with one line naming the limit, the
user and the number; a repeat of a submit that made a job still gets its job back."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pwd
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import msgspec
import pytest

from conftest import VENV_BIN, revenant_cli
from helpers import agent_config, cli_env, connect_as, coordinator_config, running, wait_for
from revenant.agent.node.agent import Agent
from revenant.common.errors import ConfigError, RemoteError
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.common.settings.config import CoordinatorConfig, load_config
from revenant.coordinator.coordinator import Coordinator
from revenant.coordinator.table.requests import ClientRequests
from revenant.coordinator.table.store import KvJobStore
from revenant.coordinator.table.userlimits import (BUCKETS_KEPT, JobTable, OverUserTotal, SubmitRate, SubmitRateExceeded,
                                             TooManyJobs, UserLimits)
from revenant.messages import JobRecord, JobReply, JobResources, JobSpec, SubmitRequest, subjects
from test_lifecycle import shell

STATES = ("pending", "running", "checkpointing", "vacated", "restoring", "completed", "failed")


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(job: str, user: str, state: str) -> JobRecord:
    # Changed just now: a finished one is not archived before the test looks.
    return JobRecord(spec=JobSpec(id=job, argv=["true"], name="true", user=user), state=state, updated_at=time.time())


def starts(agents) -> int:
    return sum(1 for _, verb, _ in agents.sent if verb == "start")


# ---------------------------------------------------------------------- the token bucket (pure)


@pytest.mark.unit
def test_the_bucket_lets_a_burst_through_then_the_rate():
    clock = Clock()
    rate = SubmitRate(8.0, 3, clock)
    assert [rate.take("alice") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rate.take("alice") == 0.125
    assert rate.take("alice") == 0.125  # a refusal takes nothing
    assert rate.take("bob") == 0.0  # a bucket per user
    clock.now += 0.0625
    assert rate.take("alice") == 0.0625
    clock.now += 0.0625
    assert rate.take("alice") == 0.0 and rate.take("alice") == 0.125
    fine, then = SubmitRate(10.0, 1, clock), clock.now
    assert fine.take("carol") == 0.0
    clock.now += 0.05
    clock.now += 0.05
    assert clock.now - then < 0.1  # a float's rounding short of a whole token: no refusal for that
    assert fine.take("carol") == 0.0
    clock.now += 3600.0  # idle for long: full again, never more than the burst
    assert [rate.take("alice") for _ in range(4)][3] > 0


@pytest.mark.unit
def test_buckets_full_again_are_forgotten():
    clock = Clock()
    rate = SubmitRate(1.0, 2, clock)
    for n in range(BUCKETS_KEPT - 1):
        rate.take(f"user{n}")
    clock.now += 2.0  # everyone's bucket is full again: the same as none
    rate.take("late")
    assert len(rate) == 1
    assert rate.take("user0") == 0.0 and rate.take("user0") == 0.0 and rate.take("user0") > 0


# ---------------------------------------------------------------------- counting the unfinished jobs


@pytest.mark.unit
def test_the_job_table_counts_each_users_unfinished_jobs_whichever_way_records_come_and_go():
    table = JobTable({"1": record("1", "alice", "running"), "2": record("2", "alice", "completed")})
    assert table.unfinished("alice") == 1 and table.unfinished("bob") == 0
    rnd = random.Random(7)
    users = ("alice", "bob", "")
    for step in range(3000):
        job = str(rnd.randrange(40))
        how = rnd.randrange(6)
        if how < 3:
            table[job] = record(job, rnd.choice(users), rnd.choice(STATES))
        elif how == 3:
            table.pop(job, None)
        elif how == 4 and job in table:
            del table[job]
        else:
            table.update({job: record(job, rnd.choice(users), rnd.choice(STATES))})
        if step % 500 == 499:
            table = JobTable(table)  # a new leader loads the table
        for user in users:
            walked = sum(1 for r in table.values() if r.spec.user == user and r.state not in ("completed", "failed"))
            assert table.unfinished(user) == walked, (step, user)
    table.clear()
    assert [table.unfinished(u) for u in users] == [0, 0, 0]


@pytest.mark.unit
def test_past_the_limits_a_submit_is_refused_with_one_line_naming_it():
    clock = Clock()
    table = JobTable({"1": record("1", "nobody", "running"), "2": record("2", "nobody", "vacated"),
                      "3": record("3", "nobody", "failed")})
    limits = UserLimits(2, 10.0, 50, clock=clock)
    with pytest.raises(TooManyJobs) as refused:
        with limits.admitting("nobody", table):
            pass
    assert str(refused.value) == ("user nobody already has 2 jobs that are not finished "
                                  "(max_jobs_per_user = 2)") and refused.value.code == "too_many_jobs"
    # Root's (admin's own) and the jobs from before users are not limited.
    for user in ("root", ""):
        for _ in range(60):
            with limits.admitting(user, table):
                pass
    rate = UserLimits(0, 10.0, 50, clock=clock)
    for _ in range(50):
        with rate.admitting("nobody", table):
            pass
    clock.now += 0.07
    with pytest.raises(SubmitRateExceeded) as refused:
        with rate.admitting("nobody", table):
            pass
    assert str(refused.value) == ("user nobody submitted more than 10 jobs/s (submit_rate_per_user = 10, "
                                  "burst 50): try again in 0.1 s") and refused.value.code == "submit_rate"
    unlimited = UserLimits(0, 0.0, 0, clock=clock)
    for _ in range(100):
        with unlimited.admitting("nobody", table):
            pass


def holding(job: str, user: str, state: str, **res) -> JobRecord:
    rec = record(job, user, state)
    return msgspec.structs.replace(rec, spec=msgspec.structs.replace(rec.spec, resources=JobResources(**res)))


@pytest.mark.unit
def test_a_users_unfinished_jobs_hold_no_more_than_the_per_user_totals():
    config = load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_COORDINATOR_MAX_MEMORY_PER_USER": "16G",
                                                                    "REVENANT_COORDINATOR_MAX_CPUS_PER_USER": "8",
                                                                    "REVENANT_COORDINATOR_MAX_GPUS_PER_USER": "2"})
    ask = config.resources.ask  # every job gets a memory limit (8G): leaving out --mem escapes nothing
    table = JobTable({"1": holding("1", "alice", "running", memory_limit_bytes=8 << 30, cpus=4),
                      "2": holding("2", "alice", "vacated", memory_bytes=4 << 30, gpus=2),
                      "3": holding("3", "alice", "completed", memory_bytes=100 << 30, cpus=64)})
    assert dataclasses.astuple(table.held("alice")) == (12 << 30, 4.0, 2)
    limits = UserLimits.of(config)
    with pytest.raises(OverUserTotal) as refused:
        with limits.admitting("alice", table, ask=ask(SubmitRequest(argv=["x"]))):
            pass
    assert str(refused.value) == ("user alice's unfinished jobs hold 12 GiB of memory; this one's 8 GiB would "
                                  "pass max_memory_per_user (16 GiB)") and refused.value.code == "over_user_total"
    with pytest.raises(OverUserTotal, match="max_memory_per_user"):  # --mem 0 is no way out
        with limits.admitting("alice", table, ask=ask(SubmitRequest(argv=["x"], memory_bytes=0))):
            pass
    with pytest.raises(OverUserTotal, match=r"hold 4 CPUs; this one's 5 would pass max_cpus_per_user \(8\)"):
        with limits.admitting("alice", table, ask=ask(SubmitRequest(argv=["x"], memory_bytes=1 << 20, cpus=5))):
            pass
    with pytest.raises(OverUserTotal, match=r"hold 2 GPUs; this one's 1 would pass max_gpus_per_user \(2\)"):
        with limits.admitting("alice", table, ask=ask(SubmitRequest(argv=["x"], memory_bytes=1 << 20, gpus=1))):
            pass
    # What fits, fits; a submit under way counts until its job is in the table; another user and
    # root have room of their own.
    with limits.admitting("alice", table, "r1", ask(SubmitRequest(argv=["x"], memory_bytes=2 << 30))):
        with pytest.raises(OverUserTotal, match="hold 14 GiB"):
            with limits.admitting("alice", table, ask=ask(SubmitRequest(argv=["x"], memory_bytes=4 << 30))):
                pass
        for user in ("bob", "root"):
            with limits.admitting(user, table, ask=ask(SubmitRequest(argv=["x"], memory_bytes=16 << 30))):
                pass
    del table["1"]  # it ended: its 8 GiB are free again
    assert dataclasses.astuple(table.held("alice")) == (4 << 30, 0.0, 2)
    with limits.admitting("alice", table, ask=ask(SubmitRequest(argv=["x"]))):
        pass
    unlimited = UserLimits.of(load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_COORDINATOR_MAX_MEMORY_PER_USER": ""}))
    with unlimited.admitting("alice", table, ask=JobResources(memory_bytes=1 << 50)):
        pass
    with pytest.raises(ConfigError, match="max_memory_per_user '1Q' is not a size"):
        load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_COORDINATOR_MAX_MEMORY_PER_USER": "1Q"})


@pytest.mark.unit
def test_submits_under_way_count_once_their_job_is_in_the_table_not_twice():
    table = JobTable()
    made: dict[str, JobRecord] = {}
    limits = UserLimits(2, made=lambda user, rid: made.get(rid))
    with limits.admitting("alice", table, "r1"):
        with pytest.raises(TooManyJobs):
            with limits.admitting("alice", table, "r2"), limits.admitting("alice", table, "r3"):
                pass
        # r1's job is recorded while its start is under way: it counts there, once.
        table["1"] = made["r1"] = record("1", "alice", "pending")
        with limits.admitting("alice", table, "r2"):
            table["2"] = made["r2"] = record("2", "alice", "pending")
        with pytest.raises(TooManyJobs, match="already has 2 jobs"):
            with limits.admitting("alice", table, "r3"):
                pass
    table["1"] = record("1", "alice", "completed")
    with limits.admitting("alice", table, "r3"):
        pass
    # Without a request id a submit under way cannot be told apart: it counts until answered.
    with limits.admitting("bob", table), limits.admitting("bob", table):
        with pytest.raises(TooManyJobs, match="user bob already has 2 jobs"):
            with limits.admitting("bob", table):
                pass


@pytest.mark.unit
@pytest.mark.parametrize("name, value, message", [
    ("MAX_JOBS_PER_USER", "-1", "max_jobs_per_user must be a finite number, 0 or more, got -1"),
    ("SUBMIT_RATE_PER_USER", "-0.5", "submit_rate_per_user must be a finite number, 0 or more, got -0.5"),
    ("SUBMIT_BURST_PER_USER", "-2", "submit_burst_per_user must be a finite number, 0 or more, got -2"),
    ("SUBMIT_BURST_PER_USER", "0", "submit_burst_per_user must be at least 1 while submit_rate_per_user is set"),
])
def test_negative_limits_stop_the_coordinator_with_one_line(name, value, message):
    with pytest.raises(ConfigError) as refused:
        load_config(CoordinatorConfig, "coordinator", environ={f"REVENANT_COORDINATOR_{name}": value})
    assert message in str(refused.value) and "\n" not in str(refused.value)
    off = load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_COORDINATOR_MAX_JOBS_PER_USER": "0",
                                                                  "REVENANT_COORDINATOR_SUBMIT_RATE_PER_USER": "0",
                                                                  "REVENANT_COORDINATOR_SUBMIT_BURST_PER_USER": "0"})
    assert (off.max_jobs_per_user, off.submit_rate_per_user, off.submit_burst_per_user) == (0, 0.0, 0)


# ---------------------------------------------------------------------- through the job service's shell


@pytest.mark.unit
async def test_a_refused_submit_takes_no_id_and_starts_nothing_and_a_repeat_still_gets_its_job():
    jobs, store, agents, _ = shell()
    answers = ClientRequests(jobs)
    clock = Clock()
    answers.limits = UserLimits(2, 1.0, 3, clock=clock, made=jobs.made_by)
    first = await answers.submit(SubmitRequest(argv=["sleep", "100"], request_id="a"), "alice")
    await answers.submit(SubmitRequest(argv=["sleep", "100"]), "alice")
    with pytest.raises(TooManyJobs, match="user alice already has 2 jobs"):
        await answers.submit(SubmitRequest(argv=["sleep", "100"], request_id="b"), "alice")
    assert starts(agents) == 2 and sorted(jobs.jobs) == ["1", "2"]
    # The first submit asked again: its job, neither refused nor a token taken.
    assert (await answers.submit(SubmitRequest(argv=["sleep", "100"], request_id="a"), "alice")) == first
    # Admin's submit on alice's behalf counts for her; admin's own is not limited.
    with pytest.raises(TooManyJobs):
        await answers.submit(SubmitRequest(argv=["true"], user="alice"), "alice")
    assert (await answers.submit(SubmitRequest(argv=["true"]), "root")).spec.user == "root"
    # A job that ends makes room; the bucket (3, one left) then refuses the next but one.
    await jobs.checkpoint("1", stop=True)  # vacated still counts
    with pytest.raises(TooManyJobs):
        await answers.submit(SubmitRequest(argv=["sleep", "100"]), "alice")
    jobs.jobs["2"] = record("2", "alice", "completed")
    await answers.submit(SubmitRequest(argv=["sleep", "100"], request_id="c"), "alice")
    jobs.jobs["4"] = record("4", "alice", "failed")  # the job just made: room again
    with pytest.raises(SubmitRateExceeded, match=r"user alice submitted more than 1 jobs/s \(submit_rate_per_user "
                                                 r"= 1, burst 3\): try again in 1 s"):
        await answers.submit(SubmitRequest(argv=["sleep", "100"], request_id="d"), "alice")
    # Ids 1 to 4 went to the four jobs made: no refusal took one.
    assert starts(agents) == 4 and await store.next_id() == "5"


@pytest.mark.unit
async def test_a_new_leader_counts_the_unfinished_jobs_of_the_table_it_loads():
    jobs, store, agents, _ = shell()
    for n, state in enumerate(("running", "vacated", "completed", "restoring"), start=10):
        store.write_behind_my_back(record(str(n), "alice", state))
    answers = ClientRequests(jobs)
    answers.limits = UserLimits(3, made=jobs.made_by)
    await jobs.open()
    assert jobs.jobs.unfinished("alice") == 3
    with pytest.raises(TooManyJobs, match="already has 3 jobs"):
        await answers.submit(SubmitRequest(argv=["true"]), "alice")
    assert starts(agents) == 0


# ---------------------------------------------------------------------- a real coordinator and agent


async def _ready(coord: Coordinator) -> bool:
    return any(n.state == "alive" and n.capabilities.criu.ok for n in coord.detector.snapshot(time.monotonic()))


async def _refused(nc, user: str, req: SubmitRequest) -> RemoteError:
    with pytest.raises(RemoteError) as refused:
        await bus.request(nc, subjects.user_request(user, "submit"), req, JobReply, 10)
    assert "\n" not in str(refused.value)
    return refused.value


@pytest.fixture
def nobodys_dir():
    """A workdir of nobody's own, on a path nobody can search (pytest's tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="revenant-user-limits-", dir="/var/tmp"))
    nobody = pwd.getpwnam("nobody")
    os.chown(path, nobody.pw_uid, nobody.pw_gid)
    yield str(path)
    shutil.rmtree(path)


@pytest.mark.nats
@pytest.mark.criu
async def test_a_coordinator_refuses_a_user_past_the_limits_with_one_line_and_makes_no_job(nats_url, tmp_path,
                                                                                          nobodys_dir):
    nc = await connect_as(nats_url, security.COORDINATOR)  # writes the table as an earlier leader did
    # Each asks with its own identity: a user's may publish on that user's subjects only.
    daemon, nobody, admin = [await connect_as(nats_url, identity, identity) for identity in (
        security.user_identity("daemon"), security.user_identity("nobody"), security.ADMIN)]
    try:
        # What an earlier leader left: two of daemon's jobs not finished, one finished.
        store = KvJobStore(nc.jetstream())
        await store.open()
        for job, state in (("101", "vacated"), ("102", "vacated"), ("103", "completed")):
            await store.save(record(job, "daemon", state))
        config = coordinator_config(nats_url, http_port=0, max_jobs_per_user=2, submit_rate_per_user=0.01,
                                    submit_burst_per_user=2)
        agent = Agent(agent_config(nats_url, tmp_path, criu_path=str(VENV_BIN / "criu")))
        async with running(Coordinator(config)) as coord, running(agent):
            await wait_for(lambda: _ready(coord), timeout=30)
            refused = await _refused(daemon, "daemon", SubmitRequest(argv=["true"], workdir="/", request_id="d1"))
            assert (refused.code, str(refused)) == (
                "too_many_jobs", "user daemon already has 2 jobs that are not finished (max_jobs_per_user = 2)")
            # Admin submitting on daemon's behalf counts for daemon: the CLI prints the one line.
            out = await asyncio.to_thread(revenant_cli, "submit", "--user", "daemon", "--workdir", "/", "--", "true",
                                          env=cli_env(nats_url))
            assert out.returncode == 1 and out.stderr.splitlines() == [
                "revenant: user daemon already has 2 jobs that are not finished (max_jobs_per_user = 2)"]
            assert sorted(coord.jobs.jobs) == ["101", "102", "103"] and agent.supervisor.jobs == {}
            # nobody's burst of two goes through (the first job takes id 1: none was taken above) ...
            made = [await bus.request(nobody, subjects.user_request("nobody", "submit"),
                                      SubmitRequest(argv=["true"], workdir=nobodys_dir, request_id=f"n{n}"),
                                      JobReply, 10)
                    for n in (1, 2)]
            assert [r.job.spec.id for r in made] == ["1", "2"]
            await wait_for(lambda: _ended(coord, "1", "2"), timeout=20)
            # A job holding more memory than a user may hold in all is refused before the rate
            # is looked at (it takes no token).
            refused = await _refused(nobody, "nobody", SubmitRequest(argv=["true"], workdir=nobodys_dir,
                                                                     request_id="big", memory_bytes=2 << 40))
            assert (refused.code, str(refused)) == ("over_user_total", (
                "user nobody's unfinished jobs hold 0 B of memory; this one's 2 TiB would pass "
                "max_memory_per_user (1 TiB)"))
            # ... the third is past the rate, though nobody has no job left unfinished.
            refused = await _refused(nobody, "nobody",
                                     SubmitRequest(argv=["true"], workdir=nobodys_dir, request_id="n3"))
            shown = re.fullmatch(r"user nobody submitted more than 0\.01 jobs/s \(submit_rate_per_user = 0\.01, "
                                 r"burst 2\): try again in ([0-9.]+) s", str(refused))
            assert refused.code == "submit_rate" and shown and 90 < float(shown[1]) <= 100, str(refused)
            # A repeat of the second still gets its job; admin's own submits are not limited.
            again = await bus.request(nobody, subjects.user_request("nobody", "submit"),
                                      SubmitRequest(argv=["true"], workdir=nobodys_dir, request_id="n2"), JobReply, 10)
            assert again.job.spec.id == "2"
            root = await bus.request(admin, subjects.coordinator("submit"), SubmitRequest(argv=["true"], workdir="/"),
                                     JobReply, 10)
            assert root.job.spec.id == "3" and sorted(coord.jobs.jobs) == ["1", "101", "102", "103", "2", "3"]
    finally:
        for conn in (nc, daemon, nobody, admin):
            await conn.close()


async def _ended(coord: Coordinator, *jobs: str) -> bool:
    return all(coord.jobs.jobs[job].state in ("completed", "failed") for job in jobs)
