"""Failover's rules, pure: lease expiry, storm pause, restore rate, the agent's fence clock."""

import pytest

from revenant.agent.node.lease import FenceClock
from revenant.coordinator.recovery.failover import LeaseState, StormGuard, TokenBucket
from revenant.coordinator.table.lifecycle import takeover_plan
from revenant.messages import JobRecord, JobSpec, NodeStatus

pytestmark = pytest.mark.unit


def test_lease_expires_ttl_plus_margin_after_its_last_renewal():
    lease = LeaseState(seq=7, incarnation="a", renewed_at=100.0)
    assert lease.expires_at(1.7, 0.2) == pytest.approx(101.9)


def test_fence_is_shorter_than_the_lease():
    f = FenceClock(fence_timeout_s=1.2, last_renewed=10.0)
    assert not f.must_fence(11.2)
    assert f.must_fence(11.21)
    f.renewed(11.0)
    assert not f.must_fence(12.0)


def nodes(states: list[str]) -> list[NodeStatus]:
    return [NodeStatus(name=f"n{i}", state=s) for i, s in enumerate(states)]


def test_one_dead_node_is_never_a_storm():
    g = StormGuard(fraction=0.3)
    assert g.update(nodes(["dead", "alive", "alive"]), pending={"n0"}) is None
    assert not g.paused


def test_many_silent_at_once_pause_failover_until_they_return():
    g = StormGuard(fraction=0.3)
    cluster = nodes(["suspect", "suspect", "dead", "alive", "alive", "alive", "alive", "alive", "alive", "alive"])
    assert g.update(cluster, pending={"n2"}) is None  # 3 of 10 is not more than 30%
    cluster[3] = NodeStatus(name="n3", state="suspect")
    assert g.update(cluster, pending={"n2"}) == "paused"
    assert g.paused
    assert g.update(cluster, pending={"n2"}) is None  # no repeat alert
    back = nodes(["alive"] * 9 + ["dead"])
    assert g.update(back, pending={"n9"}) == "resumed"
    # Dead nodes whose jobs were already moved no longer count, and departed ones never do.
    assert g.update(nodes(["dead"] * 5 + ["alive"] * 5), pending=set()) is None
    assert g.update(nodes(["left"] * 5 + ["suspect", "alive", "alive"]), pending=set()) is None


def test_restore_rate_is_limited():
    b = TokenBucket(rate_per_s=5.0, burst=2, now=0.0)
    assert b.take(0.0) == 0 and b.take(0.0) == 0
    wait = b.take(0.0)
    assert abs(wait - 0.2) < 1e-9
    assert b.take(0.2) == 0
    assert b.take(10.0) == 0 and b.take(10.0) == 0 and b.take(10.0) > 0  # the burst caps the saving


def _rec(job: str, state: str, generation: int, node: str) -> JobRecord:
    return JobRecord(spec=JobSpec(id=job, name=job, argv=["true"]), state=state, generation=generation, node=node)


def test_takeover_redoes_only_what_the_old_leader_left():
    inherited = {
        "1": ("restoring", 3, "node-2"),  # the old leader was restoring it: redo
        "2": ("running", 1, "node-9"),    # on a node that never came back: recover from node-9
        "3": ("running", 1, "node-1"),    # on a live node: leave it
        "4": ("restoring", 2, "node-2"),  # this leader restarted it since (generation 3): in flight, leave it
        "5": ("vacated", 1, ""),          # this leader's `checkpoint restart` is in flight: leave it
        "6": ("completed", 1, ""),
        "8": ("checkpointing", 2, "node-1"),  # its checkpoint's reply went to the old leader
    }
    jobs = {
        "1": _rec("1", "restoring", 3, "node-2"),
        "2": _rec("2", "running", 1, "node-9"),
        "3": _rec("3", "running", 1, "node-1"),
        "4": _rec("4", "restoring", 3, "node-1"),
        "5": _rec("5", "restoring", 2, "node-2"),
        "6": _rec("6", "completed", 1, ""),
        "7": _rec("7", "pending", 1, "node-1"),  # submitted to this leader: its launch is in flight
        "8": _rec("8", "checkpointing", 2, "node-1"),
    }
    assert takeover_plan(inherited, jobs, alive={"node-1", "node-2"}) == [("1", ""), ("2", "node-9"), ("8", None)]
    # A failover this leader already runs for a job is not started twice.
    assert takeover_plan(inherited, jobs, alive={"node-1", "node-2"}, recovering={"2"}) == [("1", ""), ("8", None)]
    # A checkpoint on a node that is gone: the job is recovered from that node.
    assert ("8", "node-1") in takeover_plan(inherited, jobs, alive={"node-2"})


def test_an_operator_can_hold_failover_and_let_a_real_storm_through():
    guard = StormGuard(0.3)
    calm = nodes(["alive"] * 10)
    assert guard.hold() == "paused" and guard.update(calm, set()) is None and guard.paused  # held, storm or not
    assert guard.release() == "resumed" and not guard.paused
    # A rack goes dark: the guard pauses; the operator, who knows the rack is gone, lets it through.
    rack = nodes(["suspect"] * 4 + ["alive"] * 6)
    assert guard.update(rack, set()) == "paused"
    assert guard.release() == "resumed" and guard.acknowledged
    assert guard.update(rack, set()) is None and not guard.paused  # the same storm stays let through
    # Once the silence ends the guard re-arms: the next storm pauses failover again.
    assert guard.update(calm, set()) is None and not guard.acknowledged
    assert guard.update(rack, set()) == "paused"


async def test_a_renewal_that_comes_back_past_the_fence_deadline_is_a_fence():
    """The jobs' dead man's switches froze them while the renewal hung: the agent fences, so the
    leader's word thaws them (else a job stays stopped for ever with its node healthy)."""
    import asyncio

    from revenant.agent.node.lease import LeaseKeeper

    now = [100.0]
    said: list = []
    done = asyncio.Event()

    async def on_fence(stale):
        said.append(("fence", round(stale, 1)))

    async def after_fence():
        said.append(("back",))
        done.set()

    keeper = LeaseKeeper(None, "n1", "i", ttl_s=1.7, renew_s=0.001, fence_timeout_s=1.2, on_fence=on_fence,
                         on_renewed_after_fence=after_fence, on_renewed=lambda: said.append(("renewed",)),
                         clock=lambda: now[0])
    delays = iter([0.3, 1.5, 0.3])

    async def renew():
        now[0] += next(delays, 0.3)
        return True

    keeper._renew = renew
    await asyncio.wait_for(keeper.run(until=done), 5)
    # The late renewal resets the switches too, before the reconcile that may thaw the jobs.
    assert said == [("renewed",), ("fence", 1.5), ("renewed",), ("back",)]


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers import examples  # noqa: E402


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.sampled_from(["alive", "suspect", "dead", "left"]), max_size=30), st.data())
def test_the_storm_counted_from_the_detectors_counts_is_the_storm_of_the_walk(states, data):
    """What a tick checks (the detector's counts and the pending nodes' states) decides as the walk
    of every node did, whatever the states and whichever failovers are pending."""
    from revenant.common.settings.config import CoordinatorConfig
    from revenant.coordinator.recovery.failover import Failover

    cluster = nodes(states)
    pending = data.draw(st.sets(st.sampled_from([n.name for n in cluster] + ["gone"])) if cluster else st.just(set()))
    walked = StormGuard(0.3)
    walked.update(cluster, pending)
    events = _Events()
    failover = Failover(CoordinatorConfig(), None, None, events, lambda: [], lambda name: None)
    failover.pending_nodes = dict.fromkeys(pending, 1)
    counts = {s: states.count(s) for s in ("alive", "suspect", "dead", "left")}
    by_name = {n.name: n.state for n in cluster}
    failover.check_storm_counted(counts, by_name.get)
    assert (failover.storm.silent, failover.storm.total, failover.storm.paused) == \
        (walked.silent, walked.total, walked.paused)
    assert [e.kind for e in events.sent] == (["failover_paused"] if walked.paused else [])


class _Events:
    def __init__(self) -> None:
        self.sent = []

    def emit(self, subject, event) -> None:
        self.sent.append(event)
