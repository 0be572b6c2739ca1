"""agent/files/cowgate.py: files copied as they were when the gate was armed, whoever opens them to
write after that (the job, resumed) waiting for their copy.  Real fanotify, as root."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from revenant.agent.files.cowgate import CowGate

pytestmark = pytest.mark.criu  # needs root and fanotify's permission events, not criu


def _slow_copy(src: int, dest: str) -> None:
    with open(dest, "wb") as out:
        os.lseek(src, 0, os.SEEK_SET)
        while chunk := os.read(src, 1 << 20):
            out.write(chunk)
    time.sleep(0.3)  # slow enough that an ungated writer would get in first


def test_a_file_opened_to_be_written_after_the_gate_is_copied_first(tmp_path):
    paths = [tmp_path / f"f{i}" for i in range(3)]
    for p in paths:
        p.write_bytes(b"as at the epoch: " + p.name.encode())
    gate = CowGate(_slow_copy)
    for p in paths:
        gate.arm(os.open(p, os.O_RDONLY | os.O_NOFOLLOW), f"{p}.copy")
    # The job resumes and rewrites the last file in place at once: its open waits for the copy.
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(paths[2])!r}, 'r+b').write(b'AFTER')"])
    assert gate.run() == []
    assert writer.wait(timeout=30) == 0
    for p in paths:
        assert (tmp_path / f"{p.name}.copy").read_bytes() == b"as at the epoch: " + p.name.encode()
    assert paths[2].read_bytes().startswith(b"AFTER")


def test_a_file_truncated_by_path_while_copied_is_reported(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x" * 4096)
    gate = CowGate(lambda src, dest: (os.truncate(p, 0), open(dest, "wb").close()))  # no open: not gated
    gate.arm(os.open(p, os.O_RDONLY), f"{p}.copy")
    [error] = gate.run()
    assert "changed size while it was copied" in error


# ------------------------------------------------------------------ through the workdir's snapshot

def _taken(wd, epoch, held=frozenset()):
    from revenant.agent.files import workdir
    from revenant.agent.files.jobfiles import scan_workdir
    epoch.mkdir(parents=True, exist_ok=True)
    stats = {}
    scan_workdir(str(wd), 1000, stats=stats)
    return workdir.Taker(str(wd), epoch, epoch, None, None, 2**30).take(stats, held)


def test_the_workdirs_changed_files_are_copied_after_the_freeze_and_a_writer_waits_for_its_copy(tmp_path):
    from revenant.agent.files import workdir
    assert workdir.gate_unavailable() == ""
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "db").write_bytes(b"at the epoch" * 100_000)
    (wd / "mapped").write_bytes(b"mapped at the epoch")
    taken = _taken(wd, tmp_path / "e", held=frozenset({str(wd / "mapped")}))
    copies = {rel: tmp_path / "e" / rec.copy for rel, rec in taken.files.items()}
    assert taken.gate is not None and taken.gate.gated == 1
    assert copies["mapped"].read_bytes() == b"mapped at the epoch"  # held by the job: copied while frozen
    assert not copies["db"].exists()  # gated: copied once the job runs
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(wd / 'db')!r}, 'r+b').write(b'AFTER')"])
    assert writer.wait(timeout=30) == 0  # its open had the file copied first
    workdir.finish(taken)
    assert copies["db"].read_bytes() == b"at the epoch" * 100_000
    assert (wd / "db").read_bytes().startswith(b"AFTER")


def test_a_gated_file_truncated_by_path_fails_the_epoch_and_abandon_lets_opens_through(tmp_path):
    from revenant.agent.files import workdir
    from revenant.agent.storage.epochs import EpochError
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "a").write_bytes(b"x" * 4096)
    taken = _taken(wd, tmp_path / "e")
    os.truncate(wd / "a", 0)  # no open: the gate cannot see it, the size check does
    with pytest.raises(EpochError, match=r"changed while its snapshot was copied: a changed size while it was copied"):
        workdir.finish(taken)
    (wd / "b").write_bytes(b"y" * 4096)
    taken = _taken(wd, tmp_path / "e2")
    taken.abandon()  # the dump failed: nothing waits any more
    assert subprocess.run([sys.executable, "-c", f"open({str(wd / 'b')!r}, 'r+b')"], timeout=30).returncode == 0


def test_an_agent_killed_with_files_gated_leaves_no_open_waiting(tmp_path):
    """The agent SIGKILLed between arming the gate and copying (at any step of the snapshot):
    its fanotify group dies with it, and the kernel lets every open through."""
    p = tmp_path / "f"
    p.write_bytes(b"x" * 4096)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the agent
        try:
            gate = CowGate(lambda src, dest: time.sleep(60))  # the copy never ends before the kill
            gate.arm(os.open(p, os.O_RDONLY), f"{p}.copy")
            os.write(w, b"armed")
            time.sleep(60)
        finally:
            os._exit(1)
    assert os.read(r, 5) == b"armed"
    opener = subprocess.Popen([sys.executable, "-c", f"open({str(p)!r}, 'r+b').write(b'after')"])
    time.sleep(0.5)
    assert opener.poll() is None  # waiting on the gate
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    assert opener.wait(timeout=30) == 0
    assert p.read_bytes().startswith(b"after")


def test_a_packed_files_writer_waits_until_its_pages_as_at_the_epoch_are_in_the_pack(tmp_path):
    from revenant.agent.files import workdir
    from revenant.agent.storage.chain import stream, workdir_recipe
    from revenant.agent.storage.epochs import JobFiles, Manifest
    from revenant.agent.files.filestep import prepare_workdir
    from revenant.agent.files.jobfiles import scan_workdir
    wd = tmp_path / "wd"
    wd.mkdir()
    at_epoch = os.urandom(4096) * 64 + os.urandom(100)  # 64 equal pages and a tail
    (wd / "db").write_bytes(at_epoch)
    files = JobFiles(tmp_path / "storage", "1")
    _, packer = prepare_workdir(files, str(wd), 10)
    stats = {}
    scan_workdir(str(wd), 1000, stats=stats)
    tmp = files.new_tmp("n")
    taken = workdir.Taker(str(wd), tmp, tmp, None, None, 2**30, racy_ns=(0, 0), packer=packer).take(stats)
    assert taken.gate is not None and taken.gate.gated == 1
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(wd / 'db')!r}, 'r+b').write(b'AFTER' * 5000)"])
    assert writer.wait(timeout=30) == 0  # its open had the file packed first
    workdir.finish(taken)
    rec = taken.files["db"]
    m = Manifest(job="1", epoch=1, generation=1, node="n", created_at=0, criu_version="", kernel="",
                 workdir_packs=taken.table)
    assert rec.runs is not None and len(taken.table) == 1
    out = tmp_path / "rebuilt"
    with open(out, "wb") as f:
        stream(files, workdir_recipe(m, rec, "db"), rec.size, rec.crc, "db", f)
    assert out.read_bytes() == at_epoch
    assert taken.copied == 2 * (4096 + 16) + 4  # two distinct pages (the tail padded), their digests, the CRC
