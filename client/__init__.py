"""revenant's Python client: what programs that drive a cluster build on.

    from revenant.client import Client

    async with Client.connect(cluster_dir="/tmp/rv") as rv:      # or nats=..., creds=...
        job = await rv.submit(["python3", "train.py"], checkpoint="30:00")
        await rv.checkpoint(job.spec.id)
        async for ev in rv.events(jobs=[job.spec.id], kinds=["restored"]):
            print(ev.seq, ev.message)

It finds the cluster as the CLI does (``--dir``, ``$REVENANT_NATS``, ``$REVENANT_CREDS``), asks
as its credential's identity (admin, or a user who sees their own jobs only), knows the subjects,
the inbox prefix and the request ids, and raises :class:`ClientError` (the protocol's ``code``
and ``retriable``) for whatever the cluster or the bus answered instead.  :class:`SyncClient` is
the same for scripts, without asyncio.  The CLI is built on it.  docs/client.md has examples."""

from revenant.client.client import Client, Failover
from revenant.client.errors import ClientError
from revenant.client.events import Event, EventStream
from revenant.client.sync import SyncClient
from revenant.messages import JobRecord, JobReply, NodeStatus, Progress

__all__ = ["Client", "ClientError", "Event", "EventStream", "Failover", "JobRecord", "JobReply", "NodeStatus",
           "Progress", "SyncClient"]
