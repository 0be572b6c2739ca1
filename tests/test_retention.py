"""The shared retention rule (common/retention.py), pure, and the agent's pruning that uses it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from revenant.common.retention import epochs_to_prune, kept

pytestmark = pytest.mark.unit

epoch_lists = st.lists(st.integers(min_value=1, max_value=10**6), unique=True, max_size=40).map(sorted)


@pytest.mark.parametrize(
    "epochs, keep, pruned",
    [
        ([], 3, []),
        ([1], 3, []),
        ([1, 2, 3], 3, []),
        ([1, 2, 3, 4], 3, [1]),
        ([1, 2, 5, 9, 12], 2, [1, 2, 5]),
        ([4, 7], 1, [4]),
        ([4, 7], 0, [4]),  # at least one epoch is always kept
        ([4, 7], -5, [4]),
    ],
)
def test_all_but_the_newest_keep_are_pruned(epochs, keep, pruned):
    assert epochs_to_prune(epochs, keep) == pruned
    assert kept(epochs, keep) == [n for n in epochs if n not in pruned]


@given(epoch_lists, st.integers(min_value=1, max_value=50))
def test_kept_and_pruned_split_the_epochs_and_keep_the_newest(epochs, keep):
    pruned, left = epochs_to_prune(epochs, keep), kept(epochs, keep)
    assert pruned + left == epochs
    assert len(left) == min(len(epochs), keep)
    if epochs:
        assert epochs[-1] in left
    assert all(p < k for p in pruned for k in left)


@given(epoch_lists, st.integers(min_value=1, max_value=50))
def test_the_rule_is_the_one_the_agent_always_applied(epochs, keep):
    """Before the rule was shared, the agent pruned ``committed()[:-keep]`` with keep >= 1."""
    assert epochs_to_prune(epochs, keep) == epochs[:-keep]


def test_the_agent_prunes_epoch_directories_by_the_rule(tmp_path):
    from revenant.agent.storage.epochs import MANIFEST, JobFiles

    files = JobFiles(tmp_path, "7")
    for n in (1, 2, 3, 5, 8):
        (files.epoch_dir(n)).mkdir(parents=True)
        (files.epoch_dir(n) / MANIFEST).write_text("{}")
    assert files.prune(2) == epochs_to_prune([1, 2, 3, 5, 8], 2) == [1, 2, 3]
    assert files.committed() == kept([1, 2, 3, 5, 8], 2) == [5, 8]
    assert files.prune(0) == [] and files.committed() == [5, 8]  # keep < 1: the agent deletes nothing
