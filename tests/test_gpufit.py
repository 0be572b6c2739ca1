"""Which node can restore a job's GPUs, and onto which of its GPUs (common/gpufit.py, pure)."""

from __future__ import annotations

import pytest

from revenant.common.gpufit import describe, driver_major, gpu_fit
from revenant.messages import Capabilities, GpuInfo, JobGpu

pytestmark = pytest.mark.unit

H200 = "NVIDIA H200"
A100 = "NVIDIA A100-SXM4-80GB"
DRIVER = "570.86.10"


def caps(*gpus: tuple[str, str], mechanism: str = "driver_api", remap: bool = True, driver: str = DRIVER,
         why: str = "") -> Capabilities:
    """A node with ``gpus`` as (uuid, model) in index order."""
    return Capabilities(hostname="host", gpu="nvml", gpu_checkpoint=mechanism, gpu_checkpoint_why=why,
                        gpu_remap=remap, cuda_version=12080,
                        gpus=[GpuInfo(index=i, uuid=u, name=m, memory_total_bytes=1 << 37, driver_version=driver)
                              for i, (u, m) in enumerate(gpus)])


def job(*gpus: tuple[int, str, str]) -> list[JobGpu]:
    """The job's GPUs as (index, uuid, model)."""
    return [JobGpu(index=i, uuid=u, name=m, memory_bytes=1 << 30) for i, u, m in gpus]


def test_a_job_without_gpus_fits_anywhere():
    assert gpu_fit([], DRIVER, Capabilities()) == (None, {})
    assert gpu_fit([], "", caps(mechanism="none")) == (None, {})


def test_the_same_node_restores_onto_the_same_gpus_without_a_map():
    need = job((0, "GPU-a", H200), (1, "GPU-b", H200))
    node = caps(("GPU-a", H200), ("GPU-b", H200), remap=False)
    assert gpu_fit(need, DRIVER, node, node="n1") == (None, {})


def test_another_node_with_the_same_model_remaps_by_uuid():
    need = job((0, "GPU-a", H200))
    assert gpu_fit(need, DRIVER, caps(("GPU-x", H200), ("GPU-y", H200))) == (None, {"GPU-a": "GPU-x"})


def test_a_remap_is_refused_where_the_mechanism_cannot_remap():
    need = job((0, "GPU-a", H200))
    why, mapping = gpu_fit(need, DRIVER, caps(("GPU-x", H200), remap=False), node="n2")
    assert mapping == {}
    assert why == ("the job's GPU GPU-a is not on node n2: restoring there needs GPU remapping, "
                   "which driver 570.86.10 on node n2 cannot do")


def test_too_few_gpus_of_the_model():
    need = job((0, "GPU-a", H200), (1, "GPU-b", H200))
    why, mapping = gpu_fit(need, DRIVER, caps(("GPU-x", H200)), node="n2")
    assert (why, mapping) == ("node n2 has 1 NVIDIA H200 GPU, the job needs 2", {})


def test_another_model_does_not_fit():
    why, _ = gpu_fit(job((0, "GPU-a", H200)), DRIVER, caps(("GPU-x", A100), ("GPU-y", A100)), node="n2")
    assert why == f"node n2 has no {H200} GPU (the job needs 1; it has 2x {A100})"
    why, _ = gpu_fit(job((0, "GPU-a", H200)), DRIVER, caps(), node="n3")
    assert why == f"node n3 has no {H200} GPU (the job needs 1; it has none)"


def test_the_driver_major_version_must_match():
    need = job((0, "GPU-a", H200))
    assert driver_major("570.86.10") == "570" and driver_major("") == ""
    assert gpu_fit(need, "570.124.06", caps(("GPU-a", H200)))[0] is None  # same major: fits
    why, _ = gpu_fit(need, DRIVER, caps(("GPU-a", H200), driver="580.65.06"), node="n2")
    assert why == ("node n2 has GPU driver 580.65.06, the job was checkpointed under driver 570.86.10 "
                   "(the major versions must match)")
    assert gpu_fit(need, "", caps(("GPU-a", H200), driver="580.65.06"))[0] is None  # unknown: not checked


def test_a_node_without_a_checkpoint_mechanism_takes_no_gpu_job():
    why, _ = gpu_fit(job((0, "GPU-a", H200)), DRIVER,
                     caps(("GPU-a", H200), mechanism="none", why="driver 550 has no checkpoint API"), node="n1")
    assert why == "node n1 cannot checkpoint or restore GPU state (driver 550 has no checkpoint API)"
    why, _ = gpu_fit(job((0, "GPU-a", H200)), DRIVER, Capabilities(hostname="h9"))
    assert why == "node h9 cannot checkpoint or restore GPU state"  # an older agent: no field, "none"


def test_several_models_are_matched_each_to_its_own():
    need = job((0, "GPU-a", A100), (1, "GPU-b", H200), (2, "GPU-c", H200))
    node = caps(("GPU-h1", H200), ("GPU-x1", A100), ("GPU-h2", H200))
    assert gpu_fit(need, DRIVER, node) == (None, {"GPU-a": "GPU-x1", "GPU-b": "GPU-h1", "GPU-c": "GPU-h2"})
    why, _ = gpu_fit(need, DRIVER, caps(("GPU-h1", H200), ("GPU-h2", H200)), node="n")
    assert why.startswith(f"node n has no {A100} GPU")


def test_gpus_are_mapped_in_index_order():
    # The job's GPUs listed out of order still map lowest index to lowest index.
    need = [JobGpu(index=1, uuid="GPU-b", name=H200), JobGpu(index=0, uuid="GPU-a", name=H200)]
    node = Capabilities(gpu_checkpoint="binary", gpu_remap=True, gpus=[
        GpuInfo(index=3, uuid="GPU-z", name=H200, driver_version=DRIVER),
        GpuInfo(index=2, uuid="GPU-y", name=H200, driver_version=DRIVER),
    ])
    assert gpu_fit(need, DRIVER, node) == (None, {"GPU-a": "GPU-y", "GPU-b": "GPU-z"})


def test_a_gpu_on_both_nodes_keeps_itself_and_no_other_takes_it():
    need = job((0, "GPU-a", H200), (1, "GPU-b", H200))
    # GPU-b is on the node, at index 0: it stays put, GPU-a takes the node's other one.
    node = caps(("GPU-b", H200), ("GPU-x", H200))
    assert gpu_fit(need, DRIVER, node) == (None, {"GPU-a": "GPU-x"})
    why, _ = gpu_fit(need, DRIVER, caps(("GPU-b", H200), ("GPU-x", H200), remap=False), node="n")
    assert why and "GPU-a is not on node n" in why and "GPU-b" not in why


def test_describe_a_gpu_set_in_one_line():
    assert describe(job((0, "GPU-a", H200)), DRIVER) == "1x NVIDIA H200 (driver 570.86.10)"
    assert describe(job((0, "a", H200), (1, "b", H200), (2, "c", A100))) == f"2x {H200}, 1x {A100}"
    assert describe([]) == ""
