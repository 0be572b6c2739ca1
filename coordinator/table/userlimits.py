"""Per-user limits on submits, checked before anything happens (no job id taken, no record
written, nothing started), each refusal one line naming the limit, the user and the number:

- ``max_jobs_per_user``: the jobs one user may have that are not finished, in any state but
  the ended ones (completed, failed: :data:`lifecycle.ENDED`).  A vacated job counts: it holds
  its checkpoints and comes back with one ``restart``.
- ``submit_rate_per_user`` with ``submit_burst_per_user``: a token bucket per user.
- ``max_memory_per_user``, ``max_cpus_per_user``, ``max_gpus_per_user``: what those unfinished
  jobs hold at once, summed (:class:`Held`); a job's memory is its reservation, else the limit
  every job gets (``[resources] memory_limit``), so leaving out ``--mem`` escapes nothing.

Both count the user a job is recorded as (and runs as): the asking user, or the one admin names
with ``revenant submit --user``.  Root's jobs (admin's own submits) and records from before jobs
had users are limited by neither: admin runs the cluster.  0 turns a limit off.

coordinator/table/requests.py answers a repeat of a submit (its request id made a job) before these
limits, so a repeat is never refused and takes no token.  The unfinished jobs are counted by
the job table itself (:class:`JobTable`), which a new leader loads whole; the buckets live in
the leader's memory, so a new leader starts them full.

Nothing here does I/O or reads a clock of its own: :class:`SubmitRate` takes a monotonic clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import ChainMap
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

from revenant.common.errors import RevenantError
from revenant.common.settings.config import CoordinatorConfig
from revenant.common.settings.limits import ROOT_USERS
from revenant.common.settings.resources import Usage, parse_size, size_text
from revenant.coordinator.table import lifecycle as lc
from revenant.messages import JobRecord, JobResources

# Past this many buckets, those of users idle long enough to be full again are dropped.
BUCKETS_KEPT = 1024


class UserLimitReached(RevenantError):
    """A submit past one of its user's limits (docs/security.md, "Per-user limits")."""

    code = "user_limit"


class TooManyJobs(UserLimitReached):
    code = "too_many_jobs"


class SubmitRateExceeded(UserLimitReached):
    code = "submit_rate"
    retriable = True


class OverUserTotal(UserLimitReached):
    code = "over_user_total"


@dataclass
class Held:
    """What unfinished jobs hold, summed: memory (each one's :meth:`JobResources.memory_cap`),
    CPUs and GPUs."""

    memory_bytes: int = 0
    cpus: float = 0.0
    gpus: int = 0

    def add(self, res: JobResources, step: int = 1) -> None:
        self.memory_bytes += step * res.memory_cap()
        self.cpus += step * res.cpus
        self.gpus += step * res.gpus


class JobTable(dict[str, JobRecord]):
    """The live job table, job id -> record, that also counts each user's jobs that are not
    finished, and each node's jobs that may have a copy there (:data:`lifecycle.ACTIVE`) with
    what they asked for (placement's room): a submit or a restore reads them without walking a
    table of 100,000 jobs.

    Every way a record enters or leaves the table passes through here (set, del, pop, update,
    clear), so the counts cannot drift from the records; and a record is never changed in place
    once in the table (:func:`lifecycle.transition` returns a new one)."""

    def __init__(self, records: Mapping[str, JobRecord] | None = None) -> None:
        super().__init__()
        self._unfinished: dict[str, int] = {}
        self.per_node: dict[str, int] = {}  # node -> its ACTIVE jobs
        self._usage: dict[str, Usage] = {}  # node -> what they asked for, the GPUs they were given
        self._held: dict[str, Held] = {}  # user -> what their unfinished jobs hold
        if records:
            self.update(records)

    def unfinished(self, user: str) -> int:
        """``user``'s jobs in the table that are not finished."""
        return self._unfinished.get(user, 0)

    def held(self, user: str) -> Held:
        """What ``user``'s jobs in the table that are not finished hold."""
        return self._held.get(user) or Held()

    def usage(self, but: str = "") -> Mapping[str, Usage]:
        """What each node's ACTIVE jobs asked for, but job ``but``'s (a restore's own)."""
        rec = self.get(but)
        if rec is None or not (rec.node and rec.state in lc.ACTIVE):
            return self._usage
        mine, res = self._usage[rec.node], rec.spec.resources
        return ChainMap({rec.node: Usage(mine.cpus - res.cpus, mine.memory_bytes - res.memory_bytes,
                                         mine.gpus - set(rec.assigned_gpus))}, self._usage)

    def _count(self, rec: JobRecord | None, step: int) -> None:
        if rec is not None and rec.node and rec.state in lc.ACTIVE:
            node, res = rec.node, rec.spec.resources
            self.per_node[node] = self.per_node.get(node, 0) + step
            used = self._usage.setdefault(node, Usage())
            used.cpus += step * res.cpus
            used.memory_bytes += step * res.memory_bytes
            (used.gpus.update if step > 0 else used.gpus.difference_update)(rec.assigned_gpus)
            if not self.per_node[node]:
                del self.per_node[node], self._usage[node]
        if rec is None or rec.state in lc.ENDED:
            return
        user = rec.spec.user
        if n := self._unfinished.get(user, 0) + step:
            self._unfinished[user] = n
            self._held.setdefault(user, Held()).add(rec.spec.resources, step)
        else:
            del self._unfinished[user]
            self._held.pop(user, None)

    def __setitem__(self, job: str, rec: JobRecord) -> None:
        self._count(self.get(job), -1)
        super().__setitem__(job, rec)
        self._count(rec, 1)

    def __delitem__(self, job: str) -> None:
        self._count(self[job], -1)
        super().__delitem__(job)

    def pop(self, job: str, *default):  # type: ignore[override]
        self._count(self.get(job), -1)
        return super().pop(job, *default)

    def popitem(self) -> tuple[str, JobRecord]:
        job, rec = super().popitem()
        self._count(rec, -1)
        return job, rec

    def setdefault(self, job: str, rec: JobRecord) -> JobRecord:  # type: ignore[override]
        if job not in self:
            self[job] = rec
        return self[job]

    def update(self, *args, **kw) -> None:  # type: ignore[override]
        for job, rec in dict(*args, **kw).items():
            self[job] = rec

    def __ior__(self, other):  # type: ignore[override]
        self.update(other)
        return self

    def clear(self) -> None:
        super().clear()
        self._unfinished.clear()
        self._held.clear()
        self.per_node.clear()
        self._usage.clear()


class SubmitRate:
    """A token bucket per user: up to ``burst`` submits at once, then ``rate`` a second;
    ``clock`` is monotonic seconds.  A fresh bucket is full, so a bucket full again is the same
    as none: they are dropped, and those kept are about the users submitting now."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not (0 < rate < math.inf and burst >= 1):
            raise ValueError(f"a submit rate needs rate > 0 and burst >= 1, got {rate!r} and {burst!r}")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # user -> (tokens, when counted)
        self._prune_at = BUCKETS_KEPT

    def take(self, user: str) -> float:
        """A token for one of ``user``'s submits: 0.0 if there was one (taken), else the seconds
        until there is one (nothing taken)."""
        now = self.clock()
        tokens, then = self._buckets.get(user, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - then) * self.rate)
        if tokens < 1.0 - 1e-9:  # not a float's rounding short of a whole token
            self._buckets[user] = (tokens, now)
            return (1.0 - tokens) / self.rate
        self._buckets[user] = (max(0.0, tokens - 1.0), now)
        if len(self._buckets) >= self._prune_at:
            full_after_s = self.burst / self.rate
            self._buckets = {u: b for u, b in self._buckets.items() if now - b[1] < full_after_s}
            self._prune_at = max(BUCKETS_KEPT, 2 * len(self._buckets))  # a walk per doubling at most
        return 0.0

    def __len__(self) -> int:
        return len(self._buckets)


def _never_made(user: str, request_id: str) -> JobRecord | None:
    return None


class UserLimits:
    """Both limits, for the submits clients ask for; 0 turns one off.  ``made(user, request_id)``
    is the live job that submit made, if any (:meth:`JobService.made_by`)."""

    def __init__(self, max_jobs: int = 0, rate: float = 0.0, burst: int = 0, *,
                 most: Held | None = None, clock: Callable[[], float] = time.monotonic,
                 made: Callable[[str, str], JobRecord | None] = _never_made) -> None:
        self.max_jobs = max_jobs
        self.rate = SubmitRate(rate, burst, clock) if rate else None
        self.most = most or Held()  # the per-user totals (0: no cap)
        self.made = made
        # The request ids ("" for none) of each user's submits under way, admitted, not yet
        # answered, with what each would hold.
        self._starting: dict[str, list[tuple[str, JobResources]]] = {}

    @classmethod
    def of(cls, config: CoordinatorConfig, **kw) -> UserLimits:
        memory = parse_size(config.max_memory_per_user, "max_memory_per_user") if config.max_memory_per_user else 0
        return cls(config.max_jobs_per_user, config.submit_rate_per_user, config.submit_burst_per_user,
                   most=Held(memory, config.max_cpus_per_user, config.max_gpus_per_user), **kw)

    @contextlib.contextmanager
    def admitting(self, user: str, table: JobTable, request_id: str = "",
                  ask: JobResources | None = None) -> Iterator[None]:
        """Refuse ``user``'s submit (of a job holding ``ask``) past a limit (:class:`TooManyJobs`
        and :class:`OverUserTotal` first, which take no token; then :class:`SubmitRateExceeded`);
        else count it as under way until the block ends."""
        if user in ROOT_USERS:  # admin's: root's, and those from before jobs had users
            yield
            return
        ask = ask or JobResources()
        self.check_jobs(user, table)
        self.check_totals(user, table, ask)
        if self.rate is not None and (wait_s := self.rate.take(user)) > 0:
            raise SubmitRateExceeded(
                f"user {user} submitted more than {self.rate.rate:g} jobs/s (submit_rate_per_user = "
                f"{self.rate.rate:g}, burst {self.rate.burst}): try again in {math.ceil(wait_s * 10) / 10:g} s")
        starting = self._starting.setdefault(user, [])
        entry = (request_id, ask)
        starting.append(entry)
        try:
            yield
        finally:
            starting.remove(entry)
            if not starting:
                del self._starting[user]

    def check_totals(self, user: str, table: JobTable, ask: JobResources) -> None:
        """Refuse a job that would take ``user``'s unfinished jobs past a per-user total.  The
        submits under way count as well, but those whose job is in the table already."""
        most = self.most
        if not (most.memory_bytes or most.cpus or most.gpus):
            return
        held = dataclasses.replace(table.held(user))
        for res in self._under_way(user):
            held.add(res)
        wanted = Held()
        wanted.add(ask)
        for field, limit, show, unit in (("memory_bytes", "max_memory_per_user", size_text, " of memory"),
                                         ("cpus", "max_cpus_per_user", "{:g}".format, " CPUs"),
                                         ("gpus", "max_gpus_per_user", str, " GPUs")):
            cap, have, more = getattr(most, field), getattr(held, field), getattr(wanted, field)
            if cap and more and have + more > cap + 1e-9:
                raise OverUserTotal(f"user {user}'s unfinished jobs hold {show(have)}{unit}; this one's "
                                    f"{show(more)} would pass {limit} ({show(cap)})")

    def check_jobs(self, user: str, table: JobTable) -> None:
        if not self.max_jobs:
            return
        starting = self._starting.get(user, [])
        if table.unfinished(user) + len(starting) < self.max_jobs:
            return
        if (held := self.held(user, table)) >= self.max_jobs:
            raise TooManyJobs(f"user {user} already has {held} jobs that are not finished "
                              f"(max_jobs_per_user = {self.max_jobs})")

    def _under_way(self, user: str) -> list[JobResources]:
        """What ``user``'s submits under way whose job is not in the table yet would hold.  One
        without a request id cannot be told apart and counts: never too few."""
        return [ask for rid, ask in self._starting.get(user, []) if not rid or self.made(user, rid) is None]

    def held(self, user: str, table: JobTable) -> int:
        """``user``'s unfinished jobs: those in ``table``, and their submits under way whose job
        is not in it yet."""
        return table.unfinished(user) + len(self._under_way(user))
