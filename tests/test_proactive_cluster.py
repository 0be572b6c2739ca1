"""Proactive moves through a real cluster (`revenant up`: nats-server, coordinator, agents, real
criu), under real trouble: memory a real allocator takes, a small filesystem filling up, a GPU's
critical XID through the NVML stand-in, a node flapping between YELLOW and GREEN, and a busy
machine.

The sick node is an agent started with an environment of its own (tests/proactive_helpers.py):
`revenant up` gives all its agents one environment, and they share this machine's memory.  Each
move is checked end to end: the events say why (cause "health", the node's findings), the job
runs on once, on the healthy node, and its output is one unbroken chain, byte for byte."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from conftest import wait_until
from fakegpu import build
from proactive_helpers import (MIB, Counter, ExtraAgent, agent_health, busy_loops, events, fill_to, health_epochs,
                               memhog, node, release_half, tmpfs, wait_event, wait_node)

pytestmark = [pytest.mark.cluster, pytest.mark.criu]


@pytest.fixture
def extra_agent(make_cluster):
    """``start(cluster, name, env)``: an agent of the cluster's with ``env`` of its own; killed, with
    its jobs, at the end (before the cluster goes down)."""
    started: list[ExtraAgent] = []

    def start(cluster, name: str, env: dict[str, str]) -> ExtraAgent:
        agent = ExtraAgent(cluster, name, env)
        started.append(agent)
        wait_node(cluster, name, lambda n: n["state"] == "alive", "a start")
        return agent

    yield start
    for agent in started:
        agent.kill()


@pytest.fixture
def small_storage(tmp_path):
    """A 512 MiB filesystem as the cluster's shared storage (`revenant up --dir DIR` uses DIR/storage).
    Requested before make_cluster, it is unmounted after the cluster is down."""
    with tmpfs(tmp_path / "cluster" / "storage", "512m") as path:
        yield path


def _migrated(cluster, job: Counter, sick: str, healthy: str, code_words: str) -> dict:
    """The job's one move off ``sick``: published ``migrated`` (cause health, the findings), from
    an epoch the eviction took for that reason; returns the event."""
    [moved] = events(cluster, "job_event.v1", job=job.id, kind="migrated")
    assert (moved["node"], moved["from_node"], moved["cause"]) == (healthy, sick, "health"), moved
    assert moved["reasons"] and any(code_words in r for r in moved["reasons"]), moved
    taken = {e["n"]: e for e in health_epochs(cluster, job.id)}
    assert moved["epoch"] in taken, (moved, taken)
    assert any(code_words in r for r in taken[moved["epoch"]]["reasons"]), taken
    [evicted] = events(cluster, "job_event.v1", job=job.id, kind="evicted")
    assert evicted["node"] == sick and f"moved off sick node {sick}" in evicted["reason"], evicted
    return moved


def test_memory_pressure_moves_a_migrate_job_and_cordons_the_node_until_green(make_cluster, extra_agent):
    cluster = make_cluster(1, insecure=True)
    # node-2's thresholds just above what the machine uses now; an allocator pushes it past RED.
    base = psutil.virtual_memory().percent
    extra_agent(cluster, "node-2", {"REVENANT_AGENT_MEMORY_YELLOW_PERCENT": f"{base + 4:.1f}",
                                    "REVENANT_AGENT_MEMORY_RED_PERCENT": f"{base + 12:.1f}"})
    job = Counter(cluster, "node-2", "--on-sick", "migrate", "--checkpoint", "5:00")
    first = job.wait(lambda j: j["state"] == "running", "a start")
    job.wait_lines(20)
    with memhog(int(psutil.virtual_memory().total / MIB * 0.18)) as hog:
        moved = job.wait(lambda j: j["state"] == "running" and j["node"] == "node-1", "the move", timeout=90)
        assert moved["generation"] == first["generation"] + 1
        at_move = job.lines()
        _migrated(cluster, job, "node-2", "node-1", "memory")
        job.assert_one_copy_continuous(at_move)

        # Better but not well (YELLOW): cordoned all the same, no new work until GREEN.
        release_half(hog)
        # `revenant nodes` shows it RED, cordoned, while its own findings are YELLOW only.
        cordoned = wait_node(cluster, "node-2", lambda n: [f["state"] for f in n["findings"]] == ["YELLOW"], "YELLOW")
        assert cordoned["health"] == "RED" and "cordoned until GREEN" in cordoned["reasons"][-1], cordoned
        refused = cluster.cli("submit", "--node", "node-2", "--", "sleep", "60", check=False)
        assert refused.returncode != 0 and "cordoned until GREEN" in refused.stderr, refused
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    submitted = wait_until(lambda: (s := cluster.cli("submit", "--node", "node-2", "--", "sleep", "60",
                                                     check=False)).returncode == 0 and s, timeout=60, interval=0.5)
    assert submitted, "node-2 stayed cordoned once GREEN"
    assert len(events(cluster, "job_event.v1", job=job.id, kind="migrated")) == 1


@pytest.mark.timeout(180)
def test_filling_storage_checkpoints_at_once_and_pauses_moves_when_every_node_is_sick(small_storage, make_cluster):
    # A hold longer than a heartbeat or two: both nodes are RED before either could be moved off.
    env = {"REVENANT_AGENT_STORAGE_YELLOW_FREE_BYTES": str(300 * MIB),
           "REVENANT_AGENT_STORAGE_RED_FREE_BYTES": str(100 * MIB), "REVENANT_COORDINATOR_PROACTIVE_HOLD_S": "3"}
    cluster = make_cluster(2, env=env)
    assert cluster.storage == small_storage
    kept = Counter(cluster, "node-1", "--checkpoint", "5:00")  # policy checkpoint: the cluster's default
    stays = Counter(cluster, "node-2", "--on-sick", "migrate", "--checkpoint", "5:00")
    for job in (kept, stays):
        job.wait(lambda j: j["state"] == "running", "a start")
        job.wait_lines(20)

    # YELLOW on every node (they share the storage): each job gets a fresh epoch, for that reason.
    fill_to(small_storage, 200 * MIB)  # room for a checkpoint (its size and a margin)
    for job in (kept, stays):
        [epoch] = wait_event(cluster, "epoch_event.v1", f"job {job.id}'s proactive epoch", job=job.id,
                             kind="created", cause="health")
        assert any(r.startswith("storage free") for r in epoch["reasons"]), epoch
    first = kept.wait(lambda j: j["epochs"], "the epoch recorded")
    [proactive] = health_epochs(cluster, kept.id)
    assert [e["n"] for e in first["epochs"]] == [proactive["n"]]

    # RED on every node: moving jobs between them would help nothing, so moves pause.
    fill_to(small_storage, 50 * MIB)
    [paused] = wait_event(cluster, "cluster_event.v1", "the storm guard's pause", kind="proactive_paused")
    assert (paused["silent"], paused["total"]) == (2, 2), paused
    time.sleep(6.0)  # twice the hold a move waits for: none comes
    info = stays.show()
    assert (info["state"], info["node"], info["generation"]) == ("running", "node-2", 1), info
    assert not events(cluster, "job_event.v1", job=stays.id, kind="migrated")
    assert not events(cluster, "job_event.v1", job=stays.id, kind="evicted")
    (small_storage / "fill").unlink()
    wait_event(cluster, "cluster_event.v1", "the storm guard's resume", kind="proactive_resumed")

    # The node dies with the job: failover restores it from the proactive epoch.
    at_kill = kept.lines()
    os.kill(cluster.pids()["node-1"], signal.SIGKILL)
    os.kill(first["pid"], signal.SIGKILL)
    again = kept.wait(lambda j: j["state"] == "running" and j["generation"] == 2, "failover", timeout=90)
    [restored] = events(cluster, "job_event.v1", job=kept.id, kind="restored")
    assert restored["epoch"] == proactive["n"] and restored["node"] == again["node"], restored
    kept.assert_one_copy_continuous(at_kill)
    stays.assert_one_copy_continuous(0)


def test_a_critical_gpu_xid_moves_a_migrate_job_off_the_node(make_cluster, extra_agent, tmp_path):
    fake = build(tmp_path / "fakegpu")
    cluster = make_cluster(1, insecure=True)
    extra_agent(cluster, "node-2", fake.env())
    assert wait_node(cluster, "node-2", lambda n: n["health"] == "GREEN", "GREEN")["capabilities"]["gpu"] == "nvml"
    job = Counter(cluster, "node-2", "--on-sick", "migrate")
    first = job.wait(lambda j: j["state"] == "running", "a start")
    job.wait_lines(20)
    fake.xid(0, 79)  # the GPU fell off the bus: RED (gpu_xid)
    moved = job.wait(lambda j: j["state"] == "running" and j["node"] == "node-1", "the move", timeout=90)
    assert moved["generation"] == first["generation"] + 1
    at_move = job.lines()
    _migrated(cluster, job, "node-2", "node-1", "critical XID 79")
    job.assert_one_copy_continuous(at_move)


@pytest.mark.timeout(150)
def test_a_flapping_node_checkpoints_a_job_once_per_cooldown(make_cluster, extra_agent):
    """Memory above YELLOW and back to GREEN in turn for 15 s (the fake NVML reads its temperature
    once, at start, so the flapping is memory's): one fresh epoch, however often the node turns."""
    cluster = make_cluster(1, insecure=True, env={"REVENANT_COORDINATOR_PROACTIVE_HOLD_S": "0.5",
                                                  "REVENANT_COORDINATOR_PROACTIVE_COOLDOWN_S": "120"})
    base = psutil.virtual_memory().percent
    extra_agent(cluster, "node-2", {"REVENANT_AGENT_MEMORY_YELLOW_PERCENT": f"{base + 4:.1f}",
                                    "REVENANT_AGENT_MEMORY_RED_PERCENT": f"{base + 14:.1f}"})
    sick = wait_node(cluster, "node-2", lambda n: n["health"] == "GREEN", "GREEN")
    job = Counter(cluster, "node-2", "--checkpoint", "5:00")
    job.wait(lambda j: j["state"] == "running", "a start")
    job.wait_lines(20)
    seen: list[str] = []
    readings: list[float] = []

    def watch(seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            health = agent_health(sick)
            readings.append(health["probes"]["memory_percent"])
            if not seen or seen[-1] != health["state"]:
                seen.append(health["state"])
            time.sleep(0.2)

    # Each YELLOW spell and each GREEN one outlasts two heartbeats (and the hold).
    end = time.monotonic() + 16
    while time.monotonic() < end:
        with memhog(int(psutil.virtual_memory().total / MIB * 0.09)):
            watch(2.5)
        watch(2.5)
    assert seen.count("YELLOW") >= 2 and "RED" not in seen, (seen, base, readings)  # it did flap
    [epoch] = health_epochs(cluster, job.id)
    assert any(r.startswith("memory") for r in epoch["reasons"]), epoch
    job.assert_one_copy_continuous(0)


def test_a_busy_node_is_not_sick(make_cluster):
    """Both cores saturated for 20 s by spinners weighted above the agent, the loop-lag thresholds
    hair-trigger low (the lag such load causes is a few milliseconds): the node looks unwell (loop_lag), which predicts no failure, so
    no move is even tried and no epoch taken."""
    cluster = make_cluster(2, env={"REVENANT_AGENT_LOOP_STALL_THRESHOLD_S": "0.001",
                                   "REVENANT_AGENT_LOOP_LAG_RED_S": "0.004"})
    job = Counter(cluster, "node-1", "--on-sick", "migrate", "--checkpoint", "5:00")
    job.wait(lambda j: j["state"] == "running", "a start")
    job.wait_lines(20)
    busy = node(cluster, "node-1")
    findings: set[str] = set()
    with busy_loops(2, nice=-10):
        end = time.monotonic() + 20
        while time.monotonic() < end:
            health = agent_health(busy)
            findings.update(f"{f['state']} {f['code']}" for f in health["probes"]["findings"])
            time.sleep(0.5)
    assert {"YELLOW loop_lag", "RED loop_lag"} & findings, findings  # it did look unwell
    info = job.show()
    assert (info["state"], info["node"], info["generation"]) == ("running", "node-1", 1), info
    tried = [e for e in events(cluster, "job_event.v1", job=job.id) if e["kind"].startswith("migrat")]
    assert not tried and not health_epochs(cluster, job.id), tried
    job.assert_one_copy_continuous(0)
