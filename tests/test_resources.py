"""What a job asks of its node: sizes, defaults, room on a node, GPUs by UUID, and the waiting
jobs' lifecycle (pure)."""

import asyncio

import pytest

from revenant.common.settings.config import ConfigError, CoordinatorConfig, load_config
from revenant.common.settings.limits import BadRequest, check_submit
from revenant.common.settings.resources import (Usage, assign_gpus, beyond, check_resources, describe, fit,
                                                parse_size)
from revenant.coordinator.table import lifecycle as lc
from revenant.coordinator.table.placement import NoCapacity, NoNodeAvailable, place_job
from revenant.messages import (Capabilities, CriuInfo, GpuInfo, JobGpu, JobRecord, JobResources, JobSpec, NodeStatus,
                               SubmitRequest)

pytestmark = pytest.mark.unit

H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"


def caps(cpus=8, mem_gib=32, gpus=(), remap=True):
    return Capabilities(cpus=cpus, memory_total_bytes=mem_gib << 30, criu=CriuInfo(ok=True),
                        gpus=[GpuInfo(index=i, name=name, uuid=uuid, driver_version="570.86.10")
                              for i, (uuid, name) in enumerate(gpus)],
                        gpu_checkpoint="driver_api" if gpus else "none", gpu_remap=remap)


def node(name, **kw):
    return NodeStatus(name=name, state="alive", capabilities=caps(**kw))


def ask(cpus=0.0, mem_gib=0, gpus=0):
    return JobResources(cpus=cpus, memory_bytes=mem_gib << 30, gpus=gpus)


@pytest.mark.parametrize("text,n", [("64G", 64 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("4096", 4096),
                                    ("2t", 2 << 40), ("10 MB", 10 << 20), ("1k", 1024)])
def test_sizes_are_read_as_people_write_them(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "G", "64X", "-1G", "0", "1e3", "2 GB extra", "99999999P"])
def test_a_size_that_is_no_size_is_one_line_naming_it(text):
    with pytest.raises(BadRequest) as err:
        parse_size(text)
    assert "--mem" in str(err.value) and "\n" not in str(err.value)


def test_the_clusters_defaults_fill_what_a_submit_leaves_out():
    cfg = load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_RESOURCES_CPUS": "1",
                                                                 "REVENANT_RESOURCES_MEMORY": "2G"})
    assert cfg.resources.ask(SubmitRequest(argv=["x"])) == JobResources(cpus=1, memory_bytes=2 << 30, gpus=0,
                                                                         pids=4096)
    # Every job gets a memory limit and a process limit: leaving out --mem (or asking 0) reserves
    # nothing, and gets the cluster's memory_limit, never reserved.
    assert cfg.resources.ask(SubmitRequest(argv=["x"], cpus=4, gpus=1, memory_bytes=0)) == \
        JobResources(cpus=4, memory_bytes=0, gpus=1, memory_limit_bytes=8 << 30, pids=4096)
    default = CoordinatorConfig().resources.ask(SubmitRequest(argv=["x"]))
    assert default == JobResources(memory_limit_bytes=8 << 30, pids=4096) and default.memory_cap() == 8 << 30
    limited = load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_RESOURCES_MEMORY_LIMIT": "512M",
                                                                     "REVENANT_RESOURCES_PIDS": "64"})
    assert limited.resources.ask(SubmitRequest(argv=["x"])) == JobResources(memory_limit_bytes=512 << 20, pids=64)
    assert limited.resources.ask(SubmitRequest(argv=["x"], memory_bytes=1 << 30)).memory_cap() == 1 << 30
    with pytest.raises(ConfigError, match=r"\[resources\] memory_limit '8X' is not a size"):
        load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_RESOURCES_MEMORY_LIMIT": "8X"})
    with pytest.raises(ConfigError, match=r"\[resources\] pids must be a whole number from 0"):
        load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_RESOURCES_PIDS": "-1"})
    with pytest.raises(ConfigError, match=r"\[resources\] memory '4Q' is not a size"):
        load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_RESOURCES_MEMORY": "4Q"})
    with pytest.raises(ConfigError, match=r"\[resources\] gpus must be a whole number"):
        load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_RESOURCES_GPUS": "-1"})


@pytest.mark.parametrize("field,value,msg", [("cpus", -1.0, "--cpus"), ("cpus", float("nan"), "--cpus"),
                                             ("gpus", -2, "--gpus"), ("gpus", 5000, "--gpus"),
                                             ("memory_bytes", -5, "--mem")])
def test_a_submit_asking_for_no_amount_is_refused_before_anything_is_sent(field, value, msg):
    with pytest.raises(BadRequest, match=msg):
        check_submit(SubmitRequest(argv=["x"], **{field: value}), "alice")


def test_more_than_any_node_has_is_refused_in_one_line():
    nodes = [("a", caps(cpus=8, gpus=[("GPU-1", H100)])), ("b", caps(cpus=16))]
    assert beyond(ask(cpus=16), nodes) is None and beyond(ask(gpus=1, cpus=8), nodes) is None
    with pytest.raises(BadRequest, match=r"--gpus 4 GPUs is more than any node has \(the most is 1 GPU, on node a\)"):
        check_resources(ask(gpus=4), nodes)
    with pytest.raises(BadRequest, match=r"--mem 64 GiB is more than any node has \(the most is 32 GiB"):
        check_resources(ask(mem_gib=64), nodes)
    with pytest.raises(BadRequest, match="no node has 16 CPUs, 1 GPU at once"):
        check_resources(ask(cpus=16, gpus=1), nodes)
    assert beyond(ask(gpus=4), []) is None  # nobody has reported yet: it waits


def test_room_is_what_the_nodes_other_jobs_have_not_taken():
    c = caps(cpus=4, mem_gib=16, gpus=[("GPU-1", H100), ("GPU-2", H100)])
    assert fit(ask(cpus=4, mem_gib=16, gpus=2), c, Usage(), "a") is None
    assert fit(ask(cpus=1), c, Usage(cpus=3.5), "a") == "node a has 0.5 of 4 CPUs free"
    assert fit(ask(mem_gib=8), c, Usage(memory_bytes=12 << 30), "a") == "node a has 4 GiB of 16 GiB memory free"
    assert fit(ask(gpus=1), c, Usage(gpus={"GPU-1", "GPU-2"}), "a") == "node a has 0 of 2 GPUs free"
    assert fit(ask(), c, Usage(cpus=99, gpus={"GPU-1", "GPU-2"}), "a") is None  # asks nothing: never waits
    assert describe(ask(cpus=2, mem_gib=64, gpus=1)) == "2 CPUs, 64 GiB, 1 GPU" and describe(ask()) == "nothing"


def test_gpus_are_given_by_uuid_and_never_twice():
    c = caps(gpus=[("GPU-1", H100), ("GPU-2", H100), ("GPU-3", A100)])
    assert assign_gpus(ask(gpus=2), c, Usage()) == (None, ["GPU-1", "GPU-2"])
    assert assign_gpus(ask(gpus=2), c, Usage(gpus={"GPU-1"})) == (None, ["GPU-2", "GPU-3"])
    # A restore: the epoch's H100 keeps itself if free, else takes a free H100 (never the A100).
    held = [JobGpu(index=0, uuid="GPU-1", name=H100)]
    assert assign_gpus(ask(gpus=1), c, Usage(), held, "570.1") == (None, ["GPU-1"])
    assert assign_gpus(ask(gpus=1), c, Usage(gpus={"GPU-1"}), held, "570.1") == (None, ["GPU-2"])
    why, given = assign_gpus(ask(gpus=1), c, Usage(gpus={"GPU-1", "GPU-2"}), held, "570.1", node="a")
    assert given == [] and "node a has no NVIDIA H100" in why
    # Remapping needs the mechanism.
    why, _ = assign_gpus(ask(gpus=1), caps(gpus=[("GPU-1", H100), ("GPU-2", H100)], remap=False),
                         Usage(gpus={"GPU-1"}), held, "570.1", node="a")
    assert "needs GPU remapping" in why


def test_placement_picks_a_node_with_room_and_says_when_there_is_none():
    nodes = [node("a", cpus=2, gpus=[("GPU-a", H100)]), node("b", cpus=8)]
    assert place_job(nodes, {}, ask=ask(cpus=4)) == ("b", [])
    assert place_job(nodes, {"a": 5}, ask=ask(gpus=1)) == ("a", ["GPU-a"])
    with pytest.raises(NoCapacity, match=r"no node has room for the job's 1 GPU now: node a has 0 of 1 GPU free"):
        place_job(nodes, {}, ask=ask(gpus=1), used={"a": Usage(gpus={"GPU-a"})})
    with pytest.raises(NoCapacity, match="no room on node a"):
        place_job(nodes, {}, "a", ask=ask(cpus=3))
    # Not room: no node could take it at all (here none is alive).
    with pytest.raises(NoNodeAvailable) as err:
        place_job([NodeStatus(name="a", state="dead", capabilities=caps())], {}, ask=ask(cpus=1))
    assert not isinstance(err.value, NoCapacity)


def spec(job="7", **kw):
    return JobSpec(id=job, argv=["true"], resources=ask(**kw))


def test_a_job_with_no_room_waits_pending_then_starts_where_room_is_found():
    d = lc.transition(None, lc.Submit(spec(gpus=1), "", waiting="waiting for room: no GPU free"), 10.0)
    rec = d.record
    assert (rec.state, rec.node, rec.generation, d.commands) == ("pending", "", 0, []) and lc.queued(rec)
    assert rec.reason == "waiting for room: no GPU free" and d.events[0].kind == "submitted"
    assert lc.needs_recovery(rec, "") is False  # no failover, no take-over: the queue's
    assert lc.takeover_plan({"7": ("pending", 0, "")}, {"7": rec}, set()) == []
    assert lc.transition(rec, lc.Waiting("waiting for room: still none"), 11.0).record.reason.endswith("still none")
    d = lc.transition(rec, lc.Placed("b", ("GPU-9",)), 12.0)
    assert (d.record.node, d.record.generation, d.record.assigned_gpus, d.record.reason) == ("b", 1, ["GPU-9"], "")
    assert d.commands == [lc.Start("b", rec.spec, 1, gpus=("GPU-9",))]
    assert lc.transition(d.record, lc.Placed("c"), 13.0).record is None  # placed once only
    # Cancelled while waiting: nothing to kill anywhere.
    d = lc.transition(rec, lc.CancelAsked(), 14.0)
    assert d.record.state == "cancelled" and d.commands == []


def test_usage_counts_what_unfinished_jobs_hold_on_their_node():
    recs = [JobRecord(spec=spec("1", cpus=2, gpus=1), state="running", node="a", assigned_gpus=["GPU-1"]),
            JobRecord(spec=spec("2", mem_gib=4), state="restoring", node="a"),
            JobRecord(spec=spec("3", cpus=8), state="completed", node="a"),
            JobRecord(spec=spec("4", cpus=8), state="vacated", node=""),
            JobRecord(spec=spec("5", cpus=1), state="pending", generation=0)]
    used = lc.usage(recs)
    assert set(used) == {"a"}
    assert (used["a"].cpus, used["a"].memory_bytes, used["a"].gpus) == (2, 4 << 30, {"GPU-1"})


def test_each_launch_carries_the_gpus_it_was_given():
    s = JobSpec(id="7", argv=["true"], requeue=True, resources=ask(gpus=1))
    rec = lc.transition(None, lc.Submit(s, "a", ("GPU-1",)), 1.0).record
    assert rec.assigned_gpus == ["GPU-1"]
    rec = lc.transition(rec, lc.Launched(1, 100), 2.0).record
    d = lc.transition(rec, lc.Recover("a", "b", gpus=("GPU-7",)), 3.0)
    assert d.record.assigned_gpus == ["GPU-7"] and d.commands[-1].gpus == ("GPU-7",)


def test_the_waiting_loop_starts_jobs_oldest_first_as_room_appears():
    from revenant.coordinator.waiting import WaitingJobs

    class Jobs:
        def __init__(self):
            self.jobs = {
                "1": JobRecord(spec=spec("1", gpus=1), state="pending", generation=0, created_at=1.0),
                "2": JobRecord(spec=spec("2", gpus=1), state="pending", generation=0, created_at=2.0),
                "3": JobRecord(spec=spec("3"), state="running", node="a", generation=1)}
            self.free = ["GPU-1"]
            self.started = []

        def place(self, s):
            if s.resources.gpus and not self.free:
                raise NoCapacity("node a has 0 of 1 GPU free")
            return "a", tuple(self.free.pop(0) for _ in range(s.resources.gpus))

        async def step(self, job, inp):
            d = lc.transition(self.jobs[job], inp, 5.0)
            if d.record is not None:
                self.jobs[job] = d.record
            return d

        async def start(self, job, cmd):
            self.started.append((job, cmd.node, cmd.gpus))

    async def main():
        jobs = Jobs()
        loop = WaitingJobs(jobs)
        assert await loop.tick() == ["1"]
        await asyncio.sleep(0)
        assert jobs.started == [("1", "a", ("GPU-1",))]
        assert jobs.jobs["2"].reason == "waiting for room: node a has 0 of 1 GPU free"
        jobs.free.append("GPU-2")
        assert await loop.tick() == ["2"]
        await asyncio.sleep(0)
        assert await loop.tick() == []

    asyncio.run(main())


def test_the_client_library_takes_sizes_as_the_cli_does():
    from revenant.client import ClientError
    from revenant.client.asking import submit_request

    req = submit_request(["true"], "alice", mem="1G", cpus=2, gpus=1)
    assert (req.memory_bytes, req.cpus, req.gpus) == (1 << 30, 2, 1)
    assert submit_request(["true"], "alice", mem=4096).memory_bytes == 4096
    with pytest.raises(ClientError, match="--mem '1Q' is not a size"):
        submit_request(["true"], "alice", mem="1Q")


def test_the_job_table_keeps_each_nodes_room_as_a_walk_of_it_would_find_it():
    import random

    from revenant.coordinator.table.userlimits import JobTable

    rng = random.Random(7)
    table = JobTable()
    states = ["pending", "running", "checkpointing", "restoring", "vacated", "completed", "failed", "cancelled"]
    for step in range(3000):
        job = str(rng.randrange(40))
        if rng.random() < 0.1:
            table.pop(job, None)
            continue
        node = rng.choice(["", "a", "b", "c"])
        gpus = [f"GPU-{node}-{job}"] if node and rng.random() < 0.5 else []
        table[job] = JobRecord(spec=spec(job, cpus=rng.choice([0, 0.5, 2]), mem_gib=rng.choice([0, 1]),
                                         gpus=len(gpus)), state=rng.choice(states), node=node, assigned_gpus=gpus)
        walked = lc.usage(table.values())
        kept = table.usage()
        assert {n: (round(u.cpus, 6), u.memory_bytes, u.gpus) for n, u in walked.items()} == \
            {n: (round(u.cpus, 6), u.memory_bytes, u.gpus) for n, u in kept.items()}, step
        assert table.per_node == lc.jobs_per_node(table.values())
        but = table.usage(but=job)  # a restore of the job itself: its own room is free
        expect = lc.usage(r for j, r in table.items() if j != job)
        assert all((round(but[n].cpus, 6), but[n].memory_bytes, but[n].gpus) ==
                   (round(expect.get(n, Usage()).cpus, 6), expect.get(n, Usage()).memory_bytes,
                    expect.get(n, Usage()).gpus) for n in but)


def test_the_cgroup_layout_is_read_from_the_mounts():
    from revenant.agent.processes.cgroups import JobCgroup, Layout, NodeCgroups, discover

    hybrid = ("30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory\n"
              "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:10 - cgroup cgroup rw,cpu,cpuacct\n"
              "32 25 0:28 / /sys/fs/cgroup/pids rw,relatime shared:11 - cgroup cgroup rw,pids\n"
              "33 25 0:29 / /sys/fs/cgroup/unified rw,relatime shared:12 - cgroup2 cgroup2 rw\n")
    layout = discover(hybrid, "4:memory:/x\n3:cpu,cpuacct:/\n2:pids:/\n0::/\n")
    assert layout.version == 1 and [h.name for h in layout.hierarchies] == ["memory", "cpu,cpuacct", "pids"]
    cg = JobCgroup(layout, "revenant/n/7-g2")
    assert cg.criu_args() == ["--manage-cgroups=soft", "--cgroup-root", "memory:/revenant/n/7-g2",
                              "--cgroup-root", "cpu,cpuacct:/revenant/n/7-g2", "--cgroup-root", "pids:/revenant/n/7-g2"]
    assert cg.limits(JobResources(cpus=1.5, memory_bytes=1 << 30), 100) == {
        "memory.limit_in_bytes": str(1 << 30), "cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "150000",
        "pids.max": "100"}
    assert cg.limits(JobResources(), 0)["cpu.cfs_quota_us"] == "-1"
    # The cluster's limits for every job: its memory where it reserved none; the fewer processes
    # of the job's and the node's.
    assert cg.limits(JobResources(memory_limit_bytes=8 << 30, pids=4096), 65536) == {
        "memory.limit_in_bytes": str(8 << 30), "cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "-1",
        "pids.max": "4096"}
    assert cg.limits(JobResources(memory_bytes=1 << 30, memory_limit_bytes=8 << 30, pids=4096), 100)[
        "memory.limit_in_bytes"] == str(1 << 30)
    assert cg.limits(JobResources(pids=4096), 100)["pids.max"] == "100"
    assert cg.limits(JobResources(pids=4096), 0)["pids.max"] == "4096"
    v2 = JobCgroup(Layout(2, layout.hierarchies[:1]), "revenant/n/7-g2")
    assert v2.limits(JobResources(cpus=0.25, memory_bytes=4096), 0) == {"memory.max": "4096", "cpu.max": "25000 100000",
                                                                       "pids.max": "max"}
    assert v2.criu_args() == ["--manage-cgroups=soft", "--cgroup-root", "/revenant/n/7-g2"]
    none = discover("33 25 0:29 / /nonexistent/cgroup rw - cgroup2 cgroup2 rw\n", "0::/\n")
    assert none.version == 0 and "memory, cpu, pids" in none.why_none
    cg, why = NodeCgroups("n", none).make("7", 1, JobResources(memory_bytes=1 << 20))
    assert cg is None and "are not enforced" in why[0]
    assert NodeCgroups("n", none).make("7", 1, JobResources()) == (None, [])

