"""Fencing by freezing, as the lifecycle core and the agent's reconcile decide it: for every
interleaving of a failover (token taken, lease read, recovery) and a frozen copy's agent asking
to thaw, never two running copies.

The actors and what each step does:

* the failover of node A: ``capture`` the record's fence token (before its lease wait),
  ``lease`` (A's lease: it goes on only if A has not renewed it since the capture and does
  not hold it now), ``recover`` (Recover with the token: a restore of generation 2 on node
  B), ``restored``;
* node A's agent, whose copy of generation 1 is frozen, in one of several scripts: ``renew``
  (its lease is back), ``ask`` (the reconcile reaches the leader: ThawAsked if it holds its
  lease, else only whether the copy moved on), ``lapse`` (the lease lapses again: it fences,
  freezing the copy if it runs), ``apply`` (the answer arrives, and the agent applies it by
  its rule, :func:`reconcile.thaw_holds`).

An answer that arrives late, after a new fence, or one asked for before the lease is back, is
what a partition that flaps brings (the CI run behind this model had both copies running).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import examples

from revenant.agent.node import reconcile
from revenant.coordinator.table import lifecycle as lc
from revenant.messages import EpochInfo, JobRecord, JobSpec, ReconcileReply

pytestmark = pytest.mark.unit

FAILOVER = ("capture", "lease", "recover", "restored")
SCRIPTS = {
    "renew, ask": ("renew", "ask", "apply"),
    "asked before the lease is back": ("ask", "renew", "apply"),
    "the answer after a new fence": ("renew", "ask", "lapse", "apply"),
    "the answer after a new fence and the lease back": ("renew", "ask", "lapse", "renew", "apply"),
}


def naive_rule(answer: reconcile.Answer, held_now: bool, fences_now: int) -> bool:
    """The rule before this model caught it: frozen copies always ask to thaw, and an answer to
    thaw is applied whenever the lease is held as it lands."""
    return held_now


@st.composite
def interleavings(draw):
    """A script of the agent's and the failover's steps, each in its own order, merged at random."""
    script = draw(st.sampled_from(sorted(SCRIPTS)))
    left, right = list(FAILOVER), list(SCRIPTS[script])
    out = []
    while left or right:
        side = draw(st.sampled_from([s for s, rest in (("f", left), ("a", right)) if rest]))
        out.append(left.pop(0) if side == "f" else right.pop(0))
    return out


def run(order: list[str], rule=reconcile.thaw_holds) -> dict:
    rec = JobRecord(spec=JobSpec(id="1", argv=["x"]), state="running", node="node-A", generation=1,
                    epochs=[EpochInfo(n=1)])
    a = "frozen"          # node A's copy of generation 1: frozen, running or killed
    b = None              # node B's copy of generation 2: None, restoring or running
    held, fences = False, 1  # A's lease lapsed (its first fence froze the copy)
    renewed_since_capture = False
    failover_alive = True
    token = None
    restore: lc.Command | None = None
    answer: tuple[str | None, reconcile.Answer] | None = None

    def ask() -> tuple[str | None, reconcile.Answer]:
        nonlocal rec
        if held or rule is naive_rule:  # frozen copies ask to thaw only while the lease is held
            d = lc.transition(rec, lc.ThawAsked("node-A", 1), 12.0)
            rec = d.record or rec
            verdict = d.outcome
        else:  # listed as running: killed if it moved on, else left alone (frozen)
            verdict = "kill" if lc.stale_local_jobs("node-A", [reconcile.LocalJob(job="1", generation=1)],
                                                    {"1": rec}) else None
        return verdict, reconcile.Answer(ReconcileReply(), fences, held)

    def apply(got: tuple[str | None, reconcile.Answer]) -> str:
        verdict, ans = got
        if verdict == "kill":
            return "killed"
        if verdict == "thaw" and a == "frozen" and rule(ans, held, fences):
            return "running"
        return a

    for step in order:
        if step == "capture":
            token = rec.fence_token
        elif step == "lease":
            failover_alive = not (renewed_since_capture or held)
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
            held = True
            renewed_since_capture = token is not None
        elif step == "lapse":
            held, fences = False, fences + 1
            a = "frozen" if a == "running" else a
        elif step == "ask":
            answer = ask()
        elif step == "apply" and answer is not None:
            a = apply(answer)
        if a == "running" and b is not None:
            return {"a": a, "b": b, "record": rec, "two": True}
    if a == "frozen" and held:  # an answer that could not thaw it: asked again once the lease is held
        a = apply(ask())
    return {"a": a, "b": b, "record": rec, "two": a == "running" and b is not None, "held": held}


def exactly_one_goes_on(result: dict) -> bool:
    """Never both; and with A's lease held at the end, one of them (the thawed or the restored)."""
    if result["two"]:
        return False
    return not result.get("held") or (result["a"] == "running") != (result["b"] is not None)


@settings(max_examples=examples(600), deadline=None)
@given(interleavings())
def test_a_thaw_and_a_failover_never_both_go_ahead(order):
    result = run(order)
    assert exactly_one_goes_on(result), (order, result)


def every_interleaving():
    from itertools import combinations

    for script in SCRIPTS.values():
        n = len(FAILOVER) + len(script)
        for agent_slots in combinations(range(n), len(script)):
            f, a = iter(FAILOVER), iter(script)
            yield [next(a) if i in agent_slots else next(f) for i in range(n)]


def test_every_interleaving_is_covered():
    """Every merge of each script with the failover's steps, spelled out (the property samples them)."""
    orders = list(every_interleaving())
    assert len(orders) == 35 + 35 + 70 + 126  # C(4 + k, k) for scripts of k steps
    for order in orders:
        result = run(order)
        assert exactly_one_goes_on(result), (order, result)


def test_the_model_finds_two_copies_under_the_naive_rule():
    """The model can fail: thawing whenever the lease is held as the answer lands runs two copies
    (an answer asked for without the lease, or one that arrives after a new fence)."""
    bad = [order for order in every_interleaving() if run(order, naive_rule)["two"]]
    assert any(order.index("ask") < order.index("renew") for order in bad)
    assert any("lapse" in order for order in bad)


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
