"""Retention with corrupted epochs: those that fail verification go first, and the newest epoch
that verifies is never deleted.  The rule (common/retention.py) as properties, and the agent's
pruning of real epoch directories (committed by JobFiles.commit, then corrupted), without criu."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from revenant.agent.storage.epochs import JobFiles, Manifest
from revenant.common.retention import epochs_to_prune, kept

pytestmark = pytest.mark.unit


@st.composite
def epochs_and_corrupt(draw):
    epochs = sorted(draw(st.lists(st.integers(1, 10**6), unique=True, max_size=30)))
    corrupt = set(draw(st.lists(st.sampled_from(epochs), unique=True))) if epochs else set()
    return epochs, corrupt


@given(epochs_and_corrupt(), st.integers(-2, 12))
def test_the_rule_with_corrupt_epochs(case, max_epochs):
    epochs, corrupt = case
    asked: list[int] = []

    def verifies(n: int) -> bool:
        asked.append(n)
        return n not in corrupt

    pruned = epochs_to_prune(epochs, max_epochs, verifies)
    left = kept(epochs, max_epochs, lambda n: n not in corrupt)
    keep = max(1, max_epochs)
    # A split of the epochs, oldest first, down to the limit (and nothing while within it).
    assert sorted(pruned + left) == epochs and pruned == sorted(pruned) and left == sorted(left)
    assert len(left) == min(len(epochs), keep)
    good = [n for n in epochs if n not in corrupt]
    # The newest epoch that verifies is never deleted.
    if good:
        assert good[-1] in left
    # Corrupt ones go first: no verifying epoch is deleted while a corrupt one is kept ...
    if any(n not in corrupt for n in pruned):
        assert all(n not in corrupt for n in left)
    # ... and among each kind the oldest go first.
    for kind in (set(good), corrupt):
        assert all(p < k for p in pruned if p in kind for k in left if k in kind)
    # Verification is asked only when something must go, newest first, each epoch once.
    assert asked == [] if len(epochs) <= keep else asked == sorted(asked, reverse=True)
    assert len(set(asked)) == len(asked)


@given(st.lists(st.integers(1, 10**6), unique=True, max_size=30).map(sorted), st.integers(1, 12))
def test_without_corruption_the_rule_is_the_one_before(epochs, keep):
    assert epochs_to_prune(epochs, keep, lambda n: True) == epochs_to_prune(epochs, keep) == epochs[:-keep]


@pytest.mark.parametrize("epochs, corrupt, keep, pruned", [
    ([2, 3, 4, 5], {3, 4}, 3, [3]),             # issue 9: a vacate pruned the good 2, kept the bad 3 and 4
    ([1, 2, 3, 4], {2, 3, 4}, 2, [2, 3]),       # only the oldest verifies: it stays
    ([1, 2, 3, 4], {4}, 3, [4]),                # a corrupt newest goes before any that verifies
    ([1, 2, 3, 4], {1, 2, 3, 4}, 3, [1]),       # nothing verifies: the oldest goes, as before
    ([1, 2, 3, 4], set(), 1, [1, 2, 3]),
])
def test_examples(epochs, corrupt, keep, pruned):
    assert epochs_to_prune(epochs, keep, lambda n: n not in corrupt) == pruned


# ------------------------------------------------------------------ the agent's epoch directories


def commit(files: JobFiles, payload: bytes) -> int:
    tmp = files.new_tmp("node-1")
    (tmp / "pages-1.img").write_bytes(payload)
    (tmp / "core-1.img").write_bytes(b"core" + payload[:16])
    m = Manifest(job=files.job, epoch=0, generation=1, node="node-1", created_at=0.0, criu_version="4.1.1",
                 kernel="test")
    return files.commit(tmp, m).epoch


def corrupt(files: JobFiles, n: int) -> None:
    path = files.epoch_dir(n) / "pages-1.img"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, wrong checksum
    path.write_bytes(bytes(data))


def test_a_vacate_with_corrupted_epochs_keeps_the_good_one(tmp_path):
    """Issue 9, finding 8: with --max-epochs 3, after epochs 3 and 4 were corrupted, the vacate's
    epoch 5 pruned the good epoch 2 and kept the bad 3 and 4."""
    files = JobFiles(tmp_path, "7")
    for i in range(4):
        commit(files, bytes([i]) * 4096)
    assert files.prune(3) == [1]
    corrupt(files, 3)
    corrupt(files, 4)
    assert commit(files, b"\x05" * 4096) == 5  # the vacate's epoch
    assert files.prune(3) == [3]
    assert files.committed() == [2, 4, 5]
    corrupt(files, 5)
    assert commit(files, b"\x06" * 4096) == 6
    assert files.prune(3) == [4]  # the corrupt ones go first, oldest first
    assert files.committed() == [2, 5, 6]
    # What a restore would use is still there.
    assert files.newest_verified()[0].epoch == 6


def test_the_newest_epoch_that_verifies_survives_when_every_newer_one_is_corrupt(tmp_path):
    files = JobFiles(tmp_path, "8")
    for i in range(4):
        commit(files, bytes([i]) * 4096)
    for n in (2, 3, 4):
        corrupt(files, n)
    assert files.prune(2) == [2, 3]
    assert files.committed() == [1, 4]
    manifest, notes = files.newest_verified()
    assert manifest.epoch == 1 and "epoch 4" in notes[0]
    assert files.prune(0) == [] and files.prune(5) == []  # keep < 1, or within the limit: nothing


def test_an_epoch_known_to_verify_is_not_read_again(tmp_path):
    """The epoch just committed was checksummed as it was written: with --max-epochs 1 a prune
    reads nothing (an epoch said to verify is kept even if it was corrupted since)."""
    files = JobFiles(tmp_path, "9")
    commit(files, b"\x01" * 4096)
    newest = commit(files, b"\x02" * 4096)
    corrupt(files, newest)  # not read, so not noticed
    assert files.prune(1, verified={newest}) == [1]
    assert files.committed() == [newest]
