"""Failure detection, free of I/O: heartbeats and probe results in, verdicts out.

Every method takes ``now`` (monotonic seconds), so the rules are unit-tested
with an injected clock and no sleeping.

A node moves alive -> suspect -> dead:

* **suspect** once it has been silent for ``suspect_timeout_s`` *and* its
  phi-accrual score says the silence is abnormal for that node (phi >=
  ``phi_suspect``).  A node whose heartbeats have been erratic - say because
  its CPUs are saturated - therefore gets more slack than a steady one, up to
  a hard cap half-way to ``node_timeout_s``.  Suspect nodes are probed directly.
* **dead** once it has been silent for ``node_timeout_s`` and a direct probe
  sent while it was suspect has failed.  Any answered probe or heartbeat makes
  it alive again ("recovered").

The coordinator protects against its own trouble: if its ticks stop (a stalled
loop) or it loses NATS, every node gets a fresh grace period instead of a
verdict (:meth:`FailureDetector.grace_all`).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from revenant.common.settings.config import CoordinatorConfig
from revenant.messages import (Capabilities, GpuHealth, HealthFinding, HealthState, Heartbeat, HeartbeatV1,
                               HeartbeatView, NodeEventKind, NodeState, NodeStatus)

# Inter-arrival history kept per node for phi-accrual.
PHI_WINDOW = 100
PHI_MIN_SAMPLES = 3
# Jitter of a healthy heartbeat is ~10% of the interval; a floor on the std keeps
# phi from exploding over a few milliseconds of scheduling noise.
PHI_MIN_STD_FRACTION = 0.1


@dataclass(frozen=True)
class Transition:
    node: str
    kind: NodeEventKind
    silence_s: float
    incarnation: str
    reason: str = ""
    # For "joined" after a restart: the incarnation whose jobs died with it.
    previous_incarnation: str = ""


@dataclass(slots=True)
class NodeRecord:
    name: str
    incarnation: str
    state: NodeState = "alive"
    seq: int = 0
    pid: int = 0
    interval_s: float = 1.0
    health: HealthState = "GREEN"
    reasons: list[str] = field(default_factory=list)
    findings: list[HealthFinding] = field(default_factory=list)
    capabilities: Capabilities = field(default_factory=Capabilities)
    capabilities_raw: bytes = b""  # as the last heartbeat encoded them (see HeartbeatView)
    gpus: list[GpuHealth] = field(default_factory=list)
    last_heartbeat_at: float = 0.0
    # The latest evidence of life: a heartbeat or an answered probe (or a grace period).
    last_alive_at: float = 0.0
    state_since: float = 0.0
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=PHI_WINDOW))
    probe_in_flight: bool = False
    last_probe_sent_at: float = -math.inf
    probe_failed_since_suspect: bool = False


def phi(elapsed_s: float, intervals: deque[float] | list[float], nominal_interval_s: float) -> float:
    """Phi-accrual suspicion (Hayashibara et al.), with the logistic approximation of the normal CDF."""
    if len(intervals) < PHI_MIN_SAMPLES:
        return 0.0
    n = len(intervals)
    mean = sum(intervals) / n
    var = sum((x - mean) ** 2 for x in intervals) / n
    std = max(math.sqrt(var), PHI_MIN_STD_FRACTION * nominal_interval_s)
    y = (elapsed_s - mean) / std
    e = math.exp(-y * (1.5976 + 0.070566 * y * y)) if y > -40 else math.inf
    if elapsed_s > mean:
        p_later = e / (1.0 + e)
    else:
        p_later = 1.0 - 1.0 / (1.0 + e)
    if p_later <= 0.0:
        return math.inf
    return -math.log10(p_later)


class FailureDetector:
    """A tick costs what could change, not the whole table: alive nodes are kept in the order of
    their last sign of life (a heartbeat moves a node to the end), so a tick reads them from the
    oldest and stops at the first that is not silent long enough to be suspected; suspects are
    few; dead and left ones are kept in the order they ended, for forgetting.  Alive nodes that
    are not GREEN are kept apart too (:meth:`attention`), and the count of each state, so that
    nothing that runs every tick or every scrape walks 100,000 healthy nodes."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.nodes: dict[str, NodeRecord] = {}
        self._last_tick: float | None = None
        self._alive: OrderedDict[str, None] = OrderedDict()
        self._suspect: set[str] = set()
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._unwell: set[str] = set()  # alive, and its last full heartbeat was not GREEN
        self._state_of: dict[str, NodeState] = {}
        self._counts = {"alive": 0, "suspect": 0, "dead": 0, "left": 0}
        self._names: tuple[str, ...] | None = ()  # every node's name in order; None: to be sorted again

    # ------------------------------------------------------------------ inputs

    def heartbeat(self, hb: Heartbeat | HeartbeatV1 | HeartbeatView, now: float,
                  capabilities: Capabilities | None = None, capabilities_raw: bytes = b"") -> list[Transition]:
        """A heartbeat at ``now``.  A :class:`HeartbeatView` comes with its ``capabilities``
        decoded (None if it had none), and the bytes they came from, which the record keeps
        for comparing.  A heartbeat without health or capabilities leaves the record's."""
        rec = self.nodes.get(hb.node)
        if rec is None or (rec.state == "left" and hb.incarnation != rec.incarnation):
            if rec is not None:
                self._index(rec.name, None)
            rec = NodeRecord(name=hb.node, incarnation=hb.incarnation, state_since=now)
            if hb.node not in self.nodes:
                self._names = None
            self.nodes[hb.node] = rec
            self._index(rec.name, "alive")
            self._absorb(rec, hb, now, capabilities, capabilities_raw)
            return [] if hb.leaving else [Transition(hb.node, "joined", 0.0, hb.incarnation)]

        out: list[Transition] = []
        if hb.incarnation != rec.incarnation:
            # The agent restarted: a new life, whatever the old one was doing.
            silence = now - rec.last_heartbeat_at
            previous = rec.incarnation
            rec.incarnation = hb.incarnation
            rec.seq = 0
            rec.intervals.clear()
            rec.last_heartbeat_at = 0.0
            self._set_state(rec, "alive", now)
            out.append(Transition(hb.node, "joined", silence, hb.incarnation, "agent restarted", previous))
        elif hb.seq <= rec.seq:
            return []  # duplicate or reordered: nothing new
        elif rec.state in ("suspect", "dead"):
            silence = now - rec.last_heartbeat_at
            was = rec.state
            self._set_state(rec, "alive", now)
            out.append(Transition(hb.node, "recovered", silence, hb.incarnation, f"heartbeat after {was}"))
        elif rec.state == "left":
            return []

        self._absorb(rec, hb, now, capabilities, capabilities_raw)
        if hb.leaving:
            self._set_state(rec, "left", now)
            out.append(Transition(hb.node, "left", 0.0, hb.incarnation, "agent shut down"))
        return out

    def beat(self, hb: HeartbeatView, now: float) -> bool:
        """The common heartbeat, at the least cost: the next one of a known alive node, slim (no
        health; the caller has seen that it has no capabilities) and not leaving.  Recorded as
        :meth:`heartbeat` would record it, and True; False for anything else, which the caller
        then gives to :meth:`heartbeat`."""
        rec = self.nodes.get(hb.node)
        if rec is None or rec.state != "alive" or hb.seq <= rec.seq or hb.incarnation != rec.incarnation \
                or hb.health is not None or hb.leaving:
            return False
        if rec.last_heartbeat_at:
            rec.intervals.append(now - rec.last_heartbeat_at)
        rec.seq = hb.seq
        rec.pid = hb.pid
        if hb.interval_s > 0:
            rec.interval_s = hb.interval_s
        rec.last_heartbeat_at = rec.last_alive_at = now
        self._alive.move_to_end(rec.name)
        return True

    def probe_result(self, node: str, ok: bool, now: float, incarnation: str | None = None) -> list[Transition]:
        rec = self.nodes.get(node)
        if rec is None:
            return []
        rec.probe_in_flight = False
        if rec.state != "suspect":
            return []
        if ok and (incarnation is None or incarnation == rec.incarnation):
            rec.last_alive_at = now
            self._set_state(rec, "alive", now)  # at the end of the alive order: the newest
            return [Transition(node, "recovered", now - rec.last_heartbeat_at, rec.incarnation, "answered probe")]
        rec.probe_failed_since_suspect = True
        return self._maybe_dead(rec, now)

    def grace_all(self, now: float, reason: str) -> list[Transition]:
        """Give every live node a fresh grace period (the coordinator itself was in trouble)."""
        out = []
        for rec in self.nodes.values():
            if rec.state in ("alive", "suspect"):
                rec.last_alive_at = now
                rec.intervals.clear()
                if rec.state == "alive":
                    self._alive.move_to_end(rec.name)
                if rec.state == "suspect":
                    self._set_state(rec, "alive", now)
                    out.append(Transition(rec.name, "recovered", now - rec.last_heartbeat_at, rec.incarnation, reason))
        return out

    def tick(self, now: float) -> tuple[list[Transition], list[str]]:
        """Advance time: returns (transitions, nodes to probe now)."""
        out: list[Transition] = []
        if self._last_tick is not None and now - self._last_tick > self.config.self_stall_grace_s:
            out += self.grace_all(now, f"coordinator stalled {now - self._last_tick:.1f} s")
        self._last_tick = now
        probes: list[str] = []
        cfg = self.config
        suspect_cap = (cfg.suspect_timeout_s + cfg.node_timeout_s) / 2
        for rec in self._oldest(self._alive, lambda r: now - r.last_alive_at >= cfg.suspect_timeout_s):
            silent = now - rec.last_alive_at
            if silent >= suspect_cap or self.phi(rec, now) >= cfg.phi_suspect:
                self._set_state(rec, "suspect", now)
                out.append(Transition(rec.name, "suspect", now - rec.last_heartbeat_at, rec.incarnation,
                                      f"silent {silent:.1f} s"))
        for name in sorted(self._suspect):  # few; in name order, as the table's walk was
            rec = self.nodes[name]
            out += self._maybe_dead(rec, now)
            if rec.state == "suspect" and not rec.probe_in_flight \
                    and now - rec.last_probe_sent_at >= cfg.probe_interval_s:
                rec.probe_in_flight = True
                rec.last_probe_sent_at = now
                probes.append(rec.name)
        for rec in self._oldest(self._ended, lambda r: now - r.state_since >= cfg.forget_after_s):
            self._index(rec.name, None)
            del self.nodes[rec.name]
            self._names = None
        return out, probes

    def _oldest(self, order: OrderedDict[str, None], due) -> list[NodeRecord]:
        """The records at the front of ``order`` for which ``due`` holds (it holds for a prefix)."""
        out = []
        for name in order:
            rec = self.nodes[name]
            if not due(rec):
                break
            out.append(rec)
        return out

    def _index(self, name: str, state: NodeState | None) -> None:
        """Keep ``name`` in the one index its state belongs to (at the end: the newest)."""
        self._alive.pop(name, None)
        self._suspect.discard(name)
        self._ended.pop(name, None)
        self._unwell.discard(name)
        old = self._state_of.pop(name, None)
        if old is not None:
            self._counts[old] -= 1
        if state is not None:
            self._state_of[name] = state
            self._counts[state] += 1
        if state == "alive":
            self._alive[name] = None
            if self.nodes[name].health != "GREEN":
                self._unwell.add(name)
        elif state == "suspect":
            self._suspect.add(name)
        elif state in ("dead", "left"):
            self._ended[name] = None

    # ------------------------------------------------------------------ queries

    def phi(self, rec: NodeRecord, now: float) -> float:
        return phi(now - rec.last_alive_at, rec.intervals, rec.interval_s)

    def snapshot(self, now: float, names: list[str] | None = None) -> list[NodeStatus]:
        """Every node's status in name order, or just those of ``names``."""
        records = (sorted(self.nodes.values(), key=lambda r: r.name) if names is None
                   else [self.nodes[n] for n in names if n in self.nodes])
        return [
            NodeStatus(
                name=r.name,
                state=r.state,
                health=r.health,
                reasons=list(r.reasons),
                findings=list(r.findings),
                pid=r.pid,
                incarnation=r.incarnation,
                seq=r.seq,
                last_heartbeat_age_s=round(now - r.last_heartbeat_at, 3) if r.last_heartbeat_at else None,
                phi=round(min(self.phi(r, now), 1e6), 2),
                state_since_age_s=round(now - r.state_since, 3),
                capabilities=r.capabilities,
                gpus=r.gpus,
            )
            for r in records
        ]

    def state(self, name: str) -> NodeState | None:
        """The state of node ``name`` (None: not known)."""
        return self._state_of.get(name)

    def names(self) -> tuple[str, ...]:
        """Every node's name in order (the node table's pages): sorted again only after a node
        joined or was forgotten, not for each page of 300 that ``revenant nodes`` asks for."""
        if self._names is None:
            self._names = tuple(sorted(self.nodes))
        return self._names

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def attention(self) -> tuple[list[NodeRecord], int]:
        """The nodes that are not simply well (suspects, and alive nodes not GREEN), and how many
        nodes are alive or suspect: what the proactive rules look at, without the healthy rest."""
        names = [*self._suspect, *self._unwell]
        return [self.nodes[n] for n in names], self._counts["alive"] + self._counts["suspect"]

    # ------------------------------------------------------------------ internals

    def _absorb(self, rec: NodeRecord, hb: Heartbeat | HeartbeatView, now: float,
                capabilities: Capabilities | None, capabilities_raw: bytes) -> None:
        if rec.last_heartbeat_at and rec.state == "alive":
            rec.intervals.append(now - rec.last_heartbeat_at)
        rec.seq = hb.seq
        rec.pid = hb.pid
        rec.interval_s = hb.interval_s if hb.interval_s > 0 else rec.interval_s
        health = hb.health  # None: as in the node's last full heartbeat (see Heartbeat)
        if health is not None:
            if health.state != rec.health and rec.state == "alive":
                (self._unwell.discard if health.state == "GREEN" else self._unwell.add)(rec.name)
            rec.health = health.state
            # Kept when unchanged: objects that outlive a heartbeat are what a full collection
            # walks, and at 100,000 nodes a tenth of them send their health each second.
            if health.reasons != rec.reasons:
                rec.reasons = list(health.reasons)
            if health.findings != rec.findings:
                rec.findings = list(health.findings)
            if health.gpus != rec.gpus:
                rec.gpus = health.gpus
        if capabilities is None and not isinstance(hb, HeartbeatView):
            capabilities = hb.capabilities
        if capabilities is not None:
            rec.capabilities = capabilities
            rec.capabilities_raw = capabilities_raw
        rec.last_heartbeat_at = now
        rec.last_alive_at = now
        if rec.state == "alive":
            self._alive.move_to_end(rec.name)

    def _maybe_dead(self, rec: NodeRecord, now: float) -> list[Transition]:
        silent = now - rec.last_alive_at
        if rec.state == "suspect" and rec.probe_failed_since_suspect and silent >= self.config.node_timeout_s:
            self._set_state(rec, "dead", now)
            return [Transition(rec.name, "dead", now - rec.last_heartbeat_at, rec.incarnation,
                               f"silent {silent:.1f} s and did not answer a probe")]
        return []

    def _set_state(self, rec: NodeRecord, state: NodeState, now: float) -> None:
        if rec.state != state:
            rec.state = state
            rec.state_since = now
            rec.probe_failed_since_suspect = False
            self._index(rec.name, state)
