"""A submit asked again (its reply lost, a leader changing) makes one job: the coordinator answers a
repeat of a request id with the job the first made (coordinator/table/requests.py), and the CLI asks again
with the same id while no leader answers (cli/client.py ``submitted``)."""

from __future__ import annotations

import asyncio

import pytest

from helpers import connect_as, creds
from revenant.client import ClientError
from revenant.common.errors import BusError, RevenantError
from revenant.common.settings import security
from revenant.common.settings.limits import BadRequest, check_submit
from revenant.coordinator.table.requests import ClientRequests
from revenant.messages import ErrorReply, JobRecord, JobReply, JobSpec, SubmitRequest, decode_as, encode, subjects
from test_lifecycle import Agents, shell


class SlowAgents(Agents):
    """Agents whose starts wait for ``go``: a repeat arrives while the first submit is under way."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()

    async def carry_out(self, cmd, timeout_s: float):
        await self.go.wait()
        return await super().carry_out(cmd, timeout_s)


def starts(agents: Agents) -> int:
    return sum(1 for _, verb, _ in agents.sent if verb == "start")


@pytest.mark.unit
async def test_a_repeated_submit_gets_the_job_the_first_made():
    jobs, _, agents, _ = shell()
    answers = ClientRequests(jobs)
    req = SubmitRequest(argv=["sleep", "100"], request_id="a1")
    first = await answers.submit(req, "alice")
    again = await answers.submit(req, "alice")
    assert again.spec.id == first.spec.id and first.spec.request_id == "a1"
    assert starts(agents) == 1 and len(jobs.jobs) == 1
    # Another user's request with the same id, and a submit without one, are other jobs.
    assert (await answers.submit(req, "bob")).spec.id != first.spec.id
    plain = SubmitRequest(argv=["sleep", "100"])
    assert (await answers.submit(plain, "alice")).spec.id != (await answers.submit(plain, "alice")).spec.id
    assert starts(agents) == 4
    # The same id for another command is a mistake, said so; nothing is started.
    with pytest.raises(RevenantError, match=f"request id a1 already made job {first.spec.id}") as refused:
        await answers.submit(SubmitRequest(argv=["true"], request_id="a1"), "alice")
    assert refused.value.code == "request_id_reused" and starts(agents) == 4


@pytest.mark.unit
async def test_a_repeat_that_comes_while_the_first_is_under_way_waits_for_its_job():
    jobs, store, _, lease = shell()
    agents = jobs.agents = SlowAgents()
    answers = ClientRequests(jobs)
    req = SubmitRequest(argv=["sleep", "100"], request_id="r-1")
    first = asyncio.create_task(answers.submit(req, "alice"))
    await asyncio.sleep(0.05)
    repeat = asyncio.create_task(answers.submit(req, "alice"))
    await asyncio.sleep(0.05)
    assert not repeat.done()
    agents.go.set()
    made, again = await asyncio.gather(first, repeat)
    assert made.spec.id == again.spec.id and starts(agents) == 1 and len(jobs.jobs) == 1


@pytest.mark.unit
async def test_a_repeat_of_a_submit_that_could_not_start_says_so_again():
    jobs, _, agents, _ = shell()
    answers = ClientRequests(jobs)
    agents.refuse["node-1"] = agents.refuse["node-2"] = RevenantError("no reply within 10 s", code="timeout")
    req = SubmitRequest(argv=["true"], node="node-1", request_id="once")
    with pytest.raises(RevenantError, match="could not start on node-1"):
        await answers.submit(req, "alice")
    with pytest.raises(RevenantError, match="could not start: start on node-1 failed") as again:
        await answers.submit(req, "alice")  # not "submitted": the same failure, the same job
    assert again.value.code == "start_failed" and len(jobs.jobs) == 1
    # The same id from another working directory is another request: refused, not merged.
    with pytest.raises(RevenantError, match="already made job"):
        await answers.submit(SubmitRequest(argv=["true"], node="node-1", workdir="/tmp", request_id="once"), "alice")


@pytest.mark.unit
async def test_a_new_leader_knows_the_request_ids_from_the_job_table():
    jobs, store, agents, lease = shell()
    made = await ClientRequests(jobs).submit(SubmitRequest(argv=["true"], request_id="k"), "alice")
    successor, _, _, _ = shell()
    successor.store = store
    await successor.open()
    again = await ClientRequests(successor).submit(SubmitRequest(argv=["true"], request_id="k"), "alice")
    assert again.spec.id == made.spec.id


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["", "x" * 65, "a b", "ä", "a/b"])
def test_a_request_id_is_short_and_plain(bad):
    check_submit(SubmitRequest(argv=["true"], request_id="Ab_9-" + "x" * 59))
    if bad:
        with pytest.raises(BadRequest, match="request id is 1 to 64 letters"):
            check_submit(SubmitRequest(argv=["true"], request_id=bad))
    else:
        check_submit(SubmitRequest(argv=["true"], request_id=bad))  # none given: fine


def as_admin(nats_url: str, monkeypatch) -> None:
    """The CLI's submit as root's, with admin's credential (what ``--creds`` resolves to)."""
    from revenant.cli import client

    monkeypatch.setattr(client, "_creds", creds(nats_url, security.ADMIN))


@pytest.mark.nats
async def test_the_cli_asks_again_with_the_same_id_while_no_leader_answers(nats_url, monkeypatch):
    from revenant.cli.client import submitted

    as_admin(nats_url, monkeypatch)
    nc = await connect_as(nats_url, security.COORDINATOR, "fake-coordinator")
    seen: list[str] = []

    async def on_submit(msg) -> None:
        req = decode_as(msg.data, SubmitRequest)
        seen.append(req.request_id)
        if len(seen) < 3:  # between terms: the coordinator that got it does not lead
            await msg.respond(encode(ErrorReply(code="not_leader", message="not the leader", retriable=True)))
        else:
            job = JobRecord(spec=JobSpec(id="7", argv=req.argv, request_id=req.request_id), state="running")
            await msg.respond(encode(JobReply(job=job)))

    await nc.subscribe(subjects.coordinator("submit"), cb=on_submit)
    await nc.flush()
    req = SubmitRequest(argv=["true"], request_id="same-1")
    reply = await asyncio.to_thread(submitted, nats_url, req, timeout_s=2, retry_s=10, pause_s=0.05)
    assert reply.job.spec.id == "7" and seen == ["same-1"] * 3
    await nc.close()


@pytest.mark.nats
@pytest.mark.parametrize("code, message", [
    ("bad_request", "nothing to run"),  # a refusal no repeat can change
    ("timeout", "job 3 could not start on node-1"),  # a node that did not answer the start
])
async def test_the_cli_does_not_ask_again_after_a_coordinators_answer(nats_url, code, message, monkeypatch):
    """Only what this client met on the bus, and not_leader, are asked again; a coordinator's
    answer is final, even one with a bus error's code."""
    from revenant.cli.client import submitted

    as_admin(nats_url, monkeypatch)
    nc = await connect_as(nats_url, security.COORDINATOR, "fake-coordinator")
    seen: list[str] = []

    async def answer(msg) -> None:
        seen.append(decode_as(msg.data, SubmitRequest).request_id)
        await msg.respond(encode(ErrorReply(code=code, message=message, retriable=code == "timeout")))

    await nc.subscribe(subjects.coordinator("submit"), cb=answer)
    await nc.flush()
    with pytest.raises(ClientError, match=message) as answered:
        await asyncio.to_thread(submitted, nats_url, SubmitRequest(argv=["true"], request_id="once"), timeout_s=2,
                                retry_s=10, pause_s=0.05)
    assert seen == ["once"] and answered.value.remote and answered.value.code == code
    await nc.close()


@pytest.mark.unit
async def test_a_submit_whose_first_write_landed_but_timed_out_is_one_job(monkeypatch):
    """The job table stored the new record but its answer was lost: the write is asked again
    (it meets the record it made, which stands), and the job starts once, as one job."""
    from revenant.coordinator.table import store

    monkeypatch.setattr(store, "PATIENCE_DELAYS_S", (0.001, 0.001))
    jobs, table, agents, _ = shell()
    save, saves = table.save, []

    async def lost_answer(rec):
        saves.append(rec.state)
        await save(rec)
        if len(saves) == 1:
            raise BusError("cannot save job 1: nats: timeout")
    monkeypatch.setattr(table, "save", lost_answer)
    made = await ClientRequests(jobs).submit(SubmitRequest(argv=["true"], request_id="lost"), "alice")
    assert made.state == "running" and list(jobs.jobs) == [made.spec.id] and starts(agents) == 1
    assert list((await store.MemoryJobStore.load(table))) == [made.spec.id]


@pytest.mark.unit
async def test_the_request_ids_are_known_again_when_a_new_term_loads_the_table():
    jobs, store, agents, _ = shell()
    answers = ClientRequests(jobs)
    await answers.submit(SubmitRequest(argv=["true"], request_id="mine"), "alice")
    # Another leader made a job of a request while this one stood by; this one leads again.
    other = JobRecord(spec=JobSpec(id="9", argv=["true"], user="alice", request_id="theirs"), state="running",
                      node="node-2", generation=1, pid=7)
    store.write_behind_my_back(other)
    await jobs.open()
    assert (await answers.submit(SubmitRequest(argv=["true"], request_id="theirs"), "alice")).spec.id == "9"
    assert (await answers.submit(SubmitRequest(argv=["true"], request_id="mine"), "alice")).spec.id == "1"
    assert starts(agents) == 1
