"""Which epochs a job keeps: one rule, used by the agent (which deletes epoch directories)
and by the coordinator (which lists a job's epochs in the job table).

Pure: numbers in, numbers out.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def kept(epochs: Sequence[T], max_epochs: int) -> list[T]:
    """The newest ``max_epochs`` of ``epochs`` (oldest first; at least one is always kept)."""
    return list(epochs[-max(1, max_epochs):]) if epochs else []


def epochs_to_prune(epochs: Sequence[T], max_epochs: int) -> list[T]:
    """The epochs retention deletes: all but the newest ``max_epochs`` (oldest first)."""
    return list(epochs[:-max(1, max_epochs)]) if epochs else []
