"""The proactive rules, pure (coordinator/nodes/proactive.py): which jobs of a sick node are checkpointed
or moved, when, and when not (hysteresis, cooldown, storm guard, policies, cordon)."""

from __future__ import annotations

import pytest

from revenant.common.settings.config import CoordinatorConfig
from revenant.coordinator.nodes.proactive import ProactiveRules, Settings, policy_of, sickness
from revenant.coordinator.table.placement import NoNodeAvailable, place
from revenant.messages import Capabilities, CriuInfo, HealthFinding, JobRecord, JobSpec, NodeStatus

pytestmark = pytest.mark.unit

CRIU = Capabilities(criu=CriuInfo(ok=True, path="/usr/sbin/criu", version="4.1"))


def node(name: str, *findings: tuple[str, str, str], state: str = "alive") -> NodeStatus:
    """A node with findings (state, code, reason): its health is the worst of them."""
    order = {"GREEN": 0, "YELLOW": 1, "RED": 2}
    health = max((f[0] for f in findings), key=order.__getitem__, default="GREEN")
    return NodeStatus(name=name, state=state, health=health, reasons=[f[2] for f in findings],
                      findings=[HealthFinding(state=f[0], code=f[1]) for f in findings], capabilities=CRIU)


def job(jid: str, on: str, on_sick: str = "migrate", state: str = "running", interval: float | None = 300.0,
        generation: int = 1) -> JobRecord:
    return JobRecord(spec=JobSpec(id=jid, argv=["x"], checkpoint_interval_s=interval, on_sick=on_sick),
                     state=state, node=on, generation=generation)


MEMORY_RED = ("RED", "memory", "memory 97% >= 95%")
MEMORY_YELLOW = ("YELLOW", "memory", "memory 90% >= 85%")
XID = ("RED", "gpu_xid", "GPU 0 critical XID 79")
LAG = ("RED", "loop_lag", "event loop lag 3.10 s")


def rules(**kw) -> ProactiveRules:
    return ProactiveRules(Settings.of(CoordinatorConfig(**kw)))


def test_the_tables_decide_the_level_and_busy_or_bus_reasons_predict_nothing():
    s = Settings.of(CoordinatorConfig())
    assert sickness(node("a", MEMORY_RED, LAG), s).level == "migrate"
    assert sickness(node("a", MEMORY_RED, LAG), s).codes == ("memory",)
    assert sickness(node("a", MEMORY_YELLOW), s).level == "checkpoint"
    assert sickness(node("a", ("YELLOW", "gpu_temperature", "GPU 0 temperature 86 C >= 85 C")), s).level == "checkpoint"
    # A busy node (loop lag, a queue), a bus blip, an application's own XID: nothing to act on.
    for finding in (LAG, ("RED", "pending_ops", "40 queued"), ("YELLOW", "nats", "NATS disconnected"),
                    ("YELLOW", "gpu_xid_app", "GPU 0 application XID 13"), ("RED", "criu", "criu unusable")):
        assert sickness(node("a", finding), s).level is None, finding
    # RED for a checkpoint-only reason is a checkpoint, not a move; RED for a migrate-only reason
    # (checkpoints failing) is a move for a migrate job, and nothing for a checkpoint job.
    assert sickness(node("a", ("RED", "gpu_temperature", "GPU 0 91 C")), s).level == "checkpoint"
    failing = sickness(node("a", ("RED", "checkpoint_failures", "3 checkpoints failed in a row")), s)
    assert (failing.level, failing.checkpoint) == ("migrate", ())
    r = rules(proactive_hold_s=0.0)
    r.update([node("a", ("RED", "checkpoint_failures", "3 failed")), node("b"), node("c"), node("d")], 0.0)
    assert [(a.job, a.action) for a in r.actions([job("m", "a"), job("c", "a", "checkpoint")], 0.0)] == [
        ("m", "migrate")]


def test_a_finding_acts_only_once_it_has_held_without_a_break():
    r = rules(proactive_hold_s=2.0)
    jobs = [job("1", "a")]
    r.update([node("a", MEMORY_RED), node("b")], 0.0)
    assert r.actions(jobs, 0.0) == []
    r.update([node("a")], 1.0)  # a break: the hold starts over
    r.update([node("a", MEMORY_RED)], 1.5)
    assert r.actions(jobs, 3.0) == []
    r.update([node("a", MEMORY_RED)], 3.5)
    [act] = r.actions(jobs, 3.5)
    assert (act.job, act.node, act.action, act.code, act.reasons) == ("1", "a", "migrate", "memory",
                                                                      ("memory 97% >= 95%",))


def test_each_policy_gets_its_action():
    r = rules(proactive_hold_s=0.0)
    jobs = [job("m", "a", "migrate"), job("c", "a", "checkpoint"), job("n", "a", "none"),
            job("d", "a", ""), job("u", "a", "", interval=None), job("v", "a", "migrate", state="vacated"),
            job("o", "b", "migrate")]
    r.update([node("a", MEMORY_RED), node("b"), node("c")], 0.0)
    got = {a.job: a.action for a in r.actions(jobs, 0.0)}
    # "" (a record from before): the cluster's default for a job with a schedule, else none.
    assert got == {"m": "migrate", "c": "checkpoint", "d": "checkpoint"}
    assert policy_of(job("u", "a", "", interval=None), r.s) == "none"
    assert policy_of(job("d", "a", ""), Settings.of(CoordinatorConfig(on_sick="migrate"))) == "migrate"


def test_yellow_checkpoints_even_a_migrate_job_and_red_then_moves_it():
    r = rules(proactive_hold_s=0.0, proactive_cooldown_s=60.0)
    jobs = [job("1", "a")]
    r.update([node("a", MEMORY_YELLOW)], 0.0)
    assert [a.action for a in r.actions(jobs, 0.0)] == ["checkpoint"]
    r.update([node("a", MEMORY_RED)], 5.0)
    assert [a.action for a in r.actions(jobs, 5.0)] == ["migrate"]  # the node got worse: escalation
    assert "a" in r.cordoned


def test_flapping_health_gives_at_most_one_action_of_a_kind_per_cooldown():
    r = rules(proactive_hold_s=0.5, proactive_cooldown_s=60.0)
    jobs = [job("1", "a", "checkpoint")]
    taken = []
    t = 0.0
    while t < 59.0:  # YELLOW for a second, GREEN for a second, for a minute
        r.update([node("a", MEMORY_YELLOW) if int(t) % 2 == 0 else node("a")], t)
        taken += [(t, a.action) for a in r.actions(jobs, t)]
        t += 0.25
    assert [a for _, a in taken] == ["checkpoint"]
    r.update([node("a", MEMORY_YELLOW)], 60.0)
    r.update([node("a", MEMORY_YELLOW)], 61.0)
    assert [a.action for a in r.actions(jobs, 61.0)] == ["checkpoint"]  # the next cooldown


def test_a_job_with_an_action_in_flight_or_not_running_is_left_alone():
    r = rules(proactive_hold_s=0.0)
    r.update([node("a", MEMORY_RED), node("b")], 0.0)
    assert r.actions([job("1", "a")], 0.0, busy={"1"}) == []
    assert r.actions([job("1", "a", state="checkpointing")], 0.0) == []
    assert [a.job for a in r.actions([job("1", "a")], 0.0)] == ["1"]  # not marked while it was busy


def test_many_nodes_sick_at_once_pause_moves_but_not_checkpoints():
    r = rules(proactive_hold_s=0.0, proactive_pause_fraction=0.3)
    healthy = [node(f"h{i}") for i in range(3)]
    assert r.update([node("a", MEMORY_RED), *healthy], 0.0) is None  # 1 of 4: never a storm alone
    assert r.update([node("a", MEMORY_RED), node("b", XID), *healthy], 1.0) == "paused"  # 2 of 5
    assert (r.sick, r.total) == (2, 5)
    assert [a.action for a in r.actions([job("1", "a")], 1.0)] == ["checkpoint"]
    assert r.update([node("a", MEMORY_RED), node("b"), *healthy], 2.0) == "resumed"
    assert [a.action for a in r.actions([job("1", "a")], 2.0)] == ["migrate"]


def test_the_unwell_nodes_and_a_total_decide_as_the_whole_table_does():
    """What the coordinator passes each tick (FailureDetector.attention): only the nodes that are
    not alive and GREEN, and how many are alive or suspect."""
    healthy = [node(f"h{i}") for i in range(5)]
    tables = [[node("a", MEMORY_RED), node("s", state="suspect"), node("d", state="dead"), *healthy],
              [node("a", MEMORY_RED), node("b", XID), node("s", state="suspect"), *healthy],
              [node("a"), node("b", MEMORY_YELLOW), *healthy]]
    whole, parts = rules(proactive_hold_s=0.0), rules(proactive_hold_s=0.0)
    for t, table in enumerate(tables):
        unwell = [n for n in table if n.state == "suspect" or (n.state == "alive" and n.health != "GREEN")]
        total = sum(n.state in ("alive", "suspect") for n in table)
        assert whole.update(table, float(t)) == parts.update(unwell, float(t), total)
        assert (whole.sick, whole.total, whole.paused) == (parts.sick, parts.total, parts.paused)
        jobs = [job("1", "a"), job("2", "b"), job("3", "s")]
        assert whole.actions(jobs, float(t)) == parts.actions(jobs, float(t))
        assert whole.cordoned == parts.cordoned


def test_shared_storage_running_out_is_a_storm_not_a_reason_to_move():
    low = ("RED", "storage_low", "storage free 30 MiB < 256 MiB")
    r = rules(proactive_hold_s=0.0)
    assert r.update([node("a", low), node("b", low)], 0.0) == "paused"
    assert [a.action for a in r.actions([job("1", "a")], 0.0)] == ["checkpoint"]


def test_an_anomaly_of_a_listed_metric_asks_for_one_checkpoint_at_once():
    r = rules(proactive_hold_s=5.0)
    r.update([node("a"), node("b")], 0.0)
    assert not r.anomaly("a", "loop_lag_s", "anomaly: loop_lag_s = 2")  # not predictive by default
    assert r.anomaly("a", "gpu0.temperature_c", "anomaly: gpu0.temperature_c = 84 (mean 60, std 2)")
    [act] = r.actions([job("1", "a", "checkpoint"), job("2", "b", "checkpoint")], 0.1)
    assert (act.job, act.action, act.code) == ("1", "checkpoint", "anomaly")
    assert r.actions([job("1", "a", "checkpoint")], 0.2) == []  # used up, and in its cooldown


def test_a_cordoned_node_gets_no_new_work_until_it_is_green():
    r = rules(proactive_hold_s=0.0)
    nodes = [node("a", MEMORY_RED), node("b", ("YELLOW", "loop_lag", "lag"))]
    r.update(nodes, 0.0)
    r.actions([job("1", "a")], 0.0)
    r.update([node("a", MEMORY_YELLOW), nodes[1]], 1.0)  # better, not well: still cordoned
    seen = r.cordon([node("a", MEMORY_YELLOW), nodes[1]])
    assert seen[0].health == "RED" and "cordoned until GREEN" in seen[0].reasons[-1]
    assert place(seen, {}) == "b"  # YELLOW b rather than the cordoned a
    with pytest.raises(NoNodeAvailable):
        place(seen, {}, exclude={"b"}, restore=True)  # a reason without a code is never waived
    r.update([node("a"), nodes[1]], 2.0)
    assert r.cordon([node("a")])[0].health == "GREEN" and not r.cordoned


def test_a_dead_node_is_forgotten_and_its_jobs_left_to_failover():
    r = rules(proactive_hold_s=0.0)
    r.update([node("a", MEMORY_RED), node("b")], 0.0)
    r.update([node("a", MEMORY_RED, state="dead"), node("b")], 1.0)
    assert r.actions([job("1", "a")], 1.0) == []


def test_the_policy_is_fixed_at_submit_and_a_bad_one_is_one_line():
    from revenant.common.settings.limits import BadRequest, check_submit
    from revenant.messages import SubmitRequest

    c = CoordinatorConfig()
    assert c.on_sick_for(SubmitRequest(argv=["x"], checkpoint_interval_s=60.0)) == "checkpoint"
    assert c.on_sick_for(SubmitRequest(argv=["x"])) == "none"  # no schedule: only if asked
    assert c.on_sick_for(SubmitRequest(argv=["x"], on_sick="migrate")) == "migrate"
    with pytest.raises(BadRequest, match="^--on-sick must be one of checkpoint, migrate, none, got 'sometimes'$"):
        check_submit(SubmitRequest(argv=["x"], on_sick="sometimes"))
    with pytest.raises(ValueError, match="proactive_pause_fraction"):
        CoordinatorConfig(proactive_pause_fraction=0.0)


def test_a_misspelt_finding_code_in_the_tables_is_a_config_error():
    from revenant.common.settings.config import load_config
    from revenant.common.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown finding code 'gpu' in proactive_.*known are memory, storage_low"):
        load_config(CoordinatorConfig, "coordinator",
                    environ={"REVENANT_COORDINATOR_PROACTIVE_MIGRATE_REASONS": "memory,gpu"})


def test_a_suspect_node_keeps_its_hold_but_gets_no_action_until_it_answers_again():
    r = rules(proactive_hold_s=2.0)
    r.update([node("a", MEMORY_RED), node("b")], 0.0)
    r.update([node("a", MEMORY_RED, state="suspect"), node("b")], 1.0)
    assert r.actions([job("1", "a")], 2.5) == []  # silent: failover's business
    r.update([node("a", MEMORY_RED), node("b")], 2.6)
    assert [a.action for a in r.actions([job("1", "a")], 2.6)] == ["migrate"]  # held since 0.0
