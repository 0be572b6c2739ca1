"""Pages of the coordinator's tables: as many entries as fit one message.

Every list reply is a page (``jobs_reply.v1``, ``nodes_reply.v1``), and a page holds as many
entries as fit :data:`PAGE_BYTES`, whatever the request's limit, so that no reply to a
request that succeeded can ever be too large to send.  Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterable, Mapping, TypeVar

import msgspec

from revenant.messages import MAX_MESSAGE_BYTES, JobRecord, JobsReply

T = TypeVar("T")

# Room left for the reply's own fields (type tag, coordinator name, totals).
PAGE_BYTES = MAX_MESSAGE_BYTES - 8 * 1024
# Jobs per page at most, however small they are.
JOBS_PAGE_MAX = 1000
# A record too large for a page (stored before submit checked sizes) is shown with its
# command line cut to this many characters.
SHOWN_ARGV_CHARS = 4096

_encoder = msgspec.msgpack.Encoder()


def job_sort_key(job_id: str) -> tuple[int, str]:
    """Numeric ids in numeric order, then any others by name."""
    numeric = job_id.isascii() and job_id.isdigit() and len(job_id) <= 18
    return (int(job_id), "") if numeric else (1 << 62, job_id)


def fitting(items: Iterable[T], budget: int = PAGE_BYTES) -> list[T]:
    """The longest prefix of ``items`` whose encodings add up to at most ``budget`` bytes, and
    at least the first item (one too large alone then fails loudly, as an error reply)."""
    out: list[T] = []
    used = 0
    for item in items:
        size = len(_encoder.encode(item)) + 1
        if out and used + size > budget:
            break
        out.append(item)
        used += size
    return out


def shown(rec: JobRecord, budget: int = PAGE_BYTES) -> JobRecord:
    """``rec``, or a copy whose command line and environment are cut short when the whole would
    not fit a reply (a record stored before submit checked sizes)."""
    return _sized(rec, budget)[0]


def _sized(rec: JobRecord, budget: int) -> tuple[JobRecord, int]:
    size = len(_encoder.encode(rec))
    if size <= budget:
        return rec, size
    argv = " ".join(rec.spec.argv)
    cut = f"{argv[:SHOWN_ARGV_CHARS]}... ({len(argv):,} characters and {len(rec.spec.env)} environment " \
          "variables, too large to show)"
    rec = msgspec.structs.replace(rec, spec=msgspec.structs.replace(rec.spec, argv=[cut], env={}))
    return rec, len(_encoder.encode(rec))


class JobPages:
    """Pages of the live job table in id order, with a cursor (the last id of the page before).

    The ids are sorted once per listing (at its first page), not once per page: a listing of
    100,000 jobs asks for about 250 pages.  A job added after a listing began may be missing
    from it; a job archived or purged meanwhile is skipped; no job is listed twice.

    ``keep`` narrows a listing to the jobs it accepts (a user's own), and ``total`` counts
    those; the sorted ids stay the whole table's, so listings of different users interleave.
    """

    def __init__(self) -> None:
        self._keys: list[tuple[int, str]] = []
        self._ids: list[str] = []

    def page(self, jobs: Mapping[str, JobRecord], after: str = "", limit: int = JOBS_PAGE_MAX,
             budget: int = PAGE_BYTES, keep: Callable[[JobRecord], bool] | None = None) -> JobsReply:
        if not after or not self._ids:
            self._ids = sorted(jobs, key=job_sort_key)
            self._keys = [job_sort_key(j) for j in self._ids]
        start = bisect.bisect_right(self._keys, job_sort_key(after)) if after else 0
        limit = max(1, min(limit, JOBS_PAGE_MAX))
        out: list[JobRecord] = []
        used = 0
        more = False
        for i in range(start, len(self._ids)):
            rec = jobs.get(self._ids[i])
            if rec is None or (keep is not None and not keep(rec)):
                continue  # archived or purged since the listing began, or not the asker's
            if len(out) == limit:
                more = True
                break
            rec, size = _sized(rec, budget)
            if out and used + size + 1 > budget:
                more = True
                break
            out.append(rec)
            used += size + 1
        total = len(jobs) if keep is None else sum(1 for rec in jobs.values() if keep(rec))
        return JobsReply(jobs=out, total=total, more=more)
