"""Agents' reports of epochs, applied to the job's record (pure, like :mod:`.lifecycle`, whose
transition function dispatches to these): an older epoch turned into a delta, and the epoch a
vacate or a drain stopped the job at."""

from __future__ import annotations

import msgspec

from revenant.common import retention
from revenant.coordinator.table.job_inputs import Decision, EpochConverted
from revenant.messages import EpochInfo, JobEvent, JobRecord


def epoch_converted(rec: JobRecord, inp: EpochConverted, now: float) -> Decision:
    ev = inp.event  # own bytes in ev.bytes; a listing a later checkpoint replaced is fresher
    epochs = [msgspec.structs.replace(e, own_bytes=ev.bytes, incremental=True) if e.n == ev.n else e
              for e in rec.epochs]
    epochs = [msgspec.structs.replace(e, plain_bytes=where[0], packed_bytes=where[1], newer_bytes=where[2])
              if len(where := ev.placement.get(e.n, [])) == 3 else e for e in epochs]
    if ev.at < rec.last_checkpoint_at or (epochs == rec.epochs and ev.storage_bytes in (0, rec.storage_bytes)):
        return Decision()
    return Decision(msgspec.structs.replace(rec, epochs=epochs, storage_bytes=ev.storage_bytes or rec.storage_bytes))


def with_reported_epoch(rec: JobRecord, ev: JobEvent) -> JobRecord:
    """``rec`` with the epoch a ``vacated`` or ``evicted`` event names listed (its reply may never
    come: a drain has none); the job's GPUs become that epoch's when it is the newest."""
    if ev.epoch is None or any(e.n == ev.epoch for e in rec.epochs):
        return rec
    epoch = EpochInfo(n=ev.epoch, created_at=ev.at, node=ev.node, generation=ev.generation, gpus=list(ev.gpus),
                      gpu_driver=ev.gpu_driver)
    changes: dict = {"epochs": retention.kept(rec.epochs + [epoch], rec.spec.max_epochs)}
    if all(e.n < ev.epoch for e in rec.epochs):
        changes.update(gpus=list(ev.gpus), gpu_driver=ev.gpu_driver if ev.gpus else "")
    return msgspec.structs.replace(rec, **changes)
