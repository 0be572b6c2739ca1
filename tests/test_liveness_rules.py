"""The liveness thread's rules, pure, on a fake clock: the health it publishes for a stuck or
fenced node, and when the next heartbeat is due.  Liveness is built from plain callables (no
agent), which is all it knows of the agent."""

from __future__ import annotations

import pytest

from revenant.agent.node.liveness import Liveness, next_beat_at, published_health
from revenant.common.settings.config import AgentConfig
from revenant.messages import Capabilities, HealthSummary

pytestmark = pytest.mark.unit

GREEN = HealthSummary(state="GREEN", reasons=[], loop_lag_s=0.01)
YELLOW = HealthSummary(state="YELLOW", reasons=["memory 86% >= 85%"])


def test_a_running_loop_publishes_its_own_health():
    assert published_health(GREEN, stuck_s=0.0, fenced=False, red_after_s=2.0) == GREEN
    assert published_health(YELLOW, stuck_s=1.99, fenced=False, red_after_s=2.0) == YELLOW


def test_a_stuck_loop_is_red_with_how_long():
    h = published_health(YELLOW, stuck_s=2.5, fenced=False, red_after_s=2.0)
    assert h.state == "RED" and h.loop_lag_s == 2.5
    assert h.reasons == ["memory 86% >= 85%", "event loop stuck for 2.5 s"]


def test_a_fenced_node_is_red():
    h = published_health(GREEN, stuck_s=3.0, fenced=True, red_after_s=2.0)
    assert h.state == "RED"
    assert h.reasons == ["event loop stuck for 3.0 s", "self-fenced: lease not renewed"]


def test_heartbeats_keep_their_rhythm_and_never_burst():
    none = lambda lo, hi: 0.0  # noqa: E731 - no jitter
    assert next_beat_at(10.0, 10.01, 1.0, 0.1, none) == 11.0
    # Jitter stretches or shrinks one interval.
    assert next_beat_at(10.0, 10.01, 1.0, 0.1, lambda lo, hi: hi) == pytest.approx(11.1)
    assert next_beat_at(10.0, 10.01, 1.0, 0.1, lambda lo, hi: lo) == pytest.approx(10.9)
    # Fell behind (the process was stopped for 5 s): one interval from now, not five at once.
    assert next_beat_at(10.0, 15.0, 1.0, 0.1, none) == 16.0


def test_liveness_reads_the_agent_only_through_what_it_is_given():
    now = [100.0]
    last_wake = 99.9
    health = [GREEN]
    liveness = Liveness(
        AgentConfig(node="n1"), "n1", "inc",
        health=lambda: health[0], capabilities=Capabilities,
        stuck_for=lambda t: max(0.0, t - last_wake - 0.1),
        on_renewed=lambda: None, on_fence=lambda stale_s: None, on_lease_back=lambda: None,
        clock=lambda: now[0])
    assert liveness.health() == GREEN and not liveness.fenced
    health[0] = YELLOW
    assert liveness.health() == YELLOW
    now[0] = 102.5  # the main loop has not woken for 2.6 s, its monitor overdue 2.5 s
    assert liveness.health().state == "RED"
    assert liveness.health().reasons[-1] == "event loop stuck for 2.5 s"
