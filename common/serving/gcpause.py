"""Python's full garbage collections: watched, and kept short in a process with a large heap.

A full collection (generation 2) walks every object the collector tracks.  A coordinator of
100,000 nodes tracks about a million (each node's record, its phi window, its capabilities), and
a full collection of them pauses the event loop for half a second to two seconds: long enough to
miss a leader-lease renewal, to be taken for a stall (every node given grace), or to fall
seconds behind the heartbeats.  Python starts one whenever the objects that survived the younger
generations since the last one reach a quarter of the long-lived ones, so a large, steady heap
still gets one every few seconds to minutes.

:func:`install` logs every collection that pauses the process ``LONG_PAUSE_S`` or more, and, with
``freeze=True``, moves what survives a full collection to the permanent generation
(``gc.freeze``): the next full collection walks only what was allocated since, a pause that
grows with the churn, not with the cluster.  Objects frozen are never collected as garbage
cycles, so every ``rewalk_s`` they are released (``gc.unfreeze``) and the next full collection
walks everything once: one long pause in that time instead of one every few seconds.

A service can choose that pause's moment: after :func:`choose_rewalk`, collections no longer
release what is frozen, and the service calls :func:`rewalk_if_due` where a pause costs least
(the coordinator: right after it renewed its leader lease, which then has most of its time left).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

LONG_PAUSE_S = 0.2
REWALK_S = 3600.0

_state: dict = {}


def install(freeze: bool = False, rewalk_s: float = REWALK_S, clock=time.monotonic) -> None:
    """Watch collections (once per process; a second call changes only ``freeze``)."""
    _state.update(freeze=freeze, rewalk_s=rewalk_s, clock=clock, chosen=False)
    if "started" not in _state:
        _state.update(started=0.0, released_at=clock())
        gc.callbacks.append(_on_collection)


def choose_rewalk() -> None:
    """The service calls :func:`rewalk_if_due` itself; collections never release what is frozen."""
    _state["chosen"] = True


def rewalk_if_due() -> float | None:
    """If the rewalk is due: walk everything now (one full collection of the whole heap), then
    freeze what survived; the pause, or None if it was not due."""
    if not _state.get("freeze") or not _rewalk_due():
        return None
    clock = _state["clock"]
    started = clock()
    _state["released_at"] = started
    gc.unfreeze()
    gc.collect()  # frozen again by _on_collection, as it ends
    took = clock() - started
    log.info("walked every object for garbage cycles (every %.0f s): paused %.2f s", _state["rewalk_s"], took)
    return took


def _rewalk_due() -> bool:
    return _state["clock"]() - _state["released_at"] >= _state["rewalk_s"]


def uninstall() -> None:
    """Stop watching; release what was frozen (tests)."""
    if _on_collection in gc.callbacks:
        gc.callbacks.remove(_on_collection)
    _state.clear()
    gc.unfreeze()


def _on_collection(phase: str, info: dict) -> None:
    clock = _state["clock"]
    if phase == "start":
        _state["started"] = clock()
        return
    took = clock() - _state["started"]
    if info["generation"] != 2:
        if took >= LONG_PAUSE_S:
            log.warning("a garbage collection of generation %d paused this process %.2f s", info["generation"], took)
        return
    if took >= LONG_PAUSE_S:
        log.warning("a full garbage collection paused this process %.2f s (%d objects were frozen, not walked)",
                    took, gc.get_freeze_count())
    if not _state["freeze"]:
        return
    if not _state.get("chosen") and _rewalk_due():
        _state["released_at"] = clock()
        gc.unfreeze()  # the next full collection walks everything once
    else:
        gc.freeze()
