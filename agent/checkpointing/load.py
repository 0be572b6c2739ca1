"""Load-aware checkpoints: the node's load, averaged over a few seconds, and whether a job's
checkpoint goes ahead under it.

:class:`LoadSampler` is fed by the agent's loop (:meth:`LoadSampler.sample`, about once a second)
and keeps the readings of the last ``window_s`` seconds; :meth:`LoadSampler.averages` is their
mean, never one instant.  A reading (:class:`PsutilReadings`) is the node's CPU utilisation and
I/O wait over the interval since the previous reading (from the deltas of ``psutil.cpu_times``,
kept by the reader itself: psutil's ``cpu_percent(None)`` shares one baseline with every other
caller in the process) and its memory use at that moment (``virtual_memory().percent``), each a
fraction from 0 to 1.

:class:`LoadGate` is the rule, pure: a *scheduled* checkpoint of a job whose policy is
``load_aware`` is skipped while an average is over its threshold (``load_threshold_cpu``,
``load_threshold_io``, ``load_threshold_memory``), with a reason naming the metric, its value and
the threshold ("cpu 0.97 > 0.95").  A job whose checkpoints were skipped more than
:data:`MAX_SKIPS_IN_A_ROW` times in a row gets the next one anyway (``forced``: sustained load
must not leave a job without any checkpoint).  A manual checkpoint (``scheduled`` false) or one
asked with ``force`` is never skipped; over a threshold its decision carries the warning.  Any
checkpoint that goes ahead starts the count again.  Without enough recent readings (an agent
that has just started, a loop that stalled) nothing is skipped: the node's load is unknown.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import psutil

from revenant.messages import CheckpointPolicy

# A job whose scheduled checkpoints were skipped more than this many times in a row gets the next.
MAX_SKIPS_IN_A_ROW = 3


@dataclass(frozen=True)
class Load:
    """The node's load, each a fraction from 0 to 1: CPU utilisation (time neither idle nor
    waiting for I/O), I/O wait, memory in use."""

    cpu: float
    io: float
    memory: float


class PsutilReadings:
    """One reading per call: CPU and I/O wait since the previous call (the first: since this
    reader was made), memory now.  ``cpu_times``/``virtual_memory``: psutil's, or stand-ins."""

    def __init__(self, cpu_times: Callable[[], Any] = psutil.cpu_times,
                 virtual_memory: Callable[[], Any] = psutil.virtual_memory) -> None:
        self._cpu_times = cpu_times
        self._virtual_memory = virtual_memory
        self._last = cpu_times()

    def __call__(self) -> Load:
        now = self._cpu_times()
        delta = {field: getattr(now, field) - getattr(self._last, field) for field in now._fields}
        self._last = now
        # Linux counts guest time in user and nice as well: count it once.
        total = sum(delta.values()) - delta.get("guest", 0.0) - delta.get("guest_nice", 0.0)
        memory = _fraction(self._virtual_memory().percent / 100)
        if total <= 0:  # no tick since the previous reading
            return Load(0.0, 0.0, memory)
        iowait = delta.get("iowait", 0.0)
        return Load(_fraction((total - delta["idle"] - iowait) / total), _fraction(iowait / total), memory)


def _fraction(x: float) -> float:
    return min(1.0, max(0.0, x))


class LoadSampler:
    """The readings of the last ``window_s`` seconds (by ``clock``), and their mean."""

    def __init__(self, read: Callable[[], Load] | None = None, *, window_s: float = 5.0, min_samples: int = 3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read if read is not None else PsutilReadings()
        self.window_s = window_s
        self.min_samples = min_samples
        self.clock = clock
        self._samples: deque[tuple[float, Load]] = deque()

    def sample(self) -> Load:
        """Take one reading (the agent's loop, about once a second)."""
        load = self._read()
        self._samples.append((self.clock(), load))
        self._drop_old()
        return load

    def averages(self) -> Load | None:
        """The mean of each metric over the window; None with fewer than ``min_samples`` readings
        in it (the load is not known well enough to skip anything on it)."""
        self._drop_old()
        if len(self._samples) < max(1, self.min_samples):
            return None
        n = len(self._samples)
        return Load(sum(s.cpu for _, s in self._samples) / n, sum(s.io for _, s in self._samples) / n,
                    sum(s.memory for _, s in self._samples) / n)

    def _drop_old(self) -> None:
        horizon = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()


class Exceeded(NamedTuple):
    metric: str  # "cpu", "io" or "memory"
    value: float
    threshold: float

    def __str__(self) -> str:
        # Enough digits that the value reads as over the threshold ("0.951 > 0.95", not "0.95 > 0.95").
        digits = next((d for d in range(2, 7) if round(self.value, d) > round(self.threshold, d)), 6)
        return f"{self.metric} {self.value:.{digits}f} > {self.threshold:.{digits}f}"


def exceeded(averages: Load, policy: CheckpointPolicy) -> list[Exceeded]:
    """Every metric of ``averages`` over its threshold in ``policy``, in the order cpu, io, memory."""
    pairs = (("cpu", averages.cpu, policy.load_threshold_cpu), ("io", averages.io, policy.load_threshold_io),
             ("memory", averages.memory, policy.load_threshold_memory))
    return [Exceeded(metric, value, threshold) for metric, value, threshold in pairs if value > threshold]


def over_threshold(averages: Load, policy: CheckpointPolicy) -> Exceeded | None:
    """The first metric of ``averages`` over its threshold (cpu, io, memory), or None."""
    over = exceeded(averages, policy)
    return over[0] if over else None


@dataclass(frozen=True)
class Decision:
    """Whether a checkpoint is skipped; ``forced``: taken although over a threshold because too
    many were skipped in a row; ``reason``: why, or the warning a checkpoint taken over a
    threshold carries ("" when the load played no part)."""

    skip: bool
    forced: bool = False
    reason: str = ""


class LoadGate:
    """The agent's per-job count of scheduled checkpoints skipped in a row, and the rule."""

    def __init__(self, max_skips: int = MAX_SKIPS_IN_A_ROW) -> None:
        self.max_skips = max_skips
        self._skipped: dict[str, int] = {}

    def decide(self, job: str, *, scheduled: bool, force: bool, averages: Load | None,
               policy: CheckpointPolicy) -> Decision:
        # A manual checkpoint (or a forced one) warns over a threshold whatever the policy; only a
        # load-aware job's scheduled checkpoints are ever skipped.
        weighed = policy.load_aware or not scheduled or force
        over = exceeded(averages, policy) if weighed and averages is not None else []
        why = ", ".join(map(str, over))
        if not over:
            self._skipped.pop(job, None)
            return Decision(skip=False)
        skipped = self._skipped.get(job, 0)
        if not scheduled or force:
            self._skipped.pop(job, None)
            what = "a checkpoint asked with force" if force else "a manual checkpoint"
            return Decision(skip=False, reason=f"{what} is taken although the node is over a load threshold: {why}")
        if skipped > self.max_skips:
            self._skipped.pop(job, None)
            return Decision(skip=False, forced=True,
                            reason=f"taken although the node is over a load threshold ({why}): the job's last "
                                   f"{skipped} scheduled checkpoints were skipped in a row")
        self._skipped[job] = skipped + 1
        return Decision(skip=True, reason=why)

    def skipped(self, job: str) -> int:
        """How many of ``job``'s scheduled checkpoints were skipped since the last one taken."""
        return self._skipped.get(job, 0)

    def forget(self, job: str) -> None:
        """``job`` left this node (ended, moved, vacated)."""
        self._skipped.pop(job, None)
