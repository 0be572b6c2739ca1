"""The rules for a job's own files, in-process: what the snapshot records (on this very process's
open files), how a restore decides for each file, what it moves aside, and the rendezvous with
criu's action script (played here by a thread)."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest

from revenant.agent.storage.epochs import FilesChanged, JobFile, JobFiles, Manifest
from revenant.agent.files.jobfiles import (
    LISTING,
    Snapshot,
    SnapshotResult,
    eligible_workdir,
    fingerprint,
    open_for_writing,
    scan_workdir,
)
from revenant.agent.files.aside import changed_since, move_aside
from revenant.agent.files.jobfiles_restore import apply, plan

pytestmark = pytest.mark.unit


def entry(path: Path, **kw) -> JobFile:
    st = path.stat()
    base = dict(size=st.st_size, mode=st.st_mode & 0o7777, uid=st.st_uid, gid=st.st_gid, ino=st.st_ino,
                mtime_ns=st.st_mtime_ns)
    return JobFile(**{**base, **kw})


def manifest(**kw) -> Manifest:
    return Manifest(job="1", epoch=3, generation=1, node="n", created_at=0, criu_version="4.1.1", kernel="k", **kw)


def sample(path: Path, size: int | None = None) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return fingerprint(fd, os.fstat(fd).st_size if size is None else size)
    finally:
        os.close(fd)


def test_fingerprint_sees_a_rewrite_at_the_head_or_the_tail_but_not_an_append(tmp_path):
    f = tmp_path / "data"
    f.write_bytes(os.urandom(1024 * 1024))
    before = sample(f)
    with open(f, "ab") as out:
        out.write(b"more")
    assert sample(f, 1024 * 1024) == before  # only grew: the first size bytes are unchanged
    for offset in (0, 1024 * 1024 - 1):
        with open(f, "r+b") as out:
            out.seek(offset)
            out.write(b"\x00" if f.read_bytes()[offset] else b"\x01")
        assert sample(f, 1024 * 1024) != before


def test_the_snapshot_finds_files_open_for_writing_and_how(tmp_path):
    a, w, r = tmp_path / "a.log", tmp_path / "w.csv", tmp_path / "r.txt"
    r.write_text("read only")
    with open(a, "a") as fa, open(w, "w") as fw, open(r) as fr:
        found = open_for_writing(os.getpid())
        assert found[str(a)].append and not found[str(w)].append
        assert str(r) not in found  # open for reading only: not the job's output
        assert fa and fw and fr


def test_a_copied_file_is_put_back_in_place_from_its_copy_with_owner_and_mode(tmp_path):
    epoch = tmp_path / "storage" / "jobs" / "1" / "epochs" / "3"
    f, copy = tmp_path / "state.bin", epoch / "files" / "0"
    copy.parent.mkdir(parents=True)
    f.write_bytes(b"00000007")
    copy.write_bytes(b"00000007")
    os.chown(f, 65534, 65534)
    f.chmod(0o640)
    m = manifest(job_files={str(f): entry(f, copy="files/0")})
    ino = f.stat().st_ino
    f.write_bytes(b"00000009")
    f.chmod(0o600)
    notes = apply(plan(m, epoch))
    assert f.read_bytes() == b"00000007" and notes == [f"restored {f} from epoch 3's copy (rewritten since the dump)"]
    st = f.stat()
    # The same inode (SQLite refuses a database whose path names another), owner and mode as at the dump.
    assert (st.st_ino, st.st_uid, st.st_mode & 0o777) == (ino, 65534, 0o640)
    f.unlink()
    assert apply(plan(m, epoch)) == [f"restored {f} from epoch 3's copy (deleted since the dump)"]
    assert f.read_bytes() == b"00000007" and f.stat().st_uid == 65534


def test_a_file_with_no_copy_is_cut_back_if_it_only_grew_else_refused(tmp_path):
    f = tmp_path / "train.log"
    f.write_bytes(b"step 0\nstep 1\n")
    e = entry(f, append=True, no_copy="append-only: cut back to its size on restore", sample=sample(f))
    m = manifest(job_files={str(f): e})
    with open(f, "ab") as out:
        out.write(b"step 2\n")
    assert apply(plan(m, tmp_path)) == [f"cut {f} back 7 bytes to its size at epoch 3"]
    assert f.read_bytes() == b"step 0\nstep 1\n"
    f.write_bytes(b"step 0\n")
    with pytest.raises(FilesChanged, match=r"train.log is 7 bytes, shorter than at epoch 3 \(14\), and epoch 3 "
                                           r"holds no copy of it: append-only"):
        plan(m, tmp_path)
    f.write_bytes(b"STEP 0\nstep 1\nstep 2\n")
    with pytest.raises(FilesChanged, match=r"train.log was rewritten in place since epoch 3 \(its first 14 bytes"):
        plan(m, tmp_path)
    f.unlink()
    with pytest.raises(FilesChanged, match="train.log is gone since epoch 3"):
        plan(m, tmp_path)


def test_a_big_file_with_no_copy_rewritten_at_the_same_size_is_refused(tmp_path):
    f = tmp_path / "big.bin"
    f.write_bytes(b"\x00" * 4096)
    why = "4096 bytes, over file_snapshot_max_bytes (1024), on a filesystem without reflinks"
    m = manifest(job_files={str(f): entry(f, no_copy=why, sample=sample(f))})
    assert plan(m, tmp_path)[0].note == ""  # untouched: nothing to say
    with open(f, "r+b") as out:
        out.seek(2000)
        out.write(b"\x01")  # between the sampled blocks, yet the size and mtime say it changed
    with pytest.raises(FilesChanged, match=re.escape(f"big.bin was rewritten in place since epoch 3 and epoch 3 "
                                                     f"holds no copy of it: {why}")):
        plan(m, tmp_path)


def test_changed_since_moves_new_replaced_and_changed_entries_outermost_only():
    listing = {"a": [1, 0, 0, 1], "a/old": [2, 5, 10, 0], "keep": [3, 4, 10, 0], "ckpt": [4, 9, 10, 0],
               "edited": [5, 1, 10, 0]}
    now = {"a": [1, 0, 99, 1],  # a directory's own mtime changes with its entries: not a change
           "a/old": [2, 5, 10, 0], "a/new": [9, 1, 11, 0],
           "a-c": [10, 0, 11, 1], "a-c/x": [11, 1, 11, 0],  # sorts between "a" and "a/..."
           "keep": [3, 4, 10, 0], "ckpt": [12, 9, 12, 0],  # renamed into place: another inode
           "edited": [5, 2, 12, 0]}
    # "edited" was written in place (same inode) though not open at the dump: changed, so moved too.
    assert changed_since(listing, now) == ["a-c", "a/new", "ckpt", "edited"]


def test_eligible_workdir_never_the_node_s_shared_directories_nor_the_storage(tmp_path):
    storage = tmp_path / "storage"
    assert eligible_workdir(str(tmp_path / "wd"), storage) is None
    assert "shared by the whole node" in eligible_workdir("/", storage)
    assert "shared by the whole node" in eligible_workdir("/home", storage)
    assert "overlaps revenant's storage" in eligible_workdir(str(tmp_path), storage)
    assert "overlaps revenant's storage" in eligible_workdir(str(storage / "jobs" / "1"), storage)
    home = tmp_path / "alice"
    home.mkdir()
    real_getpwuid = pwd.getpwuid
    pwd.getpwuid = lambda uid: type("pw", (), {"pw_dir": str(home)})  # alice owns it and calls it home
    try:
        assert "is a home directory" in eligible_workdir(str(home), storage)
    finally:
        pwd.getpwuid = real_getpwuid


def test_move_aside_names_the_epoch_and_keeps_what_it_moves(tmp_path):
    wd = tmp_path / "wd"
    (wd / "sub").mkdir(parents=True)
    (wd / "data.csv").write_text("x")
    (wd / "sub" / "f").write_text("y")
    epoch = tmp_path / "epoch"
    epoch.mkdir()
    (epoch / LISTING).write_bytes(msgspec.json.encode(scan_workdir(str(wd), 100)))
    m = manifest(workdir=str(wd))
    (wd / "ckpt.pt.tmp").write_text("new")
    os.rename(wd / "ckpt.pt.tmp", wd / "ckpt.pt")
    (wd / "sub" / "f").unlink()
    with open(wd / "data.csv", "a") as f:
        f.write("y")  # written in place after the dump, though not open at it: changed, moved too
    notes = move_aside(m, epoch, 100)
    aside = wd / "revenant-after-epoch-3"
    assert (aside / "ckpt.pt").read_text() == "new" and not (wd / "ckpt.pt").exists()
    assert (aside / "data.csv").read_text() == "xy" and not (wd / "data.csv").exists()
    assert notes == [f"moved 2 entries of {wd} that appeared or changed after epoch 3 to {aside}: ckpt.pt, data.csv",
                     f"1 entry of {wd} at epoch 3 are gone since: sub/f"]
    (wd / "ckpt.pt").write_text("newer")
    assert move_aside(m, epoch, 100)[0].startswith(f"moved 1 entry of {wd} that appeared or changed after epoch 3 "
                                                   f"to {aside}-2: ")  # never over an earlier one
    assert move_aside(m, epoch, 0)[0].endswith("it now has more than 0 entries (workdir_scan_max_entries)")


def rendezvous(snap: Snapshot) -> tuple[bytes, SnapshotResult]:
    """``snap.serve()`` while a thread plays criu's action script (its lines, in Python) and then
    criu's exit; the answer the script read, and the result."""
    answer: list[bytes] = []

    def script() -> None:
        with open(snap.fifo_in, "w") as f:
            f.write("frozen\n")
        with open(snap.fifo_out, "rb", buffering=0) as back:
            answer.append(back.read(16))
        snap.release()  # then criu exits

    t = threading.Thread(target=script)
    t.start()
    safety = threading.Timer(10, snap.release)  # should the script never get there
    safety.start()
    result = snap.serve()
    safety.cancel()
    t.join(5)
    assert not t.is_alive() and len(answer) == 1
    return answer[0], result


@contextlib.contextmanager
def holder(path: Path):
    """A process standing for the job: it holds ``path`` open for writing, rewritten in place
    (pytest itself holds deleted files in /tmp, which the dump would refuse: agent/files/remade.py)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'r+'); "
                             "print('held', flush=True); time.sleep(60)", str(path)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout.readline() == b"held\n"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_the_rendezvous_snapshots_while_the_script_waits_and_a_release_ends_it(tmp_path):
    scratch, epoch = tmp_path / "scratch", tmp_path / "epoch"
    scratch.mkdir()
    epoch.mkdir()
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "metrics.csv").write_text("0,1\n")
    with holder(wd / "metrics.csv") as pid:
        snap = Snapshot(pid, epoch, scratch, workdir=str(wd), storage=tmp_path / "storage",
                        max_bytes=1024, max_entries=100)
        answer, result = rendezvous(snap)
    assert answer == b"ok\n" and not result.error
    e = result.files[str(wd / "metrics.csv")]
    assert e.copy.startswith("files/") and (epoch / e.copy).read_text() == "0,1\n" and e.size == 4
    assert msgspec.json.decode((epoch / LISTING).read_bytes()) == {}  # an open file is covered, not listed
    assert result.workdir == str(wd) and result.workdir_note == ""
    # criu failed before its post-dump action: release() ends the wait at once.
    idle = Snapshot(os.getpid(), epoch, tmp_path, workdir="", storage=tmp_path, max_bytes=0, max_entries=1)
    idle.release()
    assert idle.serve().files == {}


def test_an_epoch_lists_its_files_those_not_copied_first(tmp_path):
    f = tmp_path / "x"
    f.write_text("1")
    m = manifest(job_files={"/a": entry(f, copy="files/0"), "/b": entry(f, no_copy="too big"),
                            "/c": entry(f, append=True, no_copy="append-only")})
    info = JobFiles(tmp_path, "1").info(m)
    assert [(x.path, x.copied, x.not_copied) for x in info.files] == [
        ("/b", False, "too big"), ("/a", True, ""), ("/c", False, "append-only")]
    assert (info.files_total, info.files_copied) == (3, 1)


def test_show_job_lists_the_newest_epoch_s_files_and_those_it_could_not_copy(capsys):
    from revenant.cli.jobview import _print_job, job_view
    from revenant.messages import EpochFile, EpochInfo, JobRecord, JobSpec

    files = [EpochFile(path="/wd/big.bin", size=2 << 20, not_copied="2097152 bytes, over file_snapshot_max_bytes"),
             EpochFile(path="/wd/metrics.csv", size=10, copied=True),
             EpochFile(path="/wd/train.log", size=7, not_copied="append-only: cut back to its size on restore")]
    rec = JobRecord(spec=JobSpec(id="7", argv=["train"]),
                    epochs=[EpochInfo(n=4, files=files, files_total=3, files_copied=1)])
    _print_job(rec, as_json=False)
    out = capsys.readouterr().out
    assert "epoch #4 covers 3 open for writing: 1 copied, 2 cut back on restore" in out
    assert "/wd/big.bin (2.0 MiB): not copied, 2097152 bytes, over file_snapshot_max_bytes" in out
    assert "train.log" not in out  # an append-only log is the usual case, not a warning
    assert job_view(rec)["epochs"][0]["files"][0] == {"path": "/wd/big.bin", "size": 2 << 20, "copied": False,
                                                      "not_copied": "2097152 bytes, over file_snapshot_max_bytes"}


def test_a_snapshot_that_fails_answers_error_at_once_naming_why(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / "w.csv").write_text("1\n")
    with holder(tmp_path / "w.csv") as pid:  # a copy is due, into an epoch directory that is not there
        snap = Snapshot(pid, tmp_path / "no-such-epoch", scratch, workdir="", storage=tmp_path,
                        max_bytes=1024, max_entries=10)
        answer, result = rendezvous(snap)
    assert answer == b"error\n"
    assert result.ran and result.done
    assert result.error.startswith("cannot snapshot ") and "No such file or directory" in result.error
    assert snap.why_failed() == result.error


def test_a_covered_path_now_a_symlink_or_under_one_is_refused(tmp_path):
    wd = tmp_path / "wd"
    (wd / "sub").mkdir(parents=True)
    f = wd / "sub" / "state.bin"
    f.write_bytes(b"1234")
    epoch = tmp_path / "storage" / "jobs" / "1" / "epochs" / "3"
    (epoch / "files").mkdir(parents=True)
    (epoch / "files" / "0").write_bytes(b"1234")
    m = manifest(job_files={str(f): entry(f, copy="files/0")}, workdir=str(wd))
    victim = tmp_path / "victim"
    victim.write_text("not the job's")
    f.unlink()
    f.symlink_to(victim)
    with pytest.raises(FilesChanged, match="state.bin is now a symlink; refusing to put epoch 3's file back"):
        plan(m, epoch)
    f.unlink()
    os.rename(wd / "sub", tmp_path / "elsewhere")
    (wd / "sub").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FilesChanged, match="a directory on the path of .*state.bin is now a symlink"):
        plan(m, epoch)
    assert victim.read_text() == "not the job's"
    (wd / "sub").unlink()
    # Its directory gone: made again inside the workdir, never outside it.
    assert apply(plan(m, epoch)) == [f"restored {f} from epoch 3's copy (deleted since the dump)"]
    assert f.read_bytes() == b"1234"
    outside = tmp_path / "gone" / "x.bin"
    m2 = manifest(job_files={str(outside): entry(f, copy="files/0")}, workdir=str(wd))
    with pytest.raises(FilesChanged, match="its directory .*gone is gone"):
        plan(m2, epoch)


def test_move_aside_enters_a_new_directory_holding_a_covered_file_and_spares_open_files(tmp_path):
    wd = tmp_path / "wd"
    (wd / "run").mkdir(parents=True)
    epoch = tmp_path / "epoch"
    epoch.mkdir()
    covered = wd / "run" / "metrics.csv"
    covered.write_text("0\n")
    (epoch / LISTING).write_bytes(msgspec.json.encode(scan_workdir(str(wd), 100, frozenset({str(covered)}))))
    m = manifest(workdir=str(wd), job_files={str(covered): entry(covered)})
    os.rename(wd / "run", wd / "run.old")  # the directory replaced after the dump...
    (wd / "run").mkdir()
    os.rename(wd / "run.old" / "metrics.csv", covered)
    (wd / "run" / "new.txt").write_text("later")
    (wd / "busy.log").write_text("held")
    (wd / ".cache").mkdir()  # a hidden entry is the job's like any other; __pycache__ is nobody's output
    (wd / "__pycache__").mkdir()
    with open(wd / "busy.log"):
        notes = move_aside(m, epoch, 100)
    aside = wd / "revenant-after-epoch-3"
    assert (aside / ".cache").is_dir() and (wd / "__pycache__").is_dir()
    # ...is entered, not moved: the covered file stays where the restore put it back.
    assert covered.exists() and (aside / "run" / "new.txt").exists() and (aside / "run.old").is_dir()
    assert (wd / "busy.log").exists() and any("left busy.log in" in n for n in notes), notes
    assert move_aside(m, epoch, 100, leave="job 12 shares it") == [
        "the working directory's changes after epoch 3 were left in place: job 12 shares it"]
