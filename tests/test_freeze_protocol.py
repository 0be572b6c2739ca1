"""Fencing by freezing, as the lifecycle core decides it: for every interleaving of a failover
(token taken, lease read, recovery) and a frozen copy asking to thaw, never two running copies.

The actors and what each step does:

* the failover of node A: ``capture`` the record's fence token (before its lease wait),
  ``lease`` (reads A's lease: it goes on only if A has not renewed it since it froze),
  ``recover`` (Recover with the token: a restore of generation 2 on node B), ``restored``;
* node A's agent, whose copy of generation 1 is frozen: ``renew`` (its lease is back),
  ``ask`` (ThawAsked: the leader's answer is carried out at once: thaw, or kill).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import examples

from revenant.coordinator.table import lifecycle as lc
from revenant.messages import EpochInfo, JobRecord, JobSpec

pytestmark = pytest.mark.unit

FAILOVER = ("capture", "lease", "recover", "restored")
AGENT = ("renew", "ask")


@st.composite
def interleavings(draw):
    """Both actors' steps, each actor's in its own order, merged at random."""
    left, right = list(FAILOVER), list(AGENT)
    out = []
    while left or right:
        side = draw(st.sampled_from([s for s, rest in (("f", left), ("a", right)) if rest]))
        out.append(left.pop(0) if side == "f" else right.pop(0))
    return out


def run(order: list[str]) -> dict:
    rec = JobRecord(spec=JobSpec(id="1", argv=["x"]), state="running", node="node-A", generation=1,
                    epochs=[EpochInfo(n=1)])
    a = "frozen"          # node A's copy of generation 1: frozen, running or killed
    b = None              # node B's copy of generation 2: None, restoring or running
    renewed = False
    failover_alive = True
    token = None
    restore: lc.Command | None = None
    for step in order:
        if step == "capture":
            token = rec.fence_token
        elif step == "lease":
            failover_alive = not renewed  # a renewed lease: the node keeps its job
        elif step == "recover" and failover_alive:
            d = lc.transition(rec, lc.Recover("node-A", "node-B", "", token), 10.0)
            rec = d.record or rec
            restore = next((c for c in d.commands if isinstance(c, lc.Restore)), None)
            if restore is not None:
                b = "restoring"
        elif step == "restored" and restore is not None:
            rec = lc.transition(rec, lc.Restored(restore.generation, 99), 11.0).record or rec
            b = "running"
        elif step == "renew":
            renewed = True
        elif step == "ask":
            d = lc.transition(rec, lc.ThawAsked("node-A", 1), 12.0)
            rec = d.record or rec
            a = "running" if d.outcome == "thaw" else "killed"
        assert not (a == "running" and b is not None), (order, a, b)
    return {"a": a, "b": b, "record": rec}


@settings(max_examples=examples(300), deadline=None)
@given(interleavings())
def test_a_thaw_and_a_failover_never_both_go_ahead(order):
    result = run(order)
    # Exactly one copy goes on: the thawed one, or the restored one.
    assert (result["a"] == "running") != (result["b"] is not None), (order, result)


def test_every_interleaving_is_covered():
    """All 15 merges of the two actors' steps, spelled out (the property above samples them)."""
    from itertools import combinations

    n = len(FAILOVER) + len(AGENT)
    for agent_slots in combinations(range(n), len(AGENT)):
        f, a = iter(FAILOVER), iter(AGENT)
        order = [next(a) if i in agent_slots else next(f) for i in range(n)]
        result = run(order)
        assert (result["a"] == "running") != (result["b"] is not None), (order, result)


def test_a_thaw_is_refused_once_the_job_moved_on_and_granted_while_it_is_still_there():
    rec = JobRecord(spec=JobSpec(id="1", argv=["x"]), state="running", node="node-A", generation=1)
    granted = lc.transition(rec, lc.ThawAsked("node-A", 1), 1.0)
    assert granted.outcome == "thaw" and granted.record.fence_token == 1
    for moved in (lc.transition(rec, lc.Recover("node-A", "node-B"), 1.0).record,
                  JobRecord(spec=rec.spec, state="failed", node="node-A", generation=1),
                  JobRecord(spec=rec.spec, state="vacated", node="", generation=1)):
        d = lc.transition(moved, lc.ThawAsked("node-A", 1), 2.0)
        assert d.outcome == "kill" and not d.changed


def test_a_failover_that_began_before_a_thaw_is_void():
    rec = JobRecord(spec=JobSpec(id="1", argv=["x"]), state="running", node="node-A", generation=1,
                    epochs=[EpochInfo(n=1)])
    token = rec.fence_token
    rec = lc.transition(rec, lc.ThawAsked("node-A", 1), 1.0).record
    assert not lc.transition(rec, lc.Recover("node-A", "node-B", "", token), 2.0).changed
    assert lc.transition(rec, lc.Recover("node-A", "node-B", "", rec.fence_token), 2.0).changed
