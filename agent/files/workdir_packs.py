"""A job's working-directory files as pages in packs, deduplicated against earlier epochs.

A database of 2 GiB that changed 1 % of its blocks since the last epoch should cost that epoch
about 1 %, not 2 GiB.  So a changed file of at least ``PACK_MIN`` bytes is not stored whole: as
the gate copies it after the job resumes (agent/files/gate/cowgate.py), or, for one copied whole while the
job was frozen (one it holds), from that copy once the job runs again, :meth:`Packer.pack` cuts it into
4 KiB pages, hashes each, and stores only the pages that neither the previous epoch's packs nor
this epoch's new pack hold yet, into one new pack per epoch (``packs/<seg>/<N>-<rnd>.pack`` and
its ``.idx``: agent/storage/chain.py's format, memory's packs' too).  The file's record in
workdir-files.json then holds its runs over ``Manifest.workdir_packs`` and its CRC-32; an
unchanged packed file keeps the previous epoch's runs (agent/files/workdir.py decides, while frozen).

An epoch's packs are those of its segment only (``(N - 1) // full_every``, as for memory): a page
that goes bad takes at most ``full_every`` epochs with it, and the first epoch of a segment
stores every page again.  The pack is written under its final name before the epoch commits:
agent/storage/packs.py's gc never deletes a pack named for an epoch newer than every committed one, and
a failed checkpoint deletes its own (:meth:`Packer.discard`).  Smaller files stay whole copies
(``files/w<i>``).
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import BinaryIO

from revenant.agent.storage import packs
from revenant.agent.storage.packfile import DIGEST, PAGE, idx_bytes, pack_path, write_private
from revenant.agent.storage.fileio import fsync_path
from revenant.agent.storage.manifest import EpochStore
from revenant.agent.storage.private import PRIVATE_FILE

# Files from this size up are packed (a smaller one's last page would waste too much of itself).
PACK_MIN = 64 * 1024

# Runs by pack name: (pack, first page, count).
Runs = list[tuple[str, int, int]]


def named(runs: list[int], table: list[str]) -> Runs:
    """Flat (pack number, first, count) triples as runs by pack name."""
    return [(table[runs[i]], runs[i + 1], runs[i + 2]) for i in range(0, len(runs), 3)]


def numbered(runs: Runs, table: list[str]) -> list[int]:
    number = {ref: i for i, ref in enumerate(table)}
    return [x for ref, first, count in runs for x in (number[ref], first, count)]


class Packer:
    """One epoch's new pack of working-directory pages (see the module docstring).  Made before
    the dump (it reads the base packs' indexes then, never while the job is frozen); packs
    files from the gate's thread; :meth:`close` once every file is in."""

    def __init__(self, files: EpochStore, epoch: int, seg: int, base: list[str], pack_min: int = PACK_MIN) -> None:
        self.files = files
        self.seg = seg
        self.pack_min = pack_min
        # The previous epoch's packs of this segment that can be read: the pages deduplicated against.
        self.base, self._index = packs.index_of(files, base)
        self.ref = f"{seg}/{epoch}-{secrets.token_hex(4)}"
        self._pack: BinaryIO | None = None
        self._digests = bytearray()
        self._lock = threading.Lock()
        self.results: dict[str, tuple[Runs, int, str]] = {}  # by key: runs, size, CRC-32
        self.closed = False

    @property
    def new_bytes(self) -> int:
        """What the new pack and its index hold."""
        pages = len(self._digests) // DIGEST
        return pages * PAGE + len(idx_bytes(self._digests)) if pages else 0

    def pack(self, src: int, key: str, at: int = 0, size: int = -1) -> None:
        """The file behind ``src`` (``size`` bytes of it from ``at``; -1: to its end) as runs over
        the base packs and the new one, under ``key``."""
        with self._lock:
            if self._pack is None:
                packs.pack_dir(self.files, self.seg)
                fd = os.open(pack_path(self.files, self.ref), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             PRIVATE_FILE)
                self._pack = open(fd, "wb")
            new_no = len(self.base)
            runs, read, crc = packs.cut(_Region(src, at, size), self._index, new_no, self._digests, self._pack)
            self.results[key] = (named(runs, [*self.base, self.ref]), read, f"{crc:08x}")

    def close(self) -> bool:
        """The new pack and its index made durable (or the pack removed, if no page was new);
        whether the epoch reads it."""
        with self._lock:
            self.closed = True
            if self._pack is None:
                return False
            self._pack.flush()
            os.fsync(self._pack.fileno())
            self._pack.close()
            if not self._digests:
                pack_path(self.files, self.ref).unlink(missing_ok=True)
                return False
            write_private(pack_path(self.files, self.ref, ".idx"), idx_bytes(self._digests))
            fsync_path(pack_path(self.files, self.ref).parent, directory=True)
            return True

    def discard(self) -> None:
        """The checkpoint failed: its pack goes (nothing else reads it)."""
        with self._lock:
            self.closed = True
            if self._pack is not None and not self._pack.closed:
                self._pack.close()
            for suffix in (".pack", ".idx"):
                pack_path(self.files, self.ref, suffix).unlink(missing_ok=True)


class _Region:
    """``size`` bytes of a file from ``at`` (-1: to its end), read as a file object is."""

    def __init__(self, fd: int, at: int, size: int) -> None:
        self.fd, self.at, self.left = fd, at, size

    def readinto(self, view: memoryview) -> int:
        want = len(view) if self.left < 0 else min(len(view), self.left)
        n = os.preadv(self.fd, [view[:want]], self.at) if want else 0
        self.at += n
        if self.left > 0:
            self.left -= n
        return n


def table_of(runs: list[Runs]) -> list[str]:
    """The packs some of ``runs`` read, oldest first: an epoch's Manifest.workdir_packs."""
    return sorted({ref for r in runs for ref, _, _ in r}, key=lambda r: (len(r), r))
