"""A user holding only their own credential tries to run code as root through a submit
(docs/security.md, "What a submit may carry"): a PATH that leads to their own tools, an
LD_PRELOAD of their own library, a working directory in /etc.  Real nats-server with the
authenticated configuration, a real coordinator and agent (`revenant up`), real processes."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import nats
import pytest

from conftest import revenant_cli, wait_until
from revenant.agent.running.jobuser import job_env
from revenant.agent.running.launcher import Launcher
from revenant.agent.storage.epochs import JobFiles
from revenant.common.settings import security
from revenant.messages import ErrorReply, JobSpec, SubmitRequest, decode, encode

NOBODY = pwd.getpwnam("nobody")
# The tools a launch runs as root, and what a job's shell runs: each faked in the user's PATH.
FAKED = ("unshare", "setsid", "setpriv", "mount", "sh", "env", "sleep", "stat", "date", "cat", "id", "kill")
CONSTRUCTOR = textwrap.dedent("""
    #include <stdio.h>
    #include <stdlib.h>
    #include <unistd.h>
    __attribute__((constructor)) static void mark(void) {
        char path[4096];
        const char *dir = getenv("MARK_DIR");
        if (!dir) return;
        snprintf(path, sizeof path, "%s/%d.%d", dir, (int) getuid(), (int) getpid());
        FILE *f = fopen(path, "w");
        if (f) fclose(f);
    }
""")


def users_dir(prefix: str) -> Path:
    """A directory of nobody's, on a path nobody can search."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    path.chmod(0o755)
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    return path


def marks(directory: Path) -> list[int]:
    """The uids that ran one of the user's tools (or their library), one per process."""
    return sorted(int(p.name.split(".")[1] if p.name.count(".") == 2 else p.name.split(".")[0])
                  for p in directory.iterdir())


@pytest.fixture
def evil():
    """nobody's tools dir, each tool leaving ``<marks>/<tool>.<uid>.<pid>`` and doing its real work."""
    tools, marked = users_dir("revenant-evil-"), users_dir("revenant-marks-")
    marked.chmod(0o777)
    for name in FAKED:
        real = shutil.which(name, path="/usr/bin:/bin")
        (tools / name).write_text(f'#!/bin/sh\n: > "{marked}/{name}.$(/usr/bin/id -u).$$"\nexec {real} "$@"\n')
        (tools / name).chmod(0o755)
        os.chown(tools / name, NOBODY.pw_uid, NOBODY.pw_gid)
    yield tools, marked
    shutil.rmtree(tools, ignore_errors=True)
    shutil.rmtree(marked, ignore_errors=True)


@pytest.fixture
def workdir():
    path = users_dir("revenant-wd-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_user(cluster, user: str, *args: str, check: bool = False) -> subprocess.CompletedProcess:
    """The CLI with ``user``'s credential, as that user would run it."""
    env = {"REVENANT_NATS": cluster.json_doc()["nats_url"], "REVENANT_CREDS": str(cluster.dir / "keys" / f"user-{user}.nk")}
    return revenant_cli(*args, env=env, check=check)


def one_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    return out.stderr.strip()


@pytest.fixture
def cluster(make_cluster):
    c = make_cluster(nodes=1)
    c.cli("keys", "--dir", str(c.dir), "--user", "nobody")
    import json

    c.json_doc = lambda: json.loads((c.dir / "cluster.json").read_text())
    wait_until(lambda: '"alive"' in c.cli("nodes", "--json", check=False).stdout, 30)
    return c


@pytest.mark.cluster
def test_a_users_path_and_library_never_run_as_root_and_a_system_workdir_is_refused(cluster, evil, workdir):
    tools, marked = evil
    # 1. PATH: the user's own unshare, setsid, mount, setpriv, sh... first on it.
    out = as_user(cluster, "nobody", "submit", "--workdir", str(workdir), "--export", "NONE",
                  "--env", f"PATH={tools}:/usr/bin:/bin", "--", "sleep", "30", check=True)
    job = out.stdout.strip()
    assert wait_until(lambda: cluster.job(job)["state"] == "running", 30), cluster.job(job)
    assert wait_until(lambda: any(p.name.startswith("sleep.") for p in marked.iterdir()), 30), list(marked.iterdir())
    ran = marks(marked)
    assert ran and 0 not in ran, sorted(p.name for p in marked.iterdir())
    assert set(ran) == {NOBODY.pw_uid}  # the job's own PATH was the job's: its sleep was the user's
    # 2. LD_PRELOAD (and the loader's other variables): refused by the coordinator, named, in one line.
    for name in ("LD_PRELOAD", "LD_LIBRARY_PATH", "BASH_ENV"):
        reply = asyncio.run(raw_submit(cluster, "nobody", SubmitRequest(argv=["sleep", "1"], workdir=str(workdir),
                                                                        env={name: f"{tools}/x.so"})))
        assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
        assert name in reply.message and "\n" not in reply.message, reply.message
    out = as_user(cluster, "nobody", "submit", "--workdir", str(workdir), "--env", "LD_PRELOAD=/x.so", "--", "true")
    assert "environment variable LD_PRELOAD is refused" in one_line(out)
    # 3. A system directory as the workdir: refused, one line, nothing started.
    for wd in ("/etc/ssh", "/var/lib/dpkg"):
        out = as_user(cluster, "nobody", "submit", "--workdir", wd, "--", "true")
        assert f"{wd} is a system directory" in one_line(out)
    out = cluster.cli("submit", "--workdir", "/etc", "--", "true", check=False)  # admin's root job too
    assert "/etc is a system directory" in one_line(out)
    # Another user's directory: refused.
    out = as_user(cluster, "nobody", "submit", "--workdir", str(cluster.dir), "--", "true")
    assert "not to the job's user" in one_line(out)


async def raw_submit(cluster, user: str, req: SubmitRequest):
    """A submit as the bare protocol sends it, past the CLI's own checks."""
    identity = security.USER_PREFIX + user
    nc = await nats.connect(cluster.json_doc()["nats_url"], nkeys_seed=str(cluster.dir / "keys" / f"{identity}.nk"),
                            inbox_prefix=security.inbox_prefix(identity), allow_reconnect=False, connect_timeout=10)
    try:
        msg = await nc.request(f"revenant.user.{user}.submit", encode(req), timeout=30)
        return decode(msg.data)
    finally:
        await nc.close()


@pytest.mark.criu
async def test_a_library_that_reached_the_node_would_run_in_the_users_processes_only(tmp_path, workdir):
    """Past the coordinator (a record from before its checks, a node of an older version): the
    node's launch never gives the job's environment to a root process.  The library marks every
    process it is loaded into with its uid."""
    lib_dir = users_dir("revenant-lib-")
    marked = users_dir("revenant-marks-")
    marked.chmod(0o777)
    try:
        (lib_dir / "mark.c").write_text(CONSTRUCTOR)
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib_dir / "mark.so"), str(lib_dir / "mark.c")],
                       check=True, capture_output=True, timeout=120)
        launcher = Launcher("n1", tmp_path / "storage", 3600.0, allow_root_jobs=False)
        spec = JobSpec(id="1", argv=["/bin/sh", "-c", "sleep 0.3; echo done"], workdir=str(workdir), user="nobody",
                       env={"LD_PRELOAD": str(lib_dir / "mark.so"), "MARK_DIR": str(marked)})
        user = launcher.user(spec)
        env = job_env(spec, user)  # not launcher.check, which refuses LD_PRELOAD on the node too
        files = await launcher.prepare("1", fresh=True, user=user, env=env)
        started = await launcher.spawn(spec, files, env, user)
        deadline = time.monotonic() + 30
        while started.wrapper.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert started.wrapper.returncode == 0, JobFiles(tmp_path / "storage", "1").output.read_text()
        ran = marks(marked)
        assert ran and set(ran) == {NOBODY.pw_uid}, ran  # the job's shell and sleep; no root process
    finally:
        shutil.rmtree(lib_dir, ignore_errors=True)
        shutil.rmtree(marked, ignore_errors=True)
