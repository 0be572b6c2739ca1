"""The asynchronous client: one NATS connection, the coordinator's verbs as methods, the event
stream as an async iterator.  See the package's docstring and docs/client.md."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from typing import Any, AsyncIterator, Callable, Iterable, TypeVar

from revenant.client.asking import (SUBMIT_RETRY_S, ask_again, asking_user, next_jobs, next_nodes, submit_request,
                                    waiting)
from revenant.client.errors import ClientError
from revenant.common.errors import RevenantError
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.common.settings.cluster import resolve_creds, resolve_nats_url
from revenant.messages import (
    FailoverReply, FailoverRequest, JobRecord, JobReply, JobRequest, JobsReply, JobsRequest, Message,
    NodesReply, NodesRequest, NodeStatus, Progress, SubmitRequest, decode_as, subjects,
)

M = TypeVar("M", bound=Message)

class Failover:
    """Automatic failover: its state, and an operator's hold (admin only)."""

    def __init__(self, client: "Client") -> None:
        self._client = client

    async def status(self) -> FailoverReply:
        return await self._client.ask("failover", FailoverRequest(action="status"), FailoverReply)

    async def pause(self) -> FailoverReply:
        return await self._client.ask("failover", FailoverRequest(action="pause"), FailoverReply)

    async def resume(self) -> FailoverReply:
        return await self._client.ask("failover", FailoverRequest(action="resume"), FailoverReply)


class Client:
    """A connection to a revenant cluster, asking as the credential's identity (admin, or a user
    who sees and acts on their own jobs only).  Make one with :meth:`connect`."""

    def __init__(self, nc: Any, creds: str, timeout_s: float) -> None:
        self.nc = nc
        self.creds = creds
        self.timeout_s = timeout_s
        self.failover = Failover(self)
        # Who asks, and so where: admin's revenant.coord.<verb> or revenant.user.<user>.<verb>.
        self.user = asking_user(creds)

    # ------------------------------------------------------------------ connecting

    @classmethod
    def connect(cls, cluster_dir: str | None = None, nats: str | None = None, creds: str | None = None, *,
                timeout: float = 5.0, name: str = "revenant-client", reconnect: bool = False) -> "_Connecting":
        """``async with Client.connect(...) as rv:`` (or ``rv = await Client.connect(...)``, then
        :meth:`close`).  The cluster as the CLI finds it: ``nats`` (a URL), else ``cluster_dir``'s
        cluster.json (``revenant up --dir``), else ``$REVENANT_NATS``; the credential likewise:
        ``creds``, the directory's, ``$REVENANT_CREDS``, or none on an open bus.  ``timeout``:
        each request's, in seconds (the long operations take their own).  ``reconnect``: keep
        reconnecting to NATS if it goes away (for a long-running event consumer)."""
        return _Connecting(cls, cluster_dir, nats, creds, timeout, name, reconnect)

    async def close(self) -> None:
        await self.nc.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ asking

    def subject(self, verb: str) -> str:
        return subjects.coordinator(verb) if self.user is None else subjects.user_request(self.user, verb)

    async def ask(self, verb: str, msg: Message, reply_type: type[M], timeout_s: float | None = None,
                  progress: Callable[[Progress], Any] | None = None, job: str = "") -> M:
        """One request to the leader; its error as a :class:`ClientError`.  ``progress``: called
        with each ``progress.v1`` report of ``job`` until the reply comes (best effort)."""
        sub = None
        try:
            if progress is not None:
                async def heard(report) -> None:
                    try:
                        progress(decode_as(report.data, Progress))
                    except Exception:  # a watcher's mistake never fails the request
                        pass
                try:  # before the request: the server hears the subscription first
                    sub = await self.nc.subscribe(subjects.job_progress(job, self.user), cb=heard)
                except Exception:
                    sub = None
            return await bus.request(self.nc, self.subject(verb), msg, reply_type,
                                     self.timeout_s if timeout_s is None else timeout_s)
        except RevenantError as exc:
            raise ClientError.of(exc) from None
        finally:
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass

    # ------------------------------------------------------------------ jobs

    async def submit(self, argv: list[str], *, retry_s: float = SUBMIT_RETRY_S, **kw: Any) -> JobRecord:
        """Run ``argv`` as a job; its record.  ``name``, ``node``; ``checkpoint``: a periodic
        interval (``"30:00"``, as ``--checkpoint`` takes it, or seconds); ``max_epochs``,
        ``requeue``; ``workdir``: where it runs (default: this process's directory); ``env``: its
        whole environment (default: none); ``user`` (admin only); the job's overrides of the
        cluster's [checkpoint] defaults (``incremental``, ``full_every``, ``pre_dump``,
        ``pre_dump_delay_s``, ``load_aware``, ``connections``, ``on_sick``); what it needs on its
        node (``cpus``, ``mem``: "64G" or bytes, ``gpus``: a job with no room now comes back
        pending, its ``reason`` saying why).  Idempotent: asked
        again with the same ``request_id`` (one is made if not given) while no leader answers,
        for up to ``retry_s``; a repeat is answered with the job the first made."""
        return (await self.submit_request(submit_request(argv, self.user, **kw), retry_s)).job

    async def submit_request(self, req: SubmitRequest, retry_s: float = SUBMIT_RETRY_S, pause_s: float = 1.0,
                             retrying: Callable[[ClientError], None] | None = None) -> JobReply:
        """Send a built ``submit.v1`` (with its request id), asking again while no leader answers."""
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return await self.ask("submit", req, JobReply)
            except ClientError as exc:
                if not ask_again(exc, deadline, pause_s):
                    raise
                if retrying is not None:
                    retrying(exc)
                    retrying = None
                await asyncio.sleep(pause_s)

    async def job(self, job: str) -> JobRecord:
        return (await self.ask("job", JobRequest(job=job), JobReply)).job

    async def jobs(self, page: int = 1000) -> AsyncIterator[JobRecord]:
        """Every job in the live table (a user's: their own), fetched a page at a time."""
        after: str | None = ""
        while after is not None:
            reply = await self.ask("jobs", JobsRequest(after=after, limit=page), JobsReply)
            for rec in reply.jobs:
                yield rec
            after = next_jobs(reply)

    async def nodes(self) -> list[NodeStatus]:
        return (await self.nodes_reply()).nodes

    async def nodes_reply(self) -> NodesReply:
        """The whole node table, page by page."""
        reply = await self.ask("nodes", NodesRequest(), NodesReply)
        nodes = list(reply.nodes)
        while (offset := next_nodes(reply, len(nodes))) is not None:
            reply = await self.ask("nodes", NodesRequest(offset=offset), NodesReply)
            nodes += reply.nodes
        reply.nodes = nodes
        return reply

    async def checkpoint(self, job: str, *, wait: float | None = None, timeout: float = 3600.0,
                         progress: Callable[[Progress], Any] | None = None) -> JobReply:
        """A new epoch; the job keeps running.  One already in progress is waited for (up to
        ``wait`` seconds; default: half of ``timeout``).  The reply: the record, notes, criu's statistics."""
        req = JobRequest(job=job, wait_s=waiting(timeout, wait))
        return await self.ask("checkpoint", req, JobReply, timeout, progress, job)

    async def vacate(self, job: str, *, wait: float | None = None, timeout: float = 3600.0,
                     progress: Callable[[Progress], Any] | None = None) -> JobReply:
        """A checkpoint, then the job stops (vacated: ``restart`` brings it back)."""
        req = JobRequest(job=job, wait_s=waiting(timeout, wait))
        return await self.ask("vacate", req, JobReply, timeout, progress, job)

    async def restart(self, job: str, *, node: str = "", epoch: int = 0, timeout: float = 3600.0,
                      progress: Callable[[Progress], Any] | None = None) -> JobReply:
        """Restore a vacated, failed or cancelled job from its newest good epoch (or ``epoch``)."""
        return await self.ask("restart", JobRequest(job=job, node=node, epoch=epoch), JobReply, timeout, progress,
                              job)

    async def cancel(self, job: str, *, signal: str = "TERM", grace: float = 10.0,
                     timeout: float | None = None) -> JobReply:
        """End ``job`` without a checkpoint: ``signal`` to its processes, SIGKILL after ``grace``."""
        # Its node has the grace, then up to 15 s to kill and answer (coordinator/table/requests.py).
        wait = (self.timeout_s if timeout is None else timeout) + grace + 15.0
        return await self.ask("cancel", JobRequest(job=job, signal=signal, grace_s=grace), JobReply, wait)

    async def signal(self, job: str, signal: str, *, all: bool = False) -> JobReply:
        """Deliver ``signal`` (``"USR1"``, ``"SIGTERM"``, ``15``) to the job's program (``all``:
        every process of the job)."""
        return await self.ask("signal", JobRequest(job=job, signal=str(signal), all=all), JobReply)

    async def purge(self, job: str, *, timeout: float = 600.0) -> JobReply:
        return await self.ask("purge", JobRequest(job=job), JobReply, timeout)

    async def check(self, job: str) -> JobReply:
        """What in the running job a checkpoint or a move carries, closes or cannot carry."""
        return await self.ask("check", JobRequest(job=job), JobReply)

    # ------------------------------------------------------------------ events

    def events(self, since: int | float | datetime | None = None, *, jobs: Iterable[str] | None = None,
               kinds: Iterable[str] | None = None, follow: bool = True):
        """The event stream (node, job, epoch, cluster and anomaly events), as typed messages.
        ``since``: a stream sequence (int: from that event on), a time (a datetime, or a float of
        seconds since the epoch), or None: from the first kept.  ``jobs``, ``kinds``: only those.
        ``follow``: wait for new events (else stop at the last one now).  Iterate with
        ``async for ev in rv.events(...)``; each has ``.seq``, ``.subject`` and ``.message``;
        ``.resume_seq`` is where to start again after a restart of your program."""
        from revenant.client.events import EventStream  # JetStream's API: only for a program that reads events

        return EventStream(self, since, jobs, kinds, follow)


class _Connecting:
    """``Client.connect(...)``: awaitable, and an async context manager that closes the client."""

    def __init__(self, cls: type[Client], cluster_dir, nats, creds, timeout, name, reconnect) -> None:
        self._args = (cls, cluster_dir, nats, creds, timeout, name, reconnect)
        self._client: Client | None = None

    async def _open(self) -> Client:
        cls, cluster_dir, nats, creds, timeout, name, reconnect = self._args
        try:
            url = resolve_nats_url(cluster_dir, nats)
            # An explicit credential, "" included (none: an open bus), is taken as it is.
            creds_file = resolve_creds(cluster_dir, None) if creds is None else creds
            nc = await bus.connect(url, name, **security.client_credentials(creds_file), endless_reconnect=reconnect,
                                   connect_timeout_s=min(timeout, 5.0))
        except RevenantError as exc:
            raise ClientError.of(exc) from None
        try:
            return cls(nc, creds_file, timeout)
        except RevenantError as exc:
            await nc.close()
            raise ClientError.of(exc) from None

    def __await__(self):
        return self._open().__await__()

    async def __aenter__(self) -> Client:
        self._client = await self._open()
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()
