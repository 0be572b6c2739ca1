"""A small synchronous facade for scripts: the same verbs, each call run to its end on a loop of
the facade's own (``SyncClient.connect(...)`` takes what :meth:`Client.connect` takes)."""

from __future__ import annotations

import asyncio
from typing import Any

from revenant.client.client import Client
from revenant.messages import JobRecord, NodeStatus


class SyncClient:
    """``with SyncClient.connect(cluster_dir="/tmp/rv") as rv: job = rv.submit(["python3", "train.py"])``"""

    def __init__(self, loop: asyncio.AbstractEventLoop, client: Client) -> None:
        self._loop, self._client = loop, client

    @classmethod
    def connect(cls, *args: Any, **kw: Any) -> "SyncClient":
        loop = asyncio.new_event_loop()
        try:
            client = loop.run_until_complete(Client.connect(*args, **kw))
        except BaseException:
            loop.close()
            raise
        return cls(loop, client)

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self._client.close())
            self._loop.close()

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, argv: list[str], **kw: Any) -> JobRecord:
        return self._run(self._client.submit(argv, **kw))

    def job(self, job: str) -> JobRecord:
        return self._run(self._client.job(job))

    def jobs(self) -> list[JobRecord]:
        async def every() -> list[JobRecord]:
            return [rec async for rec in self._client.jobs()]
        return self._run(every())

    def nodes(self) -> list[NodeStatus]:
        return self._run(self._client.nodes())

    def checkpoint(self, job: str, **kw: Any):
        return self._run(self._client.checkpoint(job, **kw))

    def vacate(self, job: str, **kw: Any):
        return self._run(self._client.vacate(job, **kw))

    def restart(self, job: str, **kw: Any):
        return self._run(self._client.restart(job, **kw))

    def cancel(self, job: str, **kw: Any):
        return self._run(self._client.cancel(job, **kw))

    def signal(self, job: str, signal: str, **kw: Any):
        return self._run(self._client.signal(job, signal, **kw))

    def purge(self, job: str, **kw: Any):
        return self._run(self._client.purge(job, **kw))
