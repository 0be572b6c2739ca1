"""The digests of an epoch's images, taken as criu writes them, and their durability.

An epoch's manifest holds a digest of every file (agent/storage/epochs.py): a keyed BLAKE3
where the node holds the cluster's image keys (agent/storage/imagekeys.py), else CRC-32.  What
follows says CRC-32; keyed digests are taken the same way, a page image's a MAC per 64 KiB extent
(ExtentMacs: its table written beside it by :func:`seal`), the rest split over the CPUs by
extent.  Read only
after criu has exited and then fsynced file by file, 2 GiB of images cost about
a second of CRC-32 and a second of writes on the commit path.  Nearly all of a
dump is its page images (``pages-*.img``), which criu writes once each,
strictly appending (criu/page-xfer.c splices each batch of pages at the end of
a file it opened with O_TRUNC).  A :class:`Follower` takes them as they grow:

* a writeback thread asks the kernel to start writing what criu has written to
  the disk (agent/storage/fileio.py ``start_writeback``): the disk works while criu
  does, and the one syncfs that makes the epoch durable finds little left;
* a reader thread carries each image's CRC-32 along, reading from the page cache.

Both run at the lowest priority while criu runs (niceness 19), so they take only
what criu and the job's parasite leave of the CPUs.  On a machine with few CPUs
(below FOLLOW_MIN_CPUS; measured on 2 vCPUs, 2 GiB) reading *and* writing back
during the dump lengthened the job's median freeze by 7 to 48% from one series
of runs to the next, writing back alone by 0 to 18%, so there the reader waits
for criu to exit, unless there is no writeback to do (node-local staging).
Once criu has exited, :meth:`Follower.finish` reads what is left through a
mapping of the page cache, split over the CPUs (the CRC-32s of the pieces are
combined), while :func:`seal`'s syncfs waits for the disk.  With the ``isal``
package installed its CRC-32 (the same function, in carry-less multiplies)
takes 2 GiB in about 0.25 s here instead of zlib's 0.7 to 1 s.

Each followed image must still be the inode it opened, exactly as long as what
was read, and never seen shorter than that (a file truncated or replaced while
criu ran): any other is left out of the answer and read again whole, like
every other (small) image and the job's own files.

Blocking code: the follower's threads are its own; :func:`seal` runs in a worker
thread.  The CRC-32 functions and os.preadv release the GIL.
"""

from __future__ import annotations

import concurrent.futures
import logging
import mmap
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from revenant.agent.storage.fileio import Durable, start_writeback
from revenant.agent.storage.imagekeys import (EXTENT, MACS_SUFFIX, PLAIN, Digest, ExtentMacs, Hasher,
                                              crc32_combine, table_of_fd)

try:  # the same CRC-32 as zlib's, with the CPU's carry-less multiply: about 3x as fast here
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32
CRC32_BY = crc32.__module__.split(".")[0]  # which one, for the log

log = logging.getLogger(__name__)

# criu's page images: written once each, only ever appended to.
FOLLOWED = re.compile(r"^pages-[0-9]+\.img$")
CHUNK = 8 * 1024 * 1024
# Writeback is started every WRITEBACK bytes criu writes to a file.
WRITEBACK = 64 * 1024 * 1024
# How long the follower's threads wait when criu has written nothing new.
POLL_S = 0.005
# Below this many CPUs, reading and writing back at once while criu runs lengthen the freeze.
FOLLOW_MIN_CPUS = 4
# What is left after criu is read in pieces of at least this, one per CPU.
MIN_PIECE = 64 * 1024 * 1024

Sums = dict[str, tuple[int, str]]  # name -> (size, CRC-32 as 8 hex digits)

def crc32_range(fd: int, start: int, end: int, buf: bytearray | None = None) -> int:
    """CRC-32 (from 0) of bytes ``start`` to ``end`` of ``fd``; OSError if the file is shorter."""
    view = memoryview(buf if buf is not None else bytearray(min(CHUNK, max(end - start, 1))))
    crc, offset = 0, start
    while offset < end:
        n = os.preadv(fd, [view[:min(len(view), end - offset)]], offset)
        if n == 0:
            raise OSError(f"file ended at byte {offset} of {end}")
        crc = crc32(view[:n], crc)
        offset += n
    return crc


def crc32_mapped(fd: int, start: int, end: int) -> int:
    """CRC-32 (from 0) of bytes ``start`` to ``end`` of ``fd``, read through a mapping of the page
    cache: no copy, twice as fast as reading here.  Only for a file nobody shortens meanwhile (a
    mapping read past the end of its file kills the process with SIGBUS): criu's images once criu
    has exited, in the agent's private epoch or staging directory."""
    if end <= start:
        return 0
    base = start - start % mmap.ALLOCATIONGRANULARITY
    crc = 0
    with mmap.mmap(fd, end - base, offset=base, prot=mmap.PROT_READ) as mapped:
        view = memoryview(mapped)
        try:
            for offset in range(start - base, end - base, CHUNK):
                crc = crc32(view[offset:min(offset + CHUNK, end - base)], crc)
        finally:
            view.release()
    return crc


def crc32_file(path: Path, digest: Digest = PLAIN, tables: dict[str, bytes] | None = None) -> tuple[int, str]:
    """(size, digest) of ``path``: its CRC-32, or ``digest``'s; with ``tables``, a page image's
    MACs by extent (imagekeys.ExtentMacs), its table put there under its name."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if not digest.keyed:
            return size, f"{crc32_range(fd, 0, size):08x}"
        if tables is not None:
            macs = digest.new(extents=True)
            assert isinstance(macs, ExtentMacs)
            macs.extend(table_of_fd(macs.key, fd, 0, size, len(os.sched_getaffinity(0))))
            tables[path.name] = macs.macs()
            return size, macs.hexdigest()
        hasher = digest.new()
        digest_mapped(hasher, fd, 0, size)
        return size, hasher.hexdigest()
    finally:
        os.close(fd)


def paged(name: str, digest: Digest) -> bool:
    """Whether ``name`` of an epoch digested so is a page image digested by extents."""
    return digest.keyed and FOLLOWED.match(name) is not None


def digest_mapped(hasher: Hasher, fd: int, start: int, end: int) -> None:
    """Feed bytes ``start`` to ``end`` of ``fd`` to ``hasher`` through a mapping of the page cache
    (crc32_mapped's rules: a file nobody shortens meanwhile)."""
    if end <= start:
        return
    base = start - start % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, end - base, offset=base, prot=mmap.PROT_READ) as mapped:
        view = memoryview(mapped)
        try:
            for offset in range(start - base, end - base, 8 * CHUNK):
                hasher.update(view[offset:min(offset + 8 * CHUNK, end - base)])
        finally:
            view.release()


def checksums(directory: Path, names: list[str], followed: Mapping[str, tuple[int, str]] | None = None,
              digest: Digest = PLAIN, tables: dict[str, bytes] | None = None) -> Sums:
    """(size, digest) of each of ``names`` in ``directory``: the follower's where it has the file
    whole at its present size, the others read now (two at a time); the page images' tables of
    MACs into ``tables`` (the follower's already there)."""
    followed = followed or {}
    tables = {} if tables is None else tables
    todo = [n for n in names if n not in followed or followed[n][0] != (directory / n).stat().st_size]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        read = dict(zip(todo, pool.map(
            lambda n: crc32_file(directory / n, digest, tables if paged(n, digest) else None), todo)))
    return {n: read[n] if n in read else followed[n] for n in names}


def _write_tables(directory: Path, tables: dict[str, bytes], digest: Digest) -> Sums:
    """Each page image's table of MACs beside it (MACS_SUFFIX), durable; their digests."""
    out: Sums = {}
    for name, table in tables.items():
        path = directory / f"{name}{MACS_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(table)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        out[path.name] = crc32_file(path, digest)
    if out:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return out


def seal(directory: Path, names: list[str], durable: Durable, follower: Follower | None = None,
         known: Sums | None = None, digest: Digest = PLAIN) -> Sums:
    """Blocking: the (size, CRC-32) of each of ``names`` in ``directory``, every one of them
    durable (``durable.sync``, which runs while what the follower has left is read); ``known``:
    files whose sums are known already (links to an older epoch's immutable copies)."""
    def sync() -> float:
        durable.sync([directory / n for n in names], sorted({(directory / n).parent for n in names}, reverse=True))
        return time.monotonic() - t0

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        syncing = pool.submit(sync)
        try:
            followed = {**(known or {}), **(follower.finish() if follower is not None else {})}
            tables = dict(follower.tables) if follower is not None else {}
            t1 = time.monotonic()
            sums = checksums(directory, names, followed, digest, tables)
            sums.update(_write_tables(directory, {n: t for n, t in tables.items() if n in sums}, digest))
            t2 = time.monotonic()
        finally:
            sync_s = syncing.result()  # never leave the sync running behind an error
    log.info("%s: %s (%s) of %d files (%d followed as criu wrote, %.1f MiB read after it) %.3f s, the rest "
             "%.3f s; durable (%s) %.3f s", directory.name, digest.name, "blake3" if digest.keyed else CRC32_BY, len(names), len(followed),
             (follower.tail_bytes if follower else 0) / 2**20, t1 - t0, t2 - t1, durable.how, sync_s)
    return sums


@dataclass
class _Image:
    fd: int
    ino: int
    offset: int = 0
    crc: int = 0
    hasher: Hasher | None = None  # a keyed digest's (else the CRC-32 above)
    written_back: int = 0
    # Seen shorter than what was read: truncated or rewritten; read again whole after criu.
    broken: bool = False


def _renice(niceness: int) -> int:
    """Set the calling thread's niceness (Linux: per thread); returns the one it had."""
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except OSError:  # lowering a thread's priority is always allowed; raising it back may not be
        pass
    return before


class Follower:
    """Follows ``directory``'s page images as criu writes them (see the module's docstring).

    ``start()`` just before criu starts, ``criu_exited()`` as soon as it has, ``finish()`` for the
    checksums; ``abandon()`` (idempotent) on any failure, and in any case before the directory is
    deleted.  ``writeback``: start writing the images back to the disk while criu runs (they are
    on the storage, not in node-local staging).  ``read_during``: read them while criu runs too
    (default: where there is no writeback, or at least FOLLOW_MIN_CPUS CPUs)."""

    def __init__(self, directory: Path, *, writeback: bool = True, read_during: bool | None = None,
                 poll_s: float = POLL_S, cpus: int | None = None, digest: Digest = PLAIN) -> None:
        self.dir = directory
        self.digest = digest
        self.poll_s = poll_s
        self.cpus = cpus or len(os.sched_getaffinity(0))
        self.read_during = read_during if read_during is not None else (
            not writeback or self.cpus >= FOLLOW_MIN_CPUS)
        self.images: dict[str, _Image] = {}
        self.tables: dict[str, bytes] = {}  # the page images' tables of MACs (keyed digests), once finished
        self.error: OSError | None = None
        self.tail_bytes = 0  # read after criu exited
        self._exited = threading.Event()
        self._abandoned = threading.Event()
        self._lock = threading.Lock()  # both threads open new images
        self._threads = []
        if self.read_during:
            self._threads.append(threading.Thread(target=self._guarded, args=(self._follow,), daemon=True,
                                                  name=f"imagesum-{directory.name}"))
        if writeback:
            self._threads.append(threading.Thread(target=self._guarded, args=(self._write_back,), daemon=True,
                                                  name=f"writeback-{directory.name}"))
        self._finished = False

    def start(self) -> Follower:
        for t in self._threads:
            t.start()
        return self

    def criu_exited(self) -> None:
        """criu has exited: the threads stop (the reader once it has caught up)."""
        self._exited.set()

    def finish(self) -> Sums:
        """Blocking: the CRC-32 of every page image followed whole, by name."""
        self.criu_exited()
        self._join()
        try:
            if self.error is None:
                self._discover()
                self._read_rest()
            out: Sums = {}
            for name, img in self.images.items():
                try:
                    st = os.stat(self.dir / name)
                except FileNotFoundError:
                    continue
                if self.error is None and not img.broken and st.st_ino == img.ino and st.st_size == img.offset:
                    out[name] = (img.offset, img.hasher.hexdigest() if img.hasher is not None else f"{img.crc:08x}")
                    if isinstance(img.hasher, ExtentMacs):
                        self.tables[name] = img.hasher.macs()
            return out
        except OSError as exc:
            log.warning("%s: following criu's images failed, reading them again: %s", self.dir, exc)
            return {}
        finally:
            self._close()

    def abandon(self) -> None:
        """Blocking, briefly: stop reading (at most one chunk more) and close every file."""
        self._abandoned.set()
        self._join()
        self._close()

    def _join(self) -> None:
        for t in self._threads:
            if t.ident is not None:  # started
                t.join()

    def _close(self) -> None:
        if not self._finished:
            self._finished = True
            for img in self.images.values():
                os.close(img.fd)

    def _guarded(self, loop) -> None:
        try:
            loop()
        except OSError as exc:  # every image is then read again after criu
            self.error = exc

    def _follow(self) -> None:
        _renice(19)  # this thread only: it ends with criu, and finish() reads the rest at full priority
        buf = bytearray(CHUNK)
        while not self._exited.is_set() and not self._abandoned.is_set():
            self._discover()
            moved = False
            for img in list(self.images.values()):
                moved = self._read(img, buf) or moved
            if not moved:
                self._exited.wait(self.poll_s)

    def _write_back(self) -> None:
        """Start writeback of every WRITEBACK bytes criu writes, until it exits (the rest is left to
        the syncfs or fsync that makes the epoch durable)."""
        _renice(19)
        while not self._exited.is_set() and not self._abandoned.is_set():
            self._discover()
            moved = False
            for img in list(self.images.values()):
                size = os.fstat(img.fd).st_size
                if size - img.written_back >= WRITEBACK:
                    start_writeback(img.fd, img.written_back, size - img.written_back)
                    img.written_back, moved = size, True
            if not moved:
                self._exited.wait(self.poll_s)

    def _discover(self) -> None:
        """Open the page images criu has started since the last look."""
        with self._lock, os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.name in self.images or not FOLLOWED.match(entry.name):
                    continue
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode):
                    self.images[entry.name] = _Image(fd, st.st_ino,
                                                     hasher=self.digest.new(extents=True) if self.digest.keyed else None)
                else:
                    os.close(fd)

    def _read(self, img: _Image, buf: bytearray) -> bool:
        """Read ``img`` from where it was left to its present end; whether anything was read."""
        if img.broken:
            return False
        size = os.fstat(img.fd).st_size
        if size < img.offset:
            img.broken = True
            return False
        start = img.offset
        view = memoryview(buf)
        while img.offset < size and not self._abandoned.is_set():
            n = os.preadv(img.fd, [view[:min(CHUNK, size - img.offset)]], img.offset)
            if n == 0:
                break
            if img.hasher is not None:
                img.hasher.update(view[:n])
            else:
                img.crc = crc32(view[:n], img.crc)
            img.offset += n
        return img.offset > start

    def _read_rest(self) -> None:
        """criu has exited: read every image from where the reader left it to its end (mapped: the
        files are final), in pieces spread over the CPUs, and combine their CRC-32s into each one's."""
        pieces: list[tuple[_Image, int, int]] = []
        for img in self.images.values():
            size = os.fstat(img.fd).st_size
            if size < img.offset:
                img.broken = True
            elif not img.broken and size > img.offset and isinstance(img.hasher, ExtentMacs):
                aligned = min(size, -(-img.offset // EXTENT) * EXTENT)  # its short extent first, then whole ones
                digest_mapped(img.hasher, img.fd, img.offset, aligned)
                if aligned < size:
                    img.hasher.extend(table_of_fd(img.hasher.key, img.fd, aligned, size, self.cpus))
                self.tail_bytes += size - img.offset
                img.offset = size
            elif not img.broken and size > img.offset:
                count = max(1, min(self.cpus, (size - img.offset) // MIN_PIECE))
                cuts = [img.offset + (size - img.offset) * i // count for i in range(count + 1)]
                pieces += [(img, a, b) for a, b in zip(cuts, cuts[1:])]
        workers = max(1, min(self.cpus, len(pieces)))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            crcs = list(pool.map(lambda p: crc32_mapped(p[0].fd, p[1], p[2]), pieces))
        for (img, a, b), crc in zip(pieces, crcs):  # in file order, each image's pieces in a row
            img.crc = crc32_combine(img.crc, crc, b - a)
            img.offset = b
            self.tail_bytes += b - a
