"""Whether a node can take a job's GPUs on restore, and onto which of its GPUs: a pure rule.

A CUDA checkpoint restores device memory onto GPUs of the model the job ran on, under the
same driver major version.  The job's GPUs (from its newest committed epoch) are matched to
the node's: a GPU the node has keeps itself; the others, model by model in index order, take
the node's remaining GPUs of their model.  Restoring onto another GPU (another UUID) needs a
mechanism that can remap GPUs (``Capabilities.gpu_remap``).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from revenant.messages import Capabilities, JobGpu


def driver_major(version: str) -> str:
    """The driver's major version: "570.86.10" -> "570" ("" when unknown)."""
    return version.strip().split(".", 1)[0]


def node_driver(caps: Capabilities) -> str:
    """The node's GPU driver version as NVML gave it ("" when unknown)."""
    return next((g.driver_version for g in caps.gpus if g.driver_version), "")


def describe(gpus: Iterable[JobGpu], driver: str = "") -> str:
    """One line for a set of GPUs, e.g. "2x NVIDIA H200 (driver 570.86.10)"; "" for none."""
    counts = Counter(g.name or "unnamed GPU" for g in gpus)
    if not counts:
        return ""
    models = ", ".join(f"{n}x {name}" for name, n in counts.items())
    return f"{models} (driver {driver})" if driver else models


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def gpu_fit(need: list[JobGpu], need_driver: str, caps: Capabilities, *,
            node: str = "") -> tuple[str | None, dict[str, str]]:
    """(why the node with ``caps`` cannot restore a job that held ``need`` under driver
    ``need_driver``, or None; {old uuid: new uuid} for every GPU that moves).

    ``node`` names the node in the reason (default: its hostname).  No GPUs: (None, {}).
    An unknown ``need_driver`` ("") is not checked."""
    if not need:
        return None, {}
    where = f"node {node or caps.hostname or '?'}"
    if caps.gpu_checkpoint == "none":
        detail = f" ({caps.gpu_checkpoint_why})" if caps.gpu_checkpoint_why else ""
        return f"{where} cannot checkpoint or restore GPU state{detail}", {}
    mapping: dict[str, str] = {}
    for model in dict.fromkeys(g.name for g in need):
        wanted = sorted((g for g in need if g.name == model), key=lambda g: g.index)
        theirs = sorted((g for g in caps.gpus if g.name == model), key=lambda g: g.index)
        if not theirs:
            others = describe(JobGpu(index=g.index, uuid=g.uuid, name=g.name) for g in caps.gpus)
            return f"{where} has no {model} GPU (the job needs {len(wanted)}; it has {others or 'none'})", {}
        if len(theirs) < len(wanted):
            return f"{where} has {_plural(len(theirs), model + ' GPU')}, the job needs {len(wanted)}", {}
        present = {g.uuid for g in theirs} & {g.uuid for g in wanted}
        free = [g.uuid for g in theirs if g.uuid not in present]
        for g in wanted:
            mapping[g.uuid] = g.uuid if g.uuid in present else free.pop(0)
    have = node_driver(caps)
    if need_driver and driver_major(need_driver) != driver_major(have):
        return (f"{where} has GPU driver {have or 'of unknown version'}, the job was checkpointed under "
                f"driver {need_driver} (the major versions must match)"), {}
    moved = {old: new for old, new in mapping.items() if old != new}
    if moved and not caps.gpu_remap:
        return (f"the job's GPU{'s' * (len(moved) > 1)} {', '.join(sorted(moved))} "
                f"{'are' if len(moved) > 1 else 'is'} not on {where}: restoring there needs GPU remapping, "
                f"which driver {have or '(unknown version)'} on {where} cannot do"), {}
    return None, moved
