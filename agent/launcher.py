"""Launching a job: its namespaces, its init (revenant-init, the dead man's switch), its files.

A job runs in its own PID namespace, so it can be restored on any node without
PID collisions, and in its own mount namespace, with a private tmpfs at /tmp
and at /dev/shm (its *scratch*)::

    agent ─ unshare --mount --pid --fork --kill-child ─ sh (pid 1: revenant-scratch,
            which execs revenant-init) ─ the job

* ``unshare`` dies with the agent (PR_SET_PDEATHSIG), and ``--kill-child`` makes
  the namespace's init die with ``unshare``, which takes the whole namespace.
* The init redirects stdin from /dev/null and appends stdout and stderr to
  ``<storage>/jobs/<id>/output.log``, then waits for the job and exits with its
  status.  ``unshare`` itself writes nowhere near the job's output.
* The init's working directory is the job's own directory on shared storage
  (``<storage>/jobs/<id>/``); only the job itself runs in its workdir (a
  ``cd`` shim before it ``exec``s).  criu's parasite, injected into the init,
  finds that the host's /proc is not its PID namespace's and mounts a proc of
  its own at ``proc.crtools``, a path *relative to the init's working
  directory*, then removes it: two jobs that shared a workdir, dumped at once,
  failed with "Can't create a directory (-17)".  A directory of its own per job
  cannot collide, and it exists on every node a restore may pick.

The scratch.  The mount namespace starts as a private copy of the host's
(``--propagation private``: nothing mounted in it reaches the host, nor the
other way round).  Its pid 1 first runs ``revenant-scratch``
(:func:`scratch_script`), which mounts the tmpfs (``job_tmp_size``,
``job_shm_size``) and ``exec``s revenant-init; a setup that fails writes why to
the job's output and exits SCRATCH_EXIT.  A tmpfs must hide nothing the job and
its init need: where the job's workdir or its directory on the storage (its
output, its stamp, the init's working directory) lies under /tmp or /dev/shm,
by its path as given or as resolved, that one stays the host's and the launcher
logs why (:func:`scratch_plan`); production storage never lies there, the test
suite's often does.  Everything else the job finds under the host's /tmp and /dev/shm
is hidden from it.  criu (agent/criu.py) dumps the job's tmpfs with it and
treats every mount inherited from the host as the host's own (``--external
mnt[]``): a restore binds those again from the restoring node, whose own ``/``
is the root (``--root /``).
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

from revenant.agent import procs
from revenant.agent.epochs import JobFiles, replace_empty
from revenant.agent.exits import SWITCH_EXIT
from revenant.common.config import AgentConfig
from revenant.common.errors import RevenantError
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
INIT_SCRIPT = f"""out=$1; stamp=$2; fence_ms=$3; max_frozen_ms=$4; shift 4
exec </dev/null >>"$out" 2>&1 3<"$stamp"
"$@" &
child=$!
frozen=0
while kill -0 $child 2>/dev/null; do
    sleep 0.2
    m=$(stat -L -c %.3Y /dev/fd/3 2>/dev/null) || continue
    now=$(date +%s%3N)
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
INIT_NAME = "revenant-init"


class LaunchError(RevenantError):
    code = "launch_failed"


# Runs the job in its workdir while the init stays in the job's own directory (see above).
CD_SHIM = 'cd -- "$1" && shift && exec "$@"'
CD_NAME = "revenant-cd"


# The scratch's setup, run by the namespace's pid 1 before it becomes revenant-init (see above).
SCRATCH_NAME = "revenant-scratch"
SCRATCH_EXIT = 125
DEFAULT_SCRATCH: dict[str, str] = AgentConfig().job_scratch()
# The tools the setup runs, wherever the job's own PATH points.
_SYS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _within(path: str, mountpoint: str) -> bool:
    return path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")


def scratch_plan(scratch: Mapping[str, str], needed: list[str]) -> tuple[dict[str, str], list[str]]:
    """The private tmpfs mounts a job gets out of ``scratch`` (mountpoint -> size), and why the others
    stay the host's: a tmpfs there would hide a ``needed`` path (by its path as given or resolved)."""
    paths = sorted({q for p in needed for q in (os.path.abspath(p), os.path.realpath(p))})
    mounts, shared = {}, []
    for mountpoint, size in scratch.items():
        hidden = [p for p in paths if _within(p, mountpoint) or _within(p, os.path.realpath(mountpoint))]
        if hidden:
            shared.append(f"{mountpoint} stays the host's: the job needs {hidden[0]}, which a private "
                          f"{mountpoint} would hide")
        else:
            mounts[mountpoint] = size
    return mounts, shared


def scratch_script(mounts: Mapping[str, str], output: str) -> str:
    """revenant-scratch: mounts the job's tmpfs (mountpoint -> size) and ``exec``s its arguments
    (revenant-init); why it failed goes to the job's ``output``."""
    q = shlex.quote
    lines = [f"exec 2>>{q(output)}", f"sys={_SYS_PATH}",
             'fail() { echo "revenant: cannot set up this job\'s private $1" >&2; exit %d; }' % SCRATCH_EXIT]
    for mountpoint, size in mounts.items():
        name = "revenant-" + (os.path.basename(mountpoint.rstrip("/")) or "root")
        lines.append(f"PATH=$sys mount -t tmpfs -o {q(f'size={size},mode=1777,nosuid,nodev')} {name} "
                     f"{q(mountpoint)} || fail {q(mountpoint)}")
    return "\n".join(lines + ['exec "$@"']) + "\n"


def init_argv(output: Path, stamp: Path, switch_timeout_s: float, argv: list[str],
              workdir: str | None = None, max_frozen_s: float = 600.0, scratch: str | None = None) -> list[str]:
    """The command line that runs ``argv`` under revenant-init in a PID namespace of its own;
    with ``workdir``, the job runs there whatever directory the init is started in; with
    ``scratch`` (:func:`scratch_script`), in a mount namespace of its own, set up by that script."""
    job = ["/bin/sh", "-c", CD_SHIM, CD_NAME, workdir, *argv] if workdir is not None else argv
    init = ["/bin/sh", "-c", INIT_SCRIPT, INIT_NAME, str(output), str(stamp),
            str(int(switch_timeout_s * 1000)), str(int(max_frozen_s * 1000)), *job]
    if scratch is None:
        return ["unshare", "--pid", "--fork", "--kill-child", "setsid", *init]
    return ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child", "setsid",
            "/bin/sh", "-c", scratch, SCRATCH_NAME, *init]


def new_stamp(files: JobFiles) -> None:
    """A new inode for the job's dead man's switch: any stale copy still watching the old one
    fences itself (blocking I/O)."""
    replace_empty(files.stamp)


def reset_stamp(path: Path) -> None:
    """Reset one dead man's switch (safe from any thread)."""
    try:
        os.utime(path)
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
                 scratch: Mapping[str, str] | None = None) -> None:
        self.node = node
        # Each job's private tmpfs mounts, mountpoint -> size; empty: the host's /tmp and /dev/shm.
        self.scratch = dict(DEFAULT_SCRATCH if scratch is None else scratch)
        self.storage = storage
        self.switch_timeout_s = switch_timeout_s
        self.max_frozen_s = max_frozen_s
        self.start_timeout_s = start_timeout_s
        self.clock = clock

    def check(self, spec: JobSpec) -> dict[str, str]:
        """Refuse a job that cannot start here; its environment if it can."""
        if not spec.argv:
            raise LaunchError("empty command")
        if not os.path.isdir(spec.workdir):
            raise LaunchError(f"workdir {spec.workdir} does not exist on {self.node}")
        env = {**os.environ, **spec.env}
        if shutil.which(spec.argv[0], path=env.get("PATH")) is None and not (
                os.path.isfile(os.path.join(spec.workdir, spec.argv[0])) and "/" in spec.argv[0]):
            raise LaunchError(f"command not found on {self.node}: {spec.argv[0]}")
        return env

    async def prepare(self, job: str, fresh: bool) -> JobFiles:
        """The job's files for a start: its output (emptied for a ``fresh`` rerun) and a new stamp."""
        files = JobFiles(self.storage, job)
        files.dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            await asyncio.to_thread(replace_empty, files.output)
        files.output.touch()
        await asyncio.to_thread(new_stamp, files)
        return files

    async def spawn(self, spec: JobSpec, files: JobFiles, env: dict[str, str]) -> Launched:
        workdir = os.path.abspath(spec.workdir)
        argv = init_argv(files.output, files.stamp, self.switch_timeout_s, spec.argv, workdir, self.max_frozen_s,
                         self._scratch(spec.id, [workdir, str(files.dir)], files.output))
        # The init's cwd is the job's own directory: criu's parasite mounts its proc there.
        wrapper = procs.spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              cwd=files.dir, env=env, preexec_fn=procs.die_with_parent, start_new_session=True)
        pid = await self._namespace_init(wrapper)
        if pid is None:
            procs.WATCHED.discard(wrapper.pid)  # reaped by poll(): nobody waits for it
        return Launched(wrapper, pid)

    def _scratch(self, job: str, needed: list[str], output: Path) -> str | None:
        """The job's revenant-scratch script; None: no mount namespace, no scratch."""
        mounts, shared = scratch_plan(self.scratch, needed)
        for why in shared:
            log.warning("job %s: %s", job, why)
        return scratch_script(mounts, str(output)) if mounts else None

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
