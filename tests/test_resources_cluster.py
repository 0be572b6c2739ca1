"""Resources through a real cluster (`revenant up`, real criu, the NVML and CUDA stand-ins of
tests/fakegpu, which the agents load through the same code as the real libraries): GPUs given
by UUID and never twice, a cgroup per generation with the job's limits that criu carries into
every restore, a job that waits for room, a restore remapped onto a free GPU of the same model,
and one-line refusals of what no node has."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from conftest import wait_until
from fakegpu import build, counter_request, free_port

pytestmark = [pytest.mark.cluster, pytest.mark.criu]

GPUCOUNTER = Path(__file__).parent / "jobs" / "gpucounter.py"
H100 = "NVIDIA H100 80GB HBM3"
GPU1, GPU2 = "GPU-8e7f3a52-1c4b-4d2e-9f60-0a1b2c3d4e01", "GPU-8e7f3a52-1c4b-4d2e-9f60-0a1b2c3d4e02"
MEMORY_ROOT = Path("/sys/fs/cgroup/memory")


def _wait(cluster, job: str, predicate, what: str, timeout: float = 60) -> dict:
    info = wait_until(lambda: (j := cluster.job(job)) and predicate(j) and j, timeout=timeout, interval=0.2)
    assert info, f"job {job}: {what} did not happen: {cluster.job(job)}"
    return info


def _counter(cluster, fake, tmp_path: Path, name: str, *flags: str) -> tuple[str, int]:
    port, workdir = free_port(), tmp_path / name
    workdir.mkdir()
    job = cluster.cli("submit", *flags, "--workdir", str(workdir), "--env",
                      f"REVENANT_FAKEGPU_DIR={fake.env()['REVENANT_FAKEGPU_DIR']}", "--", sys.executable,
                      str(GPUCOUNTER), "--port", str(port), "--device-mib", "1").stdout.strip()
    return job, port


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _cgroup(pid: int, controller: str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return path
    raise AssertionError(f"pid {pid} has no {controller} cgroup")


def _limits(pid: int) -> tuple[str, str, str, str]:
    """(memory cgroup path, memory limit, cpu quota, pids.max) of ``pid``'s cgroups."""
    def read(ctl: str, name: str) -> str:
        return (Path("/sys/fs/cgroup") / ctl / _cgroup(pid, ctl).lstrip("/") / name).read_text().strip()

    return (_cgroup(pid, "memory"), read("memory", "memory.limit_in_bytes"), read("cpu", "cpu.cfs_quota_us"),
            read("pids", "pids.max"))


def _on_gpu(fake, pid_tree: set[int]) -> set[str]:
    return {uuid for uuid, procs in fake.device_processes().items() if any(p in pid_tree for p, _ in procs)}


@pytest.mark.skipif(not (MEMORY_ROOT / "cgroup.procs").exists(), reason="needs cgroup v1 memory, cpu and pids "
                    "hierarchies (these machines have them; a pure cgroup v2 host runs the same code with v2 files)")
def test_resources_are_given_limited_waited_for_and_carried_across_restores(make_cluster, tmp_path):
    fake = build(tmp_path / "fakegpu")
    fake.set_gpus([(GPU1, H100, 80 << 30), (GPU2, H100, 80 << 30)])
    fake.set_driver("580.65.06", 13000)  # CUDA 13: a restore may remap GPUs
    cluster = make_cluster(2, env={**fake.env(), "REVENANT_AGENT_GPU_CHECKPOINT": "driver_api"})
    wait_until(lambda: (n := cluster.json("nodes", "--json")) and len(n) == 2 and n, timeout=30)

    # Bad asks: one line each, nothing made.
    for flags, said in ((["--gpus", "3"], "--gpus 3 GPUs is more than any node has (the most is 2 GPUs"),
                        (["--mem", "lots"], "--mem 'lots' is not a size"),
                        (["--cpus", "-1"], "--cpus must be a number from 0")):
        bad = cluster.cli("submit", *flags, "--", "true", check=False)
        assert bad.returncode != 0 and said in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr

    # A: one GPU, 256 MiB, half a CPU, on node-1.
    a, a_port = _counter(cluster, fake, tmp_path, "a", "--node", "node-1", "--gpus", "1", "--mem", "256M",
                         "--cpus", "0.5")
    info = _wait(cluster, a, lambda j: j["state"] == "running", "start of A")
    assert info["assigned_gpus"] == [GPU1] and info["resources"] == {"cpus": 0.5, "memory_bytes": 256 << 20, "gpus": 1,
                                                                  "memory_limit_bytes": 0, "pids": 4096}
    assert _environ(info["program_pid"])["CUDA_VISIBLE_DEVICES"] == GPU1
    # Its processes: the cluster's limit for every job (4096), under the node's (65536).
    assert _limits(info["program_pid"]) == (f"/revenant/node-1/{a}-g1", str(256 << 20), "50000", "4096")
    assert counter_request(a_port, "inc", timeout=30) == "101"
    assert _on_gpu(fake, {info["program_pid"]}) == {GPU1}

    # B on node-1 gets the other GPU, never A's.
    b, _ = _counter(cluster, fake, tmp_path, "b", "--node", "node-1", "--gpus", "1")
    info_b = _wait(cluster, b, lambda j: j["state"] == "running", "start of B")
    assert info_b["assigned_gpus"] == [GPU2] and _environ(info_b["program_pid"])["CUDA_VISIBLE_DEVICES"] == GPU2
    # Its own cgroup: no --mem, so nothing reserved, and the cluster's memory limit for every job.
    assert _limits(info_b["program_pid"]) == (f"/revenant/node-1/{b}-g1", str(8 << 30), "-1", "4096")
    # What node-1's jobs took, as `revenant nodes` shows it.
    node1 = next(n for n in cluster.json("nodes", "--json") if n["name"] == "node-1")
    assert node1["jobs"] == 2 and node1["allocated"] == {"cpus": 0.5, "memory_bytes": 256 << 20, "gpus": 2,
                                                     "memory_limit_bytes": 0, "pids": 0}
    assert "2 jobs, 0.5/" in cluster.cli("nodes").stdout and "2/2 gpu" in cluster.cli("nodes").stdout

    # node-1 is full: a third GPU job asked there is refused; one anywhere goes to node-2.
    full = cluster.cli("submit", "--node", "node-1", "--gpus", "1", "--", "sleep", "60", check=False)
    assert full.returncode != 0 and "no room on node node-1" in full.stderr and "0 of 2 GPUs free" in full.stderr
    c = cluster.cli("submit", "--gpus", "2", "--", "sleep", "600").stdout.strip()
    assert _wait(cluster, c, lambda j: j["state"] == "running", "start of C")["node"] == "node-2"

    # D fits nowhere now: it waits, pending with the reason, and starts once C is cancelled.
    d = cluster.cli("submit", "--gpus", "1", "--", "sleep", "600")
    assert "is pending, waiting for room" in d.stderr, d.stderr
    d = d.stdout.strip()
    waiting = cluster.job(d)
    assert waiting["state"] == "pending" and not waiting["node"] and "waiting for room" in waiting["reason"]
    shown = cluster.cli("show", "job", d).stdout
    assert "waiting for room" in shown and "asks" in shown and "1 GPU" in shown
    assert "memory 8 GiB (the cluster's, for a job without --mem), 4096 processes" in shown  # its limits line
    cluster.cli("cancel", c)
    started = _wait(cluster, d, lambda j: j["state"] == "running", "start of D once C ended", timeout=30)
    assert started["node"] == "node-2" and started["assigned_gpus"] == [GPU1]

    # A moves to node-2, where its GPU is D's: restored onto the free one of its model, its limits
    # in the new generation's cgroup (criu's --cgroup-root), its counter going on.
    cluster.cli("checkpoint", "vacate", a)
    _wait(cluster, a, lambda j: j["state"] == "vacated", "vacate of A")
    # The ended generation's cgroup goes once its last process has been reaped (NodeCgroups.retire, then tidy).
    assert wait_until(lambda: not (MEMORY_ROOT / "revenant" / "node-1" / f"{a}-g1").exists(), timeout=30)
    cluster.cli("checkpoint", "restart", a, "--node", "node-2")
    moved = _wait(cluster, a, lambda j: j["state"] == "running" and j["node"] == "node-2", "restart of A")
    assert moved["assigned_gpus"] == [GPU2]
    assert _limits(moved["program_pid"]) == (f"/revenant/node-2/{a}-g{moved['generation']}", str(256 << 20),
                                             "50000", "4096")
    assert counter_request(a_port, "inc", timeout=30) == "102"
    assert _on_gpu(fake, {moved["program_pid"]}) == {GPU2}
    events = [e for e in cluster.events() if e.get("job") == a and e.get("kind") == "restored"]
    assert events and f"{GPU1} -> {GPU2}" in events[-1]["reason"], events

    # An ask beyond the room a node has now is refused for a restart that names it.
    cluster.cli("checkpoint", "vacate", b)
    _wait(cluster, b, lambda j: j["state"] == "vacated", "vacate of B")
    busy = cluster.cli("checkpoint", "restart", b, "--node", "node-2", check=False)
    assert busy.returncode != 0 and "no room on node node-2" in busy.stderr, busy.stderr
    json.loads(cluster.cli("show", "job", b, "--json").stdout)  # still vacated, untouched
    assert cluster.job(b)["state"] == "vacated"
    for job in (a, d):
        cluster.cli("cancel", job)


@pytest.mark.skipif(not (MEMORY_ROOT / "cgroup.procs").exists(), reason="needs cgroup v1 memory, cpu and pids "
                    "hierarchies (these machines have them; a pure cgroup v2 host runs the same code with v2 files)")
def test_failover_waits_for_room_and_a_job_over_its_memory_is_told_why_it_died(make_cluster, tmp_path):
    fake = build(tmp_path / "fakegpu")
    fake.set_gpus([(GPU1, H100, 80 << 30), (GPU2, H100, 80 << 30)])
    cluster = make_cluster(2, env={**fake.env(), "REVENANT_AGENT_GPU_CHECKPOINT": "driver_api"})
    wait_until(lambda: (n := cluster.json("nodes", "--json")) and len(n) == 2 and n, timeout=30)

    # Over its --mem: the OOM killer in its cgroup, and the job's reason says so.
    hog = cluster.cli("submit", "--mem", "64M", "--", sys.executable, "-c",
                      "b = bytearray(512 << 20)\nimport time; time.sleep(30)").stdout.strip()
    ended = _wait(cluster, hog, lambda j: j["state"] == "failed", "the OOM kill")
    assert "OOM killer" in ended["reason"] and "64 MiB" in ended["reason"], ended

    # A holds both of node-1's GPUs; B both of node-2's.  node-1 dies: A waits for room, restoring.
    a, port = _counter(cluster, fake, tmp_path, "a", "--node", "node-1", "--gpus", "2", "--mem", "512M")
    _wait(cluster, a, lambda j: j["state"] == "running", "start of A")
    assert counter_request(port, "inc", timeout=30) == "101"
    b = cluster.cli("submit", "--node", "node-2", "--gpus", "2", "--", "sleep", "600").stdout.strip()
    _wait(cluster, b, lambda j: j["state"] == "running", "start of B")
    cluster.cli("checkpoint", "create", a)
    first = _wait(cluster, a, lambda j: j["state"] == "running" and j["epochs"], "checkpoint of A")
    os.kill(cluster.pids()["node-1"], signal.SIGKILL)
    os.kill(first["pid"], signal.SIGKILL)
    held = _wait(cluster, a, lambda j: "waiting for room" in j["reason"], "failover waiting for room", timeout=60)
    assert held["state"] in ("running", "restoring") and "node-2 has 0 of 2 GPUs free" in held["reason"], held
    cluster.cli("cancel", b)
    moved = _wait(cluster, a, lambda j: j["state"] == "running" and j["node"] == "node-2"
                  and j["generation"] > first["generation"], "failover once B ended", timeout=60)
    assert sorted(moved["assigned_gpus"]) == [GPU1, GPU2] and not moved["reason"]
    assert _limits(moved["program_pid"])[:2] == (f"/revenant/node-2/{a}-g{moved['generation']}", str(512 << 20))
    assert counter_request(port, "inc", timeout=30) == "102"
    cluster.cli("cancel", a)
