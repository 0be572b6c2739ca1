"""The history checker: reads a partition test's whole history (tests/netcluster/history.py) and
names every violation of what revenant promises under a split.  Pure: tests/test_checker.py
feeds it histories made by hand, one per kind of violation.

The violations:
- ``two copies``: two copies of one job running (not frozen) in one sample;
- ``output``: a job's output that is not a byte-exact prefix of the uninterrupted run (the
  stepper's lines without their address), or all of it for a completed job, or whose lines
  name an address no node has;
- ``superseded``: a step taken on a node after the table had moved the job away from it
  (``moved_slack_s``: the step's and the record's clocks are this host's, so only the moment
  between reading the clock and acting), or on a node the table never gave it (``slack_s``
  after the step: a new copy's first steps may outrun the table's watch);
- ``lost epoch``: an epoch the table once listed (acknowledged) that is not on the storage at
  the end, unless ``max_epochs`` newer ones are (retention);
- ``unexplained``: a job at the end neither running with exactly one copy where the table says,
  nor completed (nor failed with a reason, where ``failed_ok``: a failed job is a lost job);

Apart from those (safety), how fast a heal settles (liveness): :func:`heal_times` gives, for each
copy frozen when a partition healed, the seconds until it was thawed (same pid) or gone with its
job running elsewhere (or on the same node as a new copy, or ended), and :func:`slow_heals` names
those past a bound (the target: 5 s).
"""

from __future__ import annotations

from dataclasses import dataclass

from netcluster.history import Copy, History, Placement

ENDED = ("completed", "failed", "cancelled")
RUNNING = ("running", "checkpointing")  # a periodic checkpoint holds the job a moment (criu's freeze)
SETTLED_S = 1.0  # the last second of samples: one of them must show the job running once


@dataclass
class Job:
    """What the checker knows of one job beyond the history."""

    id: str
    reference: bytes  # the uninterrupted run's output, addresses removed
    output: bytes  # its output.log at the end
    on_disk: set[int]  # epoch numbers on the storage at the end
    max_epochs: int


def check(history: History, jobs: list[Job], addresses: set[str], *, slack_s: float = 0.5,
          moved_slack_s: float = 0.1, failed_ok: bool = False) -> list[str]:
    found: list[str] = []
    found += two_copies(history)
    for job in jobs:
        table = _placements(history, job.id)
        found += output(job, addresses, completed=bool(table) and table[-1].state == "completed")
        found += superseded(history, job.id, slack_s, moved_slack_s)
        found += lost_epochs(history, job)
        found += unexplained(history, job.id, failed_ok)
    return found


def two_copies(history: History) -> list[str]:
    found = []
    for t, seen in history.samples:
        running: dict[str, list[str]] = {}
        for c in seen:
            if not c.frozen:
                running.setdefault(c.job, []).append(f"{c.node} pid {c.pid}")
        found += [f"two copies: job {job} ran on {', '.join(where)} at {t:.2f}"
                  for job, where in running.items() if len(where) > 1]
    return found


def strip_addresses(data: bytes) -> tuple[bytes, set[str]]:
    """The stepper's output without the address that ends each line, and those addresses."""
    lines, seen = [], set()
    for line in data.splitlines(keepends=True):
        body, _, addr = line.rstrip(b"\n").rpartition(b" ")
        lines.append(body + (b"\n" if line.endswith(b"\n") else b""))
        seen.add(addr.decode(errors="replace"))
    return b"".join(lines), seen


def output(job: Job, addresses: set[str], completed: bool = False) -> list[str]:
    body, seen = strip_addresses(job.output)
    found = []
    if completed and body != job.reference and job.reference.startswith(body):
        have, want = body.count(b"\n"), job.reference.count(b"\n")
        found.append(f"output: job {job.id} completed with {have} of the uninterrupted run's {want} lines")
    elif not job.reference.startswith(body):
        at = next((i for i, (a, b) in enumerate(zip(body, job.reference)) if a != b), min(len(body),
                                                                                       len(job.reference)))
        line = body[:at].count(b"\n")
        found.append(f"output: job {job.id} is not a prefix of the uninterrupted run from line {line}")
    strangers = seen - addresses
    if strangers:
        found.append(f"output: job {job.id} has lines from {', '.join(sorted(strangers))}, no node's address")
    return found


def _placements(history: History, job: str) -> list[Placement]:
    return sorted((p for p in history.table if p.job == job), key=lambda p: (p.t, p.generation))


def superseded(history: History, job: str, slack_s: float, moved_slack_s: float = 0.1) -> list[str]:
    """A step from a node must come from the table's current placement there: the newest
    generation the table gave that node before the step (``slack_s`` after, for a new copy
    whose first steps outrun the watch) must still be the table's newest ``moved_slack_s``
    before it."""
    table = _placements(history, job)
    found = []
    for step in (s for s in history.steps if s.job == job):
        placed = [p for p in table if p.t <= step.t + slack_s and p.node == step.node]
        if not placed:
            found.append(f"superseded: job {job} step {step.step} came from {step.node}, where the table "
                         f"never placed it")
            continue
        mine = max(p.generation for p in placed)
        before = [p for p in table if p.t <= step.t - moved_slack_s]
        newest = max((p.generation for p in before), default=mine)
        if newest > mine:
            found.append(f"superseded: job {job} step {step.step} came from {step.node} (generation {mine}) at "
                         f"{step.t:.2f}, after the table moved it to generation {newest}")
    return found


def lost_epochs(history: History, job: Job) -> list[str]:
    acked = sorted({n for p in _placements(history, job.id) for n in p.epochs})
    found = []
    for n in acked:
        newer = sum(1 for m in job.on_disk if m > n)
        if n not in job.on_disk and newer < job.max_epochs:
            found.append(f"lost epoch: job {job.id} epoch {n} was acknowledged and is gone "
                         f"({newer} newer on the storage, {job.max_epochs} kept)")
    return found


def unexplained(history: History, job: str, failed_ok: bool = False) -> list[str]:
    table = _placements(history, job)
    if not table:
        return [f"unexplained: job {job} never appeared in the table"]
    last = table[-1]
    if last.state in ENDED:
        if last.state == "completed" or (failed_ok and last.reason):
            return []
        return [f"unexplained: job {job} {last.state}: {last.reason or 'without a reason'}"]
    if last.state not in RUNNING:
        return [f"unexplained: job {job} left {last.state} on {last.node}"]
    end = history.samples[-1][0] if history.samples else 0.0
    final: list = []
    for t, seen in (s for s in history.samples if s[0] >= end - SETTLED_S):
        final = [c for c in seen if c.job == job]
        if len(final) == 1 and not final[0].frozen and final[0].node == last.node:
            return []
    where = ", ".join(f"{c.node} pid {c.pid}{' frozen' if c.frozen else ''}" for c in final) or "nowhere"
    return [f"unexplained: job {job} is running on {last.node} in the table, its copies: {where}"]


def heal_times(history: History, from_lease: bool = False) -> list[tuple[float, Copy, float | None]]:
    """For each heal and each copy frozen at it: (the heal's time, the copy, seconds until it
    was thawed with the same pid or gone with its job running elsewhere; None: never seen).
    ``from_lease``: counted from when the copy's node renewed its lease again, if that is later
    than the heal (the bus itself taking writes again: a NATS cluster whose servers were split
    elects its streams' leaders anew when they meet again)."""
    out = []
    for healed in history.heals:
        before = [s for s in history.samples if s[0] <= healed]
        if not before:
            continue
        for c in (c for c in before[-1][1] if c.frozen):
            start = healed
            if from_lease:
                back = min((t for t in history.leases.get(c.node, ()) if t >= healed), default=healed)
                start = max(healed, back)
            settled = None
            ended = min((p.t for p in history.table if p.job == c.job and p.state in ENDED), default=None)
            for t, seen in (s for s in history.samples if s[0] > healed):
                same = [x for x in seen if x.pid == c.pid]
                if (same and not same[0].frozen) or (not same and (
                        any(x.job == c.job and not x.frozen for x in seen) or (ended is not None and ended <= t))):
                    settled = max(0.0, t - start)  # thawed; or gone, the job running (anywhere) or ended
                    break
            out.append((healed, c, settled))
    return out


def slow_heals(history: History, bound_s: float = 5.0, from_lease: bool = False) -> list[str]:
    since = "its node's lease was back after the heal" if from_lease else "the heal"
    return [f"heal: job {c.job}'s copy on {c.node} (pid {c.pid}) was neither thawed nor killed with its job "
            f"running elsewhere within {bound_s:g} s of {since} at {healed:.2f}"
            + (f" (it took {took:.1f} s)" if took is not None else "")
            for healed, c, took in heal_times(history, from_lease) if took is None or took > bound_s]
