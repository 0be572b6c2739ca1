"""Slim heartbeats: which ones an agent sends in full (agent/node/liveness.py FullBeats), and the
coordinator's intake (coordinator/nodes/heartbeats.py) keeping a node's health and capabilities
across the slim ones, decoding capabilities only when their bytes change."""

from __future__ import annotations

import msgspec
import pytest

from revenant.agent.node.liveness import FULL_FIRST, FullBeats
from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.nodes.detector import FailureDetector
from revenant.coordinator.nodes.heartbeats import HeartbeatIntake
from revenant.messages import (Capabilities, CriuInfo, HealthFinding, HealthSummary, Heartbeat, HeartbeatV1,
                               encode, subjects)

pytestmark = pytest.mark.unit

CAPS = Capabilities(hostname="h1", cpus=8, criu=CriuInfo(ok=True, version="4.1.1"))
GREEN = HealthSummary(memory_percent=20.0)


def test_full_beats_first_on_change_periodically_and_when_forced():
    beats = FullBeats(every=5)
    shapes = [beats.shape(GREEN, CAPS) != (None, None) for _ in range(FULL_FIRST + 6)]
    assert shapes == [True] * FULL_FIRST + [False] * 4 + [True, False]  # the 5th after the last full
    # A new reading alone waits for the period; a new verdict goes at once.
    assert beats.shape(msgspec.structs.replace(GREEN, memory_percent=21.0), CAPS) == (None, None)
    yellow = HealthSummary(state="YELLOW", reasons=["memory 91%"], findings=[HealthFinding("YELLOW", "memory")])
    assert beats.shape(yellow, CAPS) == (yellow, CAPS)
    assert beats.shape(yellow, CAPS) == (None, None)
    other = msgspec.structs.replace(yellow, findings=[HealthFinding("YELLOW", "storage_low")])
    assert beats.shape(other, CAPS) == (other, CAPS)  # same words, another finding
    caps2 = msgspec.structs.replace(CAPS, lazy_restore=True)
    assert beats.shape(other, caps2) == (other, caps2)
    beats.force = True  # after a reconnect, or a heartbeat that could not be sent
    assert beats.shape(other, caps2) == (other, caps2)
    assert beats.shape(other, caps2) == (None, None)
    assert beats.shape(other, caps2, leaving=True) == (other, caps2)
    every = FullBeats(every=1)
    assert all(every.shape(GREEN, CAPS) == (GREEN, CAPS) for _ in range(10))


def make_intake():
    detector = FailureDetector(CoordinatorConfig())
    clock = [100.0]
    emitted = []
    return detector, clock, emitted, HeartbeatIntake(detector, lambda: clock[0], emitted.extend)


def beat(intake, clock, hb, subject_node: str | None = None) -> None:
    clock[0] += 1.0
    intake([(subjects.heartbeat(subject_node or hb.node).encode(), encode(hb))])


def test_slim_heartbeats_keep_what_the_last_full_one_said():
    detector, clock, emitted, intake = make_intake()
    yellow = HealthSummary(state="YELLOW", reasons=["memory 91%"], findings=[HealthFinding("YELLOW", "memory")])
    beat(intake, clock, Heartbeat(node="n1", seq=1, sent_at=1.0, incarnation="i", capabilities=CAPS, health=yellow))
    assert [t.kind for t in emitted] == ["joined"]
    rec = detector.nodes["n1"]
    caps_object = rec.capabilities
    for seq in range(2, 6):
        beat(intake, clock, Heartbeat(node="n1", seq=seq, sent_at=1.0, incarnation="i"))
    assert rec.seq == 5 and rec.last_heartbeat_at == clock[0] and len(rec.intervals) == 4
    assert rec.health == "YELLOW" and rec.reasons == ["memory 91%"] and rec.findings[0].code == "memory"
    assert rec.capabilities == CAPS
    # The same capabilities again: not decoded again (the record keeps its object).
    beat(intake, clock, Heartbeat(node="n1", seq=6, sent_at=1.0, incarnation="i", capabilities=CAPS, health=GREEN))
    assert rec.capabilities is caps_object and rec.health == "GREEN" and rec.reasons == []
    changed = msgspec.structs.replace(CAPS, cpus=16)
    beat(intake, clock, Heartbeat(node="n1", seq=7, sent_at=1.0, incarnation="i", capabilities=changed, health=GREEN))
    assert rec.capabilities == changed
    # An agent from before heartbeat.v2: every heartbeat full.
    beat(intake, clock, HeartbeatV1(node="n2", seq=1, sent_at=1.0, incarnation="j", capabilities=CAPS, health=yellow))
    assert detector.nodes["n2"].capabilities == CAPS and detector.nodes["n2"].health == "YELLOW"
    assert intake.received == 8 and intake.malformed == 0
    assert intake.counts_since_last() == (8, 0) and intake.counts_since_last() == (0, 0)


def test_a_node_first_heard_slim_is_not_placeable_until_its_full_heartbeat():
    detector, clock, emitted, intake = make_intake()
    beat(intake, clock, Heartbeat(node="n1", seq=40, sent_at=1.0, incarnation="i"))
    rec = detector.nodes["n1"]
    assert rec.state == "alive" and not rec.capabilities.criu.ok  # placement skips it
    beat(intake, clock, Heartbeat(node="n1", seq=41, sent_at=1.0, incarnation="i", capabilities=CAPS, health=GREEN))
    assert rec.capabilities.criu.ok


def test_bad_heartbeats_are_counted_and_dropped(caplog):
    detector, clock, emitted, intake = make_intake()
    intake([(subjects.heartbeat("n1").encode(), b"\x93garbage")])
    beat(intake, clock, Heartbeat(node="n2", seq=1, sent_at=1.0, incarnation="i"), subject_node="n1")
    intake([(b"revenant.other.n1", encode(Heartbeat(node="n1", seq=1, sent_at=1.0, incarnation="i")))])
    bad_caps = msgspec.msgpack.encode({"type": "heartbeat.v2", "node": "n1", "seq": 1, "sent_at": 1.0,
                                       "incarnation": "i", "capabilities": [1, 2]})
    intake([(subjects.heartbeat("n1").encode(), bad_caps)])
    # A node name no subject may carry, even with a heartbeat that names it: never a record.
    intake([(b"revenant.hb.bad~name", encode(Heartbeat(node="bad~name", seq=1, sent_at=1.0, incarnation="i")))])
    assert intake.malformed == 5 and intake.received == 0 and detector.nodes == {}
    assert "dropped bad heartbeat" in caplog.text


def test_a_slim_heartbeat_leaves_its_defaults_out_and_is_recorded_in_place():
    """The agent's slim heartbeat omits what is at its default; the intake records it through the
    detector's short path, with what the whole path would have recorded, in the order a read
    brought them; a full one, or one the short path does not take, goes the whole way."""
    slim = encode(Heartbeat(node="n1", seq=2, sent_at=1.0, incarnation="i"))
    assert b"capabilities" not in slim and b"health" not in slim and b"leaving" not in slim and len(slim) < 100
    fast, fast_clock, _, fast_intake = make_intake()
    whole, whole_clock, _, whole_intake = make_intake()
    whole.beat = lambda hb, now: False  # every heartbeat the whole way
    first = Heartbeat(node="n1", seq=1, sent_at=1.0, incarnation="i", pid=7, capabilities=CAPS, health=GREEN)
    later = [Heartbeat(node="n1", seq=s, sent_at=1.0, incarnation="i", pid=8, interval_s=0.5) for s in (2, 3, 5, 4)]
    for det, clock, intake in ((fast, fast_clock, fast_intake), (whole, whole_clock, whole_intake)):
        beat(intake, clock, first)
        clock[0] += 1.0
        intake([(subjects.heartbeat("n1").encode(), encode(hb)) for hb in later])  # one read: one time
        beat(intake, clock, Heartbeat(node="n1", seq=6, sent_at=1.0, incarnation="i", pid=8, interval_s=0.5,
                                      health=HealthSummary(
            state="YELLOW", reasons=["disk"], findings=[HealthFinding("YELLOW", "disk")])))
    a, b = fast.nodes["n1"], whole.nodes["n1"]
    assert (a.seq, a.pid, a.interval_s, a.last_heartbeat_at, a.last_alive_at, list(a.intervals)) == \
        (b.seq, b.pid, b.interval_s, b.last_heartbeat_at, b.last_alive_at, list(b.intervals)) == \
        (6, 8, 0.5, 103.0, 103.0, [1.0, 0.0, 0.0, 1.0])
    assert a.health == b.health == "YELLOW" and a.capabilities == CAPS and fast.attention()[0] == [a]
    assert fast_intake.received == whole_intake.received == 6  # seq 4, after 5, counted and ignored
    # A slim heartbeat on another node's subject is refused on the short path too.
    fast_intake([(subjects.heartbeat("n2").encode(), encode(later[0]))])
    assert fast_intake.malformed == 1 and "n2" not in fast.nodes


def test_a_heartbeat_whose_handling_fails_loses_only_itself(caplog):
    detector, clock, _, _ = make_intake()

    def emit(transitions):
        if any(t.node == "bad" for t in transitions):
            raise RuntimeError("a bug downstream")

    intake = HeartbeatIntake(detector, lambda: clock[0], emit)
    beat(intake, clock, Heartbeat(node="a", seq=1, sent_at=1.0, incarnation="i"))
    intake([(subjects.heartbeat(n).encode(), encode(Heartbeat(node=n, seq=s, sent_at=1.0, incarnation="i")))
            for n, s in (("a", 2), ("bad", 1), ("a", 3), ("c", 1))])
    assert detector.nodes["a"].seq == 3 and "c" in detector.nodes
    assert intake.received == 5 and "a bug downstream" in caplog.text
