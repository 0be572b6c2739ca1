"""Reverse-incremental epochs on real files: conversion to packs and recipes, deduplication,
materialisation, verification and fallback, segments, gc, purge, and crashes at every step."""

from __future__ import annotations

import os
import random
import stat
import time
from pathlib import Path

import msgspec
import pytest

from revenant.agent.storage import chain, packs
from revenant.agent.storage.epochs import MANIFEST, CorruptEpoch, JobFiles, Manifest, NoEpoch

pytestmark = pytest.mark.unit

PAGE = chain.PAGE


def pages(rnd: random.Random, count: int) -> list[bytes]:
    return [rnd.randbytes(PAGE) for _ in range(count)]


def commit(files: JobFiles, images: dict[str, bytes]) -> Manifest:
    """A synthetic epoch: ``images`` (name -> bytes) written and committed as criu's would be."""
    tmp = files.new_tmp("n1")
    for name, data in images.items():
        (tmp / name).parent.mkdir(exist_ok=True)
        (tmp / name).write_bytes(data)
    m = Manifest(job=files.job, epoch=0, generation=1, node="n1", created_at=time.time(), criu_version="4.1.1",
                 kernel="k")
    return files.commit(tmp, m)


def epoch(body: list[bytes], extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    return {"pages-1.img": b"".join(body), "core-1.img": b"core", **(extra or {})}


def rebuilt(files: JobFiles, n: int, tmp_path: Path) -> dict[str, bytes]:
    """Every file a restore of epoch ``n`` would see, by name."""
    m = files.verify(n)
    d = files.epoch_dir(n)
    if packs.converted(m):
        d = tmp_path / f"restore-{n}-{time.monotonic_ns()}"
        packs.materialize(files, m, d)
    recipes = {r.recipe for r in m.recipes.values()}
    return {name: (d / name).read_bytes() for name in [*m.files, *m.recipes] if name not in recipes}


def pack_files(files: JobFiles) -> list[Path]:
    return sorted(files.packs_dir.rglob("*")) if files.packs_dir.exists() else []


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_one_percent_changed_adds_about_one_percent_and_three_epochs_cost_one_image(tmp_path):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(1)
    body = pages(rnd, 2048)  # 8 MiB
    images = {}
    for _ in range(3):
        images[commit(files, epoch(body)).epoch] = b"".join(body)
        for i in rnd.sample(range(len(body)), 20):  # 1% of the pages
            body[i] = rnd.randbytes(PAGE)
    first = packs.convert(files, 1, 10)
    second = packs.convert(files, 2, 10)
    size = len(images[1])
    print(f"\nfull image {size} B; first conversion added {first.added_bytes} B ({first.added_bytes / size:.2%}); "
          f"1% changed added {second.added_bytes} B ({second.added_bytes / size:.3%}: "
          f"{second.new_pages * PAGE} B of pages, {second.added_bytes - second.new_pages * PAGE} B index and digests)")
    # Only what the next epoch changed is stored: the rest is read from the newer plain images.
    assert first.converted and first.new_pages == 20 and first.added_bytes <= 0.015 * size
    assert second.converted and second.new_pages == 20 and second.pages == 2048
    assert second.added_bytes <= 0.015 * size  # 1% of pages, 0.4% of digests
    # The plain images went; each epoch is rebuilt exactly; the newest stays plain.
    assert not (files.epoch_dir(2) / "pages-1.img").exists()
    assert not packs.converted(files.read_manifest(3))
    for n in (1, 2, 3):
        assert rebuilt(files, n, tmp_path)["pages-1.img"] == images[n]
    assert files.read_manifest(2).total_bytes == size + 4  # what a restore reads, as before
    assert {r for n in (1, 2) for r in chain.read_recipe(files, files.read_manifest(n), "pages-1.img").packs
            if r.startswith("@")} == {"@3/pages-1.img"}
    storage, own = packs.usage(files)
    assert own[2] < 0.015 * size and own[3] > size and storage < 1.04 * size  # three epochs: one image
    assert storage == sum(p.stat().st_size for p in pack_files(files) if p.is_file()) + sum(
        p.stat().st_size for n in (1, 2, 3) for p in files.epoch_dir(n).iterdir())


def test_inserted_page_shifting_the_rest_still_dedups(tmp_path):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(2)
    body = pages(rnd, 600)
    commit(files, epoch(body))
    shifted = body[:100] + [rnd.randbytes(PAGE)] + body[100:500] + body[501:]
    commit(files, epoch(shifted))
    commit(files, epoch(shifted))
    r = packs.convert(files, 1, 10)
    assert r.new_pages == 1  # the page removed since: found nowhere newer
    assert packs.convert(files, 2, 10).new_pages == 0
    recipe = chain.read_recipe(files, files.read_manifest(1), "pages-1.img")
    assert len(recipe.runs) // 3 == 4  # before, the shifted middle, the removed page, after it
    assert rebuilt(files, 1, tmp_path)["pages-1.img"] == b"".join(body)
    assert rebuilt(files, 2, tmp_path)["pages-1.img"] == b"".join(shifted)


def test_materialize_is_byte_exact_private_and_links_plain_files(tmp_path):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(3)
    odd = rnd.randbytes(3 * PAGE + 123)  # not a multiple of a page: its last one is padded in the pack
    zeros = bytes(PAGE * 8)  # eight identical pages: one in the pack
    extra = {"pages-2.img": odd + zeros, "pages-3.img": b"", "files/0": b"job file copy", "workdir.json": b"{}"}
    want = epoch(pages(rnd, 50), extra)
    m1 = commit(files, want)
    commit(files, epoch(pages(rnd, 2)))
    r = packs.convert(files, 1, 10)
    assert r.converted and r.new_pages == 50 + 4 + 1
    m = files.verify(1)
    assert packs.converted(m) and set(m.recipes) == {"pages-1.img", "pages-2.img", "pages-3.img"}
    assert m.total_bytes == m1.total_bytes
    dest = files.new_tmp("n1")
    packs.materialize(files, m, dest)
    got = {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert got == want
    assert os.stat(dest / "core-1.img").st_ino == os.stat(files.epoch_dir(1) / "core-1.img").st_ino
    assert stat.S_IMODE(os.stat(dest / "files").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(dest / "pages-1.img").st_mode) == 0o600
    for p in pack_files(files):
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600)
    files.discard(dest)
    assert files.verify(1) == m  # the links' removal took nothing from the epoch


def test_corrupt_pack_page_fails_verify_and_restore_falls_back_naming_it(tmp_path):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(4)
    body = pages(rnd, 64)
    first = b"".join(body)
    commit(files, epoch(body))
    body[10] = rnd.randbytes(PAGE)  # only epoch 2 holds this page
    commit(files, epoch(body))
    body[10] = rnd.randbytes(PAGE)
    commit(files, epoch(body))
    packs.convert(files, 1, 10)
    packs.convert(files, 2, 10)
    ref = next(r for r in files.read_manifest(2).packs if r.split("/")[1].startswith("2-"))
    flip(chain.pack_path(files, ref), 100)  # its only page: page 0 of epoch 2's pack
    flip(files.epoch_dir(3) / "pages-1.img", 10 * PAGE + 5)  # the newest's own page 10, which no other reads
    with pytest.raises(CorruptEpoch, match=f"page 0 of pack {ref} is corrupt"):
        files.verify(2)
    with pytest.raises(CorruptEpoch, match=f"page 0 of pack {ref}"):
        packs.materialize(files, files.read_manifest(2), tmp_path / "r")
    m, notes = files.newest_verified()
    assert m.epoch == 1 and len(notes) == 2
    assert "epoch 3: pages-1.img fails its checksum" in notes[0] and f"page 0 of pack {ref}" in notes[1]
    assert rebuilt(files, 1, tmp_path)["pages-1.img"] == first
    # Retention deletes the corrupt ones first (never the newest that verifies), gc their pack.
    assert files.prune(2) == [2]
    assert packs.gc(files) == PAGE + chain.DIGEST + 4 and not chain.pack_path(files, ref).exists()
    # A page of the newest image that an older epoch reads takes that epoch with it, named.
    flip(files.epoch_dir(3) / "pages-1.img", 3 * PAGE)
    with pytest.raises(CorruptEpoch, match=r"epoch 1: pages-1.img rebuilt from its packs fails its checksum: "
                                           r"page 3 of image @3/pages-1.img is corrupt"):
        files.verify(1)
    flip(files.epoch_dir(3) / "pages-1.img", 3 * PAGE)
    # A missing pack: its pages are nowhere.
    chain.pack_path(files, files.read_manifest(1).packs[0]).unlink()
    with pytest.raises(CorruptEpoch, match="epoch 1: pages-1.img: page 10 is in no pack nor newer image"):
        files.verify(1)
    with pytest.raises(NoEpoch, match="no epoch verifies"):
        files.newest_verified()


def unique_first(rnd: random.Random, count: int, unique: int) -> list[dict[str, bytes]]:
    """Three epochs of ``count`` pages, the same but for the first ``unique`` pages of the first."""
    body = pages(rnd, count)
    return [epoch(pages(rnd, unique) + body[unique:]), epoch(body), epoch(body)]


def test_a_damaged_index_costs_nothing_its_pack_is_hashed_again(tmp_path):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(5)
    for images in unique_first(rnd, 32, 4):
        commit(files, images)
    packs.convert(files, 1, 10)
    ref = files.read_manifest(1).packs[0]
    flip(chain.pack_path(files, ref, ".idx"), 3)
    files.verify(1)  # its pages are intact: still restorable
    assert packs.convert(files, 2, 10).new_pages == 0
    assert rebuilt(files, 1, tmp_path) == unique_first(random.Random(5), 32, 4)[0]


def test_a_corrupt_pack_is_never_spread_to_a_good_epoch(tmp_path):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(6)
    body = pages(rnd, 16)
    x = body[5]
    commit(files, epoch(body))
    body[5] = rnd.randbytes(PAGE)
    commit(files, epoch(body))
    packs.convert(files, 1, 10)  # its page 5 into a pack: the newer epoch changed it
    ref = files.read_manifest(1).packs[0]
    body[5] = x  # and back again: epoch 3 holds the packed page, the newest does not
    commit(files, epoch(body))
    body[5] = rnd.randbytes(PAGE)
    commit(files, epoch(body))
    flip(chain.pack_path(files, ref), 7)
    assert packs.convert(files, 2, 10).converted
    r = packs.convert(files, 3, 10)  # its page 5 is found in that pack, which no longer holds it
    assert not r.converted and f"page 0 of pack {ref} is corrupt" in r.note
    m = files.verify(3)  # still plain, still good, and nothing of the attempt is left
    assert not packs.converted(m) and not [p for p in pack_files(files) if p.name.startswith(".tmp-")]
    assert len([p for p in pack_files(files) if p.suffix == ".pack"]) == 2  # epoch 1's and 2's


def test_convert_twice_is_a_no_op_and_a_corrupt_plain_epoch_is_left_alone(tmp_path):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(7)
    for _ in range(3):
        commit(files, epoch(pages(rnd, 8)))
    flip(files.epoch_dir(2) / "pages-1.img", 9)  # before anything took its digest list
    assert packs.convert(files, 1, 10).converted
    assert not (files.epoch_dir(2) / "pages-1.img.digests").exists()  # a damaged image is no place
    before = files.read_manifest(1)
    again = packs.convert(files, 1, 10)
    assert (again.converted, again.added_bytes, again.note) == (False, 0, "already converted")
    assert files.read_manifest(1) == before and again.own_bytes > 8 * PAGE
    r = packs.convert(files, 2, 10)
    assert not r.converted and "pages-1.img fails its checksum" in r.note
    assert not packs.converted(files.read_manifest(2))
    assert not [p for p in pack_files(files) if p.name.startswith(".tmp-")]


def test_full_every_keeps_segments_apart(tmp_path):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(8)
    body = pages(rnd, 40)
    for _ in range(5):
        commit(files, epoch(body))
        body[0] = rnd.randbytes(PAGE)
    added = {n: packs.convert(files, n, 2) for n in (1, 2, 3, 4)}
    segments = {n: files.read_manifest(n) for n in (1, 2, 3, 4)}
    assert [segments[n].segment for n in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert all(r.startswith("0/") for n in (1, 2) for r in segments[n].packs)
    assert all(r.startswith("1/") for n in (3, 4) for r in segments[n].packs)
    # A segment's last epoch is stored whole (no newer image of its segment), the others by what changed.
    assert [added[n].new_pages for n in (1, 2, 3, 4)] == [1, 40, 1, 40]
    # A corrupt page takes its segment's epochs with it, never the next segment's.
    seg0 = next(r for r in segments[2].packs if r.startswith("0/2-"))
    flip(chain.pack_path(files, seg0), 20 * PAGE)
    for n in (1, 2):
        with pytest.raises(CorruptEpoch, match=f"page 20 of pack {seg0}"):
            files.verify(n)
    for n in (3, 4, 5):
        files.verify(n)


def test_gc_keeps_what_kept_epochs_reference_and_purge_frees_everything(tmp_path):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(9)
    body = pages(rnd, 24)
    images = {}
    for _ in range(4):
        images[commit(files, epoch(body)).epoch] = b"".join(body)
        body[3] = rnd.randbytes(PAGE)
    for n in (1, 2, 3):
        packs.convert(files, n, 10)
    assert packs.gc(files) == 0
    assert files.prune(2) == [1, 2]
    freed = packs.gc(files)  # epoch 3 reads the newest image and its own pack: 1's and 2's packs go
    assert freed == 2 * (PAGE + chain.DIGEST + 4)
    assert [r.split("/")[1].split("-")[0] for r in files.read_manifest(3).packs] == ["3"]
    for n in (3, 4):
        assert rebuilt(files, n, tmp_path)["pages-1.img"] == images[n]
    on_disk = sum(p.stat().st_size for p in [*pack_files(files), *files.epochs_dir.rglob("*")] if p.is_file())
    assert files.purge() == on_disk
    assert not files.epochs_dir.exists() and not files.packs_dir.exists()


def test_gc_refuses_to_delete_packs_while_a_manifest_is_unreadable(tmp_path):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(10)
    for _ in range(3):
        commit(files, epoch(pages(rnd, 4)))
    packs.convert(files, 1, 10)
    packs.convert(files, 2, 10)
    m1 = files.read_manifest(1)
    (files.epoch_dir(2) / MANIFEST).write_text("{")  # it may reference any pack
    (files.epoch_dir(1) / MANIFEST).write_bytes(msgspec.json.encode(msgspec.structs.replace(m1, packs=[])))
    assert packs.gc(files) == 0 and len([p for p in pack_files(files) if p.is_file()]) == 4


def test_manifests_from_before_conversion_still_decode():
    old = (b'{"version":1,"job":"7","epoch":3,"generation":1,"node":"n","created_at":0,"criu_version":"4",'
           b'"kernel":"k","files":{"pages-1.img":{"size":8192,"checksum":"00000000"}}}')
    m = msgspec.json.decode(old, type=Manifest)
    assert not packs.converted(m) and (m.recipes, m.packs, m.segment, m.total_bytes) == ({}, [], 0, 8192)


def two_image_epochs(files: JobFiles, rnd: random.Random) -> dict[int, dict[str, bytes]]:
    body, other = pages(rnd, 40), pages(rnd, 6)
    images = {}
    for _ in range(3):
        want = epoch(body, {"pages-2.img": b"".join(other)})
        images[commit(files, want).epoch] = want
        body[rnd.randrange(40)] = rnd.randbytes(PAGE)
        other[0] = rnd.randbytes(PAGE)
    return images


def crash_converting(files: JobFiles, n: int, at: str, codec: str = "") -> None:
    """Convert epoch ``n`` (its pack compressed with ``codec``) in a child process that dies
    (os._exit, no cleanup) at step ``at``."""
    crashed = 71
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            packs.convert(files, n, 10, on_step=lambda s: os._exit(crashed) if s == at else None, codec=codec)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == crashed


@pytest.mark.parametrize("codec", ["", "zstd"])
@pytest.mark.parametrize("at", packs.STEPS)
def test_a_crash_at_any_step_of_a_conversion_leaves_every_epoch_restorable(tmp_path, at, codec):
    files = JobFiles(tmp_path, "7")
    images = two_image_epochs(files, random.Random(11))
    packs.convert(files, 1, 10, codec=codec)
    crash_converting(files, 2, at, codec)
    assert files.committed() == [1, 2, 3]
    for n, want in images.items():
        assert rebuilt(files, n, tmp_path) == want
    assert packs.converted(files.read_manifest(2)) == (at in ("committed", "unlinking"))  # the commit point
    r = packs.convert(files, 2, 10, codec=codec)  # over what the crash left: finished now, or already done
    assert packs.converted(files.read_manifest(2)) and r.note in ("", "already converted")
    packs.gc(files)
    leftovers = [p for p in pack_files(files) if p.name.startswith(".tmp-")]
    for n in (1, 2, 3):
        m = files.read_manifest(n)  # (a plain epoch's digest lists are its cache, not in its manifest)
        leftovers += [p for p in files.epoch_dir(n).iterdir() if p.name not in m.files and p.name != MANIFEST
                      and not (not m.recipes and p.name.endswith(".digests"))]
    assert leftovers == []
    referenced = {r for n in (1, 2, 3) for r in files.read_manifest(n).packs}
    assert {f"{p.parent.name}/{p.stem}" for p in pack_files(files) if p.is_file()} == referenced
    for n, want in images.items():
        assert rebuilt(files, n, tmp_path) == want

