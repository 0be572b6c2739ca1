"""A job's user and what the node gives it: who it runs as (resolved here), how its init
becomes that user (setpriv), its directory and output on the storage, its environment, and
which working directory it may have.  See agent/running/launcher.py for the launch itself and
docs/security.md for why each rule is there."""

from __future__ import annotations

import os
import pwd
import shlex
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from revenant.agent.files.jobfiles import SYSTEM_DIRS
from revenant.agent.processes import procs
from revenant.agent.processes.jobprocs import PSEUDO
from revenant.agent.storage.epochs import JobFiles
from revenant.agent.storage.fileio import replace_empty
from revenant.common.errors import RevenantError
from revenant.common.settings.limits import ENV_NAME
from revenant.messages import JobSpec

# Where the launch's root processes find their tools, and a job's PATH unless it sets its own.
SYS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


class LaunchError(RevenantError):
    code = "launch_failed"


# A job's directory on the storage: root's; its user's init may enter it (its output is there).
JOB_DIR_MODE = 0o711


# The job's environment, as ``export NAME='value'`` lines, in the job's directory.
ENV_FILE = "job.env"

# From the agent's environment into a job's, as a login would set them; nothing else of the agent's.
_PASSED = ("LANG", "LANGUAGE", "TZ")


# Besides SYSTEM_DIRS themselves, nothing under these is any job's working directory.
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
                "/sys", "/usr", "/var/lib", "/var/log", "/var/cache", "/var/spool", "/var/mail", "/var/backups",
                *(p.rstrip("/") for p in PSEUDO))


@dataclass(frozen=True)
class JobUser:
    """Whom a job runs as, resolved on this node."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    shell: str = "/bin/sh"

    def env(self) -> dict[str, str]:
        return {"USER": self.name, "LOGNAME": self.name, "HOME": self.home, "SHELL": self.shell}


def resolve_user(job: str, name: str, node: str, allow_root: bool) -> JobUser:
    """The user ``name`` of ``job`` on ``node`` ("": root, for records from before jobs had
    users); a user unknown here, or root where ``allow_root`` is false, is refused."""
    name = name or "root"
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise LaunchError(f"job {job}'s user {name!r} is unknown on {node}") from None
    if pw.pw_uid == 0 and not allow_root:
        raise LaunchError(f"job {job} would run as root ({name!r} is uid 0 on {node}): set allow_root_jobs = true "
                          f"in the agent's config to allow it", code="root_refused")
    try:
        groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
    except OSError as exc:
        raise LaunchError(f"job {job}: cannot list the groups of {name!r} on {node}: {exc}") from None
    return JobUser(pw.pw_name, pw.pw_uid, pw.pw_gid, tuple(dict.fromkeys(groups)), pw.pw_dir or "/",
                   pw.pw_shell or "/bin/sh")


def setpriv_argv(setpriv: str, user: JobUser) -> list[str]:
    """Runs the rest of the command line as ``user``: its uid, gid and groups, no_new_privs,
    no inheritable capabilities, and the parent-death signal kept across the change."""
    return [setpriv, f"--reuid={user.uid}", f"--regid={user.gid}",
            f"--groups={','.join(map(str, user.groups))}" if user.groups else "--clear-groups",
            "--no-new-privs", "--inh-caps=-all", "--pdeathsig=keep", "--"]


def can_checkpoint_other_users(criu_other_users: bool = False) -> bool:
    """Whether criu, run by this process, can dump a job of another user: it reads each task's
    rlimits with prlimit(2), which needs CAP_SYS_RESOURCE for a task whose uids are not its own,
    unless it is the criu deploy/scripts/install-criu.sh patches (``criu_other_users``: the
    agent's criu says so, agent/pipeline/criu.py ``reads_other_users``)."""
    return criu_other_users or procs.has_cap_sys_resource()


def own_job_files(files: JobFiles, user: JobUser) -> None:
    """The job's directory is root's (0711: the user's init may enter it, no one else may list or
    change it; so nothing in it, the stamp, the epochs, the logs, can be swapped for a link by the
    user), and its output the user's (0600); the output is never opened through a symlink
    (replaced by an empty file instead; blocking I/O)."""
    st = os.lstat(files.dir)
    if not stat.S_ISDIR(st.st_mode):
        raise LaunchError(f"job {files.job}: {files.dir} is not a directory")
    os.chown(files.dir, os.geteuid(), os.getegid(), follow_symlinks=False)
    os.chmod(files.dir, JOB_DIR_MODE, follow_symlinks=False)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(files.output, flags, 0o600)
    except OSError:  # a symlink (ELOOP), a fifo without reader (ENXIO), ...
        replace_empty(files.output)
        fd = os.open(files.output, flags, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LaunchError(f"job {files.job}: its output {files.output} is not a regular file")
        if st.st_nlink != 1:  # a hard link to another file: never chowned to the user
            os.close(fd)
            replace_empty(files.output)
            fd = os.open(files.output, flags, 0o600)
        os.fchown(fd, user.uid, user.gid)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def job_env(spec: JobSpec, user: JobUser) -> dict[str, str]:
    """The environment the job itself gets: a login's (PATH, the user's USER, LOGNAME, HOME and
    SHELL, the agent's LANG and TZ), REVENANT_JOB_ID, then what the submit exported (``spec.env``,
    checked by the coordinator: common/settings/limits.py).  Nothing else of the agent's own environment."""
    base = {"PATH": SYS_PATH, **{k: os.environ[k] for k in _PASSED if k in os.environ}, **user.env(),
            "REVENANT_JOB_ID": spec.id}
    return {**base, **spec.env}


def env_script(env: Mapping[str, str]) -> str:
    """``export NAME='value'`` lines that a POSIX shell reads back as exactly ``env`` (names are
    shell identifiers; a value holds no NUL: both checked at submit, and again here)."""
    lines = []
    for name, value in env.items():
        if not ENV_NAME.fullmatch(name) or "\0" in value:
            raise LaunchError(f"the job's environment variable {name[:80]!r} cannot be passed to it")
        lines.append(f"export {name}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def write_job_env(files: JobFiles, env: Mapping[str, str], user: JobUser | None) -> None:
    """The job's environment file, the user's (0600), in the job's (root's) directory; a new
    inode each time, written through a descriptor (blocking I/O)."""
    path = files.dir / ENV_FILE
    tmp = files.dir / f".{ENV_FILE}.{os.getpid()}.{time.monotonic_ns()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, env_script(env).encode())
        if user is not None:
            os.fchown(fd, user.uid, user.gid)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)


def _system(real: str) -> bool:
    return real in SYSTEM_DIRS or any(within(real, tree) for tree in SYSTEM_TREES)


def workdir_problem(workdir: str, uid: int, storage: Path | str, job: str) -> str | None:
    """Why a job of ``uid`` may not work in ``workdir`` on this node, or None.  A restore puts
    files back and moves entries aside there as root, so it must be the job's user's own
    directory (for a root job, root's, that no other user can write), named by its real path (no
    link on the way: every root operation there walks it without following one, agent/files/beneath.py),
    never a system directory (a root job may use ``/``, where nothing is ever moved aside), and
    nothing in revenant's storage but the job's own directory."""
    if not workdir.startswith("/") or os.path.normpath(workdir) != workdir or workdir.startswith("//"):
        return "a working directory must be an absolute path without '.', '..', '//' or a trailing '/'"
    real = os.path.realpath(workdir)
    if real != workdir:
        return f"a directory on its path is a symbolic link (give its real path, {real})"
    if _system(real) and not (real == "/" and uid == 0):
        return f"{real} is a system directory"
    storage_real = os.path.realpath(storage)
    own = os.path.join(storage_real, "jobs", job)
    if within(real, storage_real) and not within(real, own):
        return f"it lies in revenant's storage ({storage_real}), outside the job's own directory"
    try:
        st = os.stat(real)
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if uid != 0 and st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}, not to the job's user (uid {uid})"
    if uid == 0 and (st.st_uid != 0 or st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != 0)):
        return "a root job's working directory must be root's, and no other user may write it"
    return None
