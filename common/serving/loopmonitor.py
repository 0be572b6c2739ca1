"""How late an event loop wakes up: the earliest sign of a process in trouble.

Used by the agent (a stalled loop makes the node YELLOW/RED) and the
coordinator (its failure detector grants grace after its own stall).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class LoopMonitor:
    """Measures event-loop lag by sleeping a fixed period and timing the wake-up."""

    period_s: float = 0.1
    stall_threshold_s: float = 0.25
    clock: Callable[[], float] = time.monotonic
    lag_s: float = 0.0
    max_lag_s: float = 0.0
    stalls: int = 0
    # When run() last woke up (clock time); None until it runs.
    last_wake: float | None = None
    _reported_stalls: int = field(default=0, repr=False)
    _reported_max: float = field(default=0.0, repr=False)

    def record(self, lag_s: float) -> None:
        self.lag_s = lag_s
        self.max_lag_s = max(self.max_lag_s, lag_s)
        if lag_s >= self.stall_threshold_s:
            self.stalls += 1

    def take_window(self) -> tuple[float, int]:
        """(worst lag, stalls) since the previous call."""
        worst, recent = self.max_lag_s, self.stalls - self._reported_stalls
        self._reported_stalls = self.stalls
        self.max_lag_s = self.lag_s
        return worst, recent

    def stuck_for(self, now: float) -> float:
        """How far overdue the monitor's next wake-up is at ``now`` (0 before it runs).

        Code that runs while this is large ran right after the loop was blocked
        (or the monitor died): what ``/live`` reports.
        """
        if self.last_wake is None:
            return 0.0
        return max(0.0, now - self.last_wake - self.period_s)

    async def run(self) -> None:
        self.last_wake = self.clock()
        while True:
            start = self.clock()
            await asyncio.sleep(self.period_s)
            self.last_wake = self.clock()
            self.record(max(0.0, self.last_wake - start - self.period_s))
