"""The working directory's snapshot (agent/files/workdir.py): taken as at the dump, linked where nothing
changed, bounded by its budget; put back exactly, whatever happened to the files since; a put-back
killed at any step is completed by the next restore; a snapshot killed at any step changed nothing."""

from __future__ import annotations

import os
import signal
import zlib
from pathlib import Path

import msgspec
import pytest

from revenant.agent.files import workdir, workdir_restore
from revenant.agent.files.aside import move_aside
from revenant.agent.files.jobfiles import scan_workdir
from revenant.agent.storage.epochs import LISTING, EpochError, FileEntry, JobFiles, Manifest

pytestmark = pytest.mark.unit


def make_workdir(tmp_path: Path) -> Path:
    wd = tmp_path / "wd"
    (wd / "base" / "5").mkdir(parents=True)
    (wd / ".git").mkdir()
    (wd / "base" / "5" / "16384").write_bytes(b"R" * 65536)
    (wd / "base" / "5" / "16385").write_bytes(b"I" * 8192)
    (wd / ".git" / "index").write_bytes(b"DIRC" * 10)
    (wd / "model.ckpt").write_bytes(os.urandom(100_000))
    os.chmod(wd / "model.ckpt", 0o640)
    os.utime(wd / "model.ckpt", ns=(1_000_000_000, 1_000_000_000))
    return wd


def state(wd: Path) -> dict[str, tuple]:
    """Every entry's content, mode and mtime (never its ctime, which no put-back can keep)."""
    out = {}
    for p in sorted(wd.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(wd))] = (p.read_bytes() if p.is_file() else None, st.st_mode, st.st_uid,
                                       None if p.is_dir() else st.st_mtime_ns)
    return out


def take(wd: Path, epoch_dir: Path, prev: workdir.Previous | None = None, budget: int = 2**30,
         uid: int | None = None, on_step=None, racy_ns: tuple[int, int] = (0, 0),
         held: frozenset[str] = frozenset()) -> tuple[workdir.Taken, Manifest]:
    epoch_dir.mkdir(parents=True, exist_ok=True)
    stats: dict[str, os.stat_result] = {}
    listing = scan_workdir(str(wd), 1000, stats=stats)
    (epoch_dir / LISTING).write_bytes(msgspec.json.encode(listing))
    taker = workdir.Taker(str(wd), epoch_dir, epoch_dir, prev, uid, budget, racy_ns=racy_ns)
    if on_step is not None:
        taker.on_step = on_step
    taken = taker.take(stats, held)
    workdir.finish(taken, on_step or (lambda step: None))
    m = Manifest(job="1", epoch=int(epoch_dir.name) if epoch_dir.name.isdigit() else 0, generation=1, node="n1", created_at=0, criu_version="4.2.1",
                 kernel="k", workdir=str(wd), workdir_files=len(taken.files), workdir_copied=taken.copied,
                 workdir_linked=taken.linked)
    return taken, m


def previous(epoch_dir: Path) -> workdir.Previous:
    files = workdir.read(epoch_dir)
    sums = {rec.copy: (rec.size, f"{zlib.crc32((epoch_dir / rec.copy).read_bytes()):08x}") for rec in files.values()}
    return workdir.Previous(epoch_dir, files, sums)


def restore(m: Manifest, epoch_dir: Path, on_step=None) -> list[str]:
    """What agent/files/filestep.py does before criu restores: move aside, then put back."""
    snap = workdir.read(epoch_dir)
    notes = move_aside(m, epoch_dir, 1000, snapshot=frozenset(snap))
    plan = workdir_restore.plan(m, epoch_dir, snap, JobFiles(epoch_dir.parent, "1"))
    return notes + (workdir_restore.apply(plan, on_step) if on_step else workdir_restore.apply(plan))


def test_every_regular_file_is_taken_and_unchanged_ones_are_linked_from_the_previous_epoch(tmp_path):
    wd = make_workdir(tmp_path)
    first, _ = take(wd, tmp_path / "epochs" / "1")
    assert set(first.files) == {"base/5/16384", "base/5/16385", ".git/index", "model.ckpt"}
    assert first.copied == 65536 + 8192 + 40 + 100_000 and first.linked == 0
    with open(wd / "base" / "5" / "16384", "r+b") as f:  # a page rewritten, the file closed again
        f.write(b"X" * 8192)
    second, _ = take(wd, tmp_path / "epochs" / "2", previous(tmp_path / "epochs" / "1"))
    assert second.copied == 65536 and second.linked == 8192 + 40 + 100_000
    e1, e2 = tmp_path / "epochs" / "1", tmp_path / "epochs" / "2"
    unchanged = first.files["model.ckpt"].copy, second.files["model.ckpt"].copy
    assert (e1 / unchanged[0]).stat().st_ino == (e2 / unchanged[1]).stat().st_ino  # one copy, two epochs
    assert (e2 / second.files["base/5/16384"].copy).read_bytes()[:8192] == b"X" * 8192
    assert (e1 / first.files["base/5/16384"].copy).read_bytes() == b"R" * 65536
    assert set(second.known) == {second.files[r].copy for r in ("base/5/16385", ".git/index", "model.ckpt")}
    assert all(oct((e2 / rec.copy).stat().st_mode)[-3:] == "600" for rec in second.files.values())


def test_a_file_changed_just_before_the_dump_or_held_by_the_job_is_never_trusted_by_its_times(tmp_path):
    wd = make_workdir(tmp_path)
    os.link(wd / "model.ckpt", wd / "model.link")  # a second link: one copy, never opened twice
    first, _ = take(wd, tmp_path / "epochs" / "1", racy_ns=(10**12, 10**12))  # all of it "just now"
    assert all(rec.racy for rec in first.files.values())
    assert first.files["model.link"].copy == first.files["model.ckpt"].copy
    assert first.copied == 65536 + 8192 + 40 + 100_000  # the linked inode once
    second, _ = take(wd, tmp_path / "epochs" / "2", previous(tmp_path / "epochs" / "1"))
    assert second.linked == 0  # racy at the first epoch: copied again, whatever its times say
    third, _ = take(wd, tmp_path / "epochs" / "3", previous(tmp_path / "epochs" / "2"))
    assert third.linked == 65536 + 8192 + 40 + 100_000
    fourth, _ = take(wd, tmp_path / "epochs" / "4", previous(tmp_path / "epochs" / "3"),
                     held=frozenset({"model.ckpt"}))
    assert fourth.files["model.ckpt"].racy and fourth.linked == 65536 + 8192 + 40  # held: copied
    assert not workdir.WorkdirFile(**{**msgspec.structs.asdict(fourth.files["model.ckpt"])}).same(
        (wd / "model.ckpt").stat())  # and always put back


def test_over_the_budget_the_snapshot_fails_naming_the_largest_files(tmp_path):
    wd = make_workdir(tmp_path)
    before = state(wd)
    with pytest.raises(workdir.OverBudget, match=r"over workdir_snapshot_max_bytes \(1\.0 KiB\); the largest: "
                                                 r"model\.ckpt \(97\.7 KiB\), base/5/16384 \(64\.0 KiB\), "
                                                 r"base/5/16385 \(8\.0 KiB\)"):
        take(wd, tmp_path / "epochs" / "1", budget=1024)
    assert state(wd) == before


def test_a_users_job_takes_only_its_users_files(tmp_path):
    wd = make_workdir(tmp_path)
    os.chown(wd / "model.ckpt", 65534, 65534)
    taken, _ = take(wd, tmp_path / "epochs" / "1", uid=65534)
    assert set(taken.files) == {"model.ckpt"}


def test_a_restore_puts_back_every_file_as_at_the_epoch_keeping_its_inode(tmp_path):
    wd = make_workdir(tmp_path)
    e1 = tmp_path / "epochs" / "1"
    _, m = take(wd, e1)
    at_epoch = state(wd)
    rel_ino = (wd / "base" / "5" / "16384").stat().st_ino
    with open(wd / "base" / "5" / "16384", "r+b") as f:  # rewritten in place
        f.write(b"Y" * 100)
    os.truncate(wd / "base" / "5" / "16385", 10)  # truncated
    (wd / ".git" / "index.lock").write_bytes(b"new index")  # replaced by a rename
    os.rename(wd / ".git" / "index.lock", wd / ".git" / "index")
    os.chmod(wd / "model.ckpt", 0o600)  # its mode changed, its content not
    (wd / "new.txt").write_text("after the epoch")  # appeared after the epoch: moved aside
    (wd / "base" / "6").mkdir()
    (wd / "base" / "6" / "x").write_text("later")
    notes = restore(m, e1)
    aside = wd / "revenant-after-epoch-1"
    assert (aside / "new.txt").read_text() == "after the epoch" and (aside / "base" / "6" / "x").exists()
    now = state(wd)
    assert {k: v for k, v in now.items() if not k.startswith("revenant-after-epoch-1")} == at_epoch
    assert (wd / "base" / "5" / "16384").stat().st_ino == rel_ino  # the inode a program may know
    assert any("put back 4 of the 4 files" in n for n in notes), notes
    # Gone: made again, with the directories it lay in.
    import shutil
    shutil.rmtree(wd / "base")
    notes = restore(m, e1)
    assert {k: v[0] for k, v in state(wd).items() if k.startswith("base/5/")} == \
        {k: v[0] for k, v in at_epoch.items() if k.startswith("base/5/")}
    again = state(wd)
    restore(m, e1)  # once more: the same
    assert state(wd) == again


def killed_at(k: int, work) -> bool:
    """Run ``work(on_step)`` in a forked agent, SIGKILLed as it reaches its step number ``k``;
    whether it was killed (False: it finished in fewer steps)."""
    pid = os.fork()
    if pid == 0:
        seen = []

        def stop(step: str) -> None:
            seen.append(step)
            if len(seen) > k:
                os.kill(os.getpid(), signal.SIGKILL)
        try:
            work(stop)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


def test_a_put_back_killed_at_each_step_is_completed_by_the_next_restore(tmp_path):
    wd = make_workdir(tmp_path)
    e1 = tmp_path / "epochs" / "1"
    _, m = take(wd, e1)
    at_epoch = state(wd)
    steps = 0
    while True:
        for p in (wd / "base" / "5" / "16384", wd / "model.ckpt", wd / ".git" / "index"):
            with open(p, "r+b") as f:
                f.write(os.urandom(64))
        (wd / f"after-{steps}").write_text("new")
        killed = killed_at(steps, lambda stop: restore(m, e1, stop))
        restore(m, e1)  # the next restore of the epoch (a failover's)
        assert {k: v for k, v in state(wd).items() if not k.startswith("revenant-after-epoch-")} == at_epoch
        if not killed:
            break
        steps += 1
    assert steps == 3  # one kill before each of the three files put back


def test_a_snapshot_killed_at_each_step_changes_nothing_in_the_workdir(tmp_path):
    wd = make_workdir(tmp_path)
    _, _ = take(wd, tmp_path / "epochs" / "1")
    with open(wd / "model.ckpt", "r+b") as f:
        f.write(b"changed")
    before = state(wd)
    for k in range(5):
        killed = killed_at(k, lambda stop: take(wd, tmp_path / "epochs" / f"{10 + k}",
                                                previous(tmp_path / "epochs" / "1"), on_step=stop))
        assert killed == (k < 4), k  # 3 links, 1 copy
        assert state(wd) == before


def test_an_unreadable_snapshot_refuses_the_restore(tmp_path):
    wd = make_workdir(tmp_path)
    e1 = tmp_path / "epochs" / "1"
    take(wd, e1)
    (e1 / "workdir-files.json").write_text("{not json")
    with pytest.raises(EpochError, match="unreadable workdir-files.json"):
        workdir.read(e1)


def test_a_copy_linked_into_the_next_epoch_is_counted_once_in_the_jobs_storage(tmp_path):
    from revenant.agent.storage import packs

    files = JobFiles(tmp_path / "storage", "1")
    wd = make_workdir(tmp_path)
    committed = []
    for k in range(2):
        tmp = files.new_tmp("n1")
        (tmp / "pages-1.img").write_bytes(b"p" * 4096)
        prev = None
        if committed:
            d = files.epoch_dir(committed[-1].epoch)
            prev = workdir.previous(d, committed[-1], str(wd))
        taken, m = take(wd, tmp, prev)
        m.files = {n: FileEntry(size=size, checksum=crc) for n, (size, crc) in taken.known.items()}
        committed.append(files.commit(tmp, m))
    assert committed[1].workdir_linked == committed[0].workdir_copied > 0
    storage, own = packs.usage(files)
    workdir_bytes = committed[0].workdir_copied
    plain = sum(f.size for f in committed[1].files.values()) - workdir_bytes
    assert own[committed[1].epoch] == plain + (files.epoch_dir(committed[1].epoch) / "manifest.json").stat().st_size
    assert storage == sum(own.values()) + workdir_bytes  # the shared copies once, in neither epoch's own


def test_a_users_file_gets_its_setgid_bit_back_only_for_a_group_the_user_is_still_in(tmp_path):
    wd = make_workdir(tmp_path)
    f = wd / "model.ckpt"
    os.chown(f, 65534, 0)  # nobody's file, in root's group (nobody is not in it)
    os.chmod(f, 0o2750)
    e1 = tmp_path / "epochs" / "1"
    _, m = take(wd, e1, uid=65534)
    m.user = "nobody"
    f.write_bytes(b"later")
    files = JobFiles(tmp_path / "storage", "1")
    [todo] = workdir_restore.plan(m, e1, workdir.read(e1), files).todo
    assert todo.entry.mode == 0o750
    m.user = "root"
    [todo] = workdir_restore.plan(m, e1, workdir.read(e1), files).todo
    assert todo.entry.mode == 0o2750
