"""The synchronous client, for scripts: the same verbs as :class:`~revenant.client.client.Client`,
each a request asked once (:func:`~revenant.client.once.ask_once`: a plain socket where the bus
allows, without asyncio or the NATS client library), so a script that asks one thing starts fast.
It has no event stream (use the asynchronous client) and no progress reports."""

from __future__ import annotations

import socket
import time
from typing import Any, TypeVar

from revenant.client.asking import (SUBMIT_RETRY_S, ask_again, asking_user, next_jobs, next_nodes, submit_request,
                                    waiting)
from revenant.client.errors import ClientError
from revenant.client.once import ask_once
from revenant.common.errors import BusError, RevenantError
from revenant.common.messaging import oneshot
from revenant.common.settings.cluster import resolve_creds, resolve_nats_url
from revenant.messages import (FailoverReply, FailoverRequest, JobRecord, JobReply, JobRequest, JobsReply,
                               JobsRequest, Message, NodesReply, NodesRequest, NodeStatus, SubmitRequest)

M = TypeVar("M", bound=Message)


def _reachable(url: str, timeout_s: float) -> None:
    """A server of ``url`` takes a connection, or a retriable ClientError says none does."""
    failures = []
    try:
        for host, port in oneshot.servers(url, plain_only=False):
            try:
                socket.create_connection((host, port), timeout=timeout_s).close()
                return
            except OSError as exc:
                failures.append(f"{host}:{port}: {exc.strerror or exc}")
    except RevenantError as exc:
        raise ClientError.of(exc) from None
    raise ClientError(f"cannot connect to NATS at {url}: {'; '.join(failures)}", code=BusError.code, retriable=True)


class SyncClient:
    """``with SyncClient.connect(cluster_dir="/tmp/rv") as rv: job = rv.submit(["python3", "train.py"])``"""

    def __init__(self, url: str, creds: str, timeout_s: float) -> None:
        self.url, self.creds, self.timeout_s = url, creds, timeout_s
        self.user = asking_user(creds)

    @classmethod
    def connect(cls, cluster_dir: str | None = None, nats: str | None = None, creds: str | None = None, *,
                timeout: float = 5.0) -> "SyncClient":
        """The cluster and credential as :meth:`Client.connect` finds them; a server of it must
        take a connection now."""
        try:
            url = resolve_nats_url(cluster_dir, nats)
            client = cls(url, resolve_creds(cluster_dir, None) if creds is None else creds, timeout)
        except RevenantError as exc:
            raise ClientError.of(exc) from None
        _reachable(url, min(timeout, 5.0))
        return client

    def close(self) -> None:
        """Nothing is held between calls: here for ``with`` and symmetry."""

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ask(self, verb: str, msg: Message, reply_type: type[M], timeout_s: float | None = None) -> M:
        return ask_once(self.url, verb, msg, reply_type, self.timeout_s if timeout_s is None else timeout_s,
                        self.creds)

    def submit(self, argv: list[str], *, retry_s: float = SUBMIT_RETRY_S, **kw: Any) -> JobRecord:
        """As :meth:`Client.submit`."""
        return self.submit_request(submit_request(argv, self.user, **kw), retry_s).job

    def submit_request(self, req: SubmitRequest, retry_s: float = SUBMIT_RETRY_S, pause_s: float = 1.0,
                       retrying=None) -> JobReply:
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return self.ask("submit", req, JobReply)
            except ClientError as exc:
                if not ask_again(exc, deadline, pause_s):
                    raise
                if retrying is not None:
                    retrying(exc)
                    retrying = None
                time.sleep(pause_s)

    def job(self, job: str) -> JobRecord:
        return self.ask("job", JobRequest(job=job), JobReply).job

    def jobs(self, page: int = 1000) -> list[JobRecord]:
        out: list[JobRecord] = []
        after: str | None = ""
        while after is not None:
            reply = self.ask("jobs", JobsRequest(after=after, limit=page), JobsReply)
            out += reply.jobs
            after = next_jobs(reply)
        return out

    def nodes_reply(self) -> NodesReply:
        reply = self.ask("nodes", NodesRequest(), NodesReply)
        nodes = list(reply.nodes)
        while (offset := next_nodes(reply, len(nodes))) is not None:
            reply = self.ask("nodes", NodesRequest(offset=offset), NodesReply)
            nodes += reply.nodes
        reply.nodes = nodes
        return reply

    def nodes(self) -> list[NodeStatus]:
        return self.nodes_reply().nodes

    def checkpoint(self, job: str, *, wait: float | None = None, timeout: float = 3600.0) -> JobReply:
        return self.ask("checkpoint", JobRequest(job=job, wait_s=waiting(timeout, wait)), JobReply, timeout)

    def vacate(self, job: str, *, wait: float | None = None, timeout: float = 3600.0) -> JobReply:
        return self.ask("vacate", JobRequest(job=job, wait_s=waiting(timeout, wait)), JobReply, timeout)

    def restart(self, job: str, *, node: str = "", epoch: int = 0, timeout: float = 3600.0) -> JobReply:
        return self.ask("restart", JobRequest(job=job, node=node, epoch=epoch), JobReply, timeout)

    def cancel(self, job: str, *, signal: str = "TERM", grace: float = 10.0) -> JobReply:
        return self.ask("cancel", JobRequest(job=job, signal=signal, grace_s=grace), JobReply,
                        self.timeout_s + grace + 15.0)

    def signal(self, job: str, signal: str, *, all: bool = False) -> JobReply:
        return self.ask("signal", JobRequest(job=job, signal=str(signal), all=all), JobReply)

    def purge(self, job: str, *, timeout: float = 600.0) -> JobReply:
        return self.ask("purge", JobRequest(job=job), JobReply, timeout)

    def check(self, job: str) -> JobReply:
        return self.ask("check", JobRequest(job=job), JobReply)

    def failover(self, action: str = "status") -> FailoverReply:
        """``status``, or (admin) ``pause`` / ``resume``."""
        return self.ask("failover", FailoverRequest(action=action), FailoverReply)
