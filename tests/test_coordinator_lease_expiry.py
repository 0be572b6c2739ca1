"""Failover's wait for a dead node's lease, against a real JetStream KV."""

from __future__ import annotations

import asyncio
import time

import pytest

from helpers import connect_as
from revenant.common.settings import security
from revenant.common.settings.config import CoordinatorConfig
from revenant.messages import subjects

pytestmark = pytest.mark.nats


async def test_lease_expiry_is_read_from_the_store_only_when_needed(nats_url):
    import msgspec

    from revenant.common.messaging.kv import open_bucket
    from revenant.messages import LeaseValue
    from revenant.coordinator.recovery.failover import Failover

    # The failover reads the leases as the coordinator; the test renews them in the agents' stead.
    nc = await connect_as(nats_url, security.COORDINATOR)
    js = nc.jetstream()
    cfg = CoordinatorConfig(nats_url=nats_url, lease_ttl_s=0.6, lease_margin_s=0.1)
    fo = Failover(cfg, js, None, None, lambda: [], lambda node: None)
    kv = await open_bucket(js, subjects.LEASES_BUCKET, cfg.lease_ttl_s)

    async def renew(node, inc):
        await kv.put(node, msgspec.msgpack.encode(LeaseValue(node=node, incarnation=inc, seq=1, at=time.time())))

    assert await fo.read_lease("ghost") is None
    assert await fo.wait_for_lease_expiry("1", "ghost", "x")  # no lease at all: nothing to wait for

    await renew("n1", "a")
    started = time.monotonic()
    assert await fo.wait_for_lease_expiry("1", "n1", "a")
    assert time.monotonic() - started >= 0.6  # ttl + margin after the renewal, less the read

    await renew("n2", "a")
    waiter = asyncio.create_task(fo.wait_for_lease_expiry("1", "n2", "a"))
    await asyncio.sleep(0.3)
    await renew("n2", "a")  # the agent is alive after all
    assert await waiter is False

    await renew("n3", "b")  # a restarted agent holds the lease: the old incarnation's is gone
    started = time.monotonic()
    assert await fo.wait_for_lease_expiry("1", "n3", "a")
    assert time.monotonic() - started < 0.3
    await nc.close()
