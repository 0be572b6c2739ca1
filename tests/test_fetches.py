"""What the agent does with a lazily restored job once its fetch ends (agent/lazyrestore/fetches.py), against
stand-ins for the supervisor and the fetch: the verdicts, the held-back exit, the marks it leaves."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from revenant.agent.lazyrestore import fetches, lazy
from revenant.agent.lazyrestore.lazy import LazyResult
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import JobNotRunning

pytestmark = pytest.mark.unit


class Sup:
    def __init__(self) -> None:
        self.jobs: dict = {}
        self.node = "n1"
        self.said: list = []
        self.reported: list = []
        self.book = SimpleNamespace(_epoch_event=lambda job, kind, gen, **kw: self.said.append((kind, kw)))
        self.policies = SimpleNamespace(lock=lambda files: contextlib.nullcontext())

    def _event(self, rt, kind, **kw):
        self.said.append((kind, kw))

    async def _kill(self, rt, reason):
        rt.killing = True
        rt.exited.set()
        self.jobs.pop(rt.spec.id, None)
        if not rt.vacating:
            self._report_exit(rt)

    def _report_exit(self, rt):
        self.reported.append((rt.evicted, rt.kill_reason))


class Fetch:
    def __init__(self, result: LazyResult | None) -> None:
        self.result = result
        self.manifest = SimpleNamespace(epoch=2)
        self.aborted = self.closed = False

    async def wait(self) -> LazyResult:
        if self.result is None:
            await asyncio.Event().wait()  # never: the job ends first
        return self.result

    async def failed(self) -> str:
        self.aborted = True
        return " (lazy-pages log: /x)"

    async def abort(self) -> None:
        self.aborted = True

    async def close(self) -> None:
        self.closed = True


def _job(tmp_path: Path, sup: Sup):
    files = JobFiles(tmp_path / "storage", "j1")
    files.epoch_dir(2).mkdir(parents=True)
    (files.epoch_dir(2) / "manifest.json").write_text("{}")
    rt = SimpleNamespace(spec=SimpleNamespace(id="j1"), generation=3, pid=2**22 + 7, files=files, vacating=False,
                         exited=asyncio.Event(), killing=False, evicted=False, kill_reason="", frozen_at=None)
    sup.jobs["j1"] = rt
    return rt


async def _run(sup: Sup, rt, fetch: Fetch) -> fetches.PageFetches:
    pf = fetches.PageFetches(sup)
    pf.start(rt, fetch)
    assert rt.vacating  # its exit held back
    await asyncio.wait_for(asyncio.gather(*pf._tasks), 10)
    assert fetch.closed and not rt.vacating
    return pf


async def test_every_page_in_says_so(tmp_path):
    sup = Sup()
    rt = _job(tmp_path, sup)
    await _run(sup, rt, Fetch(LazyResult(ok=True, seconds=1.5, bytes=4096)))
    assert sup.said == [("restore_completed", {"epoch": 2, "duration_s": 1.5, "bytes": 4096})]
    assert sup.reported == [] and not rt.evicted


async def test_a_job_that_ends_first_has_its_own_exit_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(fetches, "EXIT_GRACE_S", 0.05)
    sup = Sup()
    rt = _job(tmp_path, sup)
    rt.exited.set()
    fetch = Fetch(None)
    await _run(sup, rt, fetch)
    assert sup.reported == [(False, "")] and fetch.aborted and sup.said == []


async def test_a_daemon_failure_evicts_the_job_and_makes_its_next_restore_eager(tmp_path):
    sup = Sup()
    rt = _job(tmp_path, sup)
    await _run(sup, rt, Fetch(LazyResult(ok=False, seconds=1, bytes=0, error="lazy-pages was killed by signal 9")))
    (evicted, why), = sup.reported
    assert evicted and "lazy restore of epoch 2 failed: lazy-pages was killed by signal 9 (lazy-pages log: /x)" in why
    assert "its next restore is eager" in why and lazy.eager_next(rt.files) and not lazy.eager_next(rt.files)
    assert rt.files.committed() == [2]


async def test_corrupt_page_data_deletes_the_epoch_with_a_pruned_event(tmp_path):
    sup = Sup()
    rt = _job(tmp_path, sup)
    await _run(sup, rt, Fetch(LazyResult(ok=False, seconds=1, bytes=0, error="epoch 2: pages-1.img fails its checksum",
                                        corrupt=True)))
    assert sup.said == [("pruned", {"n": 2})] and rt.files.committed() == []
    (evicted, why), = sup.reported
    assert evicted and "epoch 2 deleted" in why and not lazy.eager_next(rt.files)


async def test_a_job_killed_on_purpose_is_not_evicted_by_its_fetch(tmp_path):
    sup = Sup()
    rt = _job(tmp_path, sup)
    rt.killing, rt.kill_reason = True, "killed as generation 4"
    rt.exited.set()
    fetch = Fetch(LazyResult(ok=False, seconds=1, bytes=0, error="lazy-pages ended with only 1 of 9 pages"))
    await _run(sup, rt, fetch)
    assert sup.reported == [(False, "killed as generation 4")] and fetch.aborted


async def test_a_checkpoint_after_the_wait_finds_a_job_that_ended_meanwhile(tmp_path):
    sup = Sup()
    rt = _job(tmp_path, sup)
    gate = asyncio.Event()

    class Slow(Fetch):
        async def wait(self):
            await gate.wait()
            rt.exited.set()  # it ended meanwhile
            sup.jobs.pop("j1")
            return LazyResult(ok=True, seconds=1, bytes=1)

    pf = fetches.PageFetches(sup)
    pf.start(rt, Slow(None))
    waiting = asyncio.create_task(pf.wait(rt, 10))
    await asyncio.sleep(0)
    gate.set()
    with pytest.raises(JobNotRunning, match="ended while its pages arrived"):
        await waiting
