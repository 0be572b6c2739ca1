"""A GPU job through a real cluster (`revenant up`: agents, coordinator, nats-server, real criu),
with the driver stood in: the agents load the fake libcuda and NVML (tests/fakegpu) from
LD_LIBRARY_PATH through the same code as the real ones.  The seed's acceptance test: packet ->
101, vacate, restart -> 102; then a checkpoint, kill -9 of the node, failover -> the next value."""

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


def _submit(cluster, port: int, workdir: Path, fake) -> str:
    # The job finds the fake driver's state where a CUDA program finds its driver: through what its
    # submit gives it (the agent's own environment never reaches a job).
    return cluster.cli("submit", "--node", "node-1", "--workdir", str(workdir),
                       "--env", f"REVENANT_FAKEGPU_DIR={fake.env()['REVENANT_FAKEGPU_DIR']}", "--", sys.executable,
                       str(GPUCOUNTER), "--port", str(port), "--device-mib", "2").stdout.strip()


def _running_counter(cluster, tmp_path: Path, fake) -> tuple[str, int]:
    """The fake CUDA counter submitted to node-1, running, asked once over UDP (101); its id and port."""
    port, workdir = free_port(), tmp_path / "wd"
    workdir.mkdir()
    job = _submit(cluster, port, workdir, fake)
    _wait(cluster, job, lambda j: j["state"] == "running", "start")
    assert counter_request(port, "inc", timeout=30) == "101"
    return job, port


def _wait(cluster, job: str, predicate, what: str, timeout: float = 60) -> dict:
    info = wait_until(lambda: (j := cluster.job(job)) and predicate(j) and j, timeout=timeout, interval=0.2)
    assert info, f"job {job}: {what} did not happen: {cluster.job(job)}"
    return info


@pytest.mark.parametrize("mechanism", ["driver_api", "binary"])
def test_a_gpu_job_is_vacated_restarted_and_fails_over_with_its_gpu_state(make_cluster, tmp_path, mechanism):
    fake = build(tmp_path / "fakegpu")
    env = {**fake.env(), "REVENANT_AGENT_GPU_CHECKPOINT": mechanism,
           "REVENANT_AGENT_GPU_CUDA_CHECKPOINT": str(fake.cuda_checkpoint)}
    cluster = make_cluster(2, env=env)
    nodes = wait_until(lambda: (n := cluster.json("nodes", "--json")) and len(n) == 2 and n, timeout=30)
    caps = nodes[0]["capabilities"]
    assert caps["gpu"] == "nvml" and caps["gpu_checkpoint"] == mechanism, caps
    job, port = _running_counter(cluster, tmp_path, fake)
    checked = json.loads(cluster.cli("check", job, "--json").stdout)  # its CUDA process, carried
    gpu = [r for r in checked["resources"] if r["kind"] == "gpu"]
    assert checked["checkpointable"] and gpu and gpu[0]["verdict"] == "carried" and mechanism in gpu[0]["reason"], checked

    cluster.cli("checkpoint", "vacate", job)
    vacated = _wait(cluster, job, lambda j: j["state"] == "vacated", "vacate")
    assert vacated["epochs"][-1]["gpus"][0]["uuid"] == fake.gpus[0][0]
    assert fake.device_processes() == {} or all(not v for v in fake.device_processes().values())
    cluster.cli("checkpoint", "restart", job, "--node", "node-2")
    _wait(cluster, job, lambda j: j["state"] == "running" and j["node"] == "node-2", "restart")
    assert counter_request(port, "inc", timeout=30) == "102"

    cluster.cli("checkpoint", "create", job)
    first = _wait(cluster, job, lambda j: j["state"] == "running" and j["epochs"][-1]["n"] >= 2, "checkpoint")
    os.kill(cluster.pids()["node-2"], signal.SIGKILL)  # the node dies, and its job with it
    os.kill(first["pid"], signal.SIGKILL)
    moved = _wait(cluster, job, lambda j: j["state"] == "running" and j["node"] == "node-1"
                  and j["generation"] > first["generation"], "failover", timeout=90)
    assert moved["gpus"] and moved["gpus"][0]["name"] == fake.gpus[0][1]
    assert counter_request(port, "inc", timeout=30) == "103"


def test_a_failed_gpu_suspend_fails_the_vacate_and_the_job_runs_on(make_cluster, tmp_path):
    fake = build(tmp_path / "fakegpu")
    cluster = make_cluster(1, env=fake.env())
    job, port = _running_counter(cluster, tmp_path, fake)
    fake.fail("checkpoint")
    out = cluster.cli("checkpoint", "vacate", job, check=False)
    assert out.returncode != 0 and "CUDA_ERROR_UNKNOWN" in out.stderr, out
    assert len(out.stderr.strip().splitlines()) == 1  # one line, no traceback
    info = _wait(cluster, job, lambda j: j["state"] == "running", "running on")
    assert "CUDA_ERROR_UNKNOWN" in info["last_checkpoint_error"] and not info["epochs"]
    assert counter_request(port, "inc", timeout=30) == "102"
