"""Where a job goes: a pure function of the node table and the job counts.

A restore is placed by a looser rule than a new job: RED reasons that a restore
does not make worse (low space on the shared storage: every node shares it, so
every node goes RED at once) do not keep it off a node, and the caller says
which it ignored (:func:`restore_waivers`).  A restore of a job that held GPUs at its
newest epoch goes only to a node that can take them (:func:`revenant.common.gpufit.gpu_fit`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Sequence

import msgspec

from revenant.common.errors import RevenantError
from revenant.common.gpufit import describe, gpu_fit
from revenant.common.settings.resources import Usage, assign_gpus, describe as describe_ask, fit
from revenant.coordinator.table.lifecycle import ENDED
from revenant.messages import JobGpu, JobRecord, JobResources, JobSpec, NodeStatus

log = logging.getLogger(__name__)

_HEALTH_RANK = {"GREEN": 0, "YELLOW": 1}

# RED finding codes (HealthFinding.code) a restore may ignore.  Low free space on the shared
# storage: a restore writes no new epoch (it replaces the output with a copy of its prefix and
# deletes the old one), and the storage is the same whichever node takes the job.
RESTORE_IGNORES = frozenset({"storage_low"})


def workdir_shared(spec: JobSpec, jobs: Iterable[JobRecord]) -> str:
    """Why a restore of ``spec`` must leave its working directory as it is, or "": other jobs not
    ended (running, vacated, failed over later...) work in it, or in a directory nested with it,
    and their files must never be moved aside for this one (agent/files/jobfiles_restore.py)."""
    mine = spec.workdir.rstrip("/") or "/"

    def nested(other: str) -> bool:
        other = other.rstrip("/") or "/"
        return other == mine or other.startswith(mine + "/") or mine.startswith(other + "/") or "/" in (mine, other)

    others = sorted((r.spec.id for r in jobs if r.spec.id != spec.id and r.state not in ENDED
                     and nested(r.spec.workdir)), key=lambda j: (len(j), j))
    if not others:
        return ""
    named = ", ".join(others[:10]) + (f" and {len(others) - 10} more" if len(others) > 10 else "")
    return f"job{'s' if len(others) > 1 else ''} {named} also work{'' if len(others) > 1 else 's'} in it"


class NoNodeAvailable(RevenantError):
    code = "no_node"
    retriable = True


class NoCapacity(NoNodeAvailable):
    """Nodes could take the job, but none has room now for what it asks: it waits for some."""

    code = "no_capacity"


NOTHING = JobResources()


def restore_waivers(node: NodeStatus) -> list[str]:
    """The reasons ``node`` is RED if a restore may ignore every one of them, else [].

    Only what the node's heartbeat coded (``findings``, one per reason) counts: a reason
    without a code (an older agent, a RED set by hand: a drain, a fence) is never ignored."""
    if node.health != "RED" or len(node.findings) != len(node.reasons):
        return []
    red = [reason for finding, reason in zip(node.findings, node.reasons) if finding.state == "RED"]
    codes = {finding.code for finding in node.findings if finding.state == "RED"}
    return red if red and codes <= RESTORE_IGNORES else []


def usable(node: NodeStatus, restore: bool = False) -> str | None:
    """Why ``node`` cannot take a job (a restore, with ``restore``), or None if it can."""
    if node.state != "alive":
        return f"node {node.name} is {node.state}"
    if node.health == "RED" and not (restore and restore_waivers(node)):
        return f"node {node.name} is RED ({'; '.join(node.reasons) or 'unhealthy'})"
    if not node.capabilities.criu.ok:
        return f"node {node.name} has no working criu ({node.capabilities.criu.error})"
    return None


def place(nodes: list[NodeStatus], jobs_per_node: dict[str, int], requested: str = "",
          exclude: set[str] | frozenset[str] = frozenset(), **kw: Any) -> str:
    """:func:`place_job`'s node alone."""
    return place_job(nodes, jobs_per_node, requested, exclude, **kw)[0]


def place_job(nodes: list[NodeStatus], jobs_per_node: dict[str, int], requested: str = "",
              exclude: set[str] | frozenset[str] = frozenset(), *, restore: bool = False,
              gpus: Sequence[JobGpu] = (), gpu_driver: str = "", ask: JobResources = NOTHING,
              used: Mapping[str, Usage] | None = None, any_health: bool = False) -> tuple[str, list[str]]:
    """The node for a job, and the UUIDs of the GPUs it gives the job: ``requested`` if usable;
    else the healthiest node with the fewest jobs among those with room for ``ask`` (with
    ``used`` taken on each node: :func:`revenant.coordinator.table.lifecycle.usage`).

    RED nodes never get work; YELLOW ones only when no GREEN node is usable.  A ``restore``
    may also go to a node RED only for reasons it does not worsen (:func:`restore_waivers`),
    last of all.  ``gpus``, ``gpu_driver``: the GPUs a restored job held at its epoch, and
    the driver it ran under: only a node :func:`gpu_fit` finds fit for them takes it.
    Raises :class:`NoNodeAvailable` when no node could take the job, :class:`NoCapacity` when
    some could but none has room for it now.  ``any_health``: the ``requested`` node takes the
    job whatever its health (:func:`own_node`: a move whose target went away goes back home).
    """
    need, taken = list(gpus), used or {}

    def why_not(node: NodeStatus) -> str | None:
        if any_health and own_node([node], node.name):
            return gpu_fit(need, gpu_driver, node.capabilities, node=node.name)[0]
        return usable(node, restore) or gpu_fit(need, gpu_driver, node.capabilities, node=node.name)[0]

    def room(node: NodeStatus) -> tuple[str | None, list[str]]:
        mine = taken.get(node.name, Usage())
        why = fit(ask, node.capabilities, mine, node.name)
        return (why, []) if why else assign_gpus(ask, node.capabilities, mine, need, gpu_driver, node.name)

    if requested:
        node = next((n for n in nodes if n.name == requested), None)
        if node is None:
            raise NoNodeAvailable(f"unknown node {requested}")
        why = why_not(node)
        if why:
            raise NoNodeAvailable(why)
        why, given = room(node)
        if why:
            raise NoCapacity(f"no room on node {requested} for the job's {describe_ask(ask)}: {why}")
        return requested, given
    candidates = [n for n in nodes if n.name not in exclude and why_not(n) is None]
    if not candidates:
        reasons = [why_not(n) for n in nodes if n.name not in exclude]
        detail = "; ".join(r for r in reasons if r) or "no node has joined"
        held = f" (it held {describe(need, gpu_driver)} at its checkpoint)" if need else ""
        raise NoNodeAvailable(f"no node can take the job{held}: {detail}")
    # The best first: the room (and GPUs) of a node is worked out only until one has it.
    for node in sorted(candidates, key=lambda n: (_HEALTH_RANK.get(n.health, 2), jobs_per_node.get(n.name, 0), n.name)):
        why, given = room(node)
        if why is None:
            return node.name, given
    detail = "; ".join(str(room(n)[0]) for n in candidates[:10])
    raise NoCapacity(f"no node has room for the job's {describe_ask(ask)} now: {detail}")


def allocated(nodes: list[NodeStatus], usage: Mapping[str, Usage], counts: Mapping[str, int]) -> list[NodeStatus]:
    """``nodes`` with what their jobs not ended asked for (``usage``), and how many they are."""
    return [msgspec.structs.replace(n, jobs=counts.get(n.name, 0), allocated=JobResources(
        cpus=usage[n.name].cpus, memory_bytes=usage[n.name].memory_bytes, gpus=len(usage[n.name].gpus)))
            if n.name in usage else n for n in nodes]


def node_address(nodes: Iterable[NodeStatus], name: str) -> str:
    """The address node ``name``'s agent advertises (Capabilities.address), or "" if unknown."""
    return next((n.capabilities.address for n in nodes if n.name == name), "") if name else ""


def restore_note(nodes: list[NodeStatus], placed: str) -> str:
    """What a restore placed on ``placed`` ignored, in words ("" if nothing)."""
    node = next((n for n in nodes if n.name == placed), None)
    waived = restore_waivers(node) if node is not None else []
    if not waived:
        return ""
    return (f"placed on {placed} although it is RED ({'; '.join(waived)}): a restore needs no new "
            f"space on the shared storage, so that reason was ignored")


def own_node(nodes: list[NodeStatus], name: str) -> str | None:
    """``name`` if it is alive with a working criu (whatever its health), else None."""
    node = next((n for n in nodes if n.name == name), None)
    return name if node is not None and node.state == "alive" and node.capabilities.criu.ok else None


def waived_notes(job: str, nodes: list[NodeStatus], target: str) -> list[str]:
    """The note for a restore placed on a node RED only for reasons a restore does not worsen."""
    note = restore_note(nodes, target)
    if note:
        log.warning("job %s: restore %s", job, note)
    return [note] if note else []
