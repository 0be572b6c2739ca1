"""The epoch store, pure files: atomic numbered epochs, verification and fallback, pruning, output rollback."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from revenant.agent.files.jobfiles_restore import apply, plan
from revenant.agent.storage.epochs import MANIFEST, CorruptEpoch, EpochError, FileEntry, JobFiles, Manifest, NoEpoch

pytestmark = pytest.mark.unit


def fake_epoch(files: JobFiles, staging: Path, payload: bytes, outputs: dict[str, int] | None = None) -> Manifest:
    staging.mkdir(parents=True, exist_ok=True)
    (staging / "pages-1.img").write_bytes(payload)
    (staging / "core-1.img").write_bytes(b"core")
    m = Manifest(job=files.job, epoch=0, generation=1, node="n1", created_at=time.time(), criu_version="4.1.1",
                 kernel="k", outputs=outputs or {})
    return files.commit(files.new_tmp("n1"), m, staging)


def test_commit_is_atomic_and_numbered(tmp_path):
    files = JobFiles(tmp_path, "7")
    assert files.committed() == [] and files.next_number() == 1
    m1 = fake_epoch(files, tmp_path / "s1", b"a" * 10000)
    m2 = fake_epoch(files, tmp_path / "s2", b"b" * 20000)
    assert (m1.epoch, m2.epoch) == (1, 2) and files.committed() == [1, 2]
    assert m2.files["pages-1.img"] == FileEntry(size=20000, checksum=m2.files["pages-1.img"].checksum)
    assert m2.checksum == "crc32" and len(m2.files["pages-1.img"].checksum) == 8
    # A half-written epoch (a crash mid-copy) is never listed, and a new agent cleans it.
    tmp = files.new_tmp("n1")
    (tmp / "pages-1.img").write_bytes(b"partial")
    assert files.committed() == [1, 2]
    assert files.next_number() == 3
    # A numbered directory without a manifest is not an epoch either.
    (files.epochs_dir / "9").mkdir()
    assert files.committed() == [1, 2]
    files.clean_stale_tmp("n1")
    assert not tmp.exists()


def test_verify_and_fallback(tmp_path):
    files = JobFiles(tmp_path, "7")
    fake_epoch(files, tmp_path / "s1", b"a" * 5000)
    fake_epoch(files, tmp_path / "s2", b"b" * 5000)
    m, notes = files.newest_verified()
    assert m.epoch == 2 and notes == []
    pages = files.epoch_dir(2) / "pages-1.img"
    pages.write_bytes(b"c" * 5000)  # same size, other bytes
    with pytest.raises(CorruptEpoch, match="checksum"):
        files.verify(2)
    m, notes = files.newest_verified()
    assert m.epoch == 1 and "epoch 2" in notes[0]
    (files.epoch_dir(1) / "core-1.img").unlink()
    with pytest.raises(NoEpoch, match="no epoch verifies"):
        files.newest_verified()
    (files.epoch_dir(2) / MANIFEST).write_text("{not json")
    with pytest.raises(CorruptEpoch, match="unreadable manifest"):
        files.verify(2)


def test_prune_keeps_the_newest_and_purge_frees_space(tmp_path):
    files = JobFiles(tmp_path, "7")
    for i in range(4):
        fake_epoch(files, tmp_path / f"s{i}", bytes([i]) * 1000)
    assert files.prune(2) == [1, 2]
    assert files.committed() == [3, 4]
    assert files.next_number() == 5  # numbers are never reused
    assert files.purge() >= 2 * 1004
    assert files.committed() == [] and not files.epochs_dir.exists()


def test_rollback_cuts_output_back_and_refuses_lost_data(tmp_path):
    out = tmp_path / "output.log"
    out.write_bytes(b"0123456789")
    m = Manifest(job="7", epoch=3, generation=1, node="n", created_at=0, criu_version="4.1.1", kernel="k",
                 outputs={str(out): 4})
    notes = apply(plan(m, tmp_path))
    assert out.read_bytes() == b"0123" and "6 bytes" in notes[0]
    assert apply(plan(m, tmp_path)) == []  # already at the right size
    m.outputs[str(out)] = 100
    with pytest.raises(EpochError, match="shorter than at the dump"):
        plan(m, tmp_path)


def test_a_node_cleans_only_its_own_half_written_epochs(tmp_path):
    files = JobFiles(tmp_path, "1")
    mine, other = files.new_tmp("n1"), files.new_tmp("n1-b")
    files.clean_stale_tmp("n1")
    assert not mine.exists() and other.exists()  # "n1-b" is another node, not one of n1's
