"""What criu says when it fails (agent/pipeline/criu.py): the line the user sees, the failed run's log that
is kept, and the parasite's leftover proc mountpoint; pure file work, no criu is run."""

from __future__ import annotations

import pytest

from revenant.agent.pipeline import criu

pytestmark = pytest.mark.unit

# criu 4.1.1's whole dump.log (-v2) when two jobs' parasites collided on proc.crtools.
COLLISION_LOG = """\
Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
pie: 1: Error (criu/pie/parasite.c:634): Can't create a directory (-17)
pie: 1: Error (criu/pie/parasite.c:657): Can't get /proc fd
pie: 1: Close the control socket for writing
Error (criu/parasite-syscall.c:300): Can't retrieve FD from socket
Error (compel/src/lib/infect-rpc.c:44): Message reply from daemon is trimmed (12/0)
Error (criu/cr-dump.c:1630): Can't get proc fd (pid: 19650)
Error (criu/cr-dump.c:2111): Dumping FAILED.
"""

# And a restore.log (-v4, abridged) that failed.
RESTORE_LOG = """\
(00.029575) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.030160) Warn  (criu/cr-restore.c:1043): Set CLONE_PARENT | CLONE_NEWPID but it might cause restore problem
(00.031328)      1: Error (criu/mount.c:48): mnt: BUG at criu/mount.c:48
(00.031384) Error (criu/cr-restore.c:1274): 20370 stopped by signal 11: Segmentation fault
(00.032083) Error (criu/cr-restore.c:2320): Restoring FAILED.
"""


def test_the_user_sees_criu_s_first_specific_error_not_its_closing_line():
    assert criu.error_line(COLLISION_LOG) == "pie: 1: Error (criu/pie/parasite.c:634): Can't create a directory (-17)"
    assert criu.error_line(RESTORE_LOG) == "(00.031328)      1: Error (criu/mount.c:48): mnt: BUG at criu/mount.c:48"
    # Nothing more specific said: the closing line; never the harmless RLIMIT_NOFILE error.
    rlimit = COLLISION_LOG.splitlines()[0]
    assert criu.error_line(f"{rlimit}\nError (criu/cr-dump.c:2111): Dumping FAILED.\n{rlimit}\n") == \
        "Error (criu/cr-dump.c:2111): Dumping FAILED."
    assert criu.error_line(f"{rlimit}\n") == "(no output)"
    assert criu.error_line("Looks good.\n") == "Looks good."
    # A job that was gone when criu came to it: criu's own error, not libnftables' complaint as
    # criu took its network lock down on the way out.
    gone = ("Warn  (compel/src/lib/infect.c:132): Unable to interrupt task: 5315 (No such process)\n"
            "Error: Could not process rule: No such file or directory\n"
            "delete table inet CRIU-9a6ac76d-c7f0-485a-b0\n"
            "Error (compel/src/lib/infect.c:417): Unable to detach from 5315: No such process\n"
            "Error (criu/cr-dump.c:2049): Dumping FAILED.\n")
    assert criu.error_line(gone) == "Error (compel/src/lib/infect.c:417): Unable to detach from 5315: No such process"


def test_a_failed_run_s_log_is_kept_in_the_job_s_directory_newest_ten(tmp_path):
    job_dir = tmp_path / "jobs" / "7"
    names = [criu.log_name("dump", 1_764_547_200.0 + i * 1.5, 3, "node-1") for i in range(12)]
    assert names[0] == "20251201T000000.000Z-dump-g3-node-1.log"
    assert names[1] == "20251201T000001.500Z-dump-g3-node-1.log"
    for i, name in enumerate(names):
        kept = criu.keep_log(f"log {i}\n{COLLISION_LOG}", job_dir, name)
        assert kept == job_dir / criu.LOG_DIR / name and kept.read_text().startswith(f"log {i}\n")
    assert sorted(p.name for p in (job_dir / criu.LOG_DIR).iterdir()) == names[-criu.KEEP_LOGS:]


async def test_the_parasite_s_leftover_proc_mountpoint_is_removed(tmp_path):
    assert await criu.clear_stale_proc_dir(tmp_path) is None
    (tmp_path / criu.PARASITE_PROC_DIR).mkdir()
    assert await criu.clear_stale_proc_dir(tmp_path) == tmp_path / "proc.crtools"
    assert not (tmp_path / "proc.crtools").exists()
    (tmp_path / "proc.crtools").write_text("not criu's")  # not a directory: left alone, and said
    with pytest.raises(NotADirectoryError):
        await criu.clear_stale_proc_dir(tmp_path)


def test_an_exception_without_a_message_is_named_by_its_type():
    import asyncio

    from revenant.common.errors import described

    assert described(asyncio.TimeoutError()) == "TimeoutError"
    assert described(ValueError("bad interval")) == "bad interval"
