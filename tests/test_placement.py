"""Placement: health decides where jobs and restores go (pure)."""

import pytest

from revenant.coordinator.table.placement import NoNodeAvailable, place
from revenant.messages import Capabilities, CriuInfo, GpuInfo, JobGpu, NodeStatus

pytestmark = pytest.mark.unit


def node(name, state="alive", health="GREEN", criu=True):
    return NodeStatus(name=name, state=state, health=health, reasons=[] if health == "GREEN" else ["memory 90%"],
                      capabilities=Capabilities(criu=CriuInfo(ok=criu, error=None if criu else "criu not found")))


def test_fewest_jobs_among_green_nodes():
    nodes = [node("a"), node("b"), node("c")]
    assert place(nodes, {"a": 2, "b": 1, "c": 1}) == "b"
    assert place(nodes, {}) == "a"


def test_red_nodes_never_get_work():
    nodes = [node("a", health="RED"), node("b", health="YELLOW")]
    assert place(nodes, {"b": 50}) == "b"
    with pytest.raises(NoNodeAvailable, match="a is RED"):
        place(nodes, {}, requested="a")
    with pytest.raises(NoNodeAvailable, match="no node can take the job"):
        place([node("a", health="RED")], {})


def test_yellow_only_when_no_green_fits():
    nodes = [node("busy"), node("warm", health="YELLOW")]
    assert place(nodes, {"busy": 10}) == "busy"
    assert place(nodes, {"busy": 10}, exclude={"busy"}) == "warm"


def test_dead_suspect_and_criu_less_nodes_are_skipped():
    nodes = [node("d", state="dead"), node("s", state="suspect"), node("x", criu=False), node("ok")]
    assert place(nodes, {"ok": 9}) == "ok"
    with pytest.raises(NoNodeAvailable, match="no working criu"):
        place(nodes, {}, requested="x")
    with pytest.raises(NoNodeAvailable, match="unknown node nope"):
        place(nodes, {}, requested="nope")
    with pytest.raises(NoNodeAvailable, match="no node has joined"):
        place([], {})


def gpu_node(name, *uuids, model="NVIDIA H200", driver="570.86.10", mechanism="driver_api", remap=True):
    n = node(name)
    n.capabilities = Capabilities(criu=CriuInfo(ok=True), gpu="nvml", gpu_checkpoint=mechanism, gpu_remap=remap,
                                  gpus=[GpuInfo(index=i, uuid=u, name=model, driver_version=driver)
                                        for i, u in enumerate(uuids)])
    return n


NEED = [JobGpu(index=0, uuid="GPU-a", name="NVIDIA H200", memory_bytes=1 << 30)]


def test_a_gpu_jobs_restore_goes_only_to_a_node_that_can_take_its_gpus():
    nodes = [node("cpu"), gpu_node("old", "GPU-o", driver="550.54.15"), gpu_node("a100", "GPU-x", model="A100"),
             gpu_node("fixed", "GPU-f", remap=False), gpu_node("h200", "GPU-h")]
    busy = {"h200": 9}
    assert place(nodes, busy, restore=True) == "a100"  # no GPU held: any node, fewest jobs first
    assert place(nodes, busy, restore=True, gpus=NEED, gpu_driver="570.86.10") == "h200"
    # Its own GPU is there: no remap needed, so a node that cannot remap takes it too.
    home = [JobGpu(index=0, uuid="GPU-f", name="NVIDIA H200")]
    assert place(nodes, busy, restore=True, gpus=home, gpu_driver="570.86.10") == "fixed"


def test_a_requested_node_that_cannot_take_the_gpus_says_why():
    nodes = [gpu_node("a100", "GPU-x", model="A100"), gpu_node("h200", "GPU-h")]
    with pytest.raises(NoNodeAvailable, match="node a100 has no NVIDIA H200 GPU"):
        place(nodes, {}, requested="a100", restore=True, gpus=NEED, gpu_driver="570.86.10")
    assert place(nodes, {}, requested="h200", restore=True, gpus=NEED, gpu_driver="570.86.10") == "h200"


def test_no_node_for_the_gpus_names_every_gpu_reason():
    nodes = [node("cpu"), gpu_node("old", "GPU-o", driver="550.54.15"), gpu_node("fixed", "GPU-f", remap=False),
             node("gone", state="dead")]
    with pytest.raises(NoNodeAvailable) as info:
        place(nodes, {}, restore=True, gpus=NEED, gpu_driver="570.86.10")
    msg = str(info.value)
    assert msg.startswith("no node can take the job (it held 1x NVIDIA H200 (driver 570.86.10) at its checkpoint)")
    assert "node cpu cannot checkpoint or restore GPU state" in msg
    assert "node old has GPU driver 550.54.15" in msg
    assert "which driver 570.86.10 on node fixed cannot do" in msg
    assert "node gone is dead" in msg and "\n" not in msg
