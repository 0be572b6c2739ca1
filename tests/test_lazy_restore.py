"""Lazy restores through the job supervisor and the engine, with real criu and userfaultfd:
the job runs before its memory is back; all pages in -> restore_completed; corrupt page data or a
lazy-pages daemon killed mid-fetch -> the job is killed at once and reported evicted (a corrupt
epoch set aside, so the next restore falls back to an older one); output byte-exact."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import COUNTER, counter_reference
from revenant.agent.storage import imagekeys
from revenant.agent.storage.epochs import JobFiles
from revenant.messages import EpochEvent, JobEvent, JobSpec

pytestmark = pytest.mark.criu

MEMDIRTY = Path(__file__).parent / "jobs" / "memdirty.py"


def _events(events: list, kind: str) -> list[JobEvent]:
    return [e for e in events if isinstance(e, JobEvent) and e.kind == kind]


async def _until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _output(sup, job: str) -> bytes:
    return JobFiles(sup.storage, job).output.read_bytes()


def _flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _lazy(sup):
    sup.engine.lazy = True
    return sup


async def test_a_lazy_restore_runs_the_job_first_and_reports_when_every_page_is_in(tmp_path, supervisors):
    events: list = []
    sup = _lazy(supervisors(scratch={}, events=events))
    spec = JobSpec(id="l1", argv=[sys.executable, str(MEMDIRTY), "64", "0.05", "0", "0.05"], workdir=str(tmp_path))
    await sup.start(spec, 1)
    await _until(lambda: _output(sup, "l1").count(b"ok") >= 3)
    await sup.checkpoint("l1", 1, stop=True)
    await sup.restore(spec, 2)
    await _until(lambda: _events(events, "restore_completed"))
    (done,) = _events(events, "restore_completed")
    assert done.epoch == 1 and done.generation == 2 and done.bytes > 32 * 2**20 and done.duration_s > 0
    before = _output(sup, "l1").count(b"ok")
    await _until(lambda: _output(sup, "l1").count(b"ok") >= before + 5)  # every page checked each step
    assert b"BAD" not in _output(sup, "l1")
    await sup.checkpoint("l1", 2, stop=False)  # after the fetch: a normal epoch


@pytest.mark.parametrize("signed", [False, True], ids=["crc32", "signed"])
async def test_a_lazily_restored_counter_keeps_its_output_byte_exact(tmp_path, supervisors, signed):
    """Signed (image keys: the default), its pages are served by revenant, each extent checked."""
    events: list = []
    keys = imagekeys.write(tmp_path / "image.keys")[0] if signed else None
    sup = _lazy(supervisors(scratch={}, events=events, keys=keys))
    spec = JobSpec(id="l2", argv=[sys.executable, str(COUNTER), "120", "0.02", "32"], workdir=str(tmp_path))
    await sup.start(spec, 1)
    await _until(lambda: _output(sup, "l2").count(b"\n") >= 20)
    await sup.checkpoint("l2", 1, stop=True)
    await sup.restore(spec, 2)
    await _until(lambda: _events(events, "exited"), timeout=90)
    assert _events(events, "restore_completed")
    assert _output(sup, "l2") == counter_reference(tmp_path, 120)


async def test_corrupt_page_data_kills_the_restored_job_and_the_next_restore_falls_back(tmp_path, supervisors):
    events: list = []
    sup = _lazy(supervisors(scratch={}, events=events))
    spec = JobSpec(id="l3", argv=[sys.executable, str(COUNTER), "400", "0.02", "32"], workdir=str(tmp_path),
                   max_epochs=3)
    await sup.start(spec, 1)
    await _until(lambda: _output(sup, "l3").count(b"\n") >= 10)
    await sup.checkpoint("l3", 1, stop=False)
    await _until(lambda: _output(sup, "l3").count(b"\n") >= 30)
    await sup.checkpoint("l3", 1, stop=True)
    files = JobFiles(sup.storage, "l3")
    assert files.committed() == [1, 2]
    pages = sorted(files.epoch_dir(2).glob("pages-*.img"), key=lambda p: p.stat().st_size)[-1]
    _flip_a_byte(pages)  # in the middle of the page data
    await sup.restore(spec, 2)
    await _until(lambda: _events(events, "evicted"))
    (ev,) = _events(events, "evicted")
    assert "lazy restore of epoch 2 failed" in ev.reason and "pages-" in ev.reason and "epoch 2 deleted" in ev.reason
    assert [e.n for e in events if isinstance(e, EpochEvent) and e.kind == "pruned"] == [2]  # the table drops it
    kept = ev.reason.split("(lazy-pages log: ", 1)[1].split(")", 1)[0]  # kept beside criu's logs
    assert Path(kept).is_file() and "lazy-pages" in Path(kept).name
    assert files.committed() == [1] and "l3" not in sup.jobs
    await sup.restore(spec, 3)  # as the coordinator does on "evicted": now from epoch 1
    await _until(lambda: _events(events, "exited"), timeout=90)
    assert _output(sup, "l3") == counter_reference(tmp_path, 400)


async def test_a_signed_epoch_served_lazily_checks_each_extent_and_a_corrupt_byte_evicts_it(tmp_path, supervisors):
    """With image keys a lazy restore reads each page image's table of MACs, not the image, before
    the job runs, and checks each extent as it serves it: one byte changed in a page image kills
    the restored job when that extent is asked for, sets the epoch aside, and the next restore
    comes back exact from the epoch before."""
    events: list = []
    keys = imagekeys.write(tmp_path / "image.keys")[0]
    sup = _lazy(supervisors(scratch={}, events=events, keys=keys))
    spec = JobSpec(id="l5", argv=[sys.executable, str(COUNTER), "400", "0.02", "32"], workdir=str(tmp_path),
                   max_epochs=3)
    await sup.start(spec, 1)
    await _until(lambda: _output(sup, "l5").count(b"\n") >= 10)
    await sup.checkpoint("l5", 1, stop=False)
    await _until(lambda: _output(sup, "l5").count(b"\n") >= 30)
    await sup.checkpoint("l5", 1, stop=True)
    files = JobFiles(sup.storage, "l5", keys)
    assert files.committed() == [1, 2]
    m = files.read_signed(2)
    pages = sorted(files.epoch_dir(2).glob("pages-*.img"), key=lambda p: p.stat().st_size)[-1]
    assert imagekeys.by_extent(m.files, pages.name)  # its table beside it, signed with the rest
    _flip_a_byte(pages)  # in the middle of the page data
    await sup.restore(spec, 2)  # not refused before it starts: the image itself is not read then
    await _until(lambda: _events(events, "evicted"))
    (ev,) = _events(events, "evicted")
    assert "lazy restore of epoch 2 failed" in ev.reason and f"{pages.name}: bytes" in ev.reason, ev.reason
    assert "fail their MAC" in ev.reason and "epoch 2 deleted" in ev.reason, ev.reason
    assert files.committed() == [1] and "l5" not in sup.jobs
    await sup.restore(spec, 3)  # from epoch 1
    await _until(lambda: _events(events, "exited"), timeout=90)
    assert _output(sup, "l5") == counter_reference(tmp_path, 400)


async def test_a_lazy_pages_daemon_killed_mid_fetch_kills_the_job_never_leaves_it_on_zero_pages(tmp_path,
                                                                                                supervisors):
    events: list = []
    sup = _lazy(supervisors(scratch={}, events=events))
    spec = JobSpec(id="l4", argv=[sys.executable, str(MEMDIRTY), "768", "0.01", "0", "0.2", "1000"],
                   workdir=str(tmp_path))
    await sup.start(spec, 1)
    await _until(lambda: b"ok" in _output(sup, "l4"), timeout=90)
    await sup.checkpoint("l4", 1, stop=True)
    await sup.restore(spec, 2)
    def is_daemon(p: psutil.Process) -> bool:
        try:
            return "lazy-pages" in " ".join(p.cmdline())
        except psutil.Error:  # a zombie, or gone
            return False

    daemons = [p for p in psutil.Process().children() if is_daemon(p)]
    for p in daemons:
        os.kill(p.pid, signal.SIGKILL)
    if not daemons:  # it was faster than us: the fetch is complete, which is fine, but proves nothing here
        pytest.fail("the lazy-pages daemon had already finished; make the job larger")
    await _until(lambda: _events(events, "evicted") or _events(events, "restore_completed"))
    assert not _events(events, "restore_completed")
    (ev,) = _events(events, "evicted")
    assert "lazy restore of epoch 1 failed" in ev.reason and "its next restore is eager" in ev.reason
    assert "l4" not in sup.jobs and JobFiles(sup.storage, "l4").committed() == [1]  # the epoch is kept: retried
    await sup.restore(spec, 3)  # eagerly this time (a daemon's failure must not repeat)
    await _until(lambda: _output(sup, "l4").count(b"ok") >= 3)
    assert len(_events(events, "restore_completed")) == 0 and b"BAD" not in _output(sup, "l4")


async def test_a_delta_epoch_is_served_lazily_from_its_recipes_and_a_corrupt_page_evicts_it(tmp_path, supervisors):
    """restart --epoch N of a delta: the job runs at once, its pages served from the packs and the
    newest epoch's image (agent/lazyrestore/deltaserve.py), output byte-exact; a corrupt page of
    its pack, met as served, kills it and deletes that epoch, naming the pack and page."""
    from revenant.agent.storage import chain, packs

    events: list = []
    sup = _lazy(supervisors(scratch={}, events=events))
    spec = JobSpec(id="l5", argv=[sys.executable, str(MEMDIRTY), "48", "0.05", "0", "0.05"], workdir=str(tmp_path),
                   max_epochs=5)
    await sup.start(spec, 1)
    files = JobFiles(sup.storage, "l5")
    for n in (1, 2, 3):
        await _until(lambda: _output(sup, "l5").count(b"ok") >= 3 * n)
        await sup.checkpoint("l5", 1, stop=n == 3)
    for n in (1, 2):
        assert packs.convert(files, n, 10).converted
    m1 = files.read_manifest(1)
    assert packs.converted(m1) and {r for r in chain.read_recipe(files, m1, next(iter(m1.recipes))).packs
                                    if r.startswith("@")}  # it reads the newest image too
    at_1 = _output(sup, "l5").count(b"ok")
    reply = await sup.restore(spec, 2, epoch=1)
    assert reply.epoch.n == 1
    await _until(lambda: _events(events, "restore_completed"))
    assert _events(events, "restore_completed")[0].epoch == 1
    await _until(lambda: _output(sup, "l5").count(b"ok") >= at_1 + 3)  # every page checked each step
    assert b"BAD" not in _output(sup, "l5")
    assert not list(files.epochs_dir.glob(".tmp-*"))  # the scratch images went with the fetch

    await sup.checkpoint("l5", 2, stop=True)  # epoch 4; epoch 3 is the newest delta
    assert packs.convert(files, 3, 10).converted
    m2 = files.read_manifest(2)
    own = [(ref, first + i) for name in m2.recipes for ref, first, count in
           chain.runs_of(chain.read_recipe(files, m2, name)) if ref.split("/")[-1].startswith("2-")
           for i in range(count)]
    assert own, "epoch 2 reads no page of its own pack"
    ref, page = own[-1]  # the job's dirtied memory, which criu serves lazily
    with open(chain.pack_path(files, ref), "r+b") as f:
        f.seek(page * 4096 + 9)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    await sup.restore(spec, 3, epoch=2)
    await _until(lambda: _events(events, "evicted"))
    (ev,) = _events(events, "evicted")
    assert "lazy restore of epoch 2 failed" in ev.reason and f"(page {page} of pack {ref}) does not match its " \
        "digest" in ev.reason and "epoch 2 deleted" in ev.reason, ev.reason
    assert 2 not in files.committed() and "l5" not in sup.jobs
