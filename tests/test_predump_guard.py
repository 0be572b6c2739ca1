"""The pre-dump step (degraded without dirty tracking; criu's pre-dump where there is) and the
storage guard, as engine steps."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from revenant.agent.checkpointing import guard, predump
from revenant.agent.pipeline import criu
from revenant.agent.pipeline.steps import DumpContext
from revenant.agent.storage.epochs import JobFiles, Manifest
from revenant.common.errors import CriuError
from revenant.messages import CheckpointPolicy

pytestmark = pytest.mark.unit


def _ctx(tmp_path: Path, policy: CheckpointPolicy | None, job: str = "j1") -> DumpContext:
    files = JobFiles(tmp_path / "storage", job)
    tmp = files.new_tmp("n1")
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    m = Manifest(job=job, epoch=0, generation=1, node="n1", created_at=0.0, criu_version="4.1.1", kernel="k")
    return DumpContext(job=job, generation=1, pid=os.getpid(), files=files, workdir=work, stop=False, manifest=m,
                       epoch_tmp=tmp, policy=policy)


async def _no_sleep(_: float) -> None:
    return None


def test_predump_argv_tracks_memory_and_the_dump_takes_its_parent(tmp_path: Path) -> None:
    argv = criu.predump_argv("criu", pid=42, images=tmp_path / "predump", workdir=tmp_path)
    assert argv[:4] == ["criu", "pre-dump", "-t", "42"]
    assert "--track-mem" in argv and argv[argv.index("-D") + 1] == str(tmp_path / "predump")
    assert criu.incremental_args() == ["--track-mem", "--prev-images-dir", criu.PREDUMP_DIR]
    dump = criu.dump_argv("criu", pid=42, images=tmp_path, workdir=tmp_path, action_script=tmp_path / "a",
                          leave_running=True, extra=criu.incremental_args())
    # The parent is named relative to the images directory: the epoch stays self-contained.
    assert dump[dump.index("--prev-images-dir") + 1] == "predump"
    assert dump[-1] == "--leave-running"


async def test_without_dirty_tracking_the_dump_is_full_and_says_so_once_per_job(tmp_path: Path) -> None:
    said: list[tuple[str, int, str]] = []
    step = predump.PreDumpStep("criu", dirty_tracking=False, degraded=lambda *a: said.append(a), sleep=_no_sleep)
    policy = CheckpointPolicy(pre_dump=True)
    for _ in range(3):
        ctx = _ctx(tmp_path, policy)
        await step.before_dump(ctx)
        assert ctx.dump_args == []  # a full dump
    assert len(said) == 1 and said[0][0] == "j1" and "mem_dirty_track" in said[0][2]
    await step.before_dump(_ctx(tmp_path, policy, job="j2"))
    assert [s[0] for s in said] == ["j1", "j2"]


async def test_no_predump_unless_the_policy_asks(tmp_path: Path) -> None:
    said: list[object] = []
    step = predump.PreDumpStep("criu", dirty_tracking=False, degraded=lambda *a: said.append(a))
    for policy in (None, CheckpointPolicy()):
        ctx = _ctx(tmp_path, policy)
        await step.before_dump(ctx)
        assert ctx.dump_args == [] and said == []


async def test_with_dirty_tracking_the_predump_runs_then_waits_then_the_dump_is_incremental(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []
    slept: list[float] = []

    async def run(argv: list[str], timeout_s: float, umask: int | None = None) -> SimpleNamespace:
        ran.append(argv)
        return SimpleNamespace(returncode=0, output="")

    async def sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(predump.procs, "run", run)
    step = predump.PreDumpStep("criu", dirty_tracking=True, degraded=lambda *a: pytest.fail("degraded"), sleep=sleep)
    ctx = _ctx(tmp_path, CheckpointPolicy(pre_dump=True, pre_dump_delay_s=2.5))
    await step.before_dump(ctx)
    assert ran[0][1] == "pre-dump" and ran[0][ran[0].index("-D") + 1] == str(ctx.epoch_tmp / "predump")
    assert (ctx.epoch_tmp / "predump").is_dir()
    assert slept == [2.5]
    assert ctx.dump_args == criu.incremental_args()
    # An incremental job gets criu's own incremental dump where the kernel tracks dirty pages...
    ran.clear()
    inc = _ctx(tmp_path, CheckpointPolicy(incremental=True))
    await step.before_dump(inc)
    assert ran and ran[0][1] == "pre-dump" and inc.dump_args == criu.incremental_args()
    # ... and, where it does not, a plain full dump without a word (it did not ask for a pre-dump).
    quiet = predump.PreDumpStep("criu", dirty_tracking=False, degraded=lambda *a: pytest.fail("degraded"))
    plain = _ctx(tmp_path, CheckpointPolicy(incremental=True))
    await quiet.before_dump(plain)
    assert plain.dump_args == []


async def test_a_failed_predump_names_criu_s_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def run(argv: list[str], timeout_s: float, umask: int | None = None) -> SimpleNamespace:
        return SimpleNamespace(returncode=1, output="Error (criu/mem.c:1): Can't open pagemap\nPre-dumping FAILED.")

    monkeypatch.setattr(predump.procs, "run", run)
    step = predump.PreDumpStep("criu", dirty_tracking=True, degraded=lambda *a: None, sleep=_no_sleep)
    with pytest.raises(CriuError, match="Can't open pagemap"):
        await step.before_dump(_ctx(tmp_path, CheckpointPolicy(pre_dump=True)))


async def test_the_storage_guard_refuses_a_dump_the_storage_cannot_hold(tmp_path: Path) -> None:
    gib = 1024**3
    step = guard.StorageGuard(gpu_bytes=lambda job: gib, resident=lambda pid: 2 * gib, free=lambda p: 3 * gib)
    ctx = _ctx(tmp_path, None)
    with pytest.raises(guard.NotEnoughSpace) as err:
        await step.before_dump(ctx)
    text = str(err.value)
    assert err.value.code == "no_space"
    # Both numbers, in bytes: 3 GiB free, 3 GiB + 10 % needed.
    assert f"{3 * gib} bytes" in text and f"{guard.needed_bytes(3 * gib)} bytes" in text
    assert "GPU memory 1.00 GiB" in text and "job j1" in text


async def test_the_storage_guard_lets_a_dump_through_with_room_to_spare(tmp_path: Path) -> None:
    gib = 1024**3
    step = guard.StorageGuard(resident=lambda pid: gib, free=lambda p: 2 * gib)
    await step.before_dump(_ctx(tmp_path, None))
    # Measured for real: this process's memory against this filesystem's free space.
    await guard.StorageGuard().before_dump(_ctx(tmp_path, None))
    assert guard.resident_bytes(os.getpid()) > 0
    assert guard.needed_bytes(0) == guard.MIN_MARGIN_BYTES


def test_a_predumped_epoch_keeps_its_predump_images_checksummed_staged_and_rebuilt(tmp_path: Path) -> None:
    """criu's images after a pre-dump: pages in predump/, linked as parent.  The commit checksums
    them with the others (directly and through staging), and a rebuilt delta links them again."""
    from revenant.agent.storage import packs

    files = JobFiles(tmp_path / "storage", "j1")

    def images(d: Path, fill: int) -> None:
        (d / "predump").mkdir()
        (d / "predump" / "pages-1.img").write_bytes(bytes([fill]) * 8192)
        (d / "predump" / "pagemap-1.img").write_bytes(b"pm")
        os.symlink("predump", d / "parent")
        (d / "pages-1.img").write_bytes(bytes([fill + 1]) * 4096)
        (d / "core-1.img").write_bytes(b"core")

    def manifest() -> Manifest:
        return Manifest(job="j1", epoch=0, generation=1, node="n1", created_at=0.0, criu_version="4.1.1", kernel="k")

    direct = files.new_tmp("n1")
    images(direct, 1)
    m1 = files.commit(direct, manifest())
    staging = tmp_path / "staging"
    staging.mkdir()
    images(staging, 3)
    m2 = files.commit(files.new_tmp("n1"), manifest(), staging)
    for m in (m1, m2):
        assert "predump/pages-1.img" in m.files and "predump/pagemap-1.img" in m.files
        d = files.epoch_dir(m.epoch)
        assert os.readlink(d / "parent") == "predump" and (d / "predump" / "pages-1.img").stat().st_size == 8192
        files.verify(m.epoch)
    (files.epoch_dir(m1.epoch) / "predump" / "pages-1.img").write_bytes(b"\0" * 8192)
    with pytest.raises(Exception, match="predump/pages-1.img fails its checksum"):
        files.verify(m1.epoch)
    # Epoch 2 as a delta: rebuilt with its pre-dump linked again.
    files.commit(files.new_tmp("n1"), manifest(), staging)
    assert packs.convert(files, 2, 10).converted
    dest = files.new_tmp("n1")
    packs.materialize(files, files.verify(2), dest)
    assert os.readlink(dest / "parent") == "predump"
    assert (dest / "predump" / "pages-1.img").read_bytes() == bytes([3]) * 8192
    assert (dest / "pages-1.img").read_bytes() == bytes([4]) * 4096
