"""Failure detection rules, driven by an injected clock: no NATS, no sleeping."""

from __future__ import annotations

import random

import pytest

from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.nodes.detector import FailureDetector, phi
from revenant.messages import HealthSummary, Heartbeat

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def advance(self, dt: float) -> float:
        self.now += dt
        return self.now


def hb(node="n1", seq=1, inc="i1", leaving=False, health=None):
    return Heartbeat(node=node, seq=seq, sent_at=0.0, incarnation=inc, leaving=leaving,
                     health=HealthSummary(state=health) if health else None)


class Cluster:
    """A detector fed by steady 1 s heartbeats, ticked every 100 ms."""

    def __init__(self, cfg: CoordinatorConfig | None = None, jitter: float = 0.05) -> None:
        self.cfg = cfg or CoordinatorConfig()
        self.det = FailureDetector(self.cfg)
        self.clock = Clock()
        self.seq: dict[str, int] = {}
        self.inc: dict[str, str] = {}
        self.events: list[tuple[float, str, str]] = []
        self.probes: list[tuple[float, str]] = []
        self.rng = random.Random(1)
        self.jitter = jitter

    def beat(self, node="n1", inc=None, **kw):
        inc = self.inc.setdefault(node, "i1") if inc is None else inc
        self.inc[node] = inc
        self.seq[node] = self.seq.get(node, 0) + 1
        self._record(self.det.heartbeat(hb(node, self.seq[node], inc, **kw), self.clock.now))

    def _record(self, transitions):
        self.events += [(self.clock.now, t.node, t.kind) for t in transitions]

    def tick(self, answer_probes: bool = False):
        transitions, probes = self.det.tick(self.clock.now)
        self._record(transitions)
        for node in probes:
            self.probes.append((self.clock.now, node))
            self._record(self.det.probe_result(node, answer_probes, self.clock.now,
                                               self.det.nodes[node].incarnation if answer_probes else None))

    def run(self, seconds: float, beating: set[str], answer_probes: bool = False, period: float = 1.0):
        next_beat = {n: self.clock.now + period for n in beating}
        end = self.clock.now + seconds
        while self.clock.now < end - 1e-9:
            self.clock.advance(0.1)
            for n in beating:
                if self.clock.now >= next_beat[n] - 1e-9:
                    self.beat(n)
                    next_beat[n] = self.clock.now + period * (1 + self.rng.uniform(-self.jitter, self.jitter))
            self.tick(answer_probes)

    def kinds(self, node="n1"):
        return [k for _, n, k in self.events if n == node]


def test_first_heartbeat_joins():
    c = Cluster()
    c.beat()
    assert c.kinds() == ["joined"]
    assert c.det.nodes["n1"].state == "alive"


def test_steady_node_stays_alive():
    c = Cluster()
    c.beat()
    c.run(60, {"n1"})
    assert c.kinds() == ["joined"]
    assert not c.probes


def test_silent_node_is_dead_within_3_s_and_only_after_a_failed_probe():
    c = Cluster()
    c.beat()
    c.run(20, {"n1"})
    last = c.det.nodes["n1"].last_heartbeat_at
    c.run(5, set())
    assert c.kinds() == ["joined", "suspect", "dead"]
    dead_at = next(t for t, _, k in c.events if k == "dead")
    suspect_at = next(t for t, _, k in c.events if k == "suspect")
    assert dead_at - last <= 3.0
    assert dead_at - last >= c.cfg.node_timeout_s
    assert any(suspect_at <= t < dead_at for t, _ in c.probes), "a probe must be sent before the verdict"


def test_node_that_answers_probes_is_never_dead():
    c = Cluster()
    c.beat()
    c.run(10, {"n1"})
    c.run(30, set(), answer_probes=True)  # heartbeats lost, but the node answers directly
    assert "dead" not in c.kinds()
    assert "recovered" in c.kinds()


def test_probe_in_flight_delays_the_verdict():
    c = Cluster()
    c.beat()
    c.run(10, {"n1"})
    # Silence, with probes that never come back (neither answer nor failure yet).
    for _ in range(60):
        c.clock.advance(0.1)
        c.det.tick(c.clock.now)
    assert c.det.nodes["n1"].state == "suspect"
    c._record(c.det.probe_result("n1", False, c.clock.now))
    assert c.det.nodes["n1"].state == "dead"


def test_heartbeat_after_suspect_or_dead_recovers():
    c = Cluster()
    c.beat()
    c.run(10, {"n1"})
    c.run(5, set())
    assert c.det.nodes["n1"].state == "dead"
    c.beat()
    assert c.kinds()[-1] == "recovered"
    assert c.det.nodes["n1"].state == "alive"


def test_erratic_node_gets_more_slack_than_a_steady_one():
    steady, erratic = Cluster(jitter=0.02), Cluster(jitter=0.45)
    for c in (steady, erratic):
        c.beat()
        c.run(120, {"n1"})
        c.run(5, set())

    def suspect_delay(c):
        return next(t for t, _, k in c.events if k == "suspect")

    s_rec, e_rec = steady.det.nodes["n1"], erratic.det.nodes["n1"]
    assert s_rec.state == e_rec.state == "dead"
    s_delay = suspect_delay(steady) - s_rec.last_heartbeat_at
    e_delay = suspect_delay(erratic) - e_rec.last_heartbeat_at
    assert s_delay <= e_delay
    assert e_delay <= (steady.cfg.suspect_timeout_s + steady.cfg.node_timeout_s) / 2 + 0.1


def test_phi_grows_with_silence():
    intervals = [1.0, 1.02, 0.98, 1.01, 0.99]
    values = [phi(t, intervals, 1.0) for t in (0.5, 1.0, 1.2, 1.5, 2.0, 3.0)]
    assert values == sorted(values)
    assert values[0] < 0.5 and values[-1] > 8
    assert phi(5.0, [1.0], 1.0) == 0.0  # too little history: no opinion


def test_coordinator_stall_gives_everyone_a_grace_period():
    c = Cluster()
    for n in ("a", "b"):
        c.beat(n)
    c.run(10, {"a", "b"})
    # The coordinator's loop freezes for 10 s: nobody heartbeats as far as it knows.
    c.clock.advance(10)
    c.tick()
    c.run(1.0, {"a", "b"})
    assert "dead" not in c.kinds("a") and "dead" not in c.kinds("b")


def test_new_incarnation_is_a_new_join():
    c = Cluster()
    c.beat(inc="old")
    c.run(3, {"n1"})
    c.seq["n1"] = 0
    c.beat(inc="new")
    assert c.kinds() == ["joined", "joined"]
    assert c.det.nodes["n1"].incarnation == "new"


def test_stale_or_duplicate_heartbeats_are_ignored():
    c = Cluster()
    c.beat()
    c.beat()
    rec = c.det.nodes["n1"]
    before = rec.last_heartbeat_at
    c.clock.advance(0.5)
    assert c.det.heartbeat(hb(seq=1), c.clock.now) == []
    assert rec.last_heartbeat_at == before


def test_leaving_node_is_left_not_dead_and_is_forgotten_later():
    c = Cluster(CoordinatorConfig(forget_after_s=30))
    c.beat()
    c.run(3, {"n1"})
    c.beat(leaving=True)
    c.run(10, set())
    assert c.kinds() == ["joined", "left"]
    c.run(30, set())
    assert "n1" not in c.det.nodes


def test_counts_and_snapshot():
    c = Cluster()
    c.beat("a")
    c.beat("b")
    c.run(5, {"a"})
    c.run(0.1, {"a"})
    snap = {s.name: s for s in c.det.snapshot(c.clock.now)}
    assert snap["a"].state == "alive" and snap["b"].state == "dead"
    assert snap["b"].last_heartbeat_age_s == pytest.approx(5.1, abs=0.01)
    assert c.det.counts() == {"alive": 1, "suspect": 0, "dead": 1, "left": 0}


# ---------------------------------------------------------------------- a tick costs what could change

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers import examples  # noqa: E402

OPS = st.lists(st.one_of(
    st.tuples(st.just("beat"), st.sampled_from(["a", "b", "c", "d"]), st.sampled_from(["i1", "i2"]), st.booleans(),
              st.sampled_from([None, "GREEN", "YELLOW", "RED"])),
    st.tuples(st.just("advance"), st.floats(0.05, 4.0)),
    st.tuples(st.just("probe"), st.sampled_from(["a", "b", "c", "d"]), st.booleans()),
    st.tuples(st.just("grace"),),
    st.tuples(st.just("tick"),),
), max_size=80)


@settings(max_examples=examples(300), deadline=None)
@given(OPS)
def test_the_ordered_tick_misses_no_verdict_and_keeps_its_indexes(ops):
    cfg = CoordinatorConfig(forget_after_s=5.0)
    det, now, seq = FailureDetector(cfg), 1000.0, {}
    cap = (cfg.suspect_timeout_s + cfg.node_timeout_s) / 2
    for op in ops:
        if op[0] == "beat":
            _, node, inc, leaving, health = op
            seq[node] = seq.get(node, 0) + 1
            h = hb(node, seq[node], inc, leaving=leaving and seq[node] % 5 == 0, health=health)
            if not (seq[node] % 2 and det.beat(h, now)):  # as the intake does, for every other one
                det.heartbeat(h, now)
        elif op[0] == "advance":
            now += op[1]
        elif op[0] == "probe" and op[1] in det.nodes:
            det.probe_result(op[1], op[2], now, det.nodes[op[1]].incarnation if op[2] else None)
        elif op[0] == "grace":
            det.grace_all(now, "test")
        elif op[0] == "tick":
            det.tick(now)
            for rec in det.nodes.values():  # what the old walk of every node would have decided
                silent = now - rec.last_alive_at
                if rec.state == "alive":
                    assert not (silent >= cfg.suspect_timeout_s and (silent >= cap or det.phi(rec, now) >= cfg.phi_suspect))
                if rec.state in ("dead", "left"):
                    assert now - rec.state_since < cfg.forget_after_s
        # Every node in exactly the index of its state; the alive ones oldest first.
        assert set(det._alive) == {n for n, r in det.nodes.items() if r.state == "alive"}
        assert det.names() == tuple(sorted(det.nodes))  # the node table's order, sorted once per change
        assert all(det.state(n) == r.state for n, r in det.nodes.items()) and det.state("unknown") is None
        assert det._suspect == {n for n, r in det.nodes.items() if r.state == "suspect"}
        assert set(det._ended) == {n for n, r in det.nodes.items() if r.state in ("dead", "left")}
        seen = [det.nodes[n].last_alive_at for n in det._alive]
        assert seen == sorted(seen)
        # What the proactive rules read instead of the table, and the counts, without a walk.
        attention, total = det.attention()
        assert {r.name for r in attention} == {n for n, r in det.nodes.items() if r.state == "suspect"
                                               or (r.state == "alive" and r.health != "GREEN")}
        assert total == sum(r.state in ("alive", "suspect") for r in det.nodes.values())
        assert det.counts() == {k: sum(r.state == k for r in det.nodes.values())
                                for k in ("alive", "suspect", "dead", "left")}
