"""A cgroup per job: what it asked for (``--mem``, ``--cpus``) as its limits, and the limits every
job gets from its spec whatever it asked (its memory limit where it reserved none, its processes:
``JobResources.memory_limit_bytes`` and ``pids``, the cluster's ``[resources]``), the processes
capped by the node's own ``job_pids_max`` as well.

Each start or restore of a job gets ``revenant/<node>/<job>-g<generation>`` in the memory, cpu and
pids controllers: on cgroup v2 (one hierarchy with those three controllers) ``memory.max``,
``cpu.max`` and ``pids.max``; on a v1 or hybrid host (one hierarchy per controller, as on the
machines revenant is tested on, whose cgroup2 mount has none of the three) ``memory.limit_in_bytes``,
``cpu.cfs_quota_us`` over a 100 ms period, and ``pids.max``.  The agent creates it, with the
limits of the job's spec, before anything of the job runs:

* a start puts the job's first process in it before it execs (:meth:`JobCgroup.join_self`), so
  everything the job forks is in it from the start;
* criu records a dumped task's cgroups, with their properties, in every epoch (``cgroup.img``);
  a restore gives criu the new generation's cgroup as the root of each of those controllers
  (``--cgroup-root memory:/revenant/b/7-g3``, one per controller: a global root would make criu
  create the path in every hierarchy, cpuset's included, where it cannot write an empty
  cpuset.cpus) with ``--manage-cgroups=soft``: criu moves the restored tasks into the existing
  cgroup and leaves its properties, the spec's limits, as the agent set them.

The cgroup goes once the job's processes have (:meth:`JobCgroup.remove`); a job the kernel's OOM
killer hit inside it is told by the cgroup's own count (:meth:`JobCgroup.oom_kills`).
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from revenant.messages import JobResources

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "cpu", "pids")
PERIOD_US = 100_000
ROOT = "revenant"


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy: how criu and /proc/PID/cgroup name it ("memory",
    "cpu,cpuacct"; "" for v2), where it is mounted, and the controllers of ours it holds."""

    name: str
    mount: Path
    controllers: tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    """Where this node's job cgroups go: v2, one hierarchy; v1, one per controller; none: why."""

    version: int = 0
    hierarchies: tuple[Hierarchy, ...] = ()
    why_none: str = ""

    def describe(self) -> str:
        if not self.version:
            return f"none ({self.why_none})"
        return f"cgroup v{self.version} ({', '.join(c for h in self.hierarchies for c in h.controllers)})"


def _mounts(mountinfo: str) -> list[tuple[str, Path, list[str]]]:
    """(fstype, mount point, super options) of each cgroup mount in ``mountinfo``'s text."""
    out = []
    for line in mountinfo.splitlines():
        mine, sep, theirs = line.partition(" - ")
        fields, rest = mine.split(), theirs.split()
        if sep and len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            point = fields[4].replace("\\040", " ")
            out.append((rest[0], Path(point), rest[2].split(",")))
    return out


def discover(mountinfo: str | None = None, proc_cgroup: str | None = None) -> Layout:
    """This host's cgroup layout (from /proc/self/mountinfo and /proc/self/cgroup unless given)."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
        proc_cgroup = Path("/proc/self/cgroup").read_text() if proc_cgroup is None else proc_cgroup
    except OSError as exc:
        return Layout(why_none=f"cannot read the cgroup mounts: {exc.strerror}")
    mounts = _mounts(mountinfo)
    for fstype, point, _ in mounts:
        if fstype == "cgroup2":
            try:
                have = set((point / "cgroup.controllers").read_text().split())
            except OSError:
                continue
            if set(CONTROLLERS) <= have:
                return Layout(2, (Hierarchy("", point, CONTROLLERS),))
    names = {}  # a v1 hierarchy's controllers -> its name in /proc/self/cgroup
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[1]:
            names[frozenset(parts[1].split(","))] = parts[1]
    found: dict[str, Hierarchy] = {}
    for fstype, point, options in mounts:
        mine = tuple(c for c in CONTROLLERS if c in options)
        if fstype != "cgroup" or not mine or any(c in found for c in mine):
            continue
        name = next((n for ctl, n in names.items() if set(mine) <= ctl), ",".join(mine))
        hierarchy = Hierarchy(name, point, mine)
        found.update((c, hierarchy) for c in mine)
    missing = [c for c in CONTROLLERS if c not in found]
    if missing:
        return Layout(why_none=f"no cgroup hierarchy with the {', '.join(missing)} controller"
                               f"{'s' if len(missing) > 1 else ''} is mounted")
    return Layout(1, tuple(dict.fromkeys(found[c] for c in CONTROLLERS)))


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class JobCgroup:
    """One generation's cgroup: ``rel`` below each hierarchy's root."""

    def __init__(self, layout: Layout, rel: str) -> None:
        self.layout = layout
        self.rel = rel
        self.dirs = [h.mount / rel for h in layout.hierarchies]

    def create(self, asked: JobResources, pids_max: int) -> None:
        """Make it (empty: one left by an earlier try is reused) with ``asked``'s limits; raises OSError."""
        for h, d in zip(self.layout.hierarchies, self.dirs):
            if self.layout.version == 2:
                self._delegate(h.mount)
            d.mkdir(parents=True, exist_ok=True)
        for name, value in self.limits(asked, pids_max).items():
            _write(self._file(name), value)

    def _delegate(self, mount: Path) -> None:
        """v2: the three controllers enabled in every cgroup above this one (the root's included)."""
        here = mount
        for part in (*Path(self.rel).parts[:-1], None):
            control = here / "cgroup.subtree_control"
            if not set(CONTROLLERS) <= set(control.read_text().split()):
                _write(control, " ".join(f"+{c}" for c in CONTROLLERS))
            if part is not None:
                here = here / part
                here.mkdir(exist_ok=True)

    def limits(self, asked: JobResources, pids_max: int) -> dict[str, str]:
        """Each control file and the value it gets."""
        quota = max(round(asked.cpus * PERIOD_US), 1000) if asked.cpus else 0  # the kernel's least: 1 ms
        most = min((n for n in (pids_max, asked.pids) if n > 0), default=0)  # the node's and the job's
        pids = str(most) if most else "max"
        memory = asked.memory_cap()  # its reservation, else the cluster's limit for every job
        if self.layout.version == 2:
            return {"memory.max": str(memory) if memory else "max",
                    "cpu.max": f"{quota or 'max'} {PERIOD_US}", "pids.max": pids}
        return {"memory.limit_in_bytes": str(memory) if memory else "-1",
                "cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": str(quota or -1), "pids.max": pids}

    def _file(self, name: str) -> Path:
        controller = name.split(".", 1)[0]
        return next(d for h, d in zip(self.layout.hierarchies, self.dirs) if controller in h.controllers) / name

    def join_self(self) -> None:
        """Move the calling process into it (a start's first process, before it execs)."""
        pid = str(os.getpid())
        for d in self.dirs:
            _write(d / "cgroup.procs", pid)

    def criu_args(self) -> list[str]:
        """criu restore's arguments that put the restored job in it, keeping its limits."""
        roots = [f"/{self.rel}"] if self.layout.version == 2 else \
            [f"{h.name}:/{self.rel}" for h in self.layout.hierarchies]
        return ["--manage-cgroups=soft", *(a for root in roots for a in ("--cgroup-root", root))]

    def oom_kills(self) -> int:
        """Processes the OOM killer killed in it (0 if unknown)."""
        name = "memory.events" if self.layout.version == 2 else "memory.oom_control"
        try:
            text = self._file(name).read_text()
        except (OSError, StopIteration):
            return 0
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0))

    def remove(self) -> bool:
        """rmdir it in every hierarchy; False if a process is still in it (it stays for later)."""
        gone = True
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    log.warning("cannot remove cgroup %s: %s", d, exc.strerror)
                gone = False
        return gone


class NodeCgroups:
    """This node's job cgroups: ``revenant/<node>/`` below each hierarchy's root."""

    def __init__(self, node: str, layout: Layout, pids_max: int = 0) -> None:
        self.node = node
        self.layout = layout
        self.pids_max = pids_max
        self.retired: list[JobCgroup] = []  # ended jobs' cgroups, removed once their last process is gone

    @classmethod
    def start(cls, node: str, enabled: bool, pids_max: int) -> NodeCgroups:
        """An agent's, as it starts: the host's layout (unless turned off), the empty cgroups an
        earlier agent of this node left removed."""
        layout = discover() if enabled else Layout(why_none="job_cgroups is off")
        made = cls(node, layout, pids_max)
        log.info("job cgroups: %s; %d left empty removed", layout.describe(), made.sweep())
        return made

    def retire(self, cg: JobCgroup | None) -> None:
        if cg is not None and not cg.remove():
            self.retired.append(cg)

    def tidy(self) -> None:
        """Remove the retired cgroups whose processes have gone since."""
        self.retired = [cg for cg in self.retired if not cg.remove()]

    def make(self, job: str, generation: int, asked: JobResources) -> tuple[JobCgroup | None, list[str]]:
        """(the job's new cgroup with its limits, []) or (None, why it has none, if it asked for
        limits: the job runs without them)."""
        if not self.layout.version:
            if not (asked.cpus or asked.memory_bytes):
                return None, []
            why = f"node {self.node} gives jobs no cgroup ({self.layout.why_none}): job {job}'s --cpus and --mem " \
                  "are not enforced"
            log.warning("%s", why)
            return None, [why]
        cg = JobCgroup(self.layout, f"{ROOT}/{self.node}/{job}-g{generation}")
        try:
            cg.create(asked, self.pids_max)
        except OSError as exc:
            cg.remove()
            why = f"node {self.node} could not make job {job}'s cgroup {cg.rel}: {exc.strerror or exc}"
            log.warning("%s", why)
            return None, [why + "; it runs without its limits"]
        return cg, []

    def sweep(self) -> int:
        """Remove this node's job cgroups left empty (by a crash of an agent before this one)."""
        removed = 0
        for h in self.layout.hierarchies:
            top = h.mount / ROOT / self.node
            for d in sorted(top.glob("*-g*")) if top.is_dir() else []:
                try:
                    d.rmdir()
                    removed += 1
                except OSError:
                    pass
        return removed
