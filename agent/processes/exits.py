"""How a job's end is reported: which job event its exit becomes (pure, clock injected).

A job's exit becomes one ``job_event.v1``, and its kind tells the coordinator what to
do with the job:

* ``vacated``: a vacate committed an epoch, then stopped it (the user's wish);
* ``evicted``: its node stopped it (a drain, a self-fence, its dead man's switch
  firing while the agent was stalled): to be restored elsewhere;
* ``killed``: the supervisor killed it (a kill command, a newer generation);
* ``exited``: it ended by itself, with its own status.

Telling a fired dead man's switch from a job that happens to exit with the same
status (251) takes the switch's timing: the switch can only have fired if the agent
had stopped resetting the switches for most of the timeout, now or a moment ago.
:class:`ExitClassifier` keeps that timing on an injected clock; :func:`classify_exit`
is the rule itself.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Literal

# The init's exit status when its switch fired (see agent/running/launcher.py).
SWITCH_EXIT = 251
SWITCH_FIRED = "its dead man's switch fired: the agent was stalled or cut off"
# A switch that went unreset this long (a fraction of its timeout) may have fired, and
# for this long after such a gap ends an exit 251 is still put down to it.
SWITCH_SUSPECT_FRACTION = 0.8
SWITCH_MEMORY_S = 10.0

ExitKind = Literal["exited", "killed", "evicted", "vacated"]


@dataclass(frozen=True)
class JobEnd:
    """What the supervisor knew about a job when it ended."""

    code: int | None  # shell-style exit status; None if it was lost
    killing: bool = False  # the supervisor was killing it
    evicted: bool = False  # its node stopped it (a drain, a fence)
    reason: str = ""  # why it was killed or evicted
    stopped_at_epoch: int | None = None  # a vacate or drain committed this epoch, then stopped it


@dataclass(frozen=True)
class ExitVerdict:
    """The job event an exit becomes (``exit_code``, ``epoch`` and ``reason`` as the event carries them)."""

    kind: ExitKind
    reason: str = ""
    exit_code: int | None = None
    epoch: int | None = None


def classify_exit(end: JobEnd, switch_may_have_fired: bool) -> ExitVerdict:
    """The rule.  ``switch_may_have_fired``: the switches went unreset long enough to fire."""
    if end.stopped_at_epoch is not None:
        return ExitVerdict("evicted" if end.evicted else "vacated", reason=end.reason, epoch=end.stopped_at_epoch)
    code = end.code if end.code is not None else -1
    if code == SWITCH_EXIT and not end.killing and switch_may_have_fired:
        return ExitVerdict("evicted", reason=SWITCH_FIRED, exit_code=code)
    kind: ExitKind = "evicted" if end.evicted else "killed" if end.killing else "exited"
    return ExitVerdict(kind, reason=end.reason, exit_code=code)


class ExitClassifier:
    """:func:`classify_exit` with the switches' timing: when they were last reset, and when a
    gap long enough to fire them last ended.  :meth:`switches_reset` may be called from another
    thread (the liveness thread resets the switches); it only stores floats."""

    def __init__(self, switch_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.switch_timeout_s = switch_timeout_s
        self.clock = clock
        self._reset_at = clock()
        self._gap_ended_at = -math.inf

    def switches_reset(self, started: float | None = None) -> float:
        """The switches were reset, the first at ``started`` (default: now) and the last now; the
        gap that ended, measured so that no switch's own can be longer: from the first reset of
        the round before to the last of this one."""
        now = self.clock()
        gap = now - self._reset_at
        if gap > self.switch_timeout_s:
            self._gap_ended_at = now
        self._reset_at = now if started is None else started
        return gap

    def switch_may_have_fired(self) -> bool:
        """Whether the switches went unreset long enough to fire, now or a moment ago."""
        now = self.clock()
        return (now - self._reset_at > self.switch_timeout_s * SWITCH_SUSPECT_FRACTION
                or now - self._gap_ended_at < SWITCH_MEMORY_S)

    def may_have_fired_since(self, since: float) -> bool:
        """Whether the switches may have fired at any time since ``since`` (this clock's time): a
        gap in their resets as long as their timeout ended since, or one is that long now."""
        return self._gap_ended_at > since or self.clock() - self._reset_at > self.switch_timeout_s

    def classify(self, end: JobEnd) -> ExitVerdict:
        return classify_exit(end, self.switch_may_have_fired())
