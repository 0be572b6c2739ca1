"""The working directory's larger files stored as pages in packs (agent/files/workdir_packs.py): an epoch
adds only the pages that changed, an unchanged file keeps its runs, a segment starts afresh,
verification names the pack and page at fault, retention and gc keep exactly what a kept epoch
reads, a failed checkpoint leaves no pack, and a restore puts every file back byte for byte."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest

from revenant.agent.files import workdir, workdir_restore
from revenant.agent.files.aside import move_aside
from revenant.agent.files.filestep import prepare_workdir
from revenant.agent.files.jobfiles import scan_workdir
from revenant.agent.storage import packs
from revenant.agent.storage.chain import DIGEST, PAGE, pack_path
from revenant.agent.storage.epochs import LISTING, CorruptEpoch, FileEntry, JobFiles, Manifest

pytestmark = pytest.mark.unit

MIB = 2**20


def make_workdir(tmp_path: Path) -> Path:
    wd = tmp_path / "wd"
    (wd / "base" / "5").mkdir(parents=True)
    (wd / "base" / "5" / "16384").write_bytes(os.urandom(MIB))  # a relation file: packed
    (wd / "model.ckpt").write_bytes(os.urandom(300_001))  # not a whole number of pages: packed
    (wd / "zeros.bin").write_bytes(bytes(256 * 1024))  # 64 equal pages: one stored
    (wd / "small.txt").write_bytes(b"s" * 1000)  # under PACK_MIN: a whole copy
    os.link(wd / "model.ckpt", wd / "model.link")  # a second link: one record's runs
    return wd


def checkpoint(files: JobFiles, wd: Path, full_every: int = 10, gate: bool = True,
               held: frozenset[str] = frozenset()) -> Manifest:
    """What agent/files/filestep.py and the engine do for the working directory around one dump."""
    prev, packer = prepare_workdir(files, str(wd), full_every)
    tmp = files.new_tmp("n1")
    (tmp / "pages-1.img").write_bytes(b"p" * PAGE)
    stats: dict[str, os.stat_result] = {}
    (tmp / LISTING).write_bytes(msgspec.json.encode(scan_workdir(str(wd), 1000, stats=stats)))
    taken = workdir.Taker(str(wd), tmp, tmp, prev, None, 2**30, gate, racy_ns=(0, 0), packer=packer).take(stats, held)
    workdir.finish(taken)
    m = Manifest(job="1", epoch=0, generation=1, node="n1", created_at=0, criu_version="4.2.1", kernel="k",
                 workdir=str(wd), workdir_files=len(taken.files), workdir_copied=taken.copied,
                 workdir_linked=taken.linked, workdir_packs=taken.table)
    m.files = {n: FileEntry(size=size, checksum=crc) for n, (size, crc) in taken.known.items()}
    return files.commit(tmp, m)


def contents(wd: Path) -> dict[str, bytes]:
    return {str(p.relative_to(wd)): p.read_bytes() for p in sorted(wd.rglob("*"))
            if p.is_file() and not str(p.relative_to(wd)).startswith("revenant-after-epoch-")}


def restore(files: JobFiles, m: Manifest, on_step=None) -> list[str]:
    d = files.epoch_dir(m.epoch)
    files.verify(m.epoch)
    snap = workdir.read(d)
    notes = move_aside(m, d, 1000, snapshot=frozenset(snap))
    plan = workdir_restore.plan(m, d, snap, files)
    return notes + (workdir_restore.apply(plan, on_step) if on_step else workdir_restore.apply(plan))


def pages_of(files: JobFiles, ref: str) -> int:
    return pack_path(files, ref).stat().st_size // PAGE


def test_an_epoch_adds_only_the_pages_that_changed_and_restores_every_byte(tmp_path):
    files = JobFiles(tmp_path / "storage", "1")
    wd = make_workdir(tmp_path)
    m1 = checkpoint(files, wd)
    snap = workdir.read(files.epoch_dir(1))
    assert [r.runs is not None for r in (snap["base/5/16384"], snap["model.ckpt"], snap["small.txt"])] == \
        [True, True, False]
    assert snap["model.link"].runs == snap["model.ckpt"].runs and snap["model.link"].crc == snap["model.ckpt"].crc
    [ref1] = m1.workdir_packs
    assert pages_of(files, ref1) == 256 + 74 + 1  # the zeros once, the links' inode once
    assert m1.workdir_copied == (256 + 74 + 1) * (PAGE + DIGEST) + 4 + 1000
    at_epoch1 = contents(wd)
    rel = wd / "base" / "5" / "16384"
    ino = rel.stat().st_ino
    with open(rel, "r+b") as f:  # 3 pages of 256 rewritten, the file closed again
        for page in (7, 100, 255):
            f.seek(page * PAGE)
            f.write(os.urandom(PAGE))
    at_epoch2 = contents(wd)
    m2 = checkpoint(files, wd)
    assert m2.workdir_packs[0] == ref1 and len(m2.workdir_packs) == 2
    assert pages_of(files, m2.workdir_packs[1]) == 3
    assert m2.workdir_copied == 3 * (PAGE + DIGEST) + 4
    assert m2.workdir_linked == 300_001 + 256 * 1024 + 1000  # model.ckpt, zeros.bin, small.txt unchanged
    storage, own = packs.usage(files)
    assert own[2] < 4 * (PAGE + DIGEST) + 50_000  # its three pages, its files and manifest
    with open(rel, "r+b") as f:
        f.write(b"after epoch 2")
    (wd / "model.ckpt").write_bytes(b"replaced")  # same inode, new size
    notes = restore(files, m1)
    assert contents(wd) == at_epoch1 and rel.stat().st_ino == ino
    assert any("put back 3 of the 5 files" in n for n in notes), notes  # 16384 and both links of model.ckpt
    restore(files, m2)
    assert contents(wd) == at_epoch2


def test_a_new_segment_stores_every_page_again_and_reads_no_older_pack(tmp_path):
    files = JobFiles(tmp_path / "storage", "1")
    wd = make_workdir(tmp_path)
    m1 = checkpoint(files, wd, full_every=2)
    m2 = checkpoint(files, wd, full_every=2)
    assert m2.workdir_packs == m1.workdir_packs and m2.workdir_copied == 0  # nothing changed
    m3 = checkpoint(files, wd, full_every=2)  # epoch 3: segment 1
    assert [ref.split("/")[0] for ref in m3.workdir_packs] == ["1"]
    assert pages_of(files, m3.workdir_packs[0]) == 256 + 74 + 1
    assert m3.workdir_linked == 1000  # only the whole copy is linked across segments


def test_verification_names_the_pack_and_page_and_a_restore_falls_back(tmp_path):
    files = JobFiles(tmp_path / "storage", "1")
    wd = make_workdir(tmp_path)
    m1 = checkpoint(files, wd)
    (wd / "small.txt").write_bytes(b"t" * 1000)
    m2 = checkpoint(files, wd)
    with open(pack_path(files, m1.workdir_packs[0]), "r+b") as f:  # page 5 of 16384, which epoch 2 reads too
        f.seek(5 * PAGE)
        f.write(b"rot")
    for n in (1, 2):
        with pytest.raises(CorruptEpoch, match=rf"epoch {n}: the working directory's base/5/16384 rebuilt from "
                                               rf"its packs fails its checksum: page 5 of pack {m1.workdir_packs[0]}"):
            files.verify(n)
    assert m2.workdir_packs == m1.workdir_packs
    pack_path(files, m1.workdir_packs[0]).unlink()
    with pytest.raises(CorruptEpoch, match="is unreadable"):
        files.verify(2)


def test_retention_and_gc_keep_exactly_the_packs_a_kept_epoch_reads(tmp_path):
    files = JobFiles(tmp_path / "storage", "1")
    wd = make_workdir(tmp_path)
    refs = []
    for k in range(3):
        (wd / "model.ckpt").write_bytes(os.urandom(300_001))  # every epoch: a new model, the rest unchanged
        refs.append(checkpoint(files, wd).workdir_packs)
    assert len(refs[2]) == 2  # epoch 1's pack (the relation file), epoch 3's (the model)
    # A checkpoint under way: its pack is named for the next epoch, which is not committed yet.
    _, packer = prepare_workdir(files, str(wd), 10)
    (wd / "model.ckpt").write_bytes(os.urandom(300_001))
    src = os.open(wd / "model.ckpt", os.O_RDONLY)
    packer.pack(src, "files/w0")
    os.close(src)
    assert packer.close()
    assert files.prune(1) == [1, 2]
    packs.gc(files)
    kept = {f"{seg.name}/{p.stem}" for seg in files.packs_dir.iterdir() for p in seg.glob("*.pack")}
    assert kept == {*refs[2], packer.ref}
    files.verify(3)
    assert packs.usage(files)[0] > 0
    packer.discard()  # the checkpoint failed: its pack goes
    assert not pack_path(files, packer.ref).exists() and not pack_path(files, packer.ref, ".idx").exists()


def test_a_put_back_of_packed_files_killed_at_each_step_is_completed_by_the_next_restore(tmp_path):
    from tests.test_workdir import killed_at

    files = JobFiles(tmp_path / "storage", "1")
    wd = make_workdir(tmp_path)
    m = checkpoint(files, wd)
    at_epoch = contents(wd)
    steps = 0
    while True:
        for p in (wd / "base" / "5" / "16384", wd / "model.ckpt", wd / "zeros.bin"):
            with open(p, "r+b") as f:
                f.write(os.urandom(64))
        killed = killed_at(steps, lambda stop: restore(files, m, stop))
        restore(files, m)
        assert contents(wd) == at_epoch
        if not killed:
            break
        steps += 1
    assert steps == 4  # 16384, model.ckpt, model.link (another path to it), zeros.bin


def test_a_file_gone_since_is_made_again_from_its_pages(tmp_path):
    files = JobFiles(tmp_path / "storage", "1")
    wd = make_workdir(tmp_path)
    m = checkpoint(files, wd)
    at_epoch = contents(wd)
    shutil.rmtree(wd / "base")
    (wd / "model.ckpt").unlink()
    restore(files, m)
    assert contents(wd) == at_epoch


@pytest.mark.parametrize("how", ["held", "no gate"])
def test_a_file_copied_while_frozen_is_packed_from_its_copy_once_the_job_runs(tmp_path, how):
    files = JobFiles(tmp_path / "storage", "1")
    wd = make_workdir(tmp_path)
    rel = wd / "base" / "5" / "16384"
    held = frozenset({str(rel.relative_to(wd))}) if how == "held" else frozenset()
    m1 = checkpoint(files, wd, gate=how != "no gate", held=held)
    at_epoch1 = contents(wd)
    with open(rel, "r+b") as f:
        f.seek(9 * PAGE)
        f.write(os.urandom(PAGE))
    m2 = checkpoint(files, wd, gate=how != "no gate", held=held)
    snap = workdir.read(files.epoch_dir(2))
    assert snap["base/5/16384"].runs is not None
    assert pages_of(files, m2.workdir_packs[-1]) == 1  # the page that changed, from the whole copy
    whole = {p.name for p in (files.epoch_dir(2) / "files").iterdir()}
    assert whole == {snap["small.txt"].copy.split("/")[1]}  # the frozen copy went once packed
    restore(files, m1)
    assert contents(wd) == at_epoch1
