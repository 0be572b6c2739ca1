"""Agents' epoch events, applied to the job's record (pure, like :mod:`.lifecycle`, whose
transition function dispatches to these): an older epoch turned into a delta."""

from __future__ import annotations

import msgspec

from revenant.coordinator.job_inputs import Decision, EpochConverted
from revenant.messages import JobRecord


def epoch_converted(rec: JobRecord, inp: EpochConverted, now: float) -> Decision:
    ev = inp.event  # own bytes in ev.bytes; a listing a later checkpoint replaced is fresher
    epochs = [msgspec.structs.replace(e, own_bytes=ev.bytes, incremental=True) if e.n == ev.n else e
              for e in rec.epochs]
    if ev.at < rec.last_checkpoint_at or (epochs == rec.epochs and ev.storage_bytes in (0, rec.storage_bytes)):
        return Decision()
    return Decision(msgspec.structs.replace(rec, epochs=epochs, storage_bytes=ev.storage_bytes or rec.storage_bytes))
