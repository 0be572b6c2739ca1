"""What a person watching a long checkpoint, vacate or restart sees: one line rewritten in place on
the terminal from the agent's ``progress.v1`` reports (``dumping job 7: 1.2 GiB of ~4.0 GiB, 310.0
MiB/s``), cleared when the reply comes; and criu's own statistics as ``--stats`` prints them.

Nothing here decides anything: a lost report, or none at all, only leaves the line as it was."""

from __future__ import annotations

from collections import deque
from typing import TextIO

from revenant.cli.jobview import _fmt_bytes
from revenant.messages import MessageError, Progress, decode_as

# The rate is taken over the reports of the last few seconds (the agent's clock: elapsed_s).
RATE_WINDOW_S = 2.0
_VERBS = {"dump": "dumping", "commit": "committing", "restore": "restoring"}


class Rate:
    """Bytes per second over the reports of the last ``window_s`` seconds of one operation."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, elapsed_s: float, done: int) -> float | None:
        """Take a report (time since the operation started, bytes so far); the rate, or None
        before there is one."""
        if self.samples and (elapsed_s < self.samples[-1][0] or done < self.samples[-1][1]):
            self.samples.clear()  # another operation, or a report out of order: start over
        if not self.samples or elapsed_s > self.samples[-1][0]:
            self.samples.append((elapsed_s, done))
        while len(self.samples) > 2 and elapsed_s - self.samples[1][0] >= self.window_s:
            self.samples.popleft()  # the window still spans window_s without the oldest
        return self._rate(elapsed_s, done)

    def _rate(self, elapsed_s: float, done: int) -> float | None:
        first_s, first = self.samples[0]
        if len(self.samples) == 1:  # one report: the average since the start
            return done / elapsed_s if elapsed_s > 0 and done else None
        return (done - first) / (elapsed_s - first_s) if elapsed_s > first_s else None


def progress_text(msg: Progress, rate: float | None) -> str:
    """The line for one report: ``dumping job 7: 1.2 GiB of ~4.0 GiB, 310.0 MiB/s``."""
    verb = _VERBS.get(msg.op, msg.op)
    done = _fmt_bytes(msg.bytes)
    if msg.op == "commit":  # checksums and the sync: nothing more is written that can be counted
        return f"{verb} job {msg.job}: {done} written"
    amount = f"{done} of ~{_fmt_bytes(msg.total_bytes)}" if 0 < msg.bytes <= msg.total_bytes else done
    speed = f", {_fmt_bytes(rate)}/s" if rate is not None else ""
    return f"{verb} job {msg.job}: {amount}{speed}"


class ProgressLine:
    """Draws ``job``'s progress on ``out`` (a terminal) as reports come, until :meth:`close`."""

    def __init__(self, job: str, out: TextIO, width: int | None = None) -> None:
        self.job = job
        self.out = out
        self.width = width
        self.shown = False
        self.closed = False
        self._op = ""
        self._rate = Rate()

    def heard(self, data: bytes) -> None:
        """One report off the bus; anything else (another job's, undecodable) is ignored."""
        try:
            msg = decode_as(data, Progress)
        except MessageError:
            return
        self.show(msg)

    def show(self, msg: Progress) -> None:
        """One report, decoded."""
        if self.closed or msg.job != self.job:
            return
        if msg.job != self.job:
            return
        if msg.op != self._op:
            self._op, self._rate = msg.op, Rate()
        text = progress_text(msg, self._rate.add(msg.elapsed_s, msg.bytes))
        import shutil  # drawn on a terminal only

        width = self.width or shutil.get_terminal_size((80, 24)).columns
        self.out.write("\r" + text[:max(width - 1, 1)] + "\x1b[K")  # never wraps, so \r always returns
        self.out.flush()
        self.shown = True

    def close(self) -> None:
        """Stop drawing, and take the line away if one was drawn."""
        self.closed = True
        if self.shown:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self.shown = False


# --stats: criu's statistics (agent/pipeline/criustats.py names) in the order a person reads them.
STATS_ROWS = (
    ("freezing_time_s", "freezing time"), ("frozen_time_s", "frozen time"),
    ("memory_dump_time_s", "memory dump time"), ("memory_write_time_s", "memory write time"),
    ("irmap_resolve_time_s", "irmap resolve time"),
    ("memory_pages_scanned", "pages scanned"), ("memory_pages_skipped_from_parent", "pages skipped (in parent)"),
    ("memory_pages_written", "pages written"), ("lazy_memory_pages", "pages left lazy"),
    ("shared_memory_pages_scanned", "shared pages scanned"),
    ("shared_memory_pages_written", "shared pages written"),
    ("forking_time_s", "forking time"), ("restore_time_s", "restore time"),
    ("pages_compared", "pages compared"), ("pages_skipped_cow", "pages skipped (COW)"),
    ("pages_restored", "pages restored"),
)


def stats_table(stats: dict[str, float]) -> str:
    """criu's statistics as a small table (times in ms, pages counted), numbers aligned."""
    rows = [(label, *((f"{stats[key] * 1000:.1f}", "ms") if key.endswith("_s") else (f"{int(stats[key]):,}", "")))
            for key, label in STATS_ROWS if key in stats]
    if not rows:
        return "criu statistics: none reported"
    label_w, value_w = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    return "\n".join(["criu statistics:", *(f"  {label.ljust(label_w)}  {value.rjust(value_w)} {unit}".rstrip()
                                             for label, value, unit in rows)])
