"""Checkpoint bookkeeping around the engine: epoch events, metrics, retention, the failure count.

The engine makes epochs; this records what happened to them.  A checkpoint that
failed is an ``epoch_event.v1 failed`` (with criu's own error line) and counts
towards the node's health (``checkpoint_failures``, reset by the next success); one
that committed is ``created``, and the epochs retention then deletes are ``pruned``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Mapping, Sequence

from revenant.agent.storage.epochs import JobFiles, Manifest
from revenant.common.serving.metrics import AgentMetrics
from revenant.messages import EpochEvent, EpochInfo, Message, subjects


# Why a checkpoint is taken, for its epoch event: {"cause": ..., "reasons": [...]} (CheckpointJob's).
Why = Mapping[str, Any]


class CheckpointBook:
    def __init__(self, node: str, emit: Callable[[str, Message], None], metrics: AgentMetrics | None = None,
                 wall_clock: Callable[[], float] = time.time, owner: Callable[[str], str] = lambda job: "") -> None:
        self.node = node
        self.emit = emit
        self.owner = owner  # a job's user, for its events' subjects
        self.metrics = metrics
        self.wall_clock = wall_clock
        # Checkpoints (of any job) that failed in a row: the health rules read it.
        self.failures = 0

    def _epoch_event(self, job: str, kind: str, generation: int, **kw) -> None:
        self.emit(subjects.epoch_event(job, kind, self.node, user=self.owner(job)),
                  EpochEvent(job=job, kind=kind, at=self.wall_clock(), node=self.node, generation=generation, **kw))

    def failed(self, job: str, generation: int, error: Exception, cause: str = "", reasons: Sequence[str] = ()) -> None:
        # A job criu cannot carry (agent/pipeline/blockers.py), or one that failed its checkpoint by
        # itself (its working directory over the budget, say: JobCaused), says nothing of the node.
        if getattr(error, "code", "") != "not_checkpointable" and not getattr(error, "job_caused", False):
            self.failures += 1
        if self.metrics is not None:
            self.metrics.observe_checkpoint(ok=False, duration_s=0.0)
        self._epoch_event(job, "failed", generation, error=str(error), cause=cause, reasons=list(reasons))

    async def committed(self, files: JobFiles, generation: int, manifest: Manifest, max_epochs: int,
                        cause: str = "", reasons: Sequence[str] = ()) -> tuple[EpochInfo, list[int]]:
        """Record a committed epoch, then apply retention (at least one epoch is kept); the
        epoch's info and the numbers retention deleted."""
        self.failures = 0
        info = files.info(manifest)
        if self.metrics is not None:
            self.metrics.observe_checkpoint(ok=True, duration_s=manifest.dump_s, freeze_s=manifest.freeze_s,
                                            size_bytes=info.bytes)
        self._epoch_event(files.job, "created", generation, n=manifest.epoch, bytes=info.bytes,
                          freeze_s=manifest.freeze_s, duration_s=manifest.dump_s, gpus=manifest.gpus,
                          gpu_driver=manifest.gpu_driver, cause=cause, reasons=list(reasons))
        # The new epoch's checksums were taken as it was written: it is not read again.
        pruned = await asyncio.to_thread(files.prune, max(1, max_epochs), {manifest.epoch})
        for n in pruned:
            self._epoch_event(files.job, "pruned", generation, n=n)
        return info, pruned
