"""Failover's rules: plain classes fed with the current time (coordinator/recovery/failover.py
says what each is for and drives them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LeaseState:
    """A node's lease as the KV store holds it: who renewed it, and when (the server's clock)."""

    seq: int
    incarnation: str
    renewed_at: float

    def expires_at(self, ttl_s: float, margin_s: float) -> float:
        return self.renewed_at + ttl_s + margin_s


@dataclass
class StormGuard:
    fraction: float
    # A single node is never a storm, whatever the cluster's size.
    min_silent: int = 2
    paused: bool = False
    # An operator paused failover: held until an operator resumes it.
    held: bool = False
    # An operator resumed during a storm (a rack really is gone): this storm is let
    # through; the guard re-arms once the silence ends.
    acknowledged: bool = False
    storm: bool = False
    # As of the last update: nodes silent, and nodes not left.
    silent: int = 0
    total: int = 0

    def update(self, nodes, pending) -> str | None:
        """Returns "paused" or "resumed" on a change.  Silent: suspect, or dead with failover pending."""
        live = [n for n in nodes if n.state != "left"]
        return self.count(sum(1 for n in live if n.state == "suspect" or (n.state == "dead" and n.name in pending)),
                          len(live))

    def count(self, silent: int, total: int) -> str | None:
        """:meth:`update` from the counts: ``silent`` nodes of ``total`` (nodes not left)."""
        self.silent, self.total = silent, total
        self.storm = self.silent >= self.min_silent and self.total > 0 and self.silent / self.total > self.fraction
        if not self.storm:
            self.acknowledged = False
        return self._settle()

    def hold(self) -> str | None:
        self.held = True
        return self._settle()

    def release(self) -> str | None:
        """The operator's resume: lifts a hold, and lets the current storm (if any) through."""
        self.held = False
        self.acknowledged = self.storm
        return self._settle()

    def _settle(self) -> str | None:
        want = self.held or (self.storm and not self.acknowledged)
        if want and not self.paused:
            self.paused = True
            return "paused"
        if not want and self.paused:
            self.paused = False
            return "resumed"
        return None


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: int, now: float) -> None:
        self.rate = rate_per_s
        self.burst = burst
        self.tokens = float(burst)
        self.at = now

    def take(self, now: float) -> float:
        """0 if a token was taken, else seconds until one is available."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate
