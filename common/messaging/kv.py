"""JetStream key-value helpers shared by the agent and the coordinator."""

from __future__ import annotations

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from revenant.common.errors import BusError
from revenant.common.messaging.bus import map_exceptions, report_replicas


async def open_bucket(js: JetStreamContext, bucket: str, ttl_s: float | None, history: int = 1, *,
                      replicas: int = 1, owner: bool = False) -> KeyValue:
    """Create the bucket if missing, with ``replicas`` copies; use it as it is if it exists with
    other settings, except that its ``owner`` raises its replicas to ``replicas`` (see
    :func:`raise_replicas`)."""
    with map_exceptions(f"cannot open KV bucket {bucket}"):
        try:
            return await js.create_key_value(KeyValueConfig(bucket=bucket, ttl=ttl_s, history=history,
                                                            storage=StorageType.FILE, replicas=replicas))
        except nats.js.errors.BadRequestError as exc:
            try:  # it exists with other settings; or the create was refused for a reason of its own
                kv = await js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                raise BusError(f"cannot create KV bucket {bucket}: {exc.description or exc}") from None
    await raise_replicas(js, bucket, replicas, owner=owner)
    return kv


async def raise_replicas(js: JetStreamContext, bucket: str, replicas: int, *, owner: bool) -> None:
    """A bucket with fewer replicas than ``replicas`` is logged, naming both counts; its ``owner``
    (the coordinator, whose identity may update streams) raises them with a stream update, which
    keeps every other setting.  Never lowers them.  A bucket that does not exist is left alone."""
    stream = f"KV_{bucket}"
    with map_exceptions(f"cannot raise the replicas of KV bucket {bucket}"):
        try:
            info = await js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            return
        have = info.config.num_replicas or 1
        report_replicas(stream, have, replicas, owner)
        if owner and have < replicas:
            info.config.num_replicas = replicas
            await js.update_stream(info.config)
