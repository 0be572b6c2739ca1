"""The rules that keep a submit's strings away from root: which environment a job may get and how
it reaches the job, which working directory it may have, and what `revenant submit` exports
(docs/security.md, "What a submit may carry").  Pure rules, and the shell that reads the job's
environment back."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from revenant.agent.files.jobfiles import scan_workdir
from revenant.agent.files.jobfiles_restore import plan
from revenant.agent.running.jobuser import env_script, workdir_problem
from revenant.agent.running.launcher import CD_NAME, CD_SHIM, ROOT_ENV, init_argv
from revenant.agent.storage.epochs import FilesChanged, JobFile, Manifest
from revenant.cli.client import exported_env
from revenant.common.settings.limits import BadRequest, check_env, check_submit, env_problem
from revenant.messages import SubmitRequest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "BASH_ENV", "ENV", "SHELLOPTS",
                                  "BASH_FUNC_ls%%", "GCONV_PATH", "GLIBC_TUNABLES"])
def test_what_the_loader_or_a_shell_acts_on_is_refused_for_every_job_naming_it(name):
    for root in (True, False):
        problem = env_problem(name, "/home/mallory/x.so", root)
        assert problem is not None and name[:80] in problem, problem
    with pytest.raises(BadRequest, match=name.split("%")[0]):
        check_submit(SubmitRequest(argv=["true"], env={"SEED": "1", name: "x"}), "alice")


def test_an_interpreters_start_up_variables_are_refused_only_for_roots_jobs():
    for name in ("PYTHONSTARTUP", "PYTHONPATH", "PERL5OPT", "NODE_OPTIONS", "JAVA_TOOL_OPTIONS"):
        assert env_problem(name, "x", root=False) is None
        assert "runs as root" in env_problem(name, "x", root=True)
    check_submit(SubmitRequest(argv=["true"], env={"PYTHONPATH": "/home/alice/lib"}), "alice")
    for user in ("", "root"):
        with pytest.raises(BadRequest, match="PYTHONPATH is refused for a job that runs as root"):
            check_submit(SubmitRequest(argv=["true"], env={"PYTHONPATH": "/x"}), user)


def test_names_that_are_not_identifiers_and_values_with_nul_are_refused():
    for name in ("", "1X", "A-B", "A B", "A=B", "Ä"):
        with pytest.raises(BadRequest, match="a name is letters, digits and '_'"):
            check_env({name: "v"}, root=False)
    with pytest.raises(BadRequest, match="NUL"):
        check_env({"X": "a\0b"}, root=False)
    check_env({"_X1": "any 'quoted' \"value\"\n$(rm -rf /)`id`"}, root=True)


def test_the_job_reads_back_exactly_the_environment_it_was_given(tmp_path):
    """The job's shell sources the file the agent wrote, as the job's user: quotes, newlines and
    command substitutions in values arrive as they are, and nothing runs."""
    env = {"A": "it's \"quoted\"", "B": "line1\nline2", "C": "$(touch pwned)`touch pwned2`", "D": "",
           "PATH": "/usr/bin:/bin", "E": "\\ $HOME ~ *"}
    (tmp_path / "job.env").write_text(env_script(env))
    (tmp_path / "wd").mkdir()
    out = subprocess.run(["/bin/sh", "-c", CD_SHIM, CD_NAME, "job.env", str(tmp_path / "wd"), "/usr/bin/env", "-0"],
                         cwd=tmp_path, env=ROOT_ENV, capture_output=True, timeout=10, check=True).stdout
    got = dict(item.split("=", 1) for item in out.decode().split("\0") if item)
    assert {k: got[k] for k in env} == env
    assert not list(tmp_path.rglob("pwned*"))


def test_the_root_part_of_a_launch_names_its_tools_by_absolute_paths():
    argv = init_argv(Path("output.log"), Path("alive"), 1.0, ["sleep", "1"], "/w",
                     tool={"unshare": "/usr/bin/unshare", "setsid": "/usr/bin/setsid"})
    assert argv[0] == "/usr/bin/unshare" and "/usr/bin/setsid" in argv and "setsid" not in argv
    assert set(ROOT_ENV) == {"PATH", "LC_ALL"}


def _export(export, pairs=(), environ=None, root=False):
    return exported_env(export, list(pairs), environ if environ is not None else
                        {"HOME": "/home/a", "SEED": "7", "LD_LIBRARY_PATH": "/opt/x", "PYTHONPATH": "/p",
                         "REVENANT_CREDS": "/k/user-a.nk", "BASH_FUNC_f%%": "() { :; }"}, root)


def test_submit_exports_as_sbatch_does():
    env, dropped = _export(None)  # ALL, the default
    assert env == {"HOME": "/home/a", "SEED": "7", "PYTHONPATH": "/p"}
    assert sorted(dropped) == ["BASH_FUNC_f%%", "LD_LIBRARY_PATH"]  # REVENANT_* silently: the client's own
    env, dropped = _export(None, root=True)
    assert env == {"HOME": "/home/a", "SEED": "7"} and "PYTHONPATH" in dropped
    assert _export("NONE") == ({}, [])
    assert _export("SEED,X=1", ["Y=a=b"]) == ({"SEED": "7", "X": "1", "Y": "a=b"}, [])
    env, _ = _export("ALL,SEED=8", ["HOME=/h"])
    assert env["SEED"] == "8" and env["HOME"] == "/h"
    with pytest.raises(BadRequest, match="NONE stands alone"):
        _export("NONE,SEED")
    with pytest.raises(BadRequest, match="--export NOPE: it is not set"):
        _export("NOPE")
    with pytest.raises(BadRequest, match="--env takes NAME=VALUE"):
        _export("NONE", ["JUSTANAME"])


def test_a_workdir_must_be_the_users_real_directory_outside_system_and_storage(tmp_path):
    storage = tmp_path / "storage"
    (storage / "jobs" / "7").mkdir(parents=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    os.chown(mine, 65534, 65534)
    assert workdir_problem(str(mine), 65534, storage, "7") is None
    assert "belongs to uid 65534, not to the job's user (uid 1000)" in workdir_problem(str(mine), 1000, storage, "7")
    assert "a root job's working directory must be root's" in workdir_problem(str(mine), 0, storage, "7")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "no other user may write it" in workdir_problem(str(shared), 0, storage, "7")
    shared.chmod(0o755)
    assert workdir_problem(str(shared), 0, storage, "7") is None
    (tmp_path / "link").symlink_to(mine)
    assert "symbolic link (give its real path" in workdir_problem(str(tmp_path / "link"), 65534, storage, "7")
    for bad in ("relative", f"{mine}/", f"{mine}/../mine", "//etc"):
        assert "absolute path without" in workdir_problem(bad, 65534, storage, "7")
    for system in ("/etc", "/etc/ssh", "/var/lib/dpkg", "/usr/local", "/proc/1", "/boot", "/tmp"):
        assert workdir_problem(system, 0, storage, "7") == f"{system} is a system directory"
    assert workdir_problem("/", 0, storage, "7") is None  # root's: nothing is ever moved aside there
    assert workdir_problem("/", 65534, storage, "7") == "/ is a system directory"
    assert "lies in revenant's storage" in workdir_problem(str(storage / "jobs"), 0, storage, "7")
    assert "lies in revenant's storage" in workdir_problem(str(storage / "jobs" / "8"), 0, storage, "7")
    assert workdir_problem(str(storage / "jobs" / "7"), 0, storage, "7") is None
    assert "cannot be read" in workdir_problem(str(tmp_path / "nope"), 0, storage, "7")


def test_a_users_job_gets_back_only_its_users_own_files(tmp_path):
    """A user's job held another user's file open for writing (mode 0666 then): its owner has
    since taken the right away; root must not write it back, nor give it its old mode."""
    theirs = tmp_path / "shared.txt"
    theirs.write_text("v2, private now\n")
    os.chown(theirs, 1, 1)
    theirs.chmod(0o600)
    st = theirs.stat()
    entry = JobFile(size=3, mode=0o666, uid=1, gid=1, ino=st.st_ino, mtime_ns=0, copy="files/0")
    m = Manifest(job="1", epoch=2, generation=1, node="n", created_at=0, criu_version="4.2.1", kernel="k",
                 user="nobody", job_files={str(theirs): entry})
    with pytest.raises(FilesChanged, match=r"shared.txt belongs to uid 1, not to the job's user nobody \(uid 65534\)"):
        plan(m, tmp_path)
    assert theirs.read_text() == "v2, private now\n" and theirs.stat().st_mode & 0o777 == 0o600


def test_a_workdir_that_leads_through_a_link_is_never_listed(tmp_path):
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (real / "sub" / "f").write_text("x")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(OSError):
        scan_workdir(str(tmp_path / "link"), 100)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "salary.xlsx").write_text("y")
    (real / "inner").symlink_to(secret)  # a directory in it swapped for a link: not entered
    assert set(scan_workdir(str(real), 100)) == {"sub", "sub/f", "inner"}


def test_nul_bytes_in_what_reaches_a_command_line_are_refused():
    for req, what in ((SubmitRequest(argv=["sh", "-c", "a\0b"]), "the command line"),
                      (SubmitRequest(argv=["true"], workdir="/w\0x"), "the working directory"),
                      (SubmitRequest(argv=["true"], name="n\0"), "the job's name")):
        with pytest.raises(BadRequest, match=f"^{what} holds a NUL byte$"):
            check_submit(req, "alice")
