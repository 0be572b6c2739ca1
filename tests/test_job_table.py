"""The coordinator's job table against a real JetStream KV: how agents' job events
change records, whatever order they arrive in relative to the replies."""

from __future__ import annotations

import nats
import pytest

from revenant.common import bus
from revenant.common.config import CoordinatorConfig
from revenant.common.events import EventPublisher
from revenant.coordinator.jobs import JobService
from revenant.messages import EpochInfo, JobEvent, JobRecord, JobSpec


@pytest.fixture
async def table(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.ensure_event_stream(js)
    service = JobService(nc, js, CoordinatorConfig(nats_url=nats_url), EventPublisher(js), lambda: [])
    await service.open()
    yield service
    await nc.close()


async def put(table: JobService, state: str, generation: int, node: str, epochs: list[int] = ()) -> JobRecord:
    rec = JobRecord(spec=JobSpec(id="1", argv=["true"], max_epochs=2), state=state, generation=generation, node=node,
                    pid=4242, epochs=[EpochInfo(n=n) for n in epochs])
    await table._save(rec)
    return rec


def event(kind: str, generation: int, node: str, **kw) -> JobEvent:
    return JobEvent(job="1", kind=kind, at=1000.0, node=node, generation=generation, **kw)


async def test_a_vacate_whose_reply_was_lost_is_applied_from_its_event(table):
    await put(table, "checkpointing", 2, "node-1", epochs=[1])
    await table.apply_event(event("vacated", 1, "node-1", epoch=2))  # an older generation's: ignored
    assert table.get("1").state == "checkpointing"
    await table.apply_event(event("vacated", 2, "node-1", epoch=2))
    rec = table.get("1")
    assert (rec.state, rec.node, rec.pid, [e.n for e in rec.epochs]) == ("vacated", "", 0, [1, 2])
    # The reply arriving after it changes nothing: the record stays vacated.
    await table.apply_event(event("vacated", 2, "node-1", epoch=2))
    assert table.get("1").state == "vacated"


async def test_an_exit_during_a_restore_is_not_lost(table):
    await put(table, "restoring", 3, "node-2", epochs=[1])
    await table.apply_event(event("exited", 3, "node-1", exit_code=0))  # another node's copy: ignored
    assert table.get("1").state == "restoring"
    await table.apply_event(event("exited", 3, "node-2", exit_code=0))
    rec = table.get("1")
    assert (rec.state, rec.exit_code, rec.pid) == ("completed", 0, 0)


async def test_a_checkpoint_abandoned_by_a_dead_leader_lets_the_job_run_on(table):
    await put(table, "checkpointing", 2, "node-1")
    await table.checkpoint_abandoned("1", 1)  # another generation: not ours to touch
    assert table.get("1").state == "checkpointing"
    await table.checkpoint_abandoned("1", 2)
    assert table.get("1").state == "running"
    # ... and the table in the store says so too (a later leader reads it).
    again = JobService(table.nc, table.js, table.config, table.events, lambda: [])
    await again.open()
    assert again.get("1").state == "running"
