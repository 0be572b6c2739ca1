"""Placement: health decides where jobs and restores go (pure)."""

import pytest

from revenant.coordinator.placement import NoNodeAvailable, place
from revenant.messages import Capabilities, CriuInfo, NodeStatus

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
