"""JetStream key-value helpers shared by the agent and the coordinator."""

from __future__ import annotations

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from revenant.common.bus import map_exceptions


async def open_bucket(js: JetStreamContext, bucket: str, ttl_s: float | None, history: int = 1) -> KeyValue:
    """Create the bucket if missing; use it as it is if it exists with other settings."""
    with map_exceptions(f"cannot open KV bucket {bucket}"):
        try:
            return await js.create_key_value(KeyValueConfig(bucket=bucket, ttl=ttl_s, history=history,
                                                            storage=StorageType.FILE))
        except nats.js.errors.BadRequestError:
            return await js.key_value(bucket)
