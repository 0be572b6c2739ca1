"""Where a job goes: a pure function of the node table and the job counts."""

from __future__ import annotations

from revenant.common.errors import RevenantError
from revenant.messages import NodeStatus

_HEALTH_RANK = {"GREEN": 0, "YELLOW": 1}


class NoNodeAvailable(RevenantError):
    code = "no_node"
    retriable = True


def usable(node: NodeStatus) -> str | None:
    """Why ``node`` cannot take a job, or None if it can."""
    if node.state != "alive":
        return f"node {node.name} is {node.state}"
    if node.health == "RED":
        return f"node {node.name} is RED ({'; '.join(node.reasons) or 'unhealthy'})"
    if not node.capabilities.criu.ok:
        return f"node {node.name} has no working criu ({node.capabilities.criu.error})"
    return None


def place(nodes: list[NodeStatus], jobs_per_node: dict[str, int], requested: str = "",
          exclude: set[str] | frozenset[str] = frozenset()) -> str:
    """The node for a job: ``requested`` if usable; else the healthiest node with the fewest jobs.

    RED nodes never get work; YELLOW ones only when no GREEN node is usable.
    """
    if requested:
        node = next((n for n in nodes if n.name == requested), None)
        if node is None:
            raise NoNodeAvailable(f"unknown node {requested}")
        why = usable(node)
        if why:
            raise NoNodeAvailable(why)
        return requested
    candidates = [n for n in nodes if n.name not in exclude and usable(n) is None]
    if not candidates:
        reasons = [usable(n) for n in nodes if n.name not in exclude]
        detail = "; ".join(r for r in reasons if r) or "no node has joined"
        raise NoNodeAvailable(f"no node can take the job: {detail}")
    best = min(candidates, key=lambda n: (_HEALTH_RANK.get(n.health, 2), jobs_per_node.get(n.name, 0), n.name))
    return best.name
