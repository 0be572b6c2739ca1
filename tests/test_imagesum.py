"""CRC-32s taken while criu writes (agent/storage/imagesum.py) and one syncfs for a whole epoch
(agent/storage/fileio.py): the same checksums as reading every file after the dump, never a stale one."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from conftest import COUNTER
from revenant.agent.storage import imagesum
from revenant.agent.storage.epochs import JobFiles, Manifest
from revenant.agent.storage.fileio import SYNCFS_FILESYSTEMS, Durable, fs_magic, kernel_at_least
from revenant.agent.storage.imagesum import Follower, checksums, crc32_combine, crc32_file, seal
from revenant.messages import JobSpec

MiB = 1 << 20


def zcrc(path: Path) -> tuple[int, str]:
    data = path.read_bytes()
    return len(data), f"{zlib.crc32(data):08x}"


def append_like_criu(path: Path, chunks: int, size: int, seed: int) -> bytes:
    """Append ``chunks`` pieces of ``size`` bytes, one write each, as criu splices pages."""
    rng = random.Random(seed)
    data = rng.randbytes(chunks * size)
    with open(path, "ab") as f:
        for i in range(chunks):
            f.write(data[i * size:(i + 1) * size])
            f.flush()
    return data


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


def no_follower_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith(("imagesum-", "writeback-"))]


@pytest.mark.unit
def test_crc32_combine_is_zlibs():
    rng = random.Random(1)
    for _ in range(300):
        a, b = rng.randbytes(rng.randint(0, 3000)), rng.randbytes(rng.randint(0, 3000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = rng.randbytes(5 * MiB + 17)
    assert crc32_combine(zlib.crc32(big[:MiB + 3]), zlib.crc32(big[MiB + 3:]), len(big) - MiB - 3) == zlib.crc32(big)


@pytest.mark.unit
def test_crc32_of_a_range_mapped_or_read(tmp_path):
    data = random.Random(2).randbytes(3 * 65536 + 123)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        for a, b in [(0, len(data)), (5, 70000), (65536, 3 * 65536 + 100), (7, 7), (100, 101)]:
            assert imagesum.crc32_mapped(fd, a, b) == imagesum.crc32_range(fd, a, b) == zlib.crc32(data[a:b])
        with pytest.raises(OSError, match="ended"):
            imagesum.crc32_range(fd, 0, len(data) + 1)
    finally:
        os.close(fd)


@pytest.mark.unit
@pytest.mark.parametrize("read_during", [True, False])
@pytest.mark.parametrize("writeback", [True, False])
def test_follower_checksums_images_as_they_grow(tmp_path, monkeypatch, read_during, writeback):
    monkeypatch.setattr(imagesum, "WRITEBACK", 256 * 1024)  # writeback starts several times
    monkeypatch.setattr(imagesum, "MIN_PIECE", 64 * 1024)  # what is left is read in pieces, combined
    follower = Follower(tmp_path, writeback=writeback, read_during=read_during, cpus=3).start()
    writers = [threading.Thread(target=append_like_criu, args=(tmp_path / name, 40, 50_000 + i, i))
               for i, name in enumerate(["pages-1.img", "pages-2.img"])]
    for w in writers:
        w.start()
    (tmp_path / "core-1.img").write_bytes(b"core")  # not a page image: not followed
    (tmp_path / "pages-3.img").write_bytes(b"")  # an empty one is followed too
    for w in writers:
        w.join()
    follower.criu_exited()
    sums = follower.finish()
    assert sums == {n: zcrc(tmp_path / n) for n in ("pages-1.img", "pages-2.img", "pages-3.img")}
    assert follower.tail_bytes <= 40 * 50_001 * 2
    if not read_during:
        assert follower.tail_bytes == 40 * 50_000 + 40 * 50_001  # all of it read after "criu"
    assert no_follower_threads()
    follower.abandon()  # idempotent after finish


@pytest.mark.unit
def test_a_truncated_or_replaced_image_is_left_to_be_read_again(tmp_path):
    follower = Follower(tmp_path, writeback=False, read_during=True).start()
    append_like_criu(tmp_path / "pages-1.img", 4, 256 * 1024, 1)
    append_like_criu(tmp_path / "pages-2.img", 4, 256 * 1024, 2)
    append_like_criu(tmp_path / "pages-3.img", 4, 256 * 1024, 3)
    wait_for(lambda: all(follower.images.get(n) is not None and follower.images[n].offset == MiB
                         for n in ("pages-1.img", "pages-2.img", "pages-3.img")))
    os.truncate(tmp_path / "pages-1.img", 1000)  # shorter than what was read
    (tmp_path / "new").write_bytes(os.urandom(MiB))
    os.replace(tmp_path / "new", tmp_path / "pages-2.img")  # another inode, same size
    sums = follower.finish()
    assert set(sums) == {"pages-3.img"}
    names = ["pages-1.img", "pages-2.img", "pages-3.img"]
    assert checksums(tmp_path, names, sums) == {n: zcrc(tmp_path / n) for n in names}


@pytest.mark.unit
def test_checksums_take_the_followers_only_at_the_files_present_size(tmp_path):
    (tmp_path / "a.img").write_bytes(b"x" * 1000)
    (tmp_path / "b.img").write_bytes(b"y" * 10)
    stale = {"a.img": (999, "00000000"), "b.img": (10, "0badc0de")}
    sums = checksums(tmp_path, ["a.img", "b.img"], stale)
    assert sums["a.img"] == zcrc(tmp_path / "a.img")  # sizes differ: read again
    assert sums["b.img"] == (10, "0badc0de")  # trusted: the follower read it whole
    assert crc32_file(tmp_path / "b.img") == zcrc(tmp_path / "b.img")


@pytest.mark.unit
def test_abandon_stops_a_follower_that_criu_never_released(tmp_path):
    follower = Follower(tmp_path, writeback=True, read_during=True).start()
    append_like_criu(tmp_path / "pages-1.img", 2, 4096, 1)
    wait_for(lambda: "pages-1.img" in follower.images)
    follower.abandon()
    assert no_follower_threads()
    Follower(tmp_path).abandon()  # never started: nothing to join


@pytest.mark.unit
def test_durable_is_one_syncfs_only_where_that_is_as_strong_as_fsyncs(tmp_path):
    assert kernel_at_least((5, 8), "6.18.44-fc-v669") and kernel_at_least((5, 8), "5.8.0")
    assert not kernel_at_least((5, 8), "5.4.0-150-generic")
    expected = "syncfs" if fs_magic(tmp_path) in SYNCFS_FILESYSTEMS else "fsync"
    (tmp_path / "f").write_bytes(b"data")
    with Durable(tmp_path) as durable:
        assert durable.how == expected
        durable.sync([tmp_path / "f"], [tmp_path])
    with Durable(tmp_path, kernel="5.4.0") as old:  # its syncfs does not report writeback errors
        assert old.how == "fsync"
        old.sync([tmp_path / "f"], [tmp_path])
    assert old.fd is None


@pytest.mark.unit
@pytest.mark.parametrize("kernel", [None, "5.4.0"])
def test_seal_and_commit_use_the_followers_checksums(tmp_path, caplog, kernel):
    caplog.set_level(logging.INFO, logger="revenant.agent.storage.imagesum")
    files = JobFiles(tmp_path / "storage", "7")
    tmp = files.new_tmp("n1")
    with Durable(tmp, kernel=kernel) as durable:
        how = durable.how
        follower = Follower(tmp, writeback=True, read_during=True).start()
        append_like_criu(tmp / "pages-1.img", 30, 40_000, 7)
        (tmp / "core-1.img").write_bytes(b"core")
        (tmp / "files").mkdir()
        (tmp / "files" / "0").write_bytes(b"a copy of one of the job's files")
        follower.criu_exited()
        m = Manifest(job="7", epoch=0, generation=1, node="n1", created_at=time.time(), criu_version="4.1.1",
                     kernel="k")
        m = files.commit(tmp, m, follower=follower, durable=durable)
    assert m.epoch == 1 and files.verify(1).files == m.files
    assert m.files["pages-1.img"] == files.verify(1).files["pages-1.img"]
    assert set(m.files) == {"core-1.img", "pages-1.img", "files/0"}
    assert "(1 followed as criu wrote" in caplog.text and f"durable ({how})" in caplog.text
    # Without a follower, seal reads everything itself.
    other = tmp_path / "other"
    other.mkdir()
    (other / "pages-1.img").write_bytes(b"p" * 5000)
    with Durable(other) as d:
        assert seal(other, ["pages-1.img"], d) == {"pages-1.img": zcrc(other / "pages-1.img")}


# ------------------------------------------------------------------ with real criu

async def start_ballast_job(sup, job: str, mib: int) -> None:
    spec = JobSpec(id=job, argv=[sys.executable, str(COUNTER), "100000", "0.02", str(mib)], workdir="/")
    await sup.start(spec, 1)
    out = JobFiles(sup.storage, job).output
    deadline = time.monotonic() + 30
    while out.stat().st_size < 30:
        assert time.monotonic() < deadline, "the job never printed"
        await asyncio.sleep(0.05)


@pytest.mark.criu
@pytest.mark.parametrize("mode", ["writeback", "read-during-too", "staging"])
async def test_real_dumps_commit_checksums_that_verify(tmp_path, supervisors, monkeypatch, caplog, mode):
    """criu's page images, followed as it wrote them, verify when read again whole: directly on the
    storage (writeback; and reading during the dump too, as on a machine with more CPUs) and through
    node-local staging."""
    caplog.set_level(logging.INFO, logger="revenant.agent.storage.imagesum")
    if mode == "read-during-too":
        monkeypatch.setattr(imagesum, "FOLLOW_MIN_CPUS", 1)
    sup = supervisors(staging=tmp_path / "staging" if mode == "staging" else None)
    await start_ballast_job(sup, "1", 48)
    for _ in range(2):
        reply = await sup.checkpoint("1", 1, stop=False)
        n = reply.epoch.n
        files = JobFiles(sup.storage, "1")
        m = await asyncio.to_thread(files.verify, n)  # every file read again, its CRC-32 compared
        pages = [name for name in m.files if name.startswith("pages-")]
        assert pages and sum(m.files[p].size for p in pages) > 48 * MiB
        assert not [p for p in files.epochs_dir.iterdir() if p.name.startswith(".tmp-")]
    assert "followed as criu wrote" in caplog.text and "(0 followed" not in caplog.text
    assert no_follower_threads()


@pytest.mark.criu
async def test_a_failed_dump_stops_the_follower_and_discards_the_epoch(tmp_path, supervisors):
    fake = tmp_path / "criu"
    # Writes a page image where criu would (-D), then fails as criu does.
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "-D" ]; do shift; done\n'
                    'head -c 3000000 /dev/urandom > "$2/pages-1.img"\n'
                    'echo "(00.02) Error (criu/cr-dump.c:2120): Dumping FAILED."\nexit 1\n')
    fake.chmod(0o755)
    sup = supervisors()
    sup.engine.criu = str(fake)
    await start_ballast_job(sup, "1", 0)
    with pytest.raises(Exception, match="criu dump failed"):
        await sup.checkpoint("1", 1, stop=False)
    files = JobFiles(sup.storage, "1")
    assert files.committed() == [] and not [p for p in files.epochs_dir.iterdir() if p.name.startswith(".tmp-")]
    assert no_follower_threads()
