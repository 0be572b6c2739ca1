"""Placement for a restore ignores RED reasons a restore does not worsen (low space on the shared
storage), and says which; new jobs still avoid the node.  Pure placement, then the coordinator's
job service without a cluster: health from the agent's rules, carried by a heartbeat through the
failure detector, the job table in memory, the agents' transport replaced."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import HeldLease

from revenant.agent.node.health import HealthSample, evaluate
from revenant.common.messaging.events import EventPublisher
from revenant.common.settings.config import CoordinatorConfig
from revenant.common.settings.thresholds import HealthThresholds
from revenant.coordinator.nodes.detector import FailureDetector
from revenant.coordinator.table.agents import AgentClient
from revenant.coordinator.table.jobs import JobService
from revenant.coordinator.table.placement import NoNodeAvailable, place, restore_note, restore_waivers
from revenant.coordinator.table.store import MemoryJobStore
from revenant.messages import (
    AgentJobReply,
    Capabilities,
    CriuInfo,
    EpochInfo,
    GpuInfo,
    HealthFinding,
    HealthSummary,
    Heartbeat,
    JobGpu,
    JobRecord,
    JobSpec,
    NodeStatus,
    SubmitRequest,
)

pytestmark = pytest.mark.unit

WORKING = Capabilities(criu=CriuInfo(path="/usr/sbin/criu", version="4.1.1", ok=True))
LOW_SHARED_STORAGE = HealthSample(storage_free_bytes=95 * 2**20)


def node(name: str, health: HealthSummary) -> NodeStatus:
    return NodeStatus(name=name, state="alive", health=health.state, reasons=list(health.reasons),
                      findings=list(health.findings), capabilities=WORKING)


# ------------------------------------------------------------------ the health rules' codes


def test_every_reason_has_its_code_and_state():
    s = evaluate(HealthSample(storage_free_bytes=95 * 2**20, memory_percent=90, nats_connected=False,
                              checkpoint_failures=5), HealthThresholds())
    assert len(s.findings) == len(s.reasons)
    assert [(f.state, f.code) for f in s.findings] == [("YELLOW", "memory"), ("RED", "storage_low"),
                                                       ("YELLOW", "nats"), ("RED", "checkpoint_failures")]
    assert s.reasons[1].startswith("storage free 95 MiB")


@given(memory=st.floats(0, 100), free=st.none() | st.integers(0, 2**40), lag=st.floats(0, 10),
       criu=st.booleans(), nats=st.booleans(), failures=st.integers(0, 10), ops=st.integers(0, 10_000))
def test_findings_match_the_reasons_and_the_state(memory, free, lag, criu, nats, failures, ops):
    s = evaluate(HealthSample(memory_percent=memory, storage_free_bytes=free, loop_lag_s=lag, criu_ok=criu,
                              nats_connected=nats, checkpoint_failures=failures, pending_ops=ops), HealthThresholds())
    assert len(s.findings) == len(s.reasons)
    assert (s.state == "RED") == any(f.state == "RED" for f in s.findings)
    assert (s.state == "GREEN") == (not s.findings)


# ------------------------------------------------------------------ placement, pure


def test_a_node_red_only_for_low_shared_storage_takes_a_restore_but_no_new_job():
    low = node("a", evaluate(LOW_SHARED_STORAGE, HealthThresholds()))
    assert low.health == "RED"
    with pytest.raises(NoNodeAvailable, match=r"a is RED \(storage free 95 MiB"):
        place([low], {})
    assert place([low], {}, restore=True) == "a"
    assert place([low], {}, requested="a", restore=True) == "a"
    assert restore_waivers(low) == [low.reasons[0]]
    assert "storage free 95 MiB" in restore_note([low], "a") and "ignored" in restore_note([low], "a")


def test_a_restore_still_prefers_a_node_that_is_not_red():
    low = node("a", evaluate(LOW_SHARED_STORAGE, HealthThresholds()))
    warm = node("b", evaluate(HealthSample(memory_percent=90), HealthThresholds()))
    assert place([low, warm], {"b": 10}, restore=True) == "b"
    assert restore_note([low, warm], "b") == ""


@pytest.mark.parametrize("sample", [
    HealthSample(storage_free_bytes=95 * 2**20, memory_percent=99),      # and memory: RED for two reasons
    HealthSample(storage_free_bytes=95 * 2**20, criu_ok=False),
    HealthSample(storage_free_bytes=95 * 2**20, checkpoint_failures=5),
])
def test_any_other_red_reason_keeps_a_restore_off_the_node(sample):
    red = node("a", evaluate(sample, HealthThresholds()))
    with pytest.raises(NoNodeAvailable, match="a is RED"):
        place([red], {}, restore=True)


def test_a_reason_without_a_code_is_never_ignored():
    """A drain or a self-fence adds a RED reason by hand (agent.py, liveness.py), and an older
    agent sends no codes: the lists differ in length, and nothing is waived."""
    health = evaluate(LOW_SHARED_STORAGE, HealthThresholds())
    draining = node("a", health)
    draining.reasons.append("draining: the agent is shutting down")
    older = node("b", health)
    older.findings = []
    for n in (draining, older):
        assert restore_waivers(n) == []
        with pytest.raises(NoNodeAvailable):
            place([n], {}, restore=True)
    bad = node("c", HealthSummary(state="RED", reasons=["x"], findings=[HealthFinding(state="YELLOW", code="memory")]))
    assert restore_waivers(bad) == []  # RED, yet no RED finding: not understood, not waived


# ------------------------------------------------------------------ the job service


def cluster_on_low_shared_storage() -> JobService:
    """Two nodes whose heartbeats say RED for low shared storage only, as the detector sees them."""
    config = CoordinatorConfig()
    detector = FailureDetector(config)
    health = evaluate(LOW_SHARED_STORAGE, HealthThresholds())
    for name in ("node-1", "node-2"):
        detector.heartbeat(Heartbeat(node=name, seq=1, sent_at=0.0, incarnation="i", capabilities=WORKING,
                                     health=health), 100.0)
    service = JobService(MemoryJobStore(), AgentClient(None, lambda: True), config, EventPublisher(None),
                         lambda: detector.snapshot(100.0), HeldLease(), wall=lambda: 1000.0)
    sent: list[tuple[str, str]] = []

    async def agent(node_name: str, verb: str, msg, timeout_s: float) -> AgentJobReply:
        sent.append((node_name, verb))
        return AgentJobReply(job=msg.spec.id, generation=msg.generation, node=node_name, pid=4242,
                             output="/out", epoch=EpochInfo(n=1))

    service.agents.send = agent
    service.sent = sent
    return service


async def test_a_restart_goes_to_a_node_red_only_for_low_shared_storage_while_a_submit_is_refused():
    service = cluster_on_low_shared_storage()
    with pytest.raises(NoNodeAvailable, match=r"RED \(storage free 95 MiB"):
        await service.submit(SubmitRequest(argv=["true"]))
    await service.save(JobRecord(spec=JobSpec(id="1", argv=["true"]), state="vacated", epochs=[EpochInfo(n=1)]))
    rec, notes = await service.restart("1")
    assert (rec.state, rec.node) == ("running", "node-1") and service.sent == [("node-1", "restore")]
    assert any("RED (storage free 95 MiB" in n and "ignored" in n for n in notes)


async def test_a_dead_nodes_job_is_restored_on_a_node_red_only_for_low_shared_storage():
    service = cluster_on_low_shared_storage()
    await service.save(JobRecord(spec=JobSpec(id="1", argv=["true"]), state="running", node="node-1",
                                 generation=1, epochs=[EpochInfo(n=1)]))
    kind, rec, epoch, notes = await service.recover("1", "node-1")
    assert (kind, rec.node, rec.generation, epoch) == ("restored", "node-2", 2, 1)
    assert any("storage free 95 MiB" in n for n in notes)  # the `restored` event's reason says so
    # Without an epoch it would be a new start (a requeue): that needs space, so no waiver.
    await service.save(JobRecord(spec=JobSpec(id="2", argv=["true"], requeue=True), state="running",
                                 node="node-1", generation=1))
    with pytest.raises(NoNodeAvailable):
        await service.recover("2", "node-1")


@pytest.mark.unit
def test_a_restore_leaves_a_working_directory_other_live_jobs_share():
    from revenant.coordinator.table.placement import workdir_shared
    from revenant.messages import JobRecord, JobSpec

    def rec(job: str, workdir: str, state: str = "running") -> JobRecord:
        return JobRecord(spec=JobSpec(id=job, argv=["x"], workdir=workdir), state=state)

    mine = JobSpec(id="1", argv=["x"], workdir="/proj/run1")
    jobs = [rec("1", "/proj/run1"), rec("2", "/proj/run2"), rec("3", "/elsewhere")]
    assert workdir_shared(mine, jobs) == ""  # siblings do not share it
    jobs += [rec("4", "/proj/run1/sub"), rec("5", "/proj", "completed"), rec("6", "/proj", "cancelled"),
             rec("12", "/proj")]
    assert workdir_shared(mine, jobs) == "jobs 4, 12 also work in it"  # nested either way; ended jobs do not count
    assert workdir_shared(mine, [rec("7", "/proj/run1/", "vacated")]) == "job 7 also works in it"


# ------------------------------------------------------------------ a job that held a GPU


def gpu_caps(uuid: str, model: str = "NVIDIA H200", driver: str = "570.86.10") -> Capabilities:
    return Capabilities(criu=WORKING.criu, gpu="nvml", gpu_checkpoint="driver_api", gpu_remap=True,
                        cuda_version=12080, gpus=[GpuInfo(index=0, uuid=uuid, name=model, driver_version=driver)])


def gpu_cluster(caps: dict[str, Capabilities]) -> JobService:
    """Healthy nodes with the given capabilities, as the detector sees them."""
    config = CoordinatorConfig()
    detector = FailureDetector(config)
    for name, c in caps.items():
        detector.heartbeat(Heartbeat(node=name, seq=1, sent_at=0.0, incarnation="i", capabilities=c), 100.0)
    service = JobService(MemoryJobStore(), AgentClient(None, lambda: True), config, EventPublisher(None),
                         lambda: detector.snapshot(100.0), HeldLease(), wall=lambda: 1000.0)
    sent: list[tuple[str, str]] = []

    async def agent(node_name: str, verb: str, msg, timeout_s: float) -> AgentJobReply:
        sent.append((node_name, verb))
        return AgentJobReply(job=msg.spec.id, generation=msg.generation, node=node_name, pid=4242,
                             output="/out", epoch=EpochInfo(n=1))

    service.agents.send = agent
    service.sent = sent
    return service


GPU_JOB = [JobGpu(index=0, uuid="GPU-gone", name="NVIDIA H200", memory_bytes=1 << 30)]


def gpu_record(job: str, state: str, node: str = "", gpus=GPU_JOB) -> JobRecord:
    return JobRecord(spec=JobSpec(id=job, argv=["train"]), state=state, node=node, generation=1,
                     epochs=[EpochInfo(n=1)], gpus=list(gpus), gpu_driver="570.86.10")


async def test_a_restart_and_a_failover_of_a_gpu_job_go_only_to_a_node_that_takes_its_gpus():
    service = gpu_cluster({"a-cpu": WORKING, "b-a100": gpu_caps("GPU-x", "NVIDIA A100"),
                           "c-h200": gpu_caps("GPU-h"), "d-h200": gpu_caps("GPU-i")})
    await service.save(gpu_record("1", "vacated"))
    with pytest.raises(NoNodeAvailable, match="node b-a100 has no NVIDIA H200 GPU"):
        await service.restart("1", node="b-a100")
    assert service.sent == [] and service.get("1").state == "vacated"
    rec, _ = await service.restart("1")
    assert rec.node == "c-h200"  # a-cpu and b-a100 have fewer jobs, but cannot take the GPU
    await service.save(gpu_record("2", "running", node="c-h200"))
    kind, rec, _, _ = await service.recover("2", "c-h200")
    assert (kind, rec.node) == ("restored", "d-h200")
    # A job without GPUs still goes to the node with the fewest jobs.
    await service.save(gpu_record("3", "vacated", gpus=[]))
    assert (await service.restart("3"))[0].node == "a-cpu"


async def test_no_node_for_a_gpu_jobs_failover_or_drain_names_the_gpu_reasons():
    service = gpu_cluster({"a-cpu": WORKING, "b-h200": gpu_caps("GPU-h", driver="580.65.06"),
                           "c-h200": gpu_caps("GPU-gone")})
    await service.save(gpu_record("1", "running", node="c-h200"))
    with pytest.raises(NoNodeAvailable) as info:
        await service.recover("1", "c-h200")
    assert "node a-cpu cannot checkpoint or restore GPU state" in str(info.value)
    assert "node b-h200 has GPU driver 580.65.06" in str(info.value)
    # A drained job may go back to its own node, where its GPU still is.
    await service.save(gpu_record("1", "restoring", node="c-h200"))
    kind, rec, _, _ = await service.recover("1", "c-h200", evicted="draining")
    assert (kind, rec.node) == ("restored", "c-h200")
