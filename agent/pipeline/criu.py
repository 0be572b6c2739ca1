"""criu at its boundary: finding it and what it can do on this kernel, the command lines
revenant runs it with, and reading what it says when it fails.

Everything criu-specific outside the engine's pipeline lives here: the engine
(``agent/checkpointing/engine.py``) asks for an argv, runs it, and asks again what went wrong.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import time
from pathlib import Path

from revenant.agent.processes import procs
from revenant.agent.storage import epochs
from revenant.common.errors import CriuError
from revenant.messages import CriuInfo

MIN_VERSION = (4, 1)
# Features revenant decides on: soft-dirty tracking gates incremental dumps and
# pre-dump; the rest are reported so operators see what the kernel offers.
FEATURES = ("mem_dirty_track", "uffd", "uffd-noncoop", "pidfd_store", "clone3_set_tid", "timens",
            "network_lock_nftables")

_VERSION_RE = re.compile(r"^Version:\s*(\S+)", re.M)
# criu rebuilt by deploy/scripts/install-criu.sh with deploy/criu/rlimits-proc-fallback.patch: it reads
# another user's rlimits from /proc/PID/limits where prlimit(2) is refused, and says so in --version.
RLIMITS_PATCH = "GitID: revenant-rlimits"
_FROZEN_RE = re.compile(r"Frozen time:\s*(\d+)\s*us")

# criu's logs, written into its work directory (-W).
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
PREDUMP_LOG = "pre-dump.log"
# A failed run's log is kept in <storage>/jobs/<job>/LOG_DIR/, the newest KEEP_LOGS of them.
LOG_DIR = "criu-logs"
KEEP_LOGS = 10
# Where criu's parasite mounts a proc of its own, relative to the dumped root's working directory
# (criu/pie/parasite.c, get_proc_fd), when the /proc it sees is not its PID namespace's.
PARASITE_PROC_DIR = "proc.crtools"
# Lines that say only that criu failed, never why; and one it logs and then succeeds anyway.
_CLOSING = ("Dumping FAILED.", "Pre-dumping FAILED.", "Restoring FAILED.")
_HARMLESS = ("RLIMIT_NOFILE",)


def locate_criu(configured: str = "", environ: dict[str, str] | None = None) -> str:
    """criu from config, then ``$REVENANT_CRIU``, then this environment's bin/, then PATH."""
    env = os.environ if environ is None else environ
    for source, value in (("criu_path", configured), ("REVENANT_CRIU", env.get("REVENANT_CRIU", ""))):
        if value:
            if not (os.path.isfile(value) and os.access(value, os.X_OK)):
                raise CriuError(f"criu not found: {source}={value} is not an executable file")
            return value
    venv_criu = os.path.join(os.path.dirname(sys.executable), "criu")
    if os.access(venv_criu, os.X_OK):
        return venv_criu
    found = shutil.which("criu", path=env.get("PATH", os.defpath))
    if found:
        return found
    raise CriuError("criu not found: set criu_path, REVENANT_CRIU, or put criu on PATH (make setup installs it)")


# ------------------------------------------------------------------ command lines

def version_argv(criu: str) -> list[str]:
    return [criu, "--version"]


def check_argv(criu: str, feature: str | None = None) -> list[str]:
    return [criu, "check"] + (["--feature", feature] if feature else [])


# A job's mount namespace (agent/running/launcher.py: a private copy of the host's, plus its own tmpfs
# /tmp and /dev/shm).  criu dumps a namespace's every mount by its filesystem's own means unless
# told otherwise: it would tar the host's /dev/shm (the agents' scratch), the cgroup tmpfs and
# any other tmpfs into each epoch, and restore private snapshots of them.  ``mnt[]`` (dump):
# every mount that is a bind of one in criu's own namespace (all the host's, and the paths the
# launcher binds back into the job's tmpfs) is recorded as external, by its path there; only the
# job's own tmpfs are dumped.  ``mnt[]`` (restore): each is bound again from that path on the
# restoring node.  ``--root /``: the namespace's root is the node's own / (without it criu 4.1.1
# crashes restoring a mount namespace, "mnt: BUG at criu/mount.c:48").  All three are no-ops for
# a job that shares the host's mount namespace (and its older epochs).
DUMP_MOUNTS = ("--external", "mnt[]")
RESTORE_MOUNTS = ("--root", "/", "--external", "mnt[]")


def network_dump_args(keep_connections: bool) -> list[str]:
    """A job's sockets (docs/cli.md, "Jobs that use the network").  ``--ext-unix-sk``: a unix
    datagram socket connected to a daemon outside the job (syslog's /dev/log).
    ``--skip-in-flight``: a connection a listening socket has not accepted yet (a busy server's)
    is left out of the epoch rather than failing the dump; the running job still has it.

    A job's TCP connections: a restore brings them back closed (RESTORE_NETWORK), so a dump
    records each as a socket to be closed (``--tcp-close``) and leaves it alone: the running job
    goes on with it, nothing held, locked or lost, at the cost of a few system calls each.  Only
    a vacate whose connections this node holds for a restore here (``keep_connections``,
    agent/network/netlock.py) dumps them whole (``--tcp-established``: each in repair mode, its queues
    read) under criu's nftables lock, taken once the job is frozen and left in place when criu
    leaves the job stopped."""
    if keep_connections:
        return ["--ext-unix-sk", "--skip-in-flight", "--tcp-established", "--network-lock", "nftables"]
    # No lock at all (``skip``): this criu's default method is nftables, whose table it would make
    # at every dump (two libnftables commands while the job is frozen) and leave behind whenever
    # it leaves the job stopped; a restore takes the method from the dump's inventory.
    return ["--ext-unix-sk", "--skip-in-flight", "--tcp-close", "--network-lock", "skip"]


# A restore brings a job's established connections back closed: its peers saw nothing since the
# epoch was taken but the job's silence, and a well-written client reconnects after the reset
# its next use gets.  Only on the node that has held them since the vacate that took the epoch
# (agent/network/netlock.py) do they come back intact: criu restores them in repair mode, then removes
# the lock its dump left (the lock method is the dump's, from its inventory) and lets them go.
RESTORE_NETWORK = ("--tcp-close", "--ext-unix-sk")
RESTORE_NETWORK_KEPT = ("--tcp-established", "--ext-unix-sk")


def dump_argv(criu: str, *, pid: int, images: Path, workdir: Path, action_script: Path,
              leave_running: bool, extra: list[str] | None = None, keep_connections: bool = False) -> list[str]:
    """Dump the tree rooted at ``pid`` into ``images``; its log goes to ``workdir``/DUMP_LOG.
    ``leave_running`` False: the tree is left stopped (a vacate kills it after the commit).
    ``extra``: arguments a pipeline step adds (a pre-dump's ``incremental_args``).
    ``keep_connections``: see network_dump_args."""
    # -v2: errors and warnings only; a verbose log is written while the job is frozen.
    # --file-locks: the job's POSIX and flock locks (SQLite holds them) are dumped and taken again.
    return [criu, "dump", "-t", str(pid), "-D", str(images), "-W", str(workdir), "-o", DUMP_LOG,
            "-v2", "--display-stats", "--action-script", str(action_script), "--file-locks",
            *DUMP_MOUNTS, *network_dump_args(keep_connections), *(extra or []),
            "--leave-running" if leave_running else "--leave-stopped"]


# A pre-dump's images, inside the epoch they precede: criu links ``<images>/parent`` to the
# directory named by --prev-images-dir, relative to the images directory, so the epoch stays
# self-contained (its images are checksummed with the others: agent/storage/epochs.py).
PREDUMP_DIR = epochs.PREDUMP_DIR


def predump_argv(criu: str, *, pid: int, images: Path, workdir: Path) -> list[str]:
    """Copy the tree's memory into ``images`` while it runs (frozen only to start the dirty
    tracking): the dump that follows writes only the pages dirtied since.  Needs the kernel's
    soft-dirty tracking (feature mem_dirty_track)."""
    return [criu, "pre-dump", "-t", str(pid), "-D", str(images), "-W", str(workdir), "-o", PREDUMP_LOG,
            "-v2", "--display-stats", "--track-mem", *DUMP_MOUNTS]


def incremental_args(parent: str = PREDUMP_DIR) -> list[str]:
    """What the dump after a pre-dump adds: keep tracking, and take unchanged pages from ``parent``."""
    return ["--track-mem", "--prev-images-dir", parent]


def restore_argv(criu: str, *, images: Path, workdir: Path, pidfile: Path,
                 action_script: Path | None = None, keep_connections: bool = False) -> list[str]:
    """Restore as the caller's own child (--restore-sibling keeps the saved PDEATHSIG alive), left
    stopped.  ``action_script``: its post-restore action lets the agent check what criu opened
    before the processes get the job's credentials (agent/checkpointing/engine.py).  ``keep_connections``:
    the epoch's TCP connections come back intact, not closed (RESTORE_NETWORK_KEPT)."""
    script = ["--action-script", str(action_script)] if action_script is not None else []
    return [criu, "restore", "-D", str(images), "-W", str(workdir), "-o", RESTORE_LOG,
            "-v4", "--restore-detached", "--restore-sibling", "--leave-stopped", "--pidfile", str(pidfile),
            "--file-locks", *script, *RESTORE_MOUNTS,
            *(RESTORE_NETWORK_KEPT if keep_connections else RESTORE_NETWORK)]


def action_script(lines: list[str], action: str = "post-dump") -> str:
    """An --action-script that runs ``lines`` (shell) at criu's ``action`` only: post-dump (the
    tree is still frozen) or post-restore (restored, its processes still criu's: root's)."""
    return (f"#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = {action} ] || exit 0\n"
            + "\n".join(lines) + "\n")


# ------------------------------------------------------------------ what criu says

def error_line(output: str) -> str:
    """criu's most telling line: its first specific error.  criu logs the cause first and then
    each caller on the way out, down to a closing "Dumping FAILED.", which is used only when
    nothing more specific was said (and the harmless RLIMIT_NOFILE error never)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    rest = [ln for ln in lines if not any(h in ln for h in _HARMLESS)]
    errors = [ln for ln in rest if "Error" in ln]
    specific = [ln for ln in errors if not ln.endswith(_CLOSING)]
    # criu's own ("Error (file:line): ...") before a library's it printed on its way out (libnftables'
    # "Error: Could not process rule" as it takes its lock down): those follow the cause.
    own = [ln for ln in specific if "Error (" in ln]
    if own or specific:
        return (own or specific)[0]
    if errors:
        return errors[-1]
    return rest[-1] if rest else "(no output)"


def read_log(logfile: Path, output: str) -> str:
    """criu's log file (if it wrote one) followed by its console output."""
    try:
        text = logfile.read_text(errors="replace")
    except OSError:
        text = ""
    return text + "\n" + output if text else output


def log_error(logfile: Path, output: str) -> str:
    """The line that says why a criu run failed, from its log and its output."""
    return error_line(read_log(logfile, output))


def keep_log(text: str, job_dir: Path, name: str, keep: int = KEEP_LOGS) -> Path:
    """Write a failed run's log to ``job_dir``/LOG_DIR/``name`` (on shared storage, so it outlives
    the node's scratch and the node), keeping the newest ``keep``; blocking I/O, raises OSError."""
    logs = job_dir / LOG_DIR
    logs.mkdir(parents=True, exist_ok=True)
    dest = logs / name
    dest.write_text(text)
    # Names start with a UTC timestamp: sorted, oldest first.
    for old in sorted(p for p in logs.iterdir() if p.suffix == ".log")[:-keep]:
        old.unlink(missing_ok=True)
    return dest


def log_name(kind: str, wall_time: float, generation: int, node: str) -> str:
    """``20251116T155626.123Z-dump-g3-node-1.log``: sortable, and says what failed where."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(wall_time)) + f".{int(wall_time * 1000) % 1000:03d}Z"
    return f"{stamp}-{kind}-g{generation}-{node}.log"


async def clear_stale_proc_dir(root_cwd: Path, timeout_s: float = 10.0) -> Path | None:
    """Remove the parasite's proc mountpoint that a criu killed mid-dump left in ``root_cwd``
    (still mounted, or not); the path if there was one.  While it exists every dump of a root
    working there fails with "Can't create a directory (-17)".  Only for a directory that no
    other dump can be using at the same time (a job's own).  Raises OSError or CriuError."""
    path = root_cwd / PARASITE_PROC_DIR
    if not os.path.lexists(path):
        return None
    if os.path.ismount(path):
        rc, out = await _run(["umount", "-l", str(path)], timeout_s)
        if rc != 0:
            raise CriuError(f"cannot unmount the stale {path}: {error_line(out)}")
    os.rmdir(path)
    return path


def no_space_line(text: str) -> str | None:
    """The first line saying the disk (or the quota) is full, if any."""
    for ln in text.splitlines():
        if "No space left on device" in ln or "Disk quota exceeded" in ln:
            return ln.strip()
    return None


def frozen_time_s(output: str) -> float:
    """How long the tree was frozen, from ``--display-stats`` (0 if criu did not say)."""
    m = _FROZEN_RE.search(output)
    return int(m.group(1)) / 1e6 if m else 0.0


def parse_version(text: str) -> str | None:
    m = _VERSION_RE.search(text)
    return m.group(1) if m else None


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


async def _run(argv: list[str], timeout_s: float) -> tuple[int, str]:
    try:
        done = await procs.run(argv, timeout_s)
    except asyncio.TimeoutError:
        raise CriuError(f"{' '.join(argv[1:])} timed out after {timeout_s:g} s") from None
    return done.returncode, done.output


async def inspect_criu(configured: str = "", timeout_s: float = 30.0) -> CriuInfo:
    """Locate criu and run ``--version``, ``check`` and ``check --feature``; never raises."""
    try:
        path = locate_criu(configured)
    except CriuError as exc:
        return CriuInfo(ok=False, error=str(exc))
    try:
        rc, out = await _run(version_argv(path), timeout_s)
        version = parse_version(out)
        if rc != 0:
            return CriuInfo(path=path, ok=False, error=f"criu --version failed: {error_line(out)}")
        if version is None:
            return CriuInfo(path=path, ok=False, error=f"{path} is not criu: no 'Version:' in its --version output")
        if version_tuple(version) < MIN_VERSION:
            need = ".".join(map(str, MIN_VERSION))
            return CriuInfo(path=path, version=version, ok=False,
                            error=f"criu {version} is too old: revenant needs {need} or later")
        other_users = RLIMITS_PATCH in out or procs.has_cap_sys_resource()
        rc, out = await _run(check_argv(path), timeout_s)
        results = await asyncio.gather(*(_run(check_argv(path, f), timeout_s) for f in FEATURES))
    except (OSError, CriuError) as exc:
        return CriuInfo(path=path, ok=False, error=f"cannot run criu: {exc}")
    # "other_users": it can dump another user's job (CAP_SYS_RESOURCE here, or the rlimits patch).
    features = {name: code == 0 for name, (code, _) in zip(FEATURES, results)} | {"other_users": other_users}
    if rc != 0:
        return CriuInfo(path=path, version=version, ok=False, features=features,
                        error=f"criu check failed: {error_line(out)}")
    return CriuInfo(path=path, version=version, ok=True, features=features)
