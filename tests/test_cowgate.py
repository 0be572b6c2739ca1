"""agent/files/gate/cowgate.py: files copied as they were when the gate was armed, whoever opens them to
write after that (the job, resumed) waiting for their copy.  Real fanotify, as root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from revenant.agent.files.gate.cowgate import CowGate

pytestmark = pytest.mark.criu  # needs root and fanotify's permission events, not criu


def _slow_copy(src: int, dest: str, size: int) -> None:
    with open(dest, "wb") as out:
        os.lseek(src, 0, os.SEEK_SET)
        while chunk := os.read(src, 1 << 20):
            out.write(chunk)
    time.sleep(0.3)  # slow enough that an ungated writer would get in first


def test_a_file_opened_to_be_written_after_the_gate_is_copied_first(tmp_path):
    paths = [tmp_path / f"f{i}" for i in range(3)]
    for p in paths:
        p.write_bytes(b"as at the epoch: " + p.name.encode())
    gate = CowGate(_slow_copy, root=os.getpid())  # the writer below is the job's: it waits for the copy
    for p in paths:
        gate.arm(os.open(p, os.O_RDONLY | os.O_NOFOLLOW), f"{p}.copy")
    # The job resumes and rewrites the last file in place at once: its open waits for the copy
    # (an outsider's would wait half a second at most: on a busy machine, not long enough).
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(paths[2])!r}, 'r+b').write(b'AFTER')"])
    errors = gate.run()
    assert writer.wait(timeout=30) == 0
    assert paths[2].read_bytes().startswith(b"AFTER")
    assert gate.unkept() == []  # the job's own file: never kept by identity for the job's write
    if gate._gate.answered() and errors:
        # The agent's thread too busy to beat (a loaded machine): its keeper let the open through
        # before the copy, and the job's write then fails the epoch, never a copy kept wrong.
        assert len(errors) == 1 and "by the job" in errors[0], errors
        return
    assert errors == []
    for p in paths:
        assert (tmp_path / f"{p.name}.copy").read_bytes() == b"as at the epoch: " + p.name.encode()


def test_a_file_truncated_by_path_while_copied_is_reported(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x" * 4096)
    gate = CowGate(lambda src, dest, size: (os.truncate(p, 0), open(dest, "wb").close()))  # no open: not gated
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
    # The writers of these tests are the job's (children of this process): they wait for the copy.
    return workdir.Taker(str(wd), epoch, epoch, None, None, 2**30, root=os.getpid()).take(stats, held)


def test_the_workdirs_changed_files_are_copied_after_the_freeze_and_a_writer_waits_for_its_copy(tmp_path):
    from revenant.agent.files import workdir
    assert workdir.gate_unavailable() == ""
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "db").write_bytes(b"at the epoch" * 100_000)
    (wd / "mapped").write_bytes(b"mapped at the epoch")
    taken = _taken(wd, tmp_path / "e", held=frozenset({"mapped"}))
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
            # The copy never ends before the kill; the opener below is the job's (a child of the
            # test's process): it waits for the copy, not half a second as an outsider would.
            gate = CowGate(lambda src, dest, size: time.sleep(60), root=os.getppid())
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
    # The writer is the job's (a child of this process): it waits for the copy, however long it takes.
    taken = workdir.Taker(str(wd), tmp, tmp, None, None, 2**30, racy_ns=(0, 0), packer=packer,
                          root=os.getpid()).take(stats)
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


# ------------------------------------------------------------------ never the host's wait (issue 44)

OPENER = "import os, sys, time; t = time.monotonic(); os.close(os.open(sys.argv[1], int(sys.argv[2]))); " \
         "print(time.monotonic() - t)"


def _timed_open(path, flags=os.O_RDONLY, timeout=30) -> float:
    """Seconds a process outside the job waited to open ``path``."""
    out = subprocess.run([sys.executable, "-c", OPENER, str(path), str(flags)], capture_output=True, text=True,
                         timeout=timeout, check=True)
    return float(out.stdout)


def _blocking_copy(release):
    def copy(src: int, dest: str, size: int) -> None:
        release.wait(60)
        with open(dest, "wb") as out:
            out.write(os.pread(src, size, 0))
    return copy


def test_an_outsider_waits_half_a_second_at_most_and_a_copy_it_did_not_change_still_counts(tmp_path):
    import threading
    p = tmp_path / "big"
    p.write_bytes(b"at the epoch" * 1000)
    release = threading.Event()
    gate = CowGate(_blocking_copy(release), root=os.getpid() + 10**6)  # a job nobody here belongs to
    assert gate.arm(os.open(p, os.O_RDONLY), f"{p}.copy")
    waited = _timed_open(p)  # a reader outside the job, its copy not made yet
    assert waited < 1.0, waited
    # It waited its half second, unless the agent's answering thread was too busy to beat (a
    # loaded machine): then the keeper let it through at once, as it must (and counted it).
    assert waited > 0.3 or gate._gate.answered() > 0, waited
    release.set()
    assert gate.run() == []  # only read: its ctime is the dump's, the copy is the dump's
    assert (tmp_path / "big.copy").read_bytes() == b"at the epoch" * 1000
    assert _timed_open(p) < 0.5  # copied: no longer gated


def test_a_file_an_outsider_writes_before_its_copy_is_not_kept_never_kept_wrong(tmp_path):
    import threading
    p = tmp_path / "db"
    p.write_bytes(b"at the epoch" * 1000)
    release = threading.Event()
    gate = CowGate(_blocking_copy(release), root=os.getpid() + 10**6)
    gate.arm(os.open(p, os.O_RDONLY), f"{p}.copy")
    writer = subprocess.run([sys.executable, "-c", f"open({str(p)!r}, 'r+b').write(b'AFTER')"], timeout=30)
    assert writer.returncode == 0
    release.set()
    assert gate.run() == []  # not the job's doing (its own opens wait for the copy): the epoch stands,
    assert gate.unkept() == [f"{p}.copy"]  # that file recorded by identity only


_TRUNCATE = "import os, sys; sys.stdin.readline(); os.truncate(sys.argv[1], 0); print('done', flush=True)"


def _truncator(p):
    return subprocess.Popen([sys.executable, "-c", _TRUNCATE, str(p)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _truncating_copy(proc):
    """A copy during which ``proc`` truncates the file by path (no open for the gate to see)."""
    def copy(src: int, dest: str, size: int) -> None:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "done\n"
        with open(dest, "wb") as out:
            out.write(os.pread(src, size, 0))
    return copy


@pytest.mark.parametrize("whose", ["job", "outsider"])
def test_a_truncate_by_path_fails_the_epoch_if_the_job_made_it_and_unkeeps_the_file_if_not(tmp_path, whose):
    """No open shows a truncate(2) by path: its event says who made it.  The job's own (resumed)
    fails the epoch; another process's makes the file not the job's to keep, the epoch standing."""
    p = tmp_path / "state.json"
    p.write_bytes(b"x" * 4096)
    with _truncator(p) as proc:
        gate = CowGate(_truncating_copy(proc), root=proc.pid if whose == "job" else os.getpid() + 10**6)
        assert gate.arm(os.open(p, os.O_RDONLY), f"{p}.copy")
        errors = gate.run()
    if whose == "job":
        assert len(errors) == 1 and "changed size while it was copied" in errors[0], errors
    else:
        assert errors == [] and gate.unkept() == [f"{p}.copy"], (errors, gate.unkept())


_HOLDER = """import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY)  # opened before the gate: no open of it to wait
print("open", flush=True)
for line in sys.stdin:
    os.ftruncate(fd, 0)
    os.write(fd, line.encode() * 100)
    print("wrote", flush=True)
"""


@pytest.mark.parametrize("when", ["before the mark", "while copied"])
def test_a_sharer_writing_through_a_descriptor_it_already_held_never_fails_the_epoch(tmp_path, when):
    """Jobs sharing a project directory: another job rewrites its own state file through a
    descriptor it opened before this job's freeze, between the freeze's look at the file and its
    mark, or while it is copied.  Not this job's doing: the file is not its to keep, and its
    epoch stands (it failed with "truncated by path")."""
    p = tmp_path / "state-other.json"
    p.write_bytes(b"at the epoch" * 100)
    with subprocess.Popen([sys.executable, "-c", _HOLDER, str(p)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdout.readline() == "open\n"

        def write() -> None:
            holder.stdin.write("changed\n")
            holder.stdin.flush()
            assert holder.stdout.readline() == "wrote\n"

        def copy(src: int, dest: str, size: int) -> None:
            if when == "while copied":
                write()
            with open(dest, "wb") as out:
                out.write(os.pread(src, size, 0))

        gate = CowGate(copy, root=os.getpid() + 10**6)  # a job the holder is not a process of
        fd = os.open(p, os.O_RDONLY)
        st = os.fstat(fd)  # the freeze's look at it
        if when == "before the mark":
            write()
        assert gate.arm(fd, f"{p}.copy", "state-other.json", st)
        assert gate.run() == []
        assert gate.unkept() == [f"{p}.copy"]
        assert p.read_bytes() == b"changed\n" * 100
        holder.stdin.close()


def test_one_gate_serves_every_checkpoint_and_holds_a_bounded_number_of_files(tmp_path, monkeypatch):
    from revenant.agent.files.gate import group
    monkeypatch.setattr(group, "MAX_GATED", 8)
    a, b = CowGate(_slow_copy), CowGate(_slow_copy)
    assert a._gate is b._gate  # one fanotify group, one answering thread, whatever the checkpoints
    armed = []
    for i in range(12):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x")
        fd = os.open(p, os.O_RDONLY)
        ok = (a if i % 2 else b).arm(fd, f"{p}.copy")
        armed.append(ok)
        if not ok:
            os.close(fd)  # the caller copies it now
    assert armed == [True] * 8 + [False] * 4
    a.close()
    b.close()
    assert not a._gate._files  # every descriptor let go


def test_a_gate_whose_answering_thread_raises_lets_every_open_through_and_fails_its_epoch(tmp_path):
    import threading
    from revenant.agent.files.gate import cowgate
    p = tmp_path / "f"
    p.write_bytes(b"x" * 4096)
    release = threading.Event()
    gate = CowGate(_blocking_copy(release), root=1)  # pid 1's descendants: every process here waits 60 s
    gate.arm(os.open(p, os.O_RDONLY), f"{p}.copy")

    def fault() -> None:
        raise RuntimeError("injected")
    gate._gate.fault = fault
    waited = _timed_open(p, os.O_RDWR)  # would wait for the copy: the thread raises on its event
    assert waited < 1.0, waited
    release.set()
    [error] = gate.run()
    assert "the file gate failed" in error and "injected" in error
    assert _timed_open(p) < 0.5
    again = CowGate(_slow_copy)  # the next checkpoint gets a gate of its own
    assert again._gate is not gate._gate and not again._gate.broken
    cowgate.close_shared()


def test_a_stopped_agent_never_holds_an_open_past_a_second_and_a_killed_one_lets_all_through(tmp_path):
    """The agent SIGSTOPped mid-copy (its gate armed, a copy that never ends): its keeper answers
    every open, the one the agent had read and held when it stopped included; then SIGKILLed:
    the group goes, and nothing waits at all."""
    p = tmp_path / "f"
    p.write_bytes(b"x" * 4096)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the agent
        try:
            gate = CowGate(lambda src, dest, size: time.sleep(600), root=1)  # every opener is "the job"
            gate.arm(os.open(p, os.O_RDONLY), f"{p}.copy")
            os.write(w, b"armed")
            gate.run()
        finally:
            os._exit(1)
    try:
        assert os.read(r, 5) == b"armed"
        # An open the agent has read and holds (for a copy that never ends) when it stops.
        held = subprocess.Popen([sys.executable, "-c", OPENER, str(p), str(os.O_RDWR)], stdout=subprocess.PIPE,
                                text=True)
        time.sleep(0.3)
        assert held.poll() is None  # waiting for its copy
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        held.communicate(timeout=30)
        assert held.returncode == 0 and time.monotonic() - stopped < 1.0
        waits = [_timed_open(p, os.O_RDWR) for _ in range(3)]
        assert max(waits) < 1.0, waits
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pid = 0
        assert _timed_open(p, os.O_RDWR) < 0.5
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_file_grown_after_the_dump_is_copied_to_its_size_at_the_dump_only(tmp_path):
    import resource
    from revenant.agent.files import workdir
    from revenant.agent.storage.epochs import EpochError
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "small").write_bytes(b"abc")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    taken = _taken(wd, tmp_path / "e")
    os.truncate(wd / "small", 100 * 2**30)  # by path, after the freeze: no open for the gate to see
    with pytest.raises(EpochError, match="changed size while it was copied"):
        workdir.finish(taken)
    copies = list((tmp_path / "e" / "files").iterdir())
    assert all(c.stat().st_size <= 3 for c in copies), [(c, c.stat().st_size) for c in copies]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB
