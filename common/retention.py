"""Which epochs a job keeps: one rule, used by the agent (which deletes epoch directories)
and by the coordinator (which lists a job's epochs in the job table).

Pure: numbers in, numbers out.  The rule, for a job allowed ``max_epochs`` (at least one):

* nothing is deleted while there are no more than ``max_epochs``;
* beyond that, epochs that fail verification go first (oldest first), then the oldest
  that verify;
* the newest epoch that verifies is never deleted: it is what a restore would use.

Whether an epoch verifies is asked through ``verifies`` (the agent checks checksums; the
coordinator, which cannot, leaves it out: every epoch verifies), newest first and only
while the answer can change what is kept: once ``max_epochs`` epochs that verify are
found, every older one goes without being read.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def _split(epochs: Sequence[T], max_epochs: int, verifies: Callable[[T], bool] | None) -> tuple[list[T], list[T]]:
    """(pruned, kept), each oldest first."""
    keep = max(1, max_epochs)
    if len(epochs) <= keep:
        return [], list(epochs)
    if verifies is None:
        return list(epochs[:-keep]), list(epochs[-keep:])
    good: list[int] = []  # indices, newest first
    bad: list[int] = []
    for i in range(len(epochs) - 1, -1, -1):
        if len(good) == keep:
            break  # enough that verify: everything older goes, unread
        (good if verifies(epochs[i]) else bad).append(i)
    # Slots no verifying epoch fills keep the newest corrupt ones (nothing better exists).
    keepers = set(good + bad[:keep - len(good)])
    return ([e for i, e in enumerate(epochs) if i not in keepers],
            [e for i, e in enumerate(epochs) if i in keepers])


def kept(epochs: Sequence[T], max_epochs: int, verifies: Callable[[T], bool] | None = None) -> list[T]:
    """The epochs retention keeps (oldest first; at least one is always kept)."""
    return _split(epochs, max_epochs, verifies)[1]


def epochs_to_prune(epochs: Sequence[T], max_epochs: int, verifies: Callable[[T], bool] | None = None) -> list[T]:
    """The epochs retention deletes (oldest first): beyond ``max_epochs``, those that fail
    verification first; never the newest that verifies."""
    return _split(epochs, max_epochs, verifies)[0]
