"""Which job event a job's end becomes (agent/processes/exits.py), pure, on a fake clock."""

from __future__ import annotations

import pytest

from revenant.agent.processes.exits import SWITCH_EXIT, SWITCH_FIRED, ExitClassifier, ExitVerdict, JobEnd, classify_exit

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    "end, fired, verdict",
    [
        # It ended by itself: its own status, whatever the switches did.
        (JobEnd(code=0), False, ExitVerdict("exited", exit_code=0)),
        (JobEnd(code=3), True, ExitVerdict("exited", exit_code=3)),
        # A lost status is reported as -1.
        (JobEnd(code=None), False, ExitVerdict("exited", exit_code=-1)),
        # The supervisor killed it (a kill command, a newer generation).
        (JobEnd(code=137, killing=True, reason="superseded by generation 2"), False,
         ExitVerdict("killed", reason="superseded by generation 2", exit_code=137)),
        # Its node stopped it without an epoch (a fence, a shutdown): evicted, to be restored elsewhere.
        (JobEnd(code=137, killing=True, evicted=True, reason="self-fenced: lease not renewed for 1.3 s"), False,
         ExitVerdict("evicted", reason="self-fenced: lease not renewed for 1.3 s", exit_code=137)),
        # A vacate or a drain committed an epoch, then stopped it: no status, the epoch.
        (JobEnd(code=137, stopped_at_epoch=4), False, ExitVerdict("vacated", epoch=4)),
        (JobEnd(code=137, evicted=True, reason="node n1 is shutting down; checkpointed", stopped_at_epoch=4), True,
         ExitVerdict("evicted", reason="node n1 is shutting down; checkpointed", epoch=4)),
        # 251 while the switches may have fired: the switch fired, the node stopped it.
        (JobEnd(code=SWITCH_EXIT), True, ExitVerdict("evicted", reason=SWITCH_FIRED, exit_code=SWITCH_EXIT)),
        # 251 with the switches kept fresh: the job's own status.
        (JobEnd(code=SWITCH_EXIT), False, ExitVerdict("exited", exit_code=SWITCH_EXIT)),
        # 251 while being killed: the kill explains it.
        (JobEnd(code=SWITCH_EXIT, killing=True, reason="killed as generation 1"), True,
         ExitVerdict("killed", reason="killed as generation 1", exit_code=SWITCH_EXIT)),
    ],
    ids=["exited", "exited-whatever-the-switch", "lost-status", "killed", "fenced", "vacated", "drained",
         "switch-fired", "own-251", "killed-251"],
)
def test_the_rule(end, fired, verdict):
    assert classify_exit(end, switch_may_have_fired=fired) == verdict


def test_an_exit_251_is_the_switch_only_after_the_switches_went_unreset():
    clock = FakeClock()
    exits = ExitClassifier(switch_timeout_s=1.0, clock=clock)
    own = JobEnd(code=SWITCH_EXIT)
    # Reset every 0.35 s, as the lease renews: a 251 is the job's own.
    for _ in range(10):
        clock.now += 0.35
        exits.switches_reset()
        assert exits.classify(own).kind == "exited"
    # The agent stalls: past 0.8 of the timeout unreset, a 251 is put down to the switch.
    clock.now += 0.75
    assert exits.classify(own).kind == "exited"
    clock.now += 0.1
    assert exits.classify(own) == ExitVerdict("evicted", reason=SWITCH_FIRED, exit_code=SWITCH_EXIT)


def test_a_gap_that_ended_is_remembered_for_a_while():
    clock = FakeClock()
    exits = ExitClassifier(switch_timeout_s=1.0, clock=clock)
    clock.now += 1.5  # a gap longer than the timeout: the switches fired
    exits.switches_reset()  # ... and the agent is back, resetting them again
    own = JobEnd(code=SWITCH_EXIT)
    # The init noticed the stale stamp a moment before the reset: still the switch.
    clock.now += 0.3
    exits.switches_reset()
    assert exits.classify(own).kind == "evicted"
    # Ten seconds after the gap ended, with the switches fresh since, a 251 is the job's own again.
    for _ in range(30):
        clock.now += 0.35
        exits.switches_reset()
    assert clock.now - 1001.5 >= 10.0
    assert exits.classify(own).kind == "exited"


def test_a_short_gap_is_not_remembered():
    clock = FakeClock()
    exits = ExitClassifier(switch_timeout_s=1.0, clock=clock)
    clock.now += 0.9  # unreset for less than the timeout: the switch cannot have fired
    exits.switches_reset()
    clock.now += 0.1
    assert exits.classify(JobEnd(code=SWITCH_EXIT)).kind == "exited"


def test_the_classifier_starts_with_the_switches_fresh():
    clock = FakeClock(50.0)
    exits = ExitClassifier(switch_timeout_s=2.0, clock=clock)
    assert not exits.switch_may_have_fired()
    clock.now += 1.5  # 0.8 of the timeout is 1.6 s
    assert not exits.switch_may_have_fired()
    clock.now += 0.2
    assert exits.switch_may_have_fired()


def test_whether_the_switches_may_have_fired_during_a_dump():
    clock = FakeClock(100.0)
    exits = ExitClassifier(switch_timeout_s=1.0, clock=clock)
    before_the_gap = clock.now
    clock.now += 1.5
    exits.switches_reset()  # a gap that ended before the dump began does not spoil it
    since = clock.now
    assert exits.may_have_fired_since(before_the_gap) and not exits.may_have_fired_since(since)
    for _ in range(5):  # reset regularly through the dump: fine
        clock.now += 0.5
        exits.switches_reset()
        assert not exits.may_have_fired_since(since)
    clock.now += 0.95
    assert not exits.may_have_fired_since(since)
    clock.now += 0.1  # unreset for the whole timeout now: it may be firing
    assert exits.may_have_fired_since(since)
    clock.now += 0.2
    exits.switches_reset()  # a gap that ended during the dump: it may have fired
    clock.now += 5
    assert exits.may_have_fired_since(since)
