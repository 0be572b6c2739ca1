"""Launching a job: its namespaces, its init (revenant-init, the dead man's switch), its files.

A job runs in its own PID namespace, so it can be restored on any node without
PID collisions, in its own IPC namespace, so the System V shared memory,
semaphores and message queues it makes are its own (criu dumps and restores
them with it, and refuses a job whose segments live in the host's namespace),
and in its own mount namespace, with a private tmpfs at /tmp and at /dev/shm
(its *scratch*)::

    agent ─ unshare --mount --ipc --pid --fork --kill-child ─ sh (pid 1: revenant-scratch, root,
            which execs setpriv, which execs revenant-init as the job's user) ─ the job

* ``unshare`` dies with the agent (PR_SET_PDEATHSIG), and ``--kill-child`` makes
  the namespace's init die with ``unshare``, which takes the whole namespace.
* The init redirects stdin from /dev/null and appends stdout and stderr to
  ``<storage>/jobs/<id>/output.log``, then waits for the job and exits with its
  status.  ``unshare`` itself writes nowhere near the job's output.
* The init's working directory is the job's own directory on shared storage
  (``<storage>/jobs/<id>/``); only the job itself runs in its workdir (a
  ``cd`` shim before it ``exec``s).  criu's parasite, injected into the init,
  finds that the host's /proc is not its PID namespace's (a root job with no
  mount namespace; the others get a /proc of their own, see below) and mounts a proc of
  its own at ``proc.crtools``, a path *relative to the init's working
  directory*, then removes it: two jobs that shared a workdir, dumped at once,
  failed with "Can't create a directory (-17)".  A directory of its own per job
  cannot collide, and it exists on every node a restore may pick.

The scratch.  The mount namespace starts as a private copy of the host's
(``--propagation private``: nothing mounted in it reaches the host, nor the
other way round).  Its pid 1 first runs ``revenant-scratch``
(:func:`scratch_script`), which mounts the tmpfs (``job_tmp_size``,
``job_shm_size``) and a /proc, and ``exec``s revenant-init; a setup that fails writes why to
the job's output and exits SCRATCH_EXIT.  A tmpfs must hide nothing the job and
its init need: where the job's workdir or its directory on the storage (its
output, its stamp, the init's working directory) lies under /tmp or /dev/shm,
by its path as given or as resolved, that one stays the host's and the launcher
logs why (:func:`scratch_plan`); production storage never lies there, the test
suite's often does.  Everything else the job finds under the host's /tmp and /dev/shm
is hidden from it.  criu (agent/pipeline/criu.py) dumps the job's tmpfs with it and
treats every mount inherited from the host as the host's own (``--external
mnt[]``): a restore binds those again from the restoring node, whose own ``/``
is the root (``--root /``).

The job's user.  ``JobSpec.user`` names the Unix user the job runs as; the agent
resolves it on its node (pwd/grp: uid, gid, supplementary groups), as nodes
sharing a user database do (:func:`resolve_user`).  The scratch runs as root (it
mounts); it ``exec``s ``setpriv`` (util-linux), which takes the user's uid, gid
and groups, sets no_new_privs, clears the inheritable capabilities and keeps the
parent-death signal (a change of credentials clears it), and ``exec``s the init:
the init, its dead man's switch and the job run as the user.  The job's directory
and its output belong to the user (mode 0700 and 0600; the init opens them by
paths relative to its working directory, so the storage above need not be
searchable by the user).  The stamp and the epochs stay root's.  A job with a
mount namespace gets a /proc of its PID namespace's: criu's parasite, which runs
with the job's credentials, refuses an unprivileged task whose /proc is not its
own ("can't dump unprivileged task whose /proc doesn't belong to it") and cannot
mount one at ``proc.crtools``; so a job that is not root's always gets a mount
namespace, scratch or not.  criu runs as root and restores the job with the
credentials it was dumped with; to read the rlimits of another user's task
(prlimit) it needs CAP_SYS_RESOURCE, which a root agent normally has (see
:func:`can_checkpoint_other_users`).  A user that resolves to uid 0 is refused
unless the agent's config sets ``allow_root_jobs``; a spec with no user (a record
from before jobs had users) is root's.  The job's environment gets the user's
USER, LOGNAME and HOME.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import psutil

from revenant.agent.processes import procs
from revenant.agent.processes.cgroups import JobCgroup
from revenant.agent.storage.epochs import JobFiles
from revenant.agent.storage.fileio import replace_empty
from revenant.agent.running.jobuser import (ENV_FILE, SYS_PATH, JobUser, LaunchError, can_checkpoint_other_users, job_env,
                                    own_job_files, resolve_user, setpriv_argv, within, workdir_problem, write_job_env)
from revenant.agent.processes.exits import SWITCH_EXIT
from revenant.common.settings.config import SWITCH_SKEW_S, AgentConfig
from revenant.common.settings.limits import BadRequest, check_env
from revenant.messages import JobSpec

log = logging.getLogger(__name__)

# pid 1 of the job's namespace.  Besides waiting for the job it is a dead man's
# switch: it holds the job's stamp file open as fd 3, and the agent touches that
# file (by path) each time it renews its lease.  If the stamp goes stale for
# FENCE_MS - the agent is dead, paused or cut off - it freezes the job (SIGSTOP to
# every other process of the namespace): a frozen job writes and does nothing, so
# it is as safe as a dead one, and loses nothing if its agent comes back and the
# leader lets it go on.  Only the agent thaws it (SIGCONT), on the leader's word.
# Frozen for MAX_FROZEN_MS with the stamp still stale (the agent never came back),
# it exits, and the kernel kills everything in the namespace.  A restore gives the
# stamp a new inode first, so a stale copy left behind on a paused node watches a
# file nobody touches any more, and freezes.  No descriptor leads outside the job's
# files, so criu dumps it like any other regular file.
# The init reads its clock before the stamp's mtime (a reset between the two reads looks
# fresh, never stale), but the mtime comes from the kernel's coarse clock, and the agent
# resets the stamps a moment after it has timed its renewal.  So the init waits this much
# longer than the agent's own fence: a switch never fires while the agent believes its lease
# was held throughout (nothing would ever thaw that job), and still long before the lease
# runs out (lease_ttl_s) and the job may be restored elsewhere.
SWITCH_SKEW_MS = round(SWITCH_SKEW_S * 1000)
INIT_SCRIPT = f"""out=$1; stamp=$2; fence_ms=$3; max_frozen_ms=$4; shift 4
exec </dev/null >>"$out" 2>&1 3<"$stamp"
"$@" &
child=$!
frozen=0
while kill -0 $child 2>/dev/null; do
    sleep 0.2
    now=$(date +%s%3N)
    m=$(stat -L -c %.3Y /dev/fd/3 2>/dev/null) || continue
    if [ $((now - ${{m%.*}}${{m#*.}})) -gt "$fence_ms" ]; then
        if [ "$frozen" = 0 ]; then
            kill -STOP -1 2>/dev/null
            frozen=$now
        elif [ $((now - frozen)) -gt "$max_frozen_ms" ]; then
            exit {SWITCH_EXIT}
        fi
    else
        frozen=0
    fi
done
wait $child
"""
INIT_NAME = procs.INIT_NAME


# Runs the job in its workdir while the init stays in the job's own directory (see above), with
# the job's environment: the file ``$1`` (in the job's directory, written by :func:`write_job_env`)
# is read here, as the job's user, after every root process of the launch is behind it.  What the
# root part ran with (ROOT_ENV) goes first: its LC_ALL=C would override the job's own LANG.
CD_SHIM = ('unset LC_ALL; . "./$1" || { echo "revenant: cannot read the job\'s environment $1" >&2; exit 126; }; '
           'shift; cd -- "$1" && shift && exec "$@"')
CD_NAME = "revenant-cd"


# The scratch's setup, run by the namespace's pid 1 before it becomes revenant-init (see above).
SCRATCH_NAME = "revenant-scratch"
SCRATCH_EXIT = 125
DEFAULT_SCRATCH: dict[str, str] = AgentConfig().job_scratch()
# The root part of a launch runs with this environment and nothing else: nothing of the job's
# reaches unshare, setsid, the scratch's shell, mount or setpriv (a PATH or an LD_PRELOAD of the
# user's would run the user's code as root).  Its tools are named by absolute paths (:func:`tools`).
ROOT_ENV = {"PATH": SYS_PATH, "LC_ALL": "C"}
# The tools of a launch's root part, found on SYS_PATH once per agent (never on a job's PATH).
TOOLS = ("unshare", "setsid", "setpriv", "mount", "umount")


def tools(path: str = SYS_PATH) -> dict[str, str]:
    """The absolute path of each of the launch's root tools (:data:`TOOLS`) found on ``path``."""
    found = {}
    for name in TOOLS:
        where = shutil.which(name, path=path)
        if where is not None:
            found[name] = os.path.realpath(where)
    return found


def given_paths(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """Host paths a job is given on its command line: its program (found on its PATH) and every
    absolute path among its arguments that exists here.  A private /tmp must not hide them (a
    program in a virtual environment under /tmp, an input file there)."""
    program = shutil.which(argv[0], path=env.get("PATH")) if argv else None
    return [p for p in [program or "", *argv[1:64]] if p.startswith("/") and os.path.exists(p)]


def scratch_plan(scratch: Mapping[str, str], needed: list[str]) -> tuple[dict[str, str], list[str]]:
    """The private tmpfs mounts a job gets out of ``scratch`` (mountpoint -> size), and why the others
    stay the host's: a tmpfs there would hide a ``needed`` path (by its path as given or resolved)."""
    paths = sorted({q for p in needed for q in (os.path.abspath(p), os.path.realpath(p))})
    mounts, shared = {}, []
    for mountpoint, size in scratch.items():
        hidden = [p for p in paths if within(p, mountpoint) or within(p, os.path.realpath(mountpoint))]
        if hidden:
            shared.append(f"{mountpoint} stays the host's: the job needs {hidden[0]}, which a private "
                          f"{mountpoint} would hide")
        else:
            mounts[mountpoint] = size
    return mounts, shared


# The host's namespace handles (``ip netns``'s /run/netns/NAME, a container runtime's, a CNI
# plugin's: nsfs mounts) are not the job's, and its private copy of them would outlive them: it
# keeps each namespace alive while the job runs, and criu records each as a mount of the host's
# to bind again at a restore, which fails once the host has let it go ("Can't stat mountpoint").
# The scratch unmounts them from the job's namespace before anything else (a mountpoint as
# mountinfo escapes it, \040 for a space, is unescaped by printf %b; no glob is expanded); one that
# will not go stays.
DROP_NSFS = """set -f
drop_nsfs() { %(umount)s -l -- "$(printf '%%b' "$5")" 2>/dev/null || :; }
while IFS= read -r entry; do
    case "$entry" in *" - nsfs "*) drop_nsfs $entry ;; esac
done < /proc/self/mountinfo
set +f"""


def scratch_script(mounts: Mapping[str, str], output: str, proc: bool = False, mount: str = "/bin/mount",
                   umount: str = "/bin/umount") -> str:
    """revenant-scratch: drops (with the tool ``umount``) the namespace handles its copy of the
    host's mounts holds (:data:`DROP_NSFS`), mounts (with the tool ``mount``) the job's tmpfs
    (mountpoint -> size), with ``proc`` a /proc of its PID namespace's, and ``exec``s its arguments
    (revenant-init); why it failed goes to the job's ``output``."""
    q = shlex.quote
    lines = [f"exec 2>>{q(output)}",
             'fail() { echo "revenant: cannot set up this job\'s private $1" >&2; exit %d; }' % SCRATCH_EXIT,
             DROP_NSFS % {"umount": q(umount)}]
    for mountpoint, size in mounts.items():
        name = "revenant-" + (os.path.basename(mountpoint.rstrip("/")) or "root")
        lines.append(f"{q(mount)} -t tmpfs -o {q(f'size={size},mode=1777,nosuid,nodev')} {name} "
                     f"{q(mountpoint)} || fail {q(mountpoint)}")
    if proc:
        lines.append(f"{q(mount)} -t proc -o nosuid,nodev,noexec revenant-proc /proc || fail /proc")
    return "\n".join(lines + ['exec "$@"']) + "\n"


def init_argv(output: Path, stamp: Path, switch_timeout_s: float, argv: list[str],
              workdir: str | None = None, max_frozen_s: float = 600.0, scratch: str | None = None,
              become: list[str] | None = None, tool: Mapping[str, str] | None = None,
              env_file: str = ENV_FILE) -> list[str]:
    """The command line that runs ``argv`` under revenant-init in a PID and an IPC namespace of its own;
    with ``workdir``, the job runs there, with the environment of ``env_file`` (relative to the
    init's directory), whatever directory the init is started in; with ``scratch``
    (:func:`scratch_script`), in a mount namespace of its own, set up by that script; with
    ``become`` (:func:`setpriv_argv`), the init and the job run as the job's user.  ``tool``: the
    absolute paths of unshare and setsid (:func:`tools`)."""
    tool = tool or {}
    job = ["/bin/sh", "-c", CD_SHIM, CD_NAME, env_file, workdir, *argv] if workdir is not None else argv
    init = [*(become or []), "/bin/sh", "-c", INIT_SCRIPT, INIT_NAME, str(output), str(stamp),
            str(int(switch_timeout_s * 1000) + SWITCH_SKEW_MS), str(int(max_frozen_s * 1000)), *job]
    unshare, setsid = tool.get("unshare", "unshare"), tool.get("setsid", "setsid")
    if scratch is None:
        return [unshare, "--ipc", "--pid", "--fork", "--kill-child", setsid, *init]
    return [unshare, "--mount", "--propagation", "private", "--ipc", "--pid", "--fork", "--kill-child", setsid,
            "/bin/sh", "-c", scratch, SCRATCH_NAME, *init]


def new_stamp(files: JobFiles) -> None:
    """A new inode for the job's dead man's switch: any stale copy still watching the old one
    fences itself (blocking I/O)."""
    replace_empty(files.stamp)


def reset_stamp(path: Path) -> None:
    """Reset one dead man's switch (safe from any thread); a link in its place is never followed."""
    try:
        os.utime(path, follow_symlinks=False)
    except OSError as exc:
        log.warning("cannot reset the dead man's switch %s: %s", path, exc)


@dataclass
class Launched:
    """A job's namespace, just started."""

    wrapper: subprocess.Popen[bytes]  # unshare
    pid: int | None  # host pid of the namespace's init; None: the whole job has already exited

    @property
    def exit_code(self) -> int:
        """The wrapper's status, shell-style (only once it has exited)."""
        code = self.wrapper.returncode
        return code if code >= 0 else 128 - code


class Launcher:
    def __init__(self, node: str, storage: Path, switch_timeout_s: float, *, start_timeout_s: float = 5.0,
                 max_frozen_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 scratch: Mapping[str, str] | None = None, allow_root_jobs: bool = True) -> None:
        self.node = node
        # The agent passes its config's allow_root_jobs (default false); a bare Launcher runs root's jobs.
        self.allow_root_jobs = allow_root_jobs
        # Each job's private tmpfs mounts, mountpoint -> size; empty: the host's /tmp and /dev/shm.
        self.scratch = dict(DEFAULT_SCRATCH if scratch is None else scratch)
        self.storage = storage
        self.switch_timeout_s = switch_timeout_s
        self.max_frozen_s = max_frozen_s
        self.start_timeout_s = start_timeout_s
        self.clock = clock
        self.tools = tools()
        self.criu_other_users = False  # the supervisor's engine's criu can dump other users' jobs

    def user(self, spec: JobSpec) -> JobUser:
        """Whom ``spec`` runs as here (:func:`resolve_user`); refused: root unless allowed, or unknown."""
        return resolve_user(spec.id, spec.user, self.node, self.allow_root_jobs)

    def check_workdir(self, spec: JobSpec, user: JobUser) -> None:
        """Refuse, in one line, a workdir ``spec`` may not have here (at every start and restore:
        a restore changes files there as root)."""
        if (why := workdir_problem(spec.workdir, user.uid, self.storage, spec.id)) is not None:
            raise LaunchError(f"job {spec.id} cannot run in {spec.workdir} on {self.node}: {why}", code="bad_workdir")

    def check(self, spec: JobSpec, user: JobUser | None = None) -> dict[str, str]:
        """Refuse a job that cannot start here (one line); the job's own environment if it can."""
        if not spec.argv:
            raise LaunchError("empty command")
        user = user or self.user(spec)
        self.check_workdir(spec, user)
        try:  # checked by the coordinator; a record from before, here
            check_env(spec.env, root=user.uid == 0)
        except BadRequest as exc:
            raise LaunchError(f"job {spec.id}: {exc}", code="bad_env") from None
        env = job_env(spec, user)
        if any("\0" in arg for arg in spec.argv):
            raise LaunchError(f"job {spec.id}: its command line holds a NUL byte")
        # Looked up here only for root's job: for a user's, root's lookup would tell the user
        # whether a file exists where they may not look; their job's shell says "not found".
        if user.uid == 0 and shutil.which(spec.argv[0], path=env.get("PATH")) is None and not (
                os.path.isfile(os.path.join(spec.workdir, spec.argv[0])) and "/" in spec.argv[0]):
            raise LaunchError(f"command not found on {self.node}: {spec.argv[0]}")
        return env

    async def prepare(self, job: str, fresh: bool, user: JobUser | None = None,
                      env: Mapping[str, str] | None = None) -> JobFiles:
        """The job's files for a start: its directory (root's), its output (emptied for a ``fresh``
        rerun; with ``user``, the user's), its environment file (``env``) and a new stamp."""
        files = JobFiles(self.storage, job)
        files.dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            await asyncio.to_thread(replace_empty, files.output)
        if user is None:
            files.output.touch()
        else:
            await asyncio.to_thread(own_job_files, files, user)
        if env is not None:
            await asyncio.to_thread(write_job_env, files, env, user)
        await asyncio.to_thread(new_stamp, files)
        return files

    def _tool(self, name: str) -> str:
        found = self.tools.get(name)
        if found is None:
            raise LaunchError(f"{name} (util-linux) is missing from {SYS_PATH} on {self.node}: jobs cannot start")
        return found

    async def spawn(self, spec: JobSpec, files: JobFiles, env: dict[str, str], user: JobUser | None = None,
                    cgroup: JobCgroup | None = None) -> Launched:
        """Start ``spec`` (as ``user``: see the module's docstring; None, as this process), in
        ``cgroup`` from its first process on.  Its root part runs with :data:`ROOT_ENV` and tools
        named by absolute paths; ``env`` (the job's own, written by :meth:`prepare`) is only looked
        at here for where the program is."""
        workdir = os.path.abspath(spec.workdir)
        become = None
        tool = {name: self._tool(name) for name in ("unshare", "setsid")}
        if user is not None:
            become = setpriv_argv(self._tool("setpriv"), user)
            if user.uid != 0 and not can_checkpoint_other_users(self.criu_other_users):
                log.warning("job %s runs as %s, but this agent lacks CAP_SYS_RESOURCE and its criu is not patched to "
                            "read the job's rlimits otherwise: criu cannot checkpoint it (deploy/scripts/install-criu.sh)",
                            spec.id, user.name)
        # The init opens its output and stamp as the user, by paths relative to its cwd (the job's
        # directory): the storage above it need not be searchable by the user.
        argv = init_argv(Path(files.output.name), Path(files.stamp.name), self.switch_timeout_s, spec.argv, workdir,
                         self.max_frozen_s, self._scratch(spec.id, [workdir, str(files.dir), *given_paths(spec.argv, env)],
                                                          files.output, user is not None and user.uid != 0),
                         become, tool)
        # The init's cwd is the job's own directory: criu's parasite mounts its proc there.
        wrapper = procs.spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              cwd=files.dir, env=dict(ROOT_ENV), preexec_fn=_before_exec(cgroup),
                              start_new_session=True)
        pid = await self._namespace_init(wrapper)
        if pid is None:
            procs.WATCHED.discard(wrapper.pid)  # reaped by poll(): nobody waits for it
        return Launched(wrapper, pid)

    def _scratch(self, job: str, needed: list[str], output: Path, unprivileged: bool) -> str | None:
        """The job's revenant-scratch script; None: no mount namespace, no scratch.  A job with a
        mount namespace gets a /proc of its own: criu's parasite, which runs with the job's
        credentials, needs one (an unprivileged job cannot mount one at proc.crtools)."""
        mounts, shared = scratch_plan(self.scratch, needed)
        for why in shared:
            log.warning("job %s: %s", job, why)
        if not (mounts or unprivileged):
            return None
        return scratch_script(mounts, str(output), proc=True, mount=self._tool("mount"), umount=self._tool("umount"))

    async def _namespace_init(self, wrapper: subprocess.Popen[bytes]) -> int | None:
        """The host pid of the namespace's init, or None if the whole job has already exited."""
        deadline = self.clock() + self.start_timeout_s
        while self.clock() < deadline:
            try:
                children = psutil.Process(wrapper.pid).children()
            except psutil.Error:
                children = []
            if children:
                return children[0].pid
            if wrapper.poll() is not None:
                return None
            await asyncio.sleep(0.005)
        procs.signal_tree(wrapper.pid, signal.SIGKILL)
        raise LaunchError(f"the job's namespace did not start within {self.start_timeout_s:g} s")


def _before_exec(cgroup: JobCgroup | None) -> Callable[[], None]:
    """What the job's first process does before it execs: die with the agent, and enter its cgroup."""
    if cgroup is None:
        return procs.die_with_parent

    def prepare() -> None:
        procs.die_with_parent()
        cgroup.join_self()

    return prepare
