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
the same for scripts, without asyncio; :func:`ask_once` asks one thing and returns, without even
starting the NATS client library where it can.  The CLI is built on it.  docs/client.md has examples."""

from revenant.client.errors import ClientError
from revenant.client.once import ask_once
from revenant.messages import JobRecord, JobReply, NodeStatus, Progress

# Imported when first used: the NATS client library (and JetStream's API, for events) is most of
# a one-shot command's start, and ask_once does without it.
_LAZY = {"Client": "client", "Failover": "client", "SyncClient": "sync", "Event": "events", "EventStream": "events"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"revenant.client.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'revenant.client' has no attribute {name!r}")


__all__ = ["Client", "ClientError", "Event", "EventStream", "Failover", "JobRecord", "JobReply", "NodeStatus",
           "Progress", "SyncClient", "ask_once"]
