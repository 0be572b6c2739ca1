"""criu's command lines and what it says when it fails (agent/pipeline/criu.py), pure: no criu is run."""

from __future__ import annotations

from pathlib import Path

import pytest

from revenant.agent.pipeline import criu

pytestmark = pytest.mark.unit


def test_dump_command_line():
    argv = criu.dump_argv("/usr/sbin/criu", pid=42, images=Path("/s/jobs/1/epochs/.tmp-n1-ab"),
                          workdir=Path("/dev/shm/w"), action_script=Path("/dev/shm/w/action.sh"),
                          leave_running=True)
    assert argv == ["/usr/sbin/criu", "dump", "-t", "42", "-D", "/s/jobs/1/epochs/.tmp-n1-ab", "-W", "/dev/shm/w",
                    "-o", "dump.log", "-v2", "--display-stats", "--action-script", "/dev/shm/w/action.sh",
                    # The job's locks (SQLite's); every mount it inherited from the node is the node's.
                    "--file-locks", "--external", "mnt[]", "--ext-unix-sk", "--skip-in-flight", "--tcp-close",
                    "--network-lock", "skip", "--leave-running"]
    stopped = criu.dump_argv("criu", pid=42, images=Path("i"), workdir=Path("w"), action_script=Path("a"),
                             leave_running=False)
    assert stopped[-1] == "--leave-stopped" and "--leave-running" not in stopped


def test_connections_are_recorded_to_be_closed_unless_a_vacate_holds_them():
    """A dump leaves a job's connections alone and records them to be closed; only a vacate whose
    node holds them dumps them whole, under criu's lock (left in place with the job stopped), and
    only its restore there brings them back intact."""
    for leave_running in (True, False):
        argv = criu.dump_argv("criu", pid=1, images=Path("i"), workdir=Path("w"), action_script=Path("a"),
                              leave_running=leave_running)
        assert argv[-6:-1] == ["--ext-unix-sk", "--skip-in-flight", "--tcp-close", "--network-lock", "skip"]
        assert "--tcp-established" not in argv
    held = criu.dump_argv("criu", pid=1, images=Path("i"), workdir=Path("w"), action_script=Path("a"),
                          leave_running=False, keep_connections=True)
    assert held[-6:] == ["--ext-unix-sk", "--skip-in-flight", "--tcp-established", "--network-lock", "nftables",
                         "--leave-stopped"]
    assert "--tcp-close" not in held
    restore = criu.restore_argv("criu", images=Path("i"), workdir=Path("w"), pidfile=Path("p"))
    assert restore[-2:] == ["--tcp-close", "--ext-unix-sk"]
    intact = criu.restore_argv("criu", images=Path("i"), workdir=Path("w"), pidfile=Path("p"), keep_connections=True)
    assert intact[-2:] == ["--tcp-established", "--ext-unix-sk"]
    assert "--tcp-close" not in intact


def test_restore_command_line_makes_the_job_our_child():
    argv = criu.restore_argv("criu", images=Path("/s/jobs/1/epochs/3"), workdir=Path("/w"), pidfile=Path("/w/pid"))
    assert argv == ["criu", "restore", "-D", "/s/jobs/1/epochs/3", "-W", "/w", "-o", "restore.log", "-v4",
                    "--restore-detached", "--restore-sibling", "--leave-stopped", "--pidfile", "/w/pid",
                    "--file-locks", "--root", "/", "--external", "mnt[]", "--tcp-close", "--ext-unix-sk"]


def test_check_command_lines():
    assert criu.version_argv("criu") == ["criu", "--version"]
    assert criu.check_argv("criu") == ["criu", "check"]
    assert criu.check_argv("criu", "mem_dirty_track") == ["criu", "check", "--feature", "mem_dirty_track"]


def test_the_action_script_runs_its_lines_only_after_the_dump():
    script = criu.action_script(["stat -c '%s' '/o' >> '/w/sizes'"])
    lines = script.splitlines()
    assert lines[0] == "#!/bin/sh"
    assert lines[1] == '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0'
    assert lines[2:] == ["stat -c '%s' '/o' >> '/w/sizes'"]


RLIMIT = "(00.001) Error (criu/util.c:123): rlimit: Can't setup RLIMIT_NOFILE"


def test_the_error_is_read_from_the_log_then_the_output(tmp_path):
    log = tmp_path / "dump.log"
    # No log written (criu failed to start): the console output alone.
    assert criu.read_log(log, "boom\n") == "boom\n"
    assert criu.log_error(log, f"{RLIMIT}\nDumping FAILED.\n") == "Dumping FAILED."
    # The log's specific error beats the console's generic closing line.
    log.write_text(f"{RLIMIT}\n(00.3) Error (criu/pie/parasite.c:634): Can't create a directory (-17)\n")
    text = criu.read_log(log, "Dumping FAILED.\n")
    assert text.startswith(RLIMIT) and text.endswith("Dumping FAILED.\n")
    assert criu.log_error(log, "Dumping FAILED.\n") == \
        "(00.3) Error (criu/pie/parasite.c:634): Can't create a directory (-17)"
    assert criu.error_line("") == "(no output)"


def test_a_full_disk_is_named_and_the_freeze_is_read_from_the_stats():
    text = (f"{RLIMIT}\n  (01.2) Error (criu/image.c:4): Can't write: No space left on device  \n"
            "(01.3) Error (criu/image.c:4): Disk quota exceeded\n")
    assert criu.no_space_line(text) == "(01.2) Error (criu/image.c:4): Can't write: No space left on device"
    assert criu.no_space_line("Dumping FAILED.") is None
    assert criu.frozen_time_s("Dumping finished successfully\nFrozen time: 123456 us\n") == pytest.approx(0.123456)
    assert criu.frozen_time_s("no stats") == 0.0
