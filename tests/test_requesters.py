"""Who asks: the coordinator reads the requester from the subject (``revenant.coord.<verb>``:
admin; ``revenant.user.<user>.<verb>``: that user), records the submitter as the job's user, and
shows and lets act on a user's own jobs only; another user's job answers exactly like a job that
does not exist.  The CLI picks its subject from who runs it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from conftest import VENV_BIN, revenant_cli
from helpers import agent_config, cli_env, connect_as, coordinator_config, creds, running, wait_for
from revenant.agent.node.agent import Agent
from revenant.cli import client
from revenant.cli.main import parse_args
from revenant.common.errors import RemoteError, UnknownJob
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.coordinator.coordinator import Coordinator
from revenant.coordinator.table.paging import JobPages
from revenant.coordinator.table.requests import (
    ADMIN,
    Forbidden,
    Requester,
    may_see,
    requester_of,
    submit_user,
    visible,
)
from revenant.coordinator.table.store import KvJobStore
from revenant.messages.subjects import InvalidName
from revenant.messages import (
    FailoverReply,
    FailoverRequest,
    JobRecord,
    JobReply,
    JobRequest,
    JobSpec,
    JobsReply,
    JobsRequest,
    NodesReply,
    NodesRequest,
    SubmitRequest,
    subjects,
)

ALICE, BOB = Requester("alice"), Requester("bob")


def record(job: str, user: str, state: str = "completed") -> JobRecord:
    return JobRecord(spec=JobSpec(id=job, argv=["true"], name="true", user=user), state=state, exit_code=0,
                     created_at=1.8e9, updated_at=time.time())


# ---------------------------------------------------------------------- subjects (pure)


@pytest.mark.unit
def test_user_subjects_are_built_checked_and_parsed():
    assert subjects.user_request("alice", "submit") == "revenant.user.alice.submit"
    assert subjects.user_requests("job") == "revenant.user.*.job"
    for bad in ("a.b", "*", ">", "", "-x", "a b", "x" * 64):
        with pytest.raises(InvalidName, match="invalid user name"):
            subjects.user_request(bad, "submit")
    assert subjects.user_from_request("revenant.user.alice.jobs") == "alice"
    for other in ("revenant.coord.jobs", "revenant.user.alice", "revenant.user.a.b.c", "revenant.user..jobs",
                  "revenant.userx.alice.jobs", "revenant.hb.alice"):
        assert subjects.user_from_request(other) is None, other


@pytest.mark.unit
def test_the_requester_is_the_subjects_admin_or_user():
    assert requester_of("revenant.coord.submit") == ADMIN and ADMIN.admin
    assert requester_of("revenant.user.alice.submit") == ALICE and not ALICE.admin
    # A Unix user called admin is a user, not admin.
    assert not requester_of("revenant.user.admin.jobs").admin
    with pytest.raises(Forbidden, match="root asks as admin"):
        requester_of("revenant.user.root.submit")
    for other in ("revenant.coord.a.b", "revenant.hb.node-1", "revenant.user.alice"):
        with pytest.raises(Forbidden):
            requester_of(other)


# ---------------------------------------------------------------------- the rules (pure)


@pytest.mark.unit
def test_a_user_sees_their_own_jobs_admin_all_and_records_from_before_users_admin_only():
    mine, theirs, legacy = record("1", "alice"), record("2", "bob"), record("3", "")
    assert may_see(ALICE, mine) and not may_see(ALICE, theirs) and not may_see(ALICE, legacy)
    assert all(may_see(ADMIN, r) for r in (mine, theirs, legacy))
    assert visible(ALICE, "1", mine) is mine
    # Another's job and a job that does not exist fail alike: same type, code and wording.
    errors = []
    for job, rec in (("2", theirs), ("3", legacy), ("2", None)):
        with pytest.raises(UnknownJob) as refused:
            visible(ALICE, job, rec)
        errors.append((refused.value.code, str(refused.value)))
    assert errors == [("unknown_job", "unknown job 2"), ("unknown_job", "unknown job 3"),
                      ("unknown_job", "unknown job 2")]


@pytest.mark.unit
def test_the_submitters_user_is_recorded_and_only_admin_names_another():
    ask = SubmitRequest(argv=["true"])
    assert submit_user(ALICE, ask) == "alice"
    assert submit_user(ALICE, SubmitRequest(argv=["true"], user="alice")) == "alice"
    assert submit_user(ADMIN, ask) == "root"
    assert submit_user(ADMIN, SubmitRequest(argv=["true"], user="alice")) == "alice"
    with pytest.raises(Forbidden, match="user alice may not submit as bob: only admin") as refused:
        submit_user(ALICE, SubmitRequest(argv=["true"], user="bob"))
    assert refused.value.code == "forbidden"
    with pytest.raises(InvalidName):
        submit_user(ADMIN, SubmitRequest(argv=["true"], user="../etc"))


@pytest.mark.unit
def test_a_users_listing_pages_through_their_jobs_only_while_others_list_too():
    jobs = {str(i): record(str(i), "alice" if i % 3 == 0 else "bob") for i in range(1, 301)}
    pages = JobPages()
    got: dict[str, list[str]] = {"alice": [], "bob": []}
    after = {"alice": "", "bob": ""}
    done: set[str] = set()
    while len(done) < 2:  # the two listings interleave on one JobPages, page by page
        for who in ("alice", "bob"):
            if who in done:
                continue
            reply = pages.page(jobs, after[who], 7, keep=lambda r, who=who: may_see(Requester(who), r))
            assert reply.total == (100 if who == "alice" else 200)
            got[who] += [r.spec.id for r in reply.jobs]
            if not reply.more:
                done.add(who)
            else:
                after[who] = reply.jobs[-1].spec.id
    assert got["alice"] == [str(i) for i in range(3, 301, 3)]
    assert got["bob"] == [str(i) for i in range(1, 301) if i % 3]
    assert pages.page(jobs, "", 1000).total == 300


# ---------------------------------------------------------------------- the CLI's subject (pure)


@pytest.mark.unit
def test_the_cli_asks_as_admin_when_root_or_with_admins_credential_else_as_its_user(monkeypatch):
    monkeypatch.delenv("REVENANT_CREDS", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert client.asking_user() is None
    assert client.request_subject("jobs") == "revenant.coord.jobs"
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    assert client.asking_user() == "nobody"
    assert client.request_subject("submit") == "revenant.user.nobody.submit"
    assert client.request_subject("jobs", creds="/etc/revenant/admin.creds") == "revenant.coord.jobs"
    monkeypatch.setenv("REVENANT_CREDS", "/home/x/.revenant/admin.creds")
    assert client.request_subject("jobs") == "revenant.coord.jobs"
    monkeypatch.setenv("REVENANT_CREDS", "/home/x/.revenant/user-nobody.creds")
    assert client.request_subject("jobs") == "revenant.user.nobody.jobs"


@pytest.mark.unit
def test_submit_user_is_sent_and_checked_before_anything_connects(capsys):
    args = parse_args(["submit", "--user", "alice", "--workdir", "/", "--", "true"])
    assert client.submit_request(args).user == "alice"
    assert client.submit_request(parse_args(["submit", "--workdir", "/", "--", "true"])).user == ""
    with pytest.raises(SystemExit) as exited:
        parse_args(["submit", "--user", "a.b", "--", "true"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "revenant: invalid user name 'a.b': use 1-63 letters, digits, '-' or '_', starting with a letter or digit"]


# ---------------------------------------------------------------------- through a real coordinator


async def _seed(nc, records: list[JobRecord], archived: list[JobRecord] = ()) -> None:
    store = KvJobStore(nc.jetstream())
    await store.open()
    for rec in [*records, *archived]:
        await store.save(rec)
    for rec in archived:
        await store.archive(rec)


class _Askers:
    """A connection per requester, each with its own identity's credential: alice asks as
    user-alice, whom the server lets publish on her own subjects only; admin as admin."""

    def __init__(self, url: str) -> None:
        self.url, self.conns = url, {}

    async def of(self, who: Requester):
        identity = security.ADMIN if who.admin else security.user_identity(who.user)
        if identity not in self.conns:
            self.conns[identity] = await connect_as(self.url, identity, identity)
        return self.conns[identity]

    async def close(self) -> None:
        for nc in self.conns.values():
            await nc.close()


async def _ask(askers: _Askers, who: Requester, verb: str, msg, reply_type):
    subject = subjects.coordinator(verb) if who.admin else subjects.user_request(who.user, verb)
    return await bus.request(await askers.of(who), subject, msg, reply_type, 5)


async def _refusal(nc, who: Requester, verb: str, msg, reply_type=JobReply) -> tuple[str, str]:
    with pytest.raises(RemoteError) as refused:
        await _ask(nc, who, verb, msg, reply_type)
    return refused.value.code, str(refused.value)


async def _listing(nc, who: Requester) -> list[tuple[str, str]]:
    reply = await _ask(nc, who, "jobs", JobsRequest(), JobsReply)
    assert reply.total == len(reply.jobs)
    return [(r.spec.id, r.spec.user) for r in reply.jobs]


@pytest.mark.nats
async def test_alice_cannot_see_or_act_on_bobs_job_and_admin_sees_all(nats_url):
    nc = await connect_as(nats_url, security.COORDINATOR)  # seeds the job table, as the coordinator writes it
    askers = _Askers(nats_url)
    try:
        await _seed(nc, [record("1", "alice"), record("2", "bob"), record("3", ""),
                         record("4", "alice", state="vacated")], archived=[record("5", "bob")])
        async with running(Coordinator(coordinator_config(nats_url, http_port=0))) as coord:
            assert await _listing(askers, ALICE) == [("1", "alice"), ("4", "alice")]
            assert await _listing(askers, BOB) == [("2", "bob")]
            assert await _listing(askers, ADMIN) == [("1", "alice"), ("2", "bob"), ("3", ""), ("4", "alice")]
            assert (await _ask(askers, ALICE, "job", JobRequest(job="1"), JobReply)).job.spec.user == "alice"
            # Bob's (live or archived) and the record from before users: as if they did not exist.
            for verb in ("job", "checkpoint", "vacate", "restart", "purge", "cancel", "signal"):
                for job in ("2", "3", "5", "99"):
                    asked = JobRequest(job=job, signal="USR1")
                    assert await _refusal(askers, ALICE, verb, asked) == ("unknown_job", f"unknown job {job}")
            # Her own pass that check: what stops them now is the job's state or the nodes.
            for verb, job in (("checkpoint", "1"), ("vacate", "1"), ("restart", "1"), ("purge", "4")):
                assert (await _refusal(askers, ALICE, verb, JobRequest(job=job)))[0] != "unknown_job", verb
            # Cancelling an ended job says so and changes nothing; a bad signal is named.
            assert await _refusal(askers, ALICE, "cancel", JobRequest(job="1")) == (
                "bad_state", "job 1 has already ended (completed); nothing to cancel")
            assert await _refusal(askers, BOB, "cancel", JobRequest(job="5")) == (
                "bad_state", "job 5 has already ended and been archived; nothing to cancel")
            assert await _refusal(askers, ALICE, "signal", JobRequest(job="1", signal="TERM")) == (
                "bad_state", "job 1 is completed; only a running job can be signalled")
            code, message = await _refusal(askers, ALICE, "cancel", JobRequest(job="4", signal="NOPE", grace_s=1))
            assert code == "bad_request" and message.startswith("unknown signal 'NOPE'")
            # Her vacated job: cancelled (no copy anywhere to kill), its epochs kept for a restart.
            cancelled = (await _ask(askers, ALICE, "cancel", JobRequest(job="4"), JobReply)).job
            assert (cancelled.state, cancelled.reason) == ("cancelled", "cancelled by user alice")
            assert await _refusal(askers, ALICE, "cancel", JobRequest(job="4")) == (
                "bad_state", "job 4 is already cancelled; nothing to cancel")
            shown = await _ask(askers, BOB, "job", JobRequest(job="5"), JobReply)
            assert shown.job.spec.user == "bob" and shown.notes[0].startswith("archived")
            for job in ("2", "3", "5"):
                assert (await _ask(askers, ADMIN, "job", JobRequest(job=job), JobReply)).job.spec.id == job
            # A user may read failover's state and the nodes, not pause failover; root is admin only.
            assert not (await _ask(askers, ALICE, "failover", FailoverRequest(), FailoverReply)).paused
            code, message = await _refusal(askers, ALICE, "failover", FailoverRequest(action="pause"), FailoverReply)
            assert code == "forbidden" and "failover pause is for admin (root) only" in message
            assert not coord.failover.storm.paused
            await _ask(askers, ALICE, "nodes", NodesRequest(), NodesReply)
            assert (await _refusal(askers, Requester("root"), "jobs", JobsRequest(), JobsReply))[0] == "forbidden"
            # A user naming another at submit is refused before anything happens.
            code, message = await _refusal(askers, ALICE, "submit", SubmitRequest(argv=["true"], user="bob"))
            assert (code, message) == ("forbidden", "user alice may not submit as bob: only admin (root) submits "
                                                    "on another user's behalf (revenant submit --user)")
            assert sorted(coord.jobs.jobs) == ["1", "2", "3", "4"]
    finally:
        await askers.close()
        await nc.close()


@contextlib.contextmanager
def _nobodys_credential(nats_url: str):
    """user-nobody's seed file, as nobody's own (the test bus's keys are root's: mode 0600, in a
    directory of mode 0700); named as its identity, which is how a client knows who it is."""
    directory = tempfile.mkdtemp(prefix="revenant-nobody-")
    try:
        path = os.path.join(directory, "user-nobody.nk")
        shutil.copyfile(creds(nats_url, security.user_identity("nobody")), path)
        for owned in (directory, path):
            os.chown(owned, 65534, 65534)
        os.chmod(path, 0o600)
        yield path
    finally:
        shutil.rmtree(directory)


def _as_nobody(*args: str, url: str, credential: str) -> subprocess.CompletedProcess:
    """The installed CLI run by the unprivileged user nobody (uid 65534), as that user would,
    with its own credential."""
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "REVENANT_NATS": url, "REVENANT_CREDS": credential, "HOME": "/"}
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           str(VENV_BIN / "revenant"), *args], capture_output=True, text=True, timeout=60,
                          env=env, stdin=subprocess.DEVNULL, cwd="/")


@pytest.mark.nats
async def test_the_cli_run_by_a_user_sees_their_jobs_only_and_root_sees_all(nats_url):
    nc = await connect_as(nats_url, security.COORDINATOR)  # seeds the job table, as the coordinator writes it
    try:
        await _seed(nc, [record("1", "nobody"), record("2", "daemon"), record("3", "nobody")])
        with _nobodys_credential(nats_url) as own:
            async with running(Coordinator(coordinator_config(nats_url, http_port=0))):
                # In threads: the coordinator answers from this process's event loop.
                mine = await asyncio.to_thread(_as_nobody, "jobs", "--json", url=nats_url, credential=own)
                assert mine.returncode == 0, mine.stderr
                assert [(j["id"], j["user"]) for j in json.loads(mine.stdout)] == [("1", "nobody"), ("3", "nobody")]
                table = await asyncio.to_thread(_as_nobody, "jobs", url=nats_url, credential=own)
                assert [line.split()[:4] for line in table.stdout.splitlines()] == [
                    ["ID", "NAME", "STATE", "USER"], ["1", "true", "completed", "nobody"],
                    ["3", "true", "completed", "nobody"]]
                theirs, unknown = [await asyncio.to_thread(_as_nobody, "show", "job", job, url=nats_url,
                                                           credential=own) for job in ("2", "2000")]
                assert theirs.returncode == unknown.returncode == 1
                assert theirs.stderr == "revenant: unknown job 2\n" and unknown.stderr == "revenant: unknown job 2000\n"
                refused = await asyncio.to_thread(_as_nobody, "submit", "--user", "daemon", "--", "true", url=nats_url,
                                                  credential=own)
                assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
                    "revenant: user nobody may not submit as daemon: only admin (root) submits on another user's "
                    "behalf (revenant submit --user)"]
                everything = await asyncio.to_thread(revenant_cli, "jobs", "--json", env=cli_env(nats_url))
                assert [(j["id"], j["user"]) for j in json.loads(everything.stdout)] == [
                    ("1", "nobody"), ("2", "daemon"), ("3", "nobody")]
    finally:
        await nc.close()


async def _started(coord: Coordinator) -> bool:
    nodes = coord.detector.snapshot(time.monotonic())
    return any(n.state == "alive" and n.capabilities.criu.ok for n in nodes)


@pytest.mark.nats
@pytest.mark.criu
async def test_a_submit_records_who_asked_and_admin_may_submit_for_a_user(nats_url, tmp_path):
    agent = Agent(agent_config(nats_url, tmp_path, criu_path=str(VENV_BIN / "criu")))
    wd = tmp_path / "nobodys"  # a job's workdir is its user's own (agent/running/jobuser.py workdir_problem)
    wd.mkdir()
    os.chown(wd, 65534, 65534)
    async with running(Coordinator(coordinator_config(nats_url, http_port=0))) as coord, running(agent):
        await wait_for(lambda: _started(coord), timeout=30)
        askers = _Askers(nats_url)
        try:
            own = await _ask(askers, Requester("nobody"), "submit", SubmitRequest(argv=["true"], workdir=str(wd)),
                             JobReply)
            assert own.job.spec.user == "nobody"
            # Root's CLI asks as admin, which may name the user.
            out = await asyncio.to_thread(revenant_cli, "submit", "--user", "nobody", "--workdir", str(wd), "--", "true",
                                          env=cli_env(nats_url))
            assert out.returncode == 0, out.stderr
            job = out.stdout.strip()
            assert coord.jobs.get(job).spec.user == "nobody"
            shown = await _ask(askers, Requester("nobody"), "job", JobRequest(job=job), JobReply)
            assert shown.job.spec.user == "nobody"
            assert await _listing(askers, Requester("nobody")) == [(own.job.spec.id, "nobody"), (job, "nobody")]
            assert await _listing(askers, Requester("daemon")) == []
        finally:
            await askers.close()
