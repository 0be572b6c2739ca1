"""One request over a plain socket (common/messaging/oneshot.py), against a real nats-server: the
reply decoded as the client library's path decodes it, an error reply with its code, nothing
listening, no reply in time, a dead first server, TLS left to the library, and a user's NKey
asking on its own subject and inbox only."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from helpers import connect_as, credentials
from test_security_bus import secured  # noqa: F401  (the fixture: a server with revenant's permissions)
from revenant.common.errors import NoResponders, RemoteError, RequestTimeout
from revenant.common.messaging import oneshot
from revenant.common.settings import security
from revenant.messages import ErrorReply, JobRequest, NodesReply, NodesRequest, decode, encode, subjects

pytestmark = pytest.mark.nats


async def ask(*args, **kw):
    return await asyncio.to_thread(oneshot.request, *args, **kw)


async def test_a_request_gets_its_reply_or_the_error_that_answers_it(nats_url):
    # The test answers as the coordinator, on admin's subjects; the one-shot asks as admin.
    nc = await connect_as(nats_url, security.COORDINATOR)
    admin = credentials(nats_url, security.ADMIN)
    nodes, job, nobody, silent = (subjects.coordinator(verb) for verb in ("nodes", "job", "nobody", "silent"))
    asked = []

    async def answer(msg) -> None:
        asked.append(decode(msg.data))
        await msg.respond(encode(NodesReply(total=7)))

    async def refuse(msg) -> None:
        await msg.respond(encode(ErrorReply(code="unknown_job", message="unknown job 9", retriable=False)))

    await nc.subscribe(nodes, cb=answer)
    await nc.subscribe(job, cb=refuse)
    async def ignore(msg) -> None:
        pass

    await nc.subscribe(silent, cb=ignore)
    await nc.flush()
    try:
        reply = await ask(nats_url, nodes, NodesRequest(offset=3), NodesReply, 5.0, creds=admin["nkey_seed"],
                          inbox_prefix=admin["inbox_prefix"])
        assert reply.total == 7 and asked == [NodesRequest(offset=3)]
        with pytest.raises(RemoteError) as refused:
            await ask(nats_url, job, JobRequest(job="9"), NodesReply, 5.0, creds=admin["nkey_seed"],
                      inbox_prefix=admin["inbox_prefix"])
        assert (refused.value.code, str(refused.value)) == ("unknown_job", "unknown job 9")
        with pytest.raises(NoResponders, match=f"nothing is listening on {nobody}"):
            await ask(nats_url, nobody, NodesRequest(), NodesReply, 5.0, creds=admin["nkey_seed"],
                      inbox_prefix=admin["inbox_prefix"])
        began = time.monotonic()
        with pytest.raises(RequestTimeout, match=f"no reply on {silent} within 0.5 s"):
            await ask(nats_url, silent, NodesRequest(), NodesReply, 0.5, creds=admin["nkey_seed"],
                      inbox_prefix=admin["inbox_prefix"])
        assert time.monotonic() - began < 3
        # A dead first server: the next one of the URL answers.
        port = nats_url.rsplit(":", 1)[1]
        assert (await ask(f"nats://127.0.0.1:1,nats://127.0.0.1:{port}", nodes, NodesRequest(), NodesReply,
                          5.0, creds=admin["nkey_seed"], inbox_prefix=admin["inbox_prefix"])).total == 7
    finally:
        await nc.close()
    with pytest.raises(oneshot.NeedsLibrary):
        await ask("tls://127.0.0.1:1", nodes, NodesRequest(), NodesReply, 1.0)


async def test_a_user_asks_with_its_nkey_on_its_own_subject_and_inbox(secured):  # noqa: F811
    server, seeds = secured
    coord = await nats.connect(server.url, nkeys_seed=str(seeds["coordinator"]),
                               inbox_prefix=security.inbox_prefix("coordinator"))

    async def answer(msg) -> None:
        await msg.respond(encode(NodesReply(total=len(msg.subject))))

    await coord.subscribe(subjects.user_request("alice", "nodes"), cb=answer)
    await coord.subscribe(subjects.coordinator("nodes"), cb=answer)
    await coord.flush()
    alice = security.client_credentials(str(seeds["user-alice"]))
    try:
        reply = await ask(server.url, subjects.user_request("alice", "nodes"), NodesRequest(), NodesReply, 5.0,
                          creds=alice["nkey_seed"], inbox_prefix=alice["inbox_prefix"])
        assert reply.total == len(subjects.user_request("alice", "nodes"))
        # Admin's subject is not hers: the server refuses the publish, and says so at once.
        with pytest.raises(Exception, match="[Pp]ermissions [Vv]iolation"):
            await ask(server.url, subjects.coordinator("nodes"), NodesRequest(), NodesReply, 5.0,
                      creds=alice["nkey_seed"], inbox_prefix=alice["inbox_prefix"])
        with pytest.raises(Exception, match="refused the connection .Authorization Violation.: it wants a "
                                            "credential") as refused:
            await ask(server.url, subjects.coordinator("nodes"), NodesRequest(), NodesReply, 5.0)
        assert (refused.value.code, refused.value.retriable) == ("refused", False)
    finally:
        await coord.close()
