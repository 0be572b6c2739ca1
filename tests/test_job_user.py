"""Jobs run as their user (agent/running/launcher.py): the uid, gid and groups the node resolves for
``JobSpec.user``, no_new_privs, the job's directory and output the user's; never root unless
``allow_root_jobs``.  criu runs as root and keeps the job's credentials: checked in
/proc/PID/status after a checkpoint, a vacate and a restore on another node (two supervisors on
one storage), and after a failover, with the output byte-exact.

criu reads each task's rlimits with prlimit(2), which for a task of another user needs
CAP_SYS_RESOURCE.  A root whose bounding set lacks it (these machines, some sandboxed VMs) needs
the criu that deploy/scripts/install-criu.sh patches to read them from /proc/PID/limits
(``make setup`` installs it): the whole path runs wherever either holds, and this suite insists
on one of them.  An unpatched criu without the capability fails the checkpoint saying so and
leaves the job unharmed (checked with the forky root's own criu, where the capability lacks)."""

from __future__ import annotations

import asyncio
import grp
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest

from conftest import COUNTER, counter_reference, gone
from helpers import agent_config, connect_as, running, until, wait_for
from revenant.agent.node.agent import Agent
from revenant.agent.processes import procs
from revenant.agent.running.jobs import Supervisor
from revenant.agent.running.jobuser import job_env
from revenant.agent.pipeline.criu import RLIMITS_PATCH
from revenant.agent.running.launcher import LaunchError, Launcher, can_checkpoint_other_users, resolve_user, setpriv_argv
from revenant.agent.storage.epochs import JobFiles
from revenant.common.errors import CriuError, NoResponders, RevenantError
from revenant.common.messaging import bus
from revenant.common.settings import security
from revenant.common.settings.config import AgentConfig, load_config
from revenant.messages import AgentJobReply, JobSpec, StartJob, subjects

USER, EXTRA_GROUP = "revenant-test", "revenant-test-x"
# The job's interpreter: the venv's lies under /root, which the test user cannot search.
PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")


# ------------------------------------------------------------------ the rules

@pytest.mark.unit
def test_root_is_refused_unless_allowed_and_no_user_means_root():
    assert AgentConfig().allow_root_jobs is False
    assert load_config(AgentConfig, "agent", environ={"REVENANT_AGENT_ALLOW_ROOT_JOBS": "true"}).allow_root_jobs
    for name in ("root", ""):  # "": a record from before jobs had users, which ran as root
        with pytest.raises(LaunchError, match=r"^job 7 would run as root \('root' is uid 0 on n1\): set "
                                              r"allow_root_jobs = true in the agent's config to allow it$") as exc:
            resolve_user("7", name, "n1", allow_root=False)
        assert exc.value.code == "root_refused"
        root = resolve_user("7", name, "n1", allow_root=True)
        assert (root.name, root.uid, root.gid, root.home) == ("root", 0, 0, pwd.getpwnam("root").pw_dir)


@pytest.mark.unit
def test_an_unknown_user_is_refused_and_a_known_one_resolves_with_its_groups():
    with pytest.raises(LaunchError, match=r"^job 7's user 'no-such-user-here' is unknown on n1$"):
        resolve_user("7", "no-such-user-here", "n1", allow_root=True)
    nobody = pwd.getpwnam("nobody")
    user = resolve_user("7", "nobody", "n1", allow_root=False)
    assert (user.uid, user.gid, user.groups) == (nobody.pw_uid, nobody.pw_gid,
                                                 tuple(dict.fromkeys(os.getgrouplist("nobody", nobody.pw_gid))))
    assert user.env() == {"USER": "nobody", "LOGNAME": "nobody", "HOME": nobody.pw_dir, "SHELL": nobody.pw_shell}
    assert setpriv_argv("/usr/bin/setpriv", user) == [
        "/usr/bin/setpriv", f"--reuid={user.uid}", f"--regid={user.gid}",
        "--groups=" + ",".join(map(str, user.groups)), "--no-new-privs", "--inh-caps=-all", "--pdeathsig=keep", "--"]


@pytest.mark.unit
def test_the_job_environment_names_its_user_and_the_spec_has_the_last_word(tmp_path):
    nobody = resolve_user("1", "nobody", "n1", allow_root=False)
    env = job_env(JobSpec(id="1", argv=["true"], user="nobody", env={"HOME": "/scratch"}), nobody)
    assert (env["USER"], env["LOGNAME"], env["HOME"], env["REVENANT_JOB_ID"]) == ("nobody", "nobody", "/scratch", "1")


@pytest.mark.unit
async def test_the_supervisor_refuses_to_start_or_restore_a_root_job_unless_allowed(tmp_path):
    sup = Supervisor("n1", tmp_path, object(), lambda subject, msg: None,  # type: ignore[arg-type]
                     allow_root_jobs=False)
    for user in ("", "root"):
        spec = JobSpec(id="3", argv=["true"], user=user)
        with pytest.raises(LaunchError, match="job 3 would run as root"):
            await sup.start(spec, 1)
        with pytest.raises(LaunchError, match="job 3 would run as root"):
            await sup.restore(spec, 2)
    assert not sup.jobs and not (tmp_path / "jobs" / "3").exists()


@pytest.mark.unit
async def test_the_jobs_directory_and_output_are_the_users_and_never_followed_through_a_symlink(tmp_path):
    nobody = resolve_user("5", "nobody", "n1", allow_root=False)
    launcher = Launcher("n1", tmp_path / "storage", 1.2, allow_root_jobs=False)
    files = JobFiles(tmp_path / "storage", "5")
    files.dir.mkdir(parents=True)
    target = tmp_path / "roots-file"
    target.write_bytes(b"root's\n")
    files.output.symlink_to(target)  # left there by the user, who owns the directory
    await launcher.prepare("5", fresh=False, user=nobody)
    assert not files.output.is_symlink() and files.output.read_bytes() == b""
    assert (target.stat().st_uid, target.read_bytes()) == (0, b"root's\n")
    st = files.dir.lstat()  # root's: nothing in it can be swapped for a link by the user
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o711)
    st = files.output.lstat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (nobody.uid, nobody.gid, 0o600)
    assert files.stamp.stat().st_uid == 0
    files.output.write_bytes(b"kept\n")
    await launcher.prepare("5", fresh=False, user=nobody)
    assert files.output.read_bytes() == b"kept\n"


@pytest.mark.unit
def test_the_criu_install_marks_its_patched_criu_as_the_agent_looks_for_it():
    repo = Path(__file__).resolve().parent.parent
    script = (repo / "deploy" / "scripts" / "install-criu.sh").read_text()
    mark = re.search(r"^patched_mark=(\S+)$", script, re.M).group(1)
    assert f"GitID: {mark}".startswith(RLIMITS_PATCH)
    patch = (repo / "deploy" / "criu" / "rlimits-proc-fallback.patch").read_text()
    assert "--- a/criu/cr-dump.c" in patch and '"limits"' in patch
    assert can_checkpoint_other_users(True)


# ------------------------------------------------------------------ real jobs, real criu

def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def test_user():
    """An unprivileged user with a supplementary group, made for the session if missing."""
    made = []
    try:
        grp.getgrnam(EXTRA_GROUP)
    except KeyError:
        _run("groupadd", "--system", EXTRA_GROUP)
        made.append(("groupdel", EXTRA_GROUP))
    try:
        pwd.getpwnam(USER)
    except KeyError:
        _run("useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
             "--groups", EXTRA_GROUP, USER)
        made.insert(0, ("userdel", USER))
    yield resolve_user("-", USER, "-", allow_root=False)
    for argv in made:  # not if a process of the user's is left: the next session reuses them
        subprocess.run(argv, capture_output=True, timeout=60)


@pytest.fixture
def workdir(test_user):
    """The job's workdir, the user's, on a path the user can search (pytest's tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="revenant-job-user-", dir="/var/tmp"))
    os.chown(path, test_user.uid, test_user.gid)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def nodes(supervisors):
    """Supervisors ("n1", "n2") sharing one storage, as two nodes would; root's jobs refused."""
    return lambda node: supervisors(node, allow_root_jobs=False)


def creds(pid: int) -> dict[str, str]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = " ".join(value.split())
    return {k: fields[k] for k in ("Uid", "Gid", "Groups", "NoNewPrivs", "CapInh", "CapPrm", "CapEff")}


def assert_runs_as(user, init_pid: int) -> None:
    """The namespace's init and the job below it carry the user's credentials, and nothing more."""
    job = psutil.Process(init_pid).children()
    assert job, "the job is not running"
    want = {"Uid": " ".join([str(user.uid)] * 4), "Gid": " ".join([str(user.gid)] * 4),
            "Groups": " ".join(map(str, sorted(user.groups))), "NoNewPrivs": "1",
            "CapInh": "0" * 16, "CapPrm": "0" * 16, "CapEff": "0" * 16}
    for pid in (init_pid, job[0].pid):
        got = creds(pid)
        got["Groups"] = " ".join(sorted(got["Groups"].split(), key=int))
        assert got == want, (pid, got)



def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n")


async def refused_then_done(sup: Supervisor, user, out: Path, count: int, tmp_path, stop: bool) -> None:
    """No CAP_SYS_RESOURCE here: the checkpoint fails with criu's reason, and the job goes on as
    its user, unharmed, to the end."""
    with pytest.raises(CriuError, match=r"criu dump failed: .*Can't get rlimit 0: Operation not permitted"):
        await sup.checkpoint("1", 1, stop=stop)
    assert_runs_as(user, sup.jobs["1"].pid)
    rt = sup.jobs["1"]
    await asyncio.wait_for(rt.exited.wait(), 60)
    assert rt.exit_code == 0
    assert out.read_bytes() == counter_reference(tmp_path, count)


def criu_dumps_other_users(criu: str) -> bool:
    """Whether ``criu``, run by this process, can dump another user's job (see the docstring)."""
    out = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=60).stdout
    return can_checkpoint_other_users(RLIMITS_PATCH in out)


def counter_spec(user, workdir: Path, count: int) -> JobSpec:
    assert PYTHON, "python3 is missing from /usr/bin and /bin: the test user's job needs one it can run"
    return JobSpec(id="1", argv=[PYTHON, str(COUNTER), str(count), "0.02"], workdir=str(workdir), user=user.name)


@pytest.mark.criu
async def test_a_job_runs_as_its_user_in_its_own_files(tmp_path, nodes, test_user, workdir):
    assert len(test_user.groups) == 2 and grp.getgrnam(EXTRA_GROUP).gr_gid in test_user.groups
    n1 = nodes("n1")
    spec = JobSpec(id="2", argv=["/bin/sh", "-c", 'id -u; id -G; echo "$USER $LOGNAME $HOME"; touch made; '
                                 'echo hello > /dev/shm/x && cat /dev/shm/x; exec sleep 60'],
                   workdir=str(workdir), user=USER)
    await n1.start(spec, 1)
    files = JobFiles(n1.storage, "2")
    await until(lambda: lines_in(files.output) >= 4)
    assert_runs_as(test_user, n1.jobs["2"].pid)
    uid, groups, names, hello = files.output.read_text().splitlines()[:4]
    assert int(uid) == test_user.uid and sorted(map(int, groups.split())) == sorted(test_user.groups)
    assert (names, hello) == (f"{USER} {USER} /nonexistent", "hello")
    assert (workdir / "made").stat().st_uid == test_user.uid
    # Its output is the user's; its directory and its stamp (the dead man's switch) stay root's.
    st = files.output.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (test_user.uid, test_user.gid, 0o600)
    st = files.dir.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o711)
    assert files.stamp.stat().st_uid == 0
    # Its credentials changed, which clears a parent-death signal: setpriv set it again, so the
    # namespace still dies with unshare (and unshare with the agent).
    rt = n1.jobs["2"]
    job = psutil.Process(rt.pid).children()[0]
    os.kill(psutil.Process(rt.pid).ppid(), signal.SIGKILL)
    await asyncio.wait_for(rt.exited.wait(), 10)
    await until(lambda: gone(job), 10)


@pytest.mark.criu
async def test_criu_keeps_the_users_credentials_across_checkpoint_vacate_and_restore(tmp_path, nodes, test_user,
                                                                                     workdir):
    n1, n2 = nodes("n1"), nodes("n2")
    spec = counter_spec(test_user, workdir, 250)
    await n1.start(spec, 1)
    out = JobFiles(n1.storage, "1").output
    await until(lambda: lines_in(out) >= 20)
    assert_runs_as(test_user, n1.jobs["1"].pid)
    assert criu_dumps_other_users(n1.engine.criu), "no CAP_SYS_RESOURCE and an unpatched criu: run make setup"
    await n1.checkpoint("1", 1, stop=False)
    assert_runs_as(test_user, n1.jobs["1"].pid)  # it went on as it was
    await until(lambda: lines_in(out) >= 60)
    await n1.checkpoint("1", 1, stop=True)  # vacate
    restored = await n2.restore(spec, 2)
    assert_runs_as(test_user, restored.pid)
    rt = n2.jobs["1"]
    await asyncio.wait_for(rt.exited.wait(), 60)
    assert rt.exit_code == 0
    assert out.read_bytes() == counter_reference(tmp_path, 250)
    assert out.stat().st_uid == test_user.uid


@pytest.mark.criu
async def test_a_failed_over_job_comes_back_as_its_user_with_its_output_exact(tmp_path, nodes, test_user, workdir):
    n1, n2 = nodes("n1"), nodes("n2")
    spec = counter_spec(test_user, workdir, 200)
    await n1.start(spec, 1)
    out = JobFiles(n1.storage, "1").output
    await until(lambda: lines_in(out) >= 20)
    assert criu_dumps_other_users(n1.engine.criu), "no CAP_SYS_RESOURCE and an unpatched criu: run make setup"
    await n1.checkpoint("1", 1, stop=False)
    n = lines_in(out)
    await until(lambda: lines_in(out) >= n + 20)  # lines after the epoch, cut back by the restore
    procs.signal_tree(n1.jobs["1"].pid, signal.SIGKILL)  # the node dies
    await until(lambda: "1" not in n1.jobs)
    restored = await n2.restore(spec, 2)
    assert_runs_as(test_user, restored.pid)
    rt = n2.jobs["1"]
    await asyncio.wait_for(rt.exited.wait(), 60)
    assert rt.exit_code == 0
    assert out.read_bytes() == counter_reference(tmp_path, 200)


@pytest.mark.criu
async def test_an_unpatched_criu_without_the_capability_refuses_saying_why_and_the_job_goes_on(
        tmp_path, supervisors, test_user, workdir):
    # criu as the forky root holds it before the patch (else the host's own, which install-criu.sh
    # never patches), run without CAP_SYS_RESOURCE whether or not this machine's root holds it.
    root = Path(os.environ.get("REVENANT_CRIU_ROOT", "/opt/revenant/criu-forky"))
    lib = root / "usr/lib/x86_64-linux-gnu"
    if (root / "usr/sbin/criu").is_file():
        criu = f"{lib}/ld-linux-x86-64.so.2 --library-path {lib} {root}/usr/sbin/criu"
    else:
        criu = shutil.which("criu") or pytest.fail(f"neither {root} nor a criu on PATH: run make setup")
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin") or pytest.fail("setpriv (util-linux) is missing")
    unpatched = tmp_path / "criu-unpatched"
    unpatched.write_text(f"#!/bin/sh\nexec {setpriv} --inh-caps=-sys_resource --bounding-set=-sys_resource -- "
                         f'{criu} "$@"\n')
    unpatched.chmod(0o755)
    version = subprocess.run([str(unpatched), "--version"], capture_output=True, text=True, timeout=60).stdout
    assert "Version:" in version and RLIMITS_PATCH not in version, version
    n1 = supervisors("n1", criu_path=str(unpatched), allow_root_jobs=False)
    await n1.start(counter_spec(test_user, workdir, 150), 1)
    out = JobFiles(n1.storage, "1").output
    await until(lambda: lines_in(out) >= 20)
    await refused_then_done(n1, test_user, out, 150, tmp_path, stop=True)


# ------------------------------------------------------------------ through the agent

@pytest.mark.nats
async def test_the_agent_refuses_a_root_job_by_default_with_one_line(nats_url, tmp_path):
    async def start(spec: JobSpec):
        try:
            await bus.request(nc, subjects.node_command("node-1", "start"), StartJob(spec=spec, generation=1),
                              AgentJobReply, 10)
        except NoResponders:  # the agent's subscription has not reached the server yet
            return None
        except RevenantError as exc:
            return exc
        raise AssertionError("the agent started it")

    config = agent_config(nats_url, tmp_path, allow_root_jobs=False)  # the default
    assert config.allow_root_jobs == AgentConfig().allow_root_jobs
    async with running(Agent(config)) as agent:
        nc = await connect_as(nats_url, security.COORDINATOR)  # commands come from the coordinator
        try:
            for user in ("", "root"):
                refused = await wait_for(lambda: start(JobSpec(id="7", argv=["sleep", "60"], user=user)))
                assert (refused.code, str(refused)) == (
                    "root_refused", "job 7 would run as root ('root' is uid 0 on node-1): set allow_root_jobs = true "
                                    "in the agent's config to allow it")
            unknown = await wait_for(lambda: start(JobSpec(id="8", argv=["sleep", "60"], user="no-such-user-here")))
            assert str(unknown) == "job 8's user 'no-such-user-here' is unknown on node-1"
            assert not agent.supervisor.jobs
        finally:
            await nc.close()
