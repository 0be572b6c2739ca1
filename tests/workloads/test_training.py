"""The PyTorch tier (make test-workloads; not in make test: torch is large and has its own
set-up, deploy/scripts/setup-torch.sh): a training loop on CPU with DataLoader(num_workers=2),
through create, a vacate and restart on the other node, a create and a failover, on a 2-node
`revenant up` with real criu.  Its whole output (every step's loss and weight checksum as exact
hex floats, then the final weights' sha256) must equal an uninterrupted run's, byte for byte.
The same program (tests/gpu/train.py) ran on an NVIDIA H200 through tests/gpu/device-check.sh
(docs/gpu.md)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from test_batch_jobs import state, through_everything

pytestmark = [pytest.mark.cluster, pytest.mark.criu, pytest.mark.workloads, pytest.mark.training]

TRAIN = REPO / "tests" / "gpu" / "train.py"
TORCH_PYTHON = os.environ.get("REVENANT_TORCH_PYTHON", "/opt/revenant/torch-venv/bin/python")


@pytest.fixture(scope="module")
def torch_python() -> str:
    ok = Path(TORCH_PYTHON).exists() and subprocess.run([TORCH_PYTHON, "-c", "import torch, numpy"],
                                                       capture_output=True, timeout=120).returncode == 0
    assert ok, (f"no torch for {TORCH_PYTHON}: run deploy/scripts/setup-torch.sh (make test-workloads does), "
                "or set REVENANT_TORCH_PYTHON")
    return TORCH_PYTHON


@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_training_loop_with_dataloader_workers_comes_through_bit_identical(make_cluster, tmp_path, torch_python,
                                                                              method):
    args = [str(TRAIN), "--device", "cpu", "--workers", "2", "--mp-context", method, "--steps", "240",
            "--step-s", "0.05", "--width", "256"]
    reference = subprocess.run([torch_python, *args], capture_output=True, check=True, timeout=300).stdout
    cluster = make_cluster(2)
    work = tmp_path / "train"
    work.mkdir()
    job = cluster.cli("submit", "--node", "node-1", "--workdir", str(work), "--", torch_python,
                      *args).stdout.strip()
    out = cluster.storage / "jobs" / job / "output.log"
    through_everything(cluster, job, lambda: out.read_bytes().count(b"\n") if out.exists() else 0)
    state(cluster, job, "completed", timeout=300)
    assert out.read_bytes() == reference
    assert reference.splitlines()[-1].startswith(b"weights ")
