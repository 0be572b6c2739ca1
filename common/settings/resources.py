"""What a job asks of its node, and whether a node has it free: a pure rule.

A job asks for CPUs, memory and GPUs (``JobResources``: its submit's, else the cluster's
``[resources]`` defaults; 0 asks for nothing).  A node's capacity is what its heartbeat
reports (``Capabilities``: cpus, memory_total_bytes, gpus); what is taken is the sum of what
the node's other unfinished jobs asked for, and the GPUs they were given (``JobRecord.
assigned_gpus``).  A job fits a node when every asked amount fits in what is free; its GPUs are
the node's free GPUs, chosen by :func:`assign_gpus` (a restore's own GPUs mapped first, by the
rule of :mod:`revenant.common.gpufit`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import msgspec

from revenant.common.gpufit import gpu_fit
from revenant.common.settings.limits import MAX_MEMORY, MAX_PIDS, BadRequest, check_asked
from revenant.messages import Capabilities, JobGpu, JobResources, SubmitRequest

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(?:i?b)?", re.I)


def parse_size(text: str, what: str = "--mem") -> int:
    """Bytes in ``text``: "64G", "512M", "1.5GiB", "4096" (bytes); K, M, G, T, P are powers of 1024."""
    found = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    if found is None:
        raise BadRequest(f"{what} {text!r} is not a size: write a number with K, M, G or T after it (e.g. 64G)")
    value = float(found.group(1)) * _UNITS[found.group(2).lower()]
    if not 0 < value <= MAX_MEMORY:
        raise BadRequest(f"{what} {text!r} must be more than 0 and at most 1 EiB")
    return math.ceil(value)


_TMPFS_SIZE = re.compile(r"[1-9][0-9]*[kmgt]?|([1-9][0-9]?|100)%", re.I)


def tmpfs_size(name: str, value: str | int) -> str:
    """``value`` as tmpfs's ``size=`` option: bytes, a number with k, m, g or t (powers of 1024), or a
    percentage of memory.  Never 0, which tmpfs reads as "no limit"."""
    text = str(value).strip() if not isinstance(value, bool) else ""
    if not _TMPFS_SIZE.fullmatch(text):
        raise ValueError(f"{name} must be a tmpfs size: bytes, or a number with k, m, g or t "
                         f"(512M, 1G), or a percentage of memory (1% to 100%); got {value!r}")
    return text


def size_text(n: float, tenths: bool = False) -> str:
    """``n`` bytes for people: "64 GiB", "1.5 MiB", "300 B"; with ``tenths``, "64.0 GiB" too
    (a column of sizes, as ``show job`` prints them)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or (n == int(n) and not tenths) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def _count(n: float, what: str) -> str:
    return f"{n:g} {what}" + ("" if n == 1 else "s")


def describe(ask: JobResources) -> str:
    """"2 CPUs, 64 GiB, 1 GPU" ("nothing" when it asks for nothing)."""
    parts = ([_count(ask.cpus, "CPU")] if ask.cpus else []) + ([size_text(ask.memory_bytes)] if ask.memory_bytes
                                                              else []) + ([_count(ask.gpus, "GPU")] if ask.gpus else [])
    return ", ".join(parts) or "nothing"


def limits_line(res: JobResources) -> str:
    """The limits a job runs under: "memory 8 GiB (the cluster's, for a job without --mem), 4096
    processes" ("" for none)."""
    parts = ([f"memory {size_text(res.memory_bytes)}"] if res.memory_bytes else
             [f"memory {size_text(res.memory_limit_bytes)} (the cluster's, for a job without --mem)"]
             if res.memory_limit_bytes else [])
    return ", ".join(parts + ([f"{res.pids} processes"] if res.pids else []))


def check_ask(ask: JobResources) -> None:
    """Refuse (one line) an ask that is no amount at all."""
    check_asked(ask.cpus, ask.memory_bytes, ask.gpus)


@dataclass
class Usage:
    """What a node's unfinished jobs have taken."""

    cpus: float = 0.0
    memory_bytes: int = 0
    gpus: set[str] = field(default_factory=set)

    def add(self, ask: JobResources, gpus: Iterable[str]) -> None:
        self.cpus += ask.cpus
        self.memory_bytes += ask.memory_bytes
        self.gpus.update(gpus)


def free_gpus(caps: Capabilities, used: Usage) -> list[str]:
    return [g.uuid for g in sorted(caps.gpus, key=lambda g: g.index) if g.uuid and g.uuid not in used.gpus]


def fit(ask: JobResources, caps: Capabilities, used: Usage, node: str) -> str | None:
    """Why node ``node`` (``caps``, with ``used`` taken) has no room for ``ask``, or None."""
    if ask.cpus and used.cpus + ask.cpus > caps.cpus + 1e-9:
        return f"node {node} has {max(caps.cpus - used.cpus, 0):g} of {_count(caps.cpus, 'CPU')} free"
    if ask.memory_bytes and used.memory_bytes + ask.memory_bytes > caps.memory_total_bytes:
        left = max(caps.memory_total_bytes - used.memory_bytes, 0)
        return f"node {node} has {size_text(left)} of {size_text(caps.memory_total_bytes)} memory free"
    free = len(free_gpus(caps, used))
    if ask.gpus > free:
        return f"node {node} has {free} of {_count(len(caps.gpus), 'GPU')} free"
    return None


def assign_gpus(ask: JobResources, caps: Capabilities, used: Usage, need: Sequence[JobGpu] = (),
                driver: str = "", node: str = "") -> tuple[str | None, list[str]]:
    """(why not, the UUIDs) of the GPUs ``node`` gives a job asking ``ask``: first those its
    epoch held (``need``), each onto itself if free or else a free one of its model (gpufit's
    rule), then free GPUs in index order up to ``ask.gpus``.  A job that asked for none but
    whose epoch holds GPUs (a job from before) is checked against all the node's GPUs, and given none."""
    if not ask.gpus:
        return gpu_fit(list(need), driver, caps, node=node)[0], []
    free = set(free_gpus(caps, used))
    mine = msgspec.structs.replace(caps, gpus=[g for g in caps.gpus if g.uuid in free])
    why, moved = gpu_fit(list(need), driver, mine, node=node)
    if why:
        return why, []
    given = [moved.get(g.uuid, g.uuid) for g in need]
    given += [u for u in free_gpus(mine, Usage(gpus=set(given)))][:max(ask.gpus - len(given), 0)]
    return None, given


def beyond(ask: JobResources, nodes: Sequence[tuple[str, Capabilities]]) -> str | None:
    """Why no node of the cluster could ever take ``ask``, even empty (one line), or None; None
    too while no node has reported (a submit then waits for one)."""
    if not nodes or (not ask.cpus and not ask.memory_bytes and not ask.gpus):
        return None
    empty = Usage()
    if any(fit(ask, caps, empty, name) is None for name, caps in nodes):
        return None
    for flag, need, have, unit in (
            ("--cpus", ask.cpus, lambda c: c.cpus, lambda n: _count(n, "CPU")),
            ("--mem", ask.memory_bytes, lambda c: c.memory_total_bytes, size_text),
            ("--gpus", ask.gpus, lambda c: len(c.gpus), lambda n: _count(n, "GPU"))):
        name, caps = max(nodes, key=lambda nc: have(nc[1]))
        if need > have(caps):
            return f"{flag} {unit(need)} is more than any node has (the most is {unit(have(caps))}, on node {name})"
    return f"no node has {describe(ask)} at once"


class ResourcesConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[resources]`` of the coordinator's config: what a job whose submit does not say asks for
    (0 and "": nothing reserved, no limit)."""

    cpus: float = 0.0
    memory: str = ""  # a size: "4G"
    gpus: int = 0
    # Every job's limits, whatever it asks: the memory of a job that reserves none (--mem omitted,
    # or 0), enforced by its node's cgroup but not reserved ("": none), and its processes.
    memory_limit: str = "8G"
    pids: int = 4096

    def __post_init__(self) -> None:
        try:
            check_ask(self.ask(SubmitRequest(argv=["-"])))
            if self.memory_limit:
                parse_size(self.memory_limit, "memory_limit")
        except BadRequest as exc:
            raise ValueError(str(exc).replace("--mem", "memory").replace("--", "")) from None
        if isinstance(self.pids, bool) or not 0 <= self.pids <= MAX_PIDS:
            raise ValueError(f"pids must be a whole number from 0 (no limit but the node's) to {MAX_PIDS}, "
                             f"got {self.pids!r}")

    def ask(self, req: SubmitRequest) -> JobResources:
        """A job's resources: what ``req`` asks for, else these defaults; and the limits every
        job gets (a submit cannot leave them out: an ask of no memory gets ``memory_limit``)."""
        memory = req.memory_bytes if req.memory_bytes is not None else \
            parse_size(self.memory, "memory") if self.memory else 0
        limit = 0 if memory or not self.memory_limit else parse_size(self.memory_limit, "memory_limit")
        return JobResources(cpus=self.cpus if req.cpus is None else req.cpus, memory_bytes=memory,
                            gpus=self.gpus if req.gpus is None else req.gpus, memory_limit_bytes=limit,
                            pids=self.pids)


def check_resources(ask: JobResources, nodes: Sequence[tuple[str, Capabilities]]) -> None:
    """Refuse (one line) an ask that is no amount, or more than any node of the cluster has."""
    check_ask(ask)
    why = beyond(ask, nodes)
    if why:
        raise BadRequest(why)


def check_per_user(cfg) -> None:
    """The coordinator's per-user limits (coordinator/table/userlimits.py), each a ValueError naming it."""
    for name in ("max_jobs_per_user", "submit_rate_per_user", "submit_burst_per_user", "max_cpus_per_user",
                 "max_gpus_per_user"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number, 0 or more, got {value!r}")
    if cfg.max_memory_per_user:
        try:
            parse_size(cfg.max_memory_per_user, "max_memory_per_user")
        except BadRequest as exc:
            raise ValueError(str(exc)) from None
    if cfg.submit_rate_per_user and cfg.submit_burst_per_user < 1:
        raise ValueError("submit_burst_per_user must be at least 1 while submit_rate_per_user is set "
                         f"(0 would refuse every submit), got {cfg.submit_burst_per_user}")
