"""Who a client asks the coordinator as, and so on which subject (docs/security.md); what a
submit sends and when it is asked again; where the next page of a listing starts.  Shared by the
asynchronous client and the synchronous one; no I/O, and nothing here imports the NATS client
library (see once.py)."""

from __future__ import annotations

import os
import pwd
import time
from typing import Any

from revenant.client.errors import ClientError
from revenant.common.errors import RevenantError
from revenant.common.settings import security
from revenant.common.settings.intervals import parse_interval
from revenant.common.settings.resources import parse_size
from revenant.common.settings.limits import check_submit
from revenant.messages import JobsReply, NodesReply, SubmitRequest, subjects

# How long a submit is asked again while no leader answers (a coordinator failing over): with its
# request id, a repeat never makes a second job.  What is asked again: nothing listening, no reply
# in time, the bus out of reach, and a coordinator's word that it does not lead.
SUBMIT_RETRY_S = 30.0
RETRY_LOCAL = ("no_responders", "timeout", "bus")
RETRY_REMOTE = ("not_leader",)


def asking_user(creds: str) -> str | None:
    """The Unix user a client holding ``creds`` ("": none) asks as, or None for admin.

    With a credential, its identity decides: ``admin`` asks as admin, ``user-<name>`` as that
    user (the server lets only that identity publish on ``revenant.user.<name>.<verb>``).
    Without one (an --insecure bus), root asks as admin and anyone else as their login name,
    which nothing checks: the coordinator trusts it."""
    if creds:
        identity = security.identity_of(creds)
        if identity == security.ADMIN:
            return None
        if identity.startswith(security.USER_PREFIX):
            return subjects.check_name(identity[len(security.USER_PREFIX):], "user name")
        raise RevenantError(f"{creds} is {identity}'s credential: a client asks with admin's or a user's")
    if os.geteuid() == 0:
        return None
    try:
        name = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        raise RevenantError(f"uid {os.geteuid()} has no user name: the coordinator knows users by name") from None
    return subjects.check_name(name, "user name")


def request_subject(verb: str, creds: str) -> str:
    """Where a client holding ``creds`` asks for ``verb``: admin's subject or its user's."""
    user = asking_user(creds)
    return subjects.coordinator(verb) if user is None else subjects.user_request(user, verb)


def submit_request(argv: list[str], asker: str | None, *, name: str = "", node: str = "", workdir: str | None = None,
                   env: dict[str, str] | None = None, checkpoint: str | float | None = None,
                   max_epochs: int | None = None, requeue: bool = False, user: str = "",
                   request_id: str | None = None, **policy: Any) -> SubmitRequest:
    """A ``submit.v1`` checked as the coordinator will check it (``asker``: the asking user, None
    for admin); a mistake is a :class:`ClientError` before anything is sent."""
    try:
        interval = parse_interval(checkpoint) if isinstance(checkpoint, str) else checkpoint
        if isinstance(policy.get("mem"), str):  # a size as --mem takes it: "64G"
            policy["memory_bytes"] = parse_size(policy.pop("mem"))
        elif "mem" in policy:
            policy["memory_bytes"] = policy.pop("mem")
        req = SubmitRequest(argv=list(argv), name=name, node=node, workdir=os.path.realpath(workdir or os.getcwd()),
                            env=dict(env or {}), checkpoint_interval_s=interval, max_epochs=max_epochs,
                            requeue=requeue, user=user, request_id=request_id or os.urandom(16).hex(),
                            **{k: v for k, v in policy.items() if v is not None})
        check_submit(req, user or asker or "root")
    except RevenantError as exc:
        raise ClientError.of(exc) from None
    return req


def ask_again(exc: ClientError, deadline: float, pause_s: float) -> bool:
    """Whether a submit that met ``exc`` is asked again (the same request id: one job at most):
    only while no leader could answer, and only until ``deadline`` (monotonic)."""
    again = RETRY_REMOTE if exc.remote else RETRY_LOCAL  # a coordinator's own timeout is its answer
    return exc.code in again and time.monotonic() + pause_s < deadline


def next_jobs(reply: JobsReply) -> str | None:
    """The ``after`` of the listing's next page, or None: it was the last."""
    return reply.jobs[-1].spec.id if reply.more and reply.jobs else None


def next_nodes(reply: NodesReply, have: int) -> int | None:
    """The ``offset`` of the node table's next page, or None: ``have`` is all of it."""
    return have if reply.nodes and have < reply.total else None


def waiting(timeout_s: float, wait_s: float | None) -> float:
    """How long a checkpoint or vacate waits for one already in progress: ``wait_s`` if given, else
    half of the request's ``timeout_s``, so that its own checkpoint has the other half before
    the client stops listening."""
    return timeout_s / 2 if wait_s is None else wait_s
