"""Network partitions: a `revenant up --netns` cluster (every process in a network namespace of
its own), links cut by the nemesis, and the whole history checked (tests/netcluster/).  Each
scenario runs stepper jobs, checkpointed every 2 s, and ends with the checker: no job ran
twice, no output is anything but a byte-exact prefix of the uninterrupted run, no step came
from a superseded copy, no acknowledged epoch is gone, every job is running once (reached at
its node's address) or ended with a reason; and every copy frozen at a heal was thawed or
killed within 5 s."""

from __future__ import annotations

import time

import pytest

from conftest import Cluster, revenant_cli
from revenant.cli.cluster import netns
from netcluster.checker import RUNNING
from netcluster.run import Run

pytestmark = [pytest.mark.cluster, pytest.mark.criu, pytest.mark.timeout(240)]


@pytest.fixture
def netrun(make_cluster, tmp_path):
    """``make(nodes, nats_servers=1, coordinators=1, env=None)``: a --netns cluster (``env``: more
    environment for its processes) and its Run, torn down
    (the cluster by make_cluster, with its namespaces) after the test."""
    runs: list[Run] = []

    def make(nodes: int, nats_servers: int = 1, coordinators: int = 1, env: dict | None = None) -> Run:
        cluster = Cluster(tmp_path / f"net{len(runs)}")
        make_cluster.clusters.append(cluster)
        revenant_cli("up", "--netns", "--nodes", str(nodes), "--nats-servers", str(nats_servers), "--coordinators",
                     str(coordinators), "--dir", str(cluster.dir), "--detach", check=True, timeout=120, env=env)
        runs.append(Run(cluster))
        return runs[-1]

    yield make
    for run in runs:
        run.stop()
        # Down here, so that the namespaces go too even if a process would not stop (the
        # cluster's own teardown then finds nothing left); a crashed run's are swept by the
        # next `up --netns`.
        revenant_cli("down", "--dir", str(run.cluster.dir), timeout=120)
        netns.remove(run.layout)


def moved_off(run: Run, jobs: list[str], nodes: set[str]):
    return all((p := run.placement(j)) and p.node not in nodes and p.state in RUNNING for j in jobs)


def settle_and_check(run: Run, jobs: list[str], settle_s: float = 8.0, from_lease: bool = False) -> None:
    """Let the healed cluster settle, reach every job at its node's address, run the checker,
    and check the heal's bound: 5 s from the heal (``from_lease``: from when each node's lease
    was back, for a split NATS cluster, whose streams elect leaders anew as it heals)."""
    time.sleep(settle_s)
    for job in jobs:
        p = run.placement(job)
        if p.state in RUNNING:
            line = run.reach(job)
            assert line.endswith(run.members[p.node]["address"]), (job, p.node, line)
    violations = run.violations()
    assert violations == [], "\n".join(violations)
    slow = run.slow_heals(5.0, from_lease)
    assert slow == [], "\n".join(slow)


def dead_verdicts(run: Run, since: float) -> set[str]:
    return {e["node"] for e in run.events()
            if e.get("type") == "node_event.v1" and e.get("kind") == "dead" and e.get("at", 0) >= since}


def test_a_node_cut_from_nats_but_not_storage_is_fenced_and_its_jobs_restored_once(netrun):
    run = netrun(3)
    jobs = [run.submit("node-1", 900), run.submit("node-1", 900)]
    run.wait(lambda: all(run.epoch_of(j) >= 1 for j in jobs), 40, "a first epoch")
    old = {c.pid for c in run.history.samples[-1][1] if c.node == "node-1"}
    run.nemesis.isolate("node-1")  # from NATS and every process; the storage is a directory
    run.wait(lambda: moved_off(run, jobs, {"node-1"}), 30, "the failover")
    # The old copies are frozen (the fence), not running, while the new ones run.
    frozen = {c.pid for c in run.history.samples[-1][1] if c.node == "node-1" and c.frozen}
    assert frozen == old, (frozen, old)
    time.sleep(3)
    run.heal()
    # Healed: the old copies are killed, never thawed.
    run.wait(lambda: not any(c.node == "node-1" for c in run.history.samples[-1][1]), 10, "the old copies' end")
    settle_and_check(run, jobs)


def test_a_leader_cut_from_nats_steps_down_and_a_standby_takes_over(netrun):
    run = netrun(3, coordinators=2)
    leader = run.wait(run.leader, 20, "a leader")
    standby = "coordinator-2" if leader == "coordinator" else "coordinator"
    jobs = [run.submit("node-1", 900), run.submit("node-2", 900)]
    run.wait(lambda: all(run.epoch_of(j) >= 1 for j in jobs), 40, "a first epoch")
    run.nemesis.isolate(leader)
    run.wait(lambda: run.leader() == standby, 20, f"{standby} taking over")
    # The new leader acts: a node cut now is failed over by it.
    run.nemesis.partition(["node-1"], [m for m in run.members if m not in ("node-1", leader)])
    run.wait(lambda: moved_off(run, jobs[:1], {"node-1"}), 30, "a failover by the new leader")
    run.heal()
    settle_and_check(run, jobs)
    assert run.leader() == standby  # the old leader came back as a standby
    stepped = [e for e in run.events() if e.get("kind") == "leader_stepped_down"]
    assert any(e.get("coordinator") == leader for e in stepped), stepped


def test_one_of_three_nats_servers_isolated_with_two_agents_pauses_failover_and_thaws_them(netrun):
    """Two of four nodes silent at once is more than failover_pause_fraction (30%): the protocol
    pauses failover (a storm guard) instead of restoring; the cut nodes' jobs stay frozen and
    thaw with the same pid once healed."""
    run = netrun(4, nats_servers=3)
    jobs = [run.submit(n, 900) for n in run.nodes]
    run.wait(lambda: all(run.epoch_of(j) >= 1 for j in jobs), 60, "a first epoch")
    since = time.time()
    minority = ["nats-server-3", "node-1", "node-2"]
    run.nemesis.partition(minority, [m for m in run.members if m not in minority])
    run.wait(lambda: any(e.get("kind") == "failover_paused" for e in run.events()), 30, "failover paused")
    cut = {c.pid for c in run.history.samples[-1][1] if c.node in ("node-1", "node-2")}
    assert cut and all(c.frozen for c in run.history.samples[-1][1] if c.pid in cut)
    time.sleep(3)
    run.heal()
    run.wait(lambda: {c.pid for c in run.history.samples[-1][1] if not c.frozen} >= cut, 20, "the thaw")
    settle_and_check(run, jobs, from_lease=True)  # three servers
    assert dead_verdicts(run, since) <= {"node-1", "node-2"}
    assert all(run.placement(j).node == n for j, n in zip(jobs, run.nodes))  # nothing moved


def test_a_three_two_split_of_five_nodes_moves_the_minoritys_jobs(netrun):
    """With failover_pause_fraction at 0.5, two silent nodes of five are failed over."""
    run = netrun(5, nats_servers=3, env={"REVENANT_COORDINATOR_FAILOVER_PAUSE_FRACTION": "0.5"})
    jobs = [run.submit(n, 900, every="0:3") for n in run.nodes]
    run.wait(lambda: all(run.epoch_of(j) >= 1 for j in jobs), 60, "a first epoch")
    since = time.time()
    minority = ["nats-server-3", "node-4", "node-5"]
    run.nemesis.partition(minority, [m for m in run.members if m not in minority])
    run.wait(lambda: moved_off(run, jobs[3:], {"node-4", "node-5"}), 45, "the minority's jobs moving")
    run.heal()
    settle_and_check(run, jobs, from_lease=True)  # three servers
    assert dead_verdicts(run, since) <= {"node-4", "node-5"}


def test_one_way_loss_between_an_agent_and_its_server_runs_every_job_once(netrun):
    run = netrun(2)
    jobs = [run.submit("node-1", 900), run.submit("node-2", 900)]
    run.wait(lambda: all(run.epoch_of(j) >= 1 for j in jobs), 40, "a first epoch")
    run.nemesis.drop("node-1", "nats-server", 40)  # 40% of what node-1 sends is lost
    time.sleep(10)
    run.nemesis.drop("nats-server", "node-1", 100)  # then nothing comes back to it
    run.wait(lambda: moved_off(run, jobs[:1], {"node-1"}), 30, "the failover")
    run.heal()
    settle_and_check(run, jobs)


def test_twenty_seconds_of_flapping_runs_every_job_once(netrun):
    run = netrun(3)
    jobs = [run.submit("node-1", 900), run.submit("node-2", 900)]
    run.wait(lambda: all(run.epoch_of(j) >= 1 for j in jobs), 40, "a first epoch")
    flapping = run.nemesis.flap(["node-1"], [m for m in run.members if m != "node-1"], period_s=1.5, duration_s=20)
    flapping.join(timeout=40)
    run.heal()
    settle_and_check(run, jobs, settle_s=10.0)
