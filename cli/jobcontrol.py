"""What is done to a running job beside its checkpoints: ``revenant cancel`` (ended without a
checkpoint), ``revenant signal``, ``revenant check`` (what a move would do to it) and ``revenant
logs`` (its output, followed across restores)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable


def add_commands(sub: Any, cluster_args: Callable[..., None]) -> None:
    p = sub.add_parser("cancel", help="end a job without a checkpoint (its epochs stay for a restart until purged)")
    cluster_args(p, timeout=30.0)
    p.add_argument("job")
    p.add_argument("--signal", "-s", default="TERM", metavar="SIG",
                   help="sent to every process of the job first (default TERM; KILL: at once)")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="seconds the job has to end after --signal before SIGKILL (default 10; 0: SIGKILL at once)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cancel, one_shot=True)

    p = sub.add_parser("signal", help="send a signal to a running job's program")
    cluster_args(p)
    p.add_argument("job")
    p.add_argument("signal", metavar="SIG", help="a name as kill -l lists them (USR1, SIGTERM) or a number")
    p.add_argument("--all", action="store_true", help="to every process of the job, not only its program")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=signal_job, one_shot=True)


def check(args: argparse.Namespace) -> int:
    """``revenant check``: what in the running job a checkpoint or a move carries, closes or cannot carry."""
    from revenant.cli.client import ask, bus_url
    from revenant.cli.jobview import print_resources
    from revenant.messages import JobReply, JobRequest

    reply = ask(bus_url(args), "check", JobRequest(job=args.job), JobReply, args.timeout)
    return print_resources(reply.job, reply.resources, args.json)


def _answer(reply, as_json: bool, line: str) -> int:
    from revenant.cli.jobview import job_view

    for note in reply.notes if not as_json else ():
        print(f"revenant: {note}", file=sys.stderr)
    print(json.dumps({**job_view(reply.job), "notes": reply.notes}, indent=2) if as_json else line)
    return 0


def cancel(args: argparse.Namespace) -> int:
    from revenant.cli.client import ask, bus_url
    from revenant.messages import JobReply, JobRequest

    req = JobRequest(job=args.job, signal=args.signal, grace_s=args.grace)
    # Its node gives the job --grace seconds to end before SIGKILL: the reply waits for that too.
    reply = ask(bus_url(args), "cancel", req, JobReply, args.timeout + args.grace)
    return _answer(reply, args.json, f"job {reply.job.spec.id}: cancelled")


def signal_job(args: argparse.Namespace) -> int:
    from revenant.cli.client import ask, bus_url
    from revenant.messages import JobReply, JobRequest

    req = JobRequest(job=args.job, signal=args.signal, all=args.all)
    reply = ask(bus_url(args), "signal", req, JobReply, args.timeout)
    return _answer(reply, args.json, f"job {reply.job.spec.id}: {'; '.join(reply.notes)}")


# ---------------------------------------------------------------------- logs


def add_logs_command(sub: Any, cluster_args: Callable[..., None]) -> None:
    p = sub.add_parser("logs", help="print a job's output (-f: keep following it, across restores and moves)")
    cluster_args(p)
    p.add_argument("job")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing what the job writes until it ends, wherever it runs")
    p.add_argument("--tail", type=int, metavar="N", help="start with its last N lines (default: all of it)")
    p.set_defaults(func=logs, one_shot=True)


def logs(args: argparse.Namespace) -> int:
    import time

    from revenant.cli.client import asking, bus_url
    from revenant.client import ClientError

    rv = asking(bus_url(args), args.timeout)
    out = sys.stdout.buffer
    rec = rv.job(args.job)
    follower = Follower(open_output(rec), rec, args.tail)
    try:
        while True:
            for piece in follower.step(rec):
                out.write(piece)
            out.flush()
            if not args.follow or (ended(rec) and follower.caught_up()):
                return 0
            time.sleep(follower.poll_s)
            try:
                rec = rv.job(args.job)
            except ClientError as exc:
                if not exc.retriable and exc.code != "not_leader":
                    raise
                # No leader answers for a moment (a coordinator failing over): the file goes on.
    finally:
        follower.f.close()


ENDED = ("completed", "failed", "cancelled")


def ended(rec) -> bool:
    return rec.state in ENDED


def open_output(rec):
    """The job's output, read where the nodes write it (the shared storage)."""
    from revenant.common.errors import RevenantError

    if not rec.output:
        raise RevenantError(f"job {rec.spec.id} has no output yet (it has not started)")
    try:
        return open(rec.output, "rb")
    except OSError as exc:
        raise RevenantError(f"cannot read job {rec.spec.id}'s output {rec.output}: {exc.strerror} (revenant logs "
                            f"reads it from the storage the nodes share: run it where that is mounted)") from None


def tail_start(f, lines: int) -> int:
    """Where the last ``lines`` lines of ``f`` begin (a final newline ends the last line)."""
    end = pos = os.fstat(f.fileno()).st_size
    if lines <= 0:
        return end
    count = 0
    while pos > 0:
        step = min(pos, 65536)
        pos -= step
        f.seek(pos)
        block = f.read(step)
        for i in range(len(block) - 1, -1, -1):
            if block[i] == 10 and pos + i != end - 1:
                count += 1
                if count == lines:
                    return pos + i + 1
    return 0


class Follower:
    """What of a job's output to print next, given its record as it is now (``revenant logs``).

    The output only grows while a copy of the job runs; a restore cuts it back to its epoch's
    ``output_bytes`` and the job writes on from there.  So before each read the follower checks
    that the last bytes it printed (its *fence*) are still in the file where it left them: they
    are unless the output was cut back.  A new generation restored from an epoch (the record's
    ``restored_from``) whose output ends before what was printed gets a marker line, and the
    follower goes on from where the epoch's output ended; so does a requeue's fresh start (from
    0).  A change the record does not explain (yet) is waited for, and after
    :attr:`patience_s` marked at the first byte that differs."""

    poll_s = 0.25
    fence_bytes = 4096
    chunk_bytes = 1 << 20
    patience_s = 3.0

    def __init__(self, f, rec, tail: int | None = None, clock=None) -> None:
        import time

        self.f, self.job, self.clock = f, rec.spec.id, clock or time.monotonic
        # Started while a launch is under way: its outcome is a relaunch, looked at once it runs.
        self.generation = None if rec.state in ("pending", "restoring") else rec.generation
        self.printed = tail_start(f, tail) if tail is not None else 0
        self.fence = self._read(max(0, self.printed - self.fence_bytes), self.printed - max(0, self.printed -
                                                                                              self.fence_bytes))
        self.diverged_at: float | None = None
        self.size = 0

    def _read(self, at: int, n: int) -> bytes:
        # pread, never a buffered read: a restore rewrites the file under us, and a buffer would
        # hand back what it held before.
        return os.pread(self.f.fileno(), n, at) if n > 0 else b""

    def caught_up(self) -> bool:
        return self.diverged_at is None and self.size <= self.printed

    def _cut(self, to: int, why: str) -> bytes:
        undone = self.printed - to
        self.printed = to
        self.fence = self._read(max(0, to - self.fence_bytes), to - max(0, to - self.fence_bytes))
        self.diverged_at = None
        return (f"--- revenant: job {self.job}'s output {why}, at byte {to} (the last {undone} bytes above are "
                f"undone) ---\n").encode()

    def _relaunched(self, rec) -> list[bytes]:
        self.generation = rec.generation
        if not rec.restored_from:  # started, not restored: a requeue's fresh start empties the output
            return [self._cut(0, "started afresh (a requeue)")] if self.printed else []
        epoch = next((e for e in rec.epochs if e.n == rec.restored_from), None)
        if epoch is None or not epoch.output_bytes or epoch.output_bytes >= self.printed:
            return []  # nothing printed was undone (or the epoch says nothing: the fence will tell)
        return [self._cut(epoch.output_bytes, f"rolled back to epoch {epoch.n}")]

    def _reopened(self) -> None:
        """A restore may put the output back as a new file at its path: read that one from now on."""
        try:
            now = os.stat(self.f.name)
        except OSError:
            return
        if (now.st_dev, now.st_ino) != (lambda st: (st.st_dev, st.st_ino))(os.fstat(self.f.fileno())):
            self.f.close()
            self.f = open(self.f.name, "rb")

    def step(self, rec) -> list[bytes]:
        self._reopened()
        if rec.generation != self.generation and rec.state in ("pending", "restoring"):
            return []  # a restore or start under way: what it does to the output is not known yet
        out = self._relaunched(rec) if rec.generation != self.generation else []
        start = self.printed - len(self.fence)
        data = self._read(start, len(self.fence) + self.chunk_bytes)
        self.size = start + len(data)
        if data[:len(self.fence)] != self.fence:
            now = self.clock()
            self.diverged_at = self.diverged_at if self.diverged_at is not None else now
            if now - self.diverged_at < self.patience_s:
                return out  # the record has not caught up with a restore yet
            same = next((i for i, (a, b) in enumerate(zip(data, self.fence)) if a != b),
                        min(len(data), len(self.fence)))
            if same == 0 and start > 0:  # it differs before what the fence holds: where, nobody knows
                out.append(self._cut(0, "was rewritten before the last bytes this kept; printed again from its start"))
            else:
                out.append(self._cut(min(start + same, self.size), "was rewritten"))
            return out + self.step(rec)
        self.diverged_at = None
        new = data[len(self.fence):]
        if new:
            self.printed += len(new)
            self.fence = (self.fence + new)[-self.fence_bytes:]
            out.append(new)
        return out
