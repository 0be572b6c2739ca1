"""An epoch restored lazily with every page checked before criu gets it: revenant is criu's page
server.  A delta epoch's pages are read where its content recipes say they are
(agent/storage/contents.py: a newer epoch's plain image or a pack), each checked against the
epoch's own digest of that page; a signed plain epoch's are read from its page images, each 64
KiB extent checked against its MAC (agent/storage/imagekeys.py ExtentMacs), from a table read
and checked once at the start: before the job runs, nothing of the page images is read but
what criu restore reads itself.

criu restores a job's lazy pages (private anonymous memory, PE_LAZY in its pagemap) from a
``criu lazy-pages`` daemon; given ``--page-server --ps-socket FD`` the daemon asks for them on
that socket instead of reading its ``pages-<id>.img``, in criu's page-server protocol
(criu/page-xfer.c): a 32-byte ``page_server_iov`` (cmd, nr_pages, vaddr, dst_id: the task's
pagemap id) with PS_IOV_GET, answered by the same header (PS_IOV_ADD_F, PE_PRESENT; as many
pages or fewer) and the pages; PS_IOV_CLOSE or PS_IOV_FORCE_CLOSE is answered by a 32-bit 0.
The socket is one end of a socketpair the agent hands the daemon: nothing else can ask.

What criu restore reads itself (pages not PE_LAZY: stacks, file-backed private pages, shared
memory) is written before it starts into sparse ``pages-<id>.img`` files of the images'
full size in a scratch directory, next to hardlinks of the epoch's other images; the pages
it serves are never written anywhere.  An epoch with a pre-dump (pages in its parent) is
rebuilt instead (:func:`servable`).
"""

from __future__ import annotations

import bisect
import os
import re
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

from revenant.agent.pipeline import criuproto
from revenant.agent.storage import chain, contents
from revenant.agent.storage.epochs import PREDUMP_DIR, CorruptEpoch, JobFiles, Manifest
from revenant.agent.storage.imagekeys import EXTENT, EXTENT_MAC, KEYED, MACS_SUFFIX, by_extent, extent_table, table_digest
from revenant.agent.storage.packfile import DIGEST, PAGE, page_hash
from revenant.agent.storage.packs import link_plain
from revenant.agent.storage.private import PRIVATE_FILE

HEADER = struct.Struct("=I4xQQQ")  # struct page_server_iov: u32 cmd, (pad), u64 nr_pages, vaddr, dst_id
PS_IOV_ADD_F, PS_IOV_GET, PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE = 6, 7, 0x1023, 0x1024
PS_CMD_BITS = 16
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4
ANSWER = PS_IOV_ADD_F | PE_PRESENT << PS_CMD_BITS
_PAGEMAP_RE = re.compile(r"^pagemap-(shmem-)?([0-9]+)\.img$")


def servable(m: Manifest) -> bool:
    """Whether delta epoch ``m`` can be served lazily: every pages image a content recipe, and
    no pre-dump (whose pages criu reads from the parent images itself)."""
    return bool(m.recipes) and all(e.recipe.endswith(contents.DIGESTS_SUFFIX) for e in m.recipes.values()) and \
        not any(n.startswith(f"{PREDUMP_DIR}/") for n in (*m.files, *m.recipes))


@dataclass
class Extent:
    vaddr: int
    pages: int
    flags: int
    first: int  # its first page's number in the pages image (present pages only are stored)


def read_pagemap(path: Path) -> tuple[int, list[Extent]]:
    """(pages id, extents) of a criu pagemap image (images/pagemap.proto); CorruptEpoch if malformed."""
    try:
        items = criuproto.entries(path.read_bytes())
        head = dict(criuproto.fields(next(items)))
        pages_id, extents, at = int(head[1]), [], 0
        for entry in items:
            f = dict(criuproto.fields(entry))
            flags = f.get(4, PE_PARENT if f.get(3) else PE_PRESENT)
            n = int(f.get(5, f[2]))
            extents.append(Extent(int(f[1]), n, int(flags), at))
            if flags & PE_PRESENT:
                at += n
    except (OSError, StopIteration, KeyError, IndexError, ValueError) as exc:
        raise CorruptEpoch(f"{path.name} cannot be read: {exc!r}") from None
    return pages_id, extents


class ImagePages:
    """One pages image of a delta epoch, read by page number through its resolved recipe, each
    page checked against the epoch's digest of it."""

    def __init__(self, files: JobFiles, m: Manifest, name: str, reader: chain.PageReader, cache: dict) -> None:
        self.what = f"epoch {m.epoch}: {name}"
        self.size = m.recipes[name].size
        self.digests, recipe = chain.content_recipe(files, m, name, cache)
        self.runs = list(chain.runs_of(recipe))
        self.starts, at = [], 0
        for ref, _, count in self.runs:
            self.starts.append(at)
            at += count
            reader.open(ref)  # every file now: retention may delete it while the job runs
        self.reader = reader

    def read(self, page: int, count: int) -> bytes:
        """Pages ``page``.. (``count``, or fewer: never none), each checked; CorruptEpoch names it."""
        k = bisect.bisect_right(self.starts, page) - 1
        if k < 0 or page >= self.starts[k] + self.runs[k][2] or count < 1:
            raise CorruptEpoch(f"{self.what} has no page {page}")
        ref, first, n = self.runs[k]
        at = first + page - self.starts[k]
        data = self.reader.read(ref, at, min(count, n - (page - self.starts[k])))
        view = memoryview(data)
        for i in range(len(data) // PAGE):
            p = page + i
            if page_hash(view[i * PAGE:(i + 1) * PAGE]) != self.digests[p * DIGEST:(p + 1) * DIGEST]:
                where = "image" if ref.startswith("@") else "pack"
                raise CorruptEpoch(f"{self.what}: page {p} (page {at + i} of {where} {ref}) does not match its digest")
        return data


def plain_servable(m: Manifest) -> bool:
    """Whether plain epoch ``m`` is served by revenant: signed, its page images digested by extent,
    and no pre-dump (whose pages criu reads from the parent images itself)."""
    return not m.recipes and m.checksum == KEYED and any(by_extent(m.files, n) for n in m.files) and \
        not any(n.startswith(f"{PREDUMP_DIR}/") for n in m.files)


class PlainPages:
    """One page image of a signed plain epoch, read by page number, each extent read checked
    against its MAC first (and what is served is what was checked: never read again)."""

    def __init__(self, files: JobFiles, m: Manifest, name: str) -> None:
        self.what = f"epoch {m.epoch}: {name}"
        self.size = m.files[name].size
        assert files.keys is not None
        self.key, table_key = files.keys.extent_keys(m.key_id)
        d = files.epoch_dir(m.epoch)
        self.table = (d / f"{name}{MACS_SUFFIX}").read_bytes()
        if table_digest(table_key, self.table) != m.files[name].checksum or \
                len(self.table) != -(-self.size // EXTENT) * EXTENT_MAC:
            raise CorruptEpoch(f"{self.what}: its table of MACs does not match the image's digest")
        self.fd = os.open(d / name, os.O_RDONLY | os.O_CLOEXEC)

    def read(self, page: int, count: int) -> bytes:
        """Pages ``page``.. (``count``, or fewer: never none), their extents checked; CorruptEpoch names it."""
        start, end = page * PAGE, min(self.size, (page + max(count, 1)) * PAGE)
        if start >= self.size or count < 1:
            raise CorruptEpoch(f"{self.what} has no page {page}")
        first, last = start // EXTENT, -(-end // EXTENT)
        data = os.pread(self.fd, min(self.size, last * EXTENT) - first * EXTENT, first * EXTENT)
        if extent_table(self.key, data) != self.table[first * EXTENT_MAC:last * EXTENT_MAC]:
            bad = next(i for i in range(first, last) if extent_table(self.key, data[(i - first) * EXTENT:(i - first + 1)
                       * EXTENT]) != self.table[i * EXTENT_MAC:(i + 1) * EXTENT_MAC])
            raise CorruptEpoch(f"{self.what}: bytes {bad * EXTENT}..{(bad + 1) * EXTENT} (page {bad * EXTENT // PAGE} "
                               "on) fail their MAC")
        return data[start - first * EXTENT:end - first * EXTENT]

    def close(self) -> None:
        os.close(self.fd)


class _Closing:
    """A plain epoch's images, closed as a delta's reader is."""

    def __init__(self, images: dict[str, PlainPages]) -> None:
        self.images = images

    def close(self) -> None:
        for pages in self.images.values():
            pages.close()


@dataclass
class _Task:
    extents: list[Extent]  # by vaddr, as the pagemap lists them
    pages: ImagePages | PlainPages


@dataclass
class DeltaServer:
    """criu's page server for one lazy restore of a delta epoch, on a thread of its own."""

    what: str
    tasks: dict[int, _Task]
    reader: chain.PageReader | _Closing
    served: int = 0  # bytes
    error: str = ""
    corrupt: bool = False
    _done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name=f"pages {self.what}", daemon=True)
        self._thread.start()

    def handed_over(self) -> None:
        """The daemon holds its end now: ours alone is left here."""
        self.theirs.close()

    def close(self) -> None:
        """Stop serving (the daemon's next request fails): on abort, or if it never started."""
        if self._thread is None:  # nothing to stop: its files closed here
            self.reader.close()
            self._ours.close()
            self._done.set()
        else:
            try:
                self._ours.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.theirs.close()

    def outcome(self, stop: threading.Event | None = None) -> tuple[str, bool]:
        """(why serving failed, "" if it did not; whether the epoch's data is at fault), once the
        daemon hung up or a page failed; ("", False) at once if ``stop`` is set first."""
        while not self._done.wait(0.05):
            if stop is not None and stop.is_set():
                return "", False
        return self.error, self.corrupt

    def _serve(self) -> None:
        sock = self._ours
        try:
            while len(head := sock.recv(HEADER.size, socket.MSG_WAITALL)) == HEADER.size:
                cmd, nr, vaddr, dst = HEADER.unpack(head)
                if cmd & 0xFFFF in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                    sock.sendall(struct.pack("=i", 0))
                    break
                if cmd != PS_IOV_GET:
                    raise ValueError(f"criu lazy-pages sent page-server command {cmd:#x}, not a request for pages")
                data = self._pages(dst, vaddr, nr)
                sock.sendall(HEADER.pack(ANSWER, len(data) // PAGE, vaddr, dst))
                sock.sendall(data)
                self.served += len(data)
        except CorruptEpoch as exc:
            self.error, self.corrupt = str(exc), True
        except OSError as exc:
            self.error = f"{self.what}: serving its pages failed: {exc.strerror or exc}"
        except Exception as exc:  # a bug or a protocol surprise: the restore fails, the agent does not
            self.error = f"{self.what}: serving its pages failed: {exc}"
        finally:
            self.reader.close()
            sock.close()
            self._done.set()

    def _pages(self, pid: int, vaddr: int, nr: int) -> bytes:
        task = self.tasks.get(pid)
        k = bisect.bisect_right(task.extents, vaddr, key=lambda e: e.vaddr) - 1 if task is not None else -1
        e = task.extents[k] if k >= 0 else None
        if e is None or not e.flags & PE_PRESENT or vaddr >= e.vaddr + e.pages * PAGE or vaddr % PAGE:
            raise ValueError(f"criu lazy-pages asked for page {vaddr:#x} of pid {pid}, which the epoch does not hold")
        off = (vaddr - e.vaddr) // PAGE
        return task.pages.read(e.first + off, min(nr, e.pages - off))


def prepare(files: JobFiles, m: Manifest, dest: Path) -> DeltaServer | None:
    """Scratch images (``dest``) criu restores delta epoch ``m``, or a plain one that
    :func:`plain_servable`, lazily from, and the server of its lazy pages (not started); None where
    criu would read pages from a parent (rebuild it instead), with nothing made.  CorruptEpoch: a
    page criu reads itself, or the recipes or tables of MACs, named."""
    src = files.epoch_dir(m.epoch)
    maps = {name: read_pagemap(src / name) for name in sorted(m.files) if _PAGEMAP_RE.match(name)}
    served = set(m.recipes) or {n for n in m.files if by_extent(m.files, n)}
    if any(e.flags & PE_PARENT for _, extents in maps.values() for e in extents) or \
            {f"pages-{pages_id}.img" for pages_id, _ in maps.values()} != served:
        return None
    link_plain(files, m, dest, leave=served)
    plain: dict[str, PlainPages] = {}
    reader: chain.PageReader | _Closing = chain.PageReader(files) if m.recipes else _Closing(plain)
    cache: dict = {}
    try:
        if m.recipes:
            images = {name: ImagePages(files, m, name, reader, cache) for name in m.recipes}
        else:
            for name in sorted(served):
                plain[name] = PlainPages(files, m, name)
            images = plain
        tasks: dict[int, _Task] = {}
        outs: dict[str, int] = {}
        try:
            for name, (pages_id, extents) in maps.items():
                shared = bool(_PAGEMAP_RE.match(name).group(1))  # type: ignore[union-attr]
                pages = images[image := f"pages-{pages_id}.img"]
                if image not in outs:
                    outs[image] = os.open(dest / image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                          PRIVATE_FILE)
                    os.ftruncate(outs[image], pages.size)
                for e in extents:  # what criu restore reads itself: all of shared memory's
                    if e.flags & PE_PRESENT and (shared or not e.flags & PE_LAZY):
                        _copy(pages, e, outs[image])
                if not shared:
                    tasks[int(_PAGEMAP_RE.match(name).group(2))] = _Task(extents, pages)  # type: ignore[union-attr]
        finally:
            for fd in outs.values():
                os.close(fd)
    except BaseException:
        reader.close()
        raise
    return DeltaServer(f"epoch {m.epoch}", tasks, reader)


def _copy(pages: ImagePages, e: Extent, fd: int) -> None:
    page, end = e.first, e.first + e.pages
    while page < end:
        data = pages.read(page, end - page)
        os.pwrite(fd, data, page * PAGE)
        page += len(data) // PAGE
