"""Proactive moves: which jobs of a sick node to checkpoint or move now, before it dies (sans-IO).

:class:`ProactiveRules` is fed each node's health (the detector's snapshot), the 3-sigma anomalies
agents report, and the current monotonic time; it answers with :class:`Action` s.  The shell that
carries them out is :mod:`revenant.coordinator.recovery.sick`.

* A node is *sick* at level ``checkpoint`` while it is YELLOW or worse for a reason in the
  checkpoint table, and at level ``migrate`` while it is RED for a reason in the migrate table
  (HealthFinding codes; config ``proactive_*_reasons``).  Other reasons (a busy node's loop lag or
  queue, a blip of NATS) predict nothing and are ignored.
* Hysteresis: a level counts once it has held for ``hold_s`` without a break.  An anomaly of a
  metric in the table counts at once, as level ``checkpoint`` (it is rate-limited at its source).
* Cooldown: at most one action of each kind per job per ``cooldown_s`` (a move may still follow
  a checkpoint: the node got worse).
* Storm guard: while more than ``pause_fraction`` of the nodes in touch (and at least two) are
  sick at level ``migrate``, moves pause (checkpoints go on): a cluster-wide cause, such as the
  shared storage running out, is not fixed by moving jobs between its nodes.
* A node some job was moved off is *cordoned* (no new work: :meth:`cordon`) until it is GREEN.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass, field
from typing import Iterable, Literal

import msgspec

from revenant.messages import JobRecord, NodeStatus

Level = Literal["checkpoint", "migrate"]
_LEVELS: tuple[Level, ...] = ("checkpoint", "migrate")
# A failed action (or a move with nowhere to go) is tried again this much later.
RETRY_S = 30.0


@dataclass(frozen=True)
class Settings:
    checkpoint_reasons: frozenset[str]
    migrate_reasons: frozenset[str]
    anomaly_metrics: tuple[str, ...] = ()
    hold_s: float = 2.0
    cooldown_s: float = 300.0
    pause_fraction: float = 0.3
    # The policy of a job whose record names none (from before policies): the cluster's on_sick
    # for a job with a schedule, else none.
    default: str = "checkpoint"
    min_sick: int = 2

    @classmethod
    def of(cls, config) -> Settings:
        """From a CoordinatorConfig."""
        return cls(checkpoint_reasons=frozenset(config.proactive_checkpoint_reasons),
                   migrate_reasons=frozenset(config.proactive_migrate_reasons),
                   anomaly_metrics=tuple(config.proactive_anomaly_metrics), hold_s=config.proactive_hold_s,
                   cooldown_s=config.proactive_cooldown_s, pause_fraction=config.proactive_pause_fraction,
                   default=config.on_sick)


@dataclass(frozen=True)
class Sickness:
    """What a node's health says now, per level: the predictive findings' codes and reasons
    (empty: not at that level).  Each level is judged by its own table."""
    migrate: tuple[tuple[str, str], ...] = ()
    checkpoint: tuple[tuple[str, str], ...] = ()

    @property
    def level(self) -> Level | None:
        return "migrate" if self.migrate else "checkpoint" if self.checkpoint else None

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(code for code, _ in self.migrate or self.checkpoint)


@dataclass(frozen=True)
class Action:
    job: str
    node: str
    action: Level
    # The first predictive code (the metric's label: a finding code, or "anomaly"), and every reason.
    code: str
    reasons: tuple[str, ...]
    generation: int = 0


def sickness(node: NodeStatus, s: Settings) -> Sickness:
    """The node's findings by the tables: RED for a migrate reason, YELLOW or worse for a checkpoint one."""
    pairs = list(zip(node.findings, node.reasons)) if len(node.findings) == len(node.reasons) else \
        [(f, f.code) for f in node.findings]
    return Sickness(
        migrate=tuple((f.code, r) for f, r in pairs if f.state == "RED" and f.code in s.migrate_reasons),
        checkpoint=tuple((f.code, r) for f, r in pairs if f.state in ("YELLOW", "RED")
                         and f.code in s.checkpoint_reasons))


def policy_of(rec: JobRecord, s: Settings) -> str:
    if rec.spec.on_sick:
        return rec.spec.on_sick
    return s.default if rec.spec.checkpoint_interval_s else "none"


@dataclass
class _NodeTrack:
    # When each level was first seen without a break since.
    since: dict[str, float] = field(default_factory=dict)
    now: Sickness = Sickness(None)


class ProactiveRules:
    """Its cost per update is one pass over the nodes, and work only for those not GREEN."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        # Nodes in touch that are not GREEN (a GREEN one is a break: its hold starts over).
        self._nodes: dict[str, _NodeTrack] = {}
        # Anomalies not yet acted on, by node: the reason.
        self._anomalies: dict[str, str] = {}
        # (job, action) -> when it was last taken.
        self._last: dict[tuple[str, str], float] = {}
        self._pruned_at = -math.inf
        self._silent: set[str] = set()
        # Node -> why jobs were moved off it: no new work until it is GREEN.
        self.cordoned: dict[str, str] = {}
        self.paused = False
        self.sick = 0
        self.total = 0

    # ------------------------------------------------------------------ inputs

    def anomaly(self, node: str, metric: str, reason: str) -> bool:
        """An agent's 3-sigma anomaly; True if its metric is one that predicts trouble."""
        if not any(fnmatch.fnmatchcase(metric, p) for p in self.s.anomaly_metrics):
            return False
        self._anomalies[node] = reason
        return True

    def update(self, nodes: Iterable, now: float, total: int | None = None) -> str | None:
        """Take the node table as it is now (NodeStatus, or anything with ``name``, ``state``,
        ``health``, ``reasons`` and ``findings``); "paused" or "resumed" when the storm guard changes.
        With ``total`` (how many nodes are alive or suspect), ``nodes`` need only hold those that
        are not alive and GREEN: the detector keeps them apart (FailureDetector.attention)."""
        given, total = total, 0
        seen: set[str] = set()
        silent: set[str] = set()
        cordoned_alive: set[str] = set()
        sick = 0
        for node in nodes:
            if node.state not in ("alive", "suspect"):
                continue
            total += 1
            name = node.name
            if node.state != "alive":  # silent for now (failover decides): its cordon and hold stay
                cordoned_alive.add(name)
                seen.add(name)
                silent.add(name)
                continue
            if node.health == "GREEN":
                continue
            seen.add(name)
            if name in self.cordoned:
                cordoned_alive.add(name)
            track = self._nodes.get(name)
            if track is None:
                track = self._nodes[name] = _NodeTrack()
            track.now = sickness(node, self.s)
            for level in _LEVELS:
                if getattr(track.now, level):
                    track.since.setdefault(level, now)
                else:
                    track.since.pop(level, None)
            sick += bool(track.now.migrate)
        for name in [n for n in self._nodes if n not in seen]:
            del self._nodes[name]  # GREEN (a break), dead, left or forgotten
        for name in [n for n in self.cordoned if n not in cordoned_alive]:
            del self.cordoned[name]  # GREEN again, or dead: failover's business now
        self.total, self.sick, self._silent = total if given is None else given, sick, silent
        total = self.total
        storm = sick >= self.s.min_sick and total > 0 and sick / total > self.s.pause_fraction
        if storm != self.paused:
            self.paused = storm
            return "paused" if storm else "resumed"
        return None

    # ------------------------------------------------------------------ decisions

    def held(self, node: str, level: Level, now: float) -> tuple[tuple[str, str], ...]:
        """The findings that have put ``node`` at ``level`` for ``hold_s`` without a break (or none)."""
        track = self._nodes.get(node)
        since = track.since.get(level) if track is not None else None
        return getattr(track.now, level) if since is not None and now - since >= self.s.hold_s else ()

    def actions(self, jobs: Iterable[JobRecord], now: float, busy: Iterable[str] = (), *,
                full_nodes: Iterable[str] = (), moves_paused: bool = False) -> list[Action]:
        """The actions due now for ``jobs`` (running ones only; ``busy``: jobs with one in flight;
        ``full_nodes``: nodes with as many actions in flight as they may have; ``moves_paused``:
        failover is paused, so moves wait too).  Each is recorded as taken (its cooldown starts);
        an anomaly is used up once seen."""
        self._prune(now)
        ready = {n for n in self._nodes if any(now - t >= self.s.hold_s for t in self._nodes[n].since.values())}
        ready = (ready | set(self._anomalies)) - set(full_nodes) - self._silent  # never to a suspect node
        if not ready:
            self._anomalies.clear()
            return []
        busy = set(busy)
        out: list[Action] = []
        moves = not (self.paused or moves_paused)
        for rec in jobs:
            if rec.node not in ready or rec.state != "running" or rec.spec.id in busy:
                continue
            self._act(rec, now, out, moves)
        self._anomalies.clear()
        return out

    def _act(self, rec: JobRecord, now: float, out: list[Action], moves: bool) -> None:
        policy = policy_of(rec, self.s)
        action = self._choose(rec, policy, now, moves) if policy != "none" else None
        if action is not None:
            self._last[(rec.spec.id, action.action)] = now
            out.append(action)
            if action.action == "migrate":
                self.cordoned[rec.node] = "; ".join(action.reasons)

    def _prune(self, now: float) -> None:
        """Cooldowns that are over are forgotten (the table would grow with every job ever acted on)."""
        if now - self._pruned_at >= self.s.cooldown_s:
            self._pruned_at = now
            self._last = {k: t for k, t in self._last.items() if now - t < self.s.cooldown_s}

    def _choose(self, rec: JobRecord, policy: str, now: float, moves: bool) -> Action | None:
        job = rec.spec.id
        found = self.held(rec.node, "migrate", now)
        if found and policy == "migrate" and moves and self._cool(job, "migrate", now):
            return self._action(rec, "migrate", found)
        found = self.held(rec.node, "checkpoint", now)
        if found and self._cool(job, "checkpoint", now):
            return self._action(rec, "checkpoint", found)
        anomaly = self._anomalies.get(rec.node)
        if anomaly is not None and self._cool(job, "checkpoint", now):
            return Action(job, rec.node, "checkpoint", "anomaly", (anomaly,), rec.generation)
        return None

    @staticmethod
    def _action(rec: JobRecord, action: Level, found: tuple[tuple[str, str], ...]) -> Action:
        return Action(rec.spec.id, rec.node, action, found[0][0], tuple(r for _, r in found), rec.generation)

    def _cool(self, job: str, action: str, now: float) -> bool:
        last = self._last.get((job, action))
        return last is None or now - last >= self.s.cooldown_s

    def unmark(self, job: str, action: str) -> None:
        """An action that never started (the job was busy with another checkpoint): due again."""
        self._last.pop((job, action), None)

    def retry_later(self, job: str, action: str, now: float) -> None:
        """An action that failed, or a move no node could take: due again after ``RETRY_S`` (or
        the cooldown, if shorter), not a whole cooldown later: the space or the node may be back."""
        self._last[(job, action)] = now - self.s.cooldown_s + min(RETRY_S, self.s.cooldown_s)

    # ------------------------------------------------------------------ placement

    def cordon(self, nodes: list[NodeStatus]) -> list[NodeStatus]:
        """The node table as placement must see it: a cordoned node is RED, with a reason no
        restore waives (it has no code), until it reports GREEN."""
        if not self.cordoned:
            return nodes
        out = []
        for n in nodes:
            why = self.cordoned.get(n.name)
            if why is not None:  # a NodeStatus, or a detector record (a dataclass)
                replace = msgspec.structs.replace if isinstance(n, msgspec.Struct) else dataclasses.replace
                n = replace(n, health="RED", reasons=[*n.reasons, f"cordoned until GREEN: jobs moved off it ({why})"])
            out.append(n)
        return out
