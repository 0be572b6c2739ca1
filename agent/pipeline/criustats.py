"""criu's own statistics of a dump or a restore: its binary ``stats-dump`` and ``stats-restore``.

criu writes one after every dump (pre-dumps too) and restore, into its work directory (``-W``),
not the images directory: a service image (``IMG_SERVICE_MAGIC``, ``STATS_MAGIC``), then one
``StatsEntry`` protobuf behind its 32-bit length (criu's images/stats.proto)::

    message stats_entry { optional dump_stats_entry dump = 1; optional restore_stats_entry restore = 2; }

Times are microseconds on the wire and seconds here (``*_s``); the rest count pages.  Reading is
best effort: a missing, short or unexpected file gives ``{}``, never an error.
"""

from __future__ import annotations

import struct
from pathlib import Path

DUMP_FILE = "stats-dump"
RESTORE_FILE = "stats-restore"
IMG_SERVICE_MAGIC = 0x55105940
STATS_MAGIC = 0x57093306

# Field number -> name, as criu's --display-stats words them (bench/checkpoint.py reads those too).
DUMP_FIELDS = {
    1: "freezing_time_s", 2: "frozen_time_s", 3: "memory_dump_time_s", 4: "memory_write_time_s",
    5: "memory_pages_scanned", 6: "memory_pages_skipped_from_parent", 7: "memory_pages_written",
    8: "irmap_resolve_time_s", 9: "lazy_memory_pages", 10: "page_pipes", 11: "page_pipe_bufs",
    12: "shared_memory_pages_scanned", 13: "shared_memory_pages_skipped_from_parent",
    14: "shared_memory_pages_written",
}
RESTORE_FIELDS = {1: "pages_compared", 2: "pages_skipped_cow", 3: "forking_time_s", 4: "restore_time_s",
                  5: "pages_restored"}
_ENTRIES = {1: DUMP_FIELDS, 2: RESTORE_FIELDS}
_VARINT, _LENGTH = 0, 2


class _Malformed(Exception):
    pass


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise _Malformed("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(pb: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message whose fields are varints or length-delimited."""
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(pb):
        key, i = _varint(pb, i)
        if key & 7 == _VARINT:
            value, i = _varint(pb, i)
            out.append((key >> 3, value))
        elif key & 7 == _LENGTH:
            n, i = _varint(pb, i)
            if i + n > len(pb):
                raise _Malformed("truncated field")
            out.append((key >> 3, pb[i:i + n]))
            i += n
        else:
            raise _Malformed(f"unexpected wire type {key & 7}")
    return out


def parse(data: bytes) -> dict[str, float]:
    """The statistics in a stats image's bytes ({} if they are not one)."""
    try:
        magic1, magic2, size = struct.unpack_from("<III", data)
        if (magic1, magic2) != (IMG_SERVICE_MAGIC, STATS_MAGIC) or 12 + size > len(data):
            return {}
        out: dict[str, float] = {}
        for number, entry in _fields(data[12:12 + size]):
            names = _ENTRIES.get(number)
            if names is None or not isinstance(entry, bytes):
                continue
            for field, value in _fields(entry):
                name = names.get(field)
                if name is not None and isinstance(value, int):
                    out[name] = value / 1e6 if name.endswith("_s") else float(value)
        return out
    except (struct.error, _Malformed):
        return {}


def read(path: Path) -> dict[str, float]:
    """The statistics criu left at ``path`` ({} if none could be read)."""
    try:
        return parse(path.read_bytes())
    except OSError:
        return {}

