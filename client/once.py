"""One request asked once, for a command that exits after it.

Nothing here imports the NATS client library at start: :func:`ask_once` speaks the protocol
over a plain socket (common/messaging/oneshot.py) and starts the library only where that path
cannot go (a server that requires TLS)."""

from __future__ import annotations

from typing import TypeVar

from revenant.client.asking import request_subject
from revenant.client.errors import ClientError
from revenant.common.errors import RevenantError
from revenant.common.messaging import oneshot
from revenant.common.settings import security
from revenant.messages import Message

M = TypeVar("M", bound=Message)


def ask_once(url: str, verb: str, msg: Message, reply_type: type[M], timeout_s: float, creds: str = "") -> M:
    """Ask the leader ``verb`` once, as ``creds``'s identity ("": none), and return its reply: over
    a plain socket where the servers allow it, else through the NATS client library.  Whatever
    answers instead raises :class:`ClientError`."""
    try:
        subject = request_subject(verb, creds)
        options = security.client_credentials(creds)
        try:
            return oneshot.request(url, subject, msg, reply_type, timeout_s, creds=options.get("nkey_seed"),
                                   inbox_prefix=options.get("inbox_prefix"))
        except oneshot.NeedsLibrary:
            pass
        import asyncio

        from revenant.client.client import Client

        async def through_library() -> M:
            async with Client.connect(nats=url, creds=creds, timeout=timeout_s) as rv:
                return await rv.ask(verb, msg, reply_type, timeout_s)

        return asyncio.run(through_library())
    except RevenantError as exc:
        raise ClientError.of(exc) from None
