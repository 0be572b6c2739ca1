"""Defence in depth: names that could leave their directory or subject are refused before use,
every decoded message is bounded, and the event stream refuses big junk."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import nats.js.errors
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import connect_as, examples

from revenant.agent.running.jobs import Supervisor
from revenant.agent.storage.epochs import JobFiles
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.messages import MessageError, PurgeJob, decode, decode_as, encode, subjects
from revenant.messages.codec import MAX_MESSAGE_BYTES
from revenant.messages.errors import OversizedMessage
from revenant.messages.subjects import InvalidName

ESCAPING = ["", ".", "..", "../x", "../../etc", "a/b", "/abs", "a\x00b", "a\n", "\nb", "a.b", "a" * 64, "-a",
            "a b", "a\\b", "é", "*", ">", "a*"]

# Text that tries hard to escape: separators, dots, NUL, newlines, wildcards, and plain letters.
hostile = st.text(st.sampled_from(list("./\\\x00\n\t *>-_aZ9é")), max_size=70) | st.text(max_size=80)


@pytest.mark.unit
@pytest.mark.parametrize("name", ESCAPING)
def test_a_name_that_could_escape_is_refused_everywhere(name, tmp_path):
    with pytest.raises(InvalidName, match="invalid job id"):
        JobFiles(tmp_path, name)
    with pytest.raises(InvalidName):
        subjects.job_event(name, "started", user="")
    with pytest.raises(InvalidName):
        subjects.node_command(name, "start")
    assert subjects.node_from_heartbeat(f"revenant.hb.{name}") is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
@settings(max_examples=examples(500), deadline=None)
@given(hostile)
def test_fuzz_a_job_id_is_a_path_under_storage_or_refused(name):
    storage = Path("/srv/storage")
    try:
        files = JobFiles(storage, name)
    except InvalidName as exc:
        assert exc.code == "invalid_name" and "job id" in str(exc)
        return
    assert files.dir.parent == storage / "jobs" and files.dir.name == name
    assert ".." not in files.dir.parts and "\x00" not in str(files.dir)


@pytest.mark.unit
@settings(max_examples=examples(500), deadline=None)
@given(hostile, hostile)
def test_fuzz_a_name_is_one_subject_token_or_refused(node, kind):
    try:
        subject = subjects.node_event(node, kind)
    except InvalidName:
        return
    assert subject.split(".") == ["revenant", "evt", "node", node, kind]
    assert not set(subject) & set(" \t\r\n\x00*>/")


def _purge_reply(storage: Path, data: bytes) -> bytes:
    """What an agent answers a purge command: the reply, or error.v1."""
    async def go() -> bytes:
        sup = Supervisor("n1", storage, None, lambda subject, msg: None)
        try:
            return encode(await sup.purge(decode_as(data, PurgeJob).job))
        except Exception as exc:
            return bus.error_reply(exc)
    return asyncio.run(go())


@pytest.mark.unit
@settings(max_examples=examples(300), deadline=None)
@given(hostile)
def test_fuzz_a_purge_with_a_hostile_job_id_is_answered_with_an_error_and_touches_nothing(name):
    import tempfile

    with tempfile.TemporaryDirectory() as top:
        storage = Path(top) / "storage"
        (storage / "jobs").mkdir(parents=True)
        victim = Path(top) / "victim" / "epochs"
        victim.mkdir(parents=True)
        reply = decode(_purge_reply(storage, msgpack.packb({"type": "purge_job.v1", "job": name})))
        assert victim.is_dir(), "a purge reached outside the storage"
        if type(reply).__name__ == "ErrorReply":
            assert reply.code in ("invalid_name", "malformed"), reply
        else:
            assert reply.job == name and subjects.check_name(name, "job id")


@pytest.mark.unit
def test_a_purge_with_a_path_escaping_id_says_why(tmp_path):
    (tmp_path / "victim" / "epochs").mkdir(parents=True)
    reply = decode(_purge_reply(tmp_path / "storage", encode(PurgeJob(job="../../victim"))))
    assert reply.code == "invalid_name" and "invalid job id '../../victim'" in reply.message
    assert (tmp_path / "victim" / "epochs").is_dir()


@pytest.mark.unit
@settings(max_examples=examples(50), deadline=None)
@given(st.integers(MAX_MESSAGE_BYTES + 1, 4 * MAX_MESSAGE_BYTES))
def test_fuzz_every_decoded_message_is_bounded(size):
    big = msgpack.packb({"type": "purge_job.v1", "job": "x" * size})
    with pytest.raises(OversizedMessage):
        decode(big)
    with pytest.raises(MessageError):
        decode_as(big, PurgeJob)


# ------------------------------------------------------------------ the event stream


@pytest.mark.nats
async def test_the_event_stream_refuses_junk_bigger_than_an_event(nats_url):
    # A node's own credential is the one that could send junk: the stream's limit stops it.
    nc = await connect_as(nats_url, security.agent_identity("junk"), "junk")
    try:
        js = nc.jetstream()
        await bus.ensure_event_stream(js)
        before = (await js.stream_info(subjects.EVENTS_STREAM)).state.bytes
        for size in (900 * 1024, bus.EVENTS_MAX_MSG_BYTES + 1):
            with pytest.raises(nats.js.errors.APIError, match="(?i)maximum|size"):
                await js.publish(subjects.node_event("junk", "joined"), b"j" * size)
        assert (await js.stream_info(subjects.EVENTS_STREAM)).state.bytes == before
        ack = await js.publish(subjects.node_event("junk", "joined"), b"j" * 1000)
        assert ack.stream == subjects.EVENTS_STREAM
    finally:
        await nc.close()


@pytest.mark.nats
async def test_an_older_event_stream_gets_the_message_size_limit(nats_url):
    from nats.js.api import StreamConfig

    nc = await connect_as(nats_url, security.COORDINATOR)  # the coordinator brings the stream up to date
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=subjects.EVENTS_STREAM, subjects=[subjects.EVENTS_ALL]))
        await js.publish(subjects.node_event("n1", "joined"), b"j" * 900 * 1024)  # what it let in before
        await bus.ensure_event_stream(js)
        info = await js.stream_info(subjects.EVENTS_STREAM)
        assert info.config.max_msg_size == bus.EVENTS_MAX_MSG_BYTES
        assert info.config.max_bytes == bus.EVENTS_MAX_BYTES
        with pytest.raises(nats.js.errors.APIError):
            await js.publish(subjects.node_event("n1", "joined"), b"j" * 900 * 1024)
    finally:
        await nc.close()


# ------------------------------------------------------------------ the job's directory may be its user's


@pytest.mark.unit
@pytest.mark.parametrize("planted", ["user's directory", "link", "group-writable"])
def test_epochs_the_jobs_user_could_have_planted_are_never_written_or_restored(tmp_path, planted):
    """The job's directory may belong to the job's user, who could replace epochs/ inside it."""
    import os

    from revenant.agent.storage.epochs import EpochError

    files = JobFiles(tmp_path / "storage", "1")
    files.dir.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted == "link":
        files.epochs_dir.symlink_to(elsewhere)
    else:
        files.epochs_dir.mkdir()
        (files.epochs_dir / "1").mkdir()
        (files.epochs_dir / "1" / "manifest.json").write_text("{}")
        if planted == "user's directory":
            os.chown(files.epochs_dir, 65534, 65534)
        else:
            files.epochs_dir.chmod(0o775)
    with pytest.raises(EpochError, match="never restored from"):
        files.newest_verified()
    if planted == "group-writable":  # root's own: made private again, then written
        files.discard(files.new_tmp("n1"))
        assert files.epochs_dir.stat().st_mode & 0o777 == 0o700
    else:
        with pytest.raises(PermissionError, match="refusing to keep checkpoint images"):
            files.new_tmp("n1")
    assert list(elsewhere.iterdir()) == []
