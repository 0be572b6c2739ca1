"""Full garbage collections in a long-running service (common/serving/gcpause.py): what survives one is
frozen, so that the next walks only what is new; once every rewalk period everything is walked
again; a long pause is logged."""

from __future__ import annotations

import gc
import logging

import pytest

from revenant.common.serving import gcpause

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def watched():
    clock = Clock()
    yield clock
    gcpause.uninstall()


def test_survivors_of_a_full_collection_are_frozen_until_the_rewalk(watched):
    gcpause.install(freeze=True, rewalk_s=60.0, clock=watched)
    survivors = [[i] for i in range(1000)]  # tracked objects that outlive the collection
    gc.collect()
    frozen = gc.get_freeze_count()
    assert frozen >= len(survivors)
    watched.now = 61.0  # the rewalk is due: released, and the next full collection walks everything
    gc.collect()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gc.get_freeze_count() >= len(survivors)


def test_without_freezing_collections_are_only_watched(watched, caplog, monkeypatch):
    monkeypatch.setattr(gcpause, "LONG_PAUSE_S", 0.0)  # every collection is "long"
    gcpause.install(freeze=False, clock=watched)
    with caplog.at_level(logging.WARNING, logger="revenant.common.serving.gcpause"):
        gc.collect()
    assert gc.get_freeze_count() == 0
    assert "a full garbage collection paused this process" in caplog.text


def test_a_service_that_chooses_the_rewalk_gets_it_only_when_it_asks(watched, caplog):
    gcpause.install(freeze=True, rewalk_s=60.0, clock=watched)
    gcpause.choose_rewalk()
    survivors = [[i] for i in range(1000)]
    gc.collect()
    assert gc.get_freeze_count() >= len(survivors)
    assert gcpause.rewalk_if_due() is None  # not due yet
    watched.now = 61.0
    gc.collect()  # due, but a collection no longer releases what is frozen
    assert gc.get_freeze_count() >= len(survivors)
    with caplog.at_level(logging.INFO, logger="revenant.common.serving.gcpause"):
        assert gcpause.rewalk_if_due() == 0.0  # walked everything now (the clock is the test's)
    assert "walked every object for garbage cycles (every 60 s)" in caplog.text
    assert gc.get_freeze_count() >= len(survivors)  # and froze the survivors again
    assert gcpause.rewalk_if_due() is None  # the next one is an hour of the test's clock away

