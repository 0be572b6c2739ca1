"""Content recipes: an older epoch's images as the digests of their pages, each page found, when
the image is read, wherever a page with that digest is now (agent/storage/packs.py converts).

An incremental job's newest epoch is plain criu images.  When a newer one commits, the one it
superseded keeps only a **digest list** per image (``pages-<id>.img.digests``: the SHA-256/128 of
each 4 KiB page, in order, with the segment it belongs to and a CRC-32), and the pages that no
*place* of its segment holds go into one new pack.  The places of epoch N, in the order a digest
is looked for:

1. the plain images of N's segment's epochs **newer than N** that have a digest list for the
   segment (the newest first): above all the newest epoch, which holds almost every page of the
   one before it;
2. the segment's packs (``packs/<seg>/*.pack``, the oldest first).

So the kept epochs cost one full image plus what each changed, and an image cut by criu at other
offsets (a mapping that grew) finds its pages all the same.  When the newest is superseded in
turn, its pages that the next one lacks go into its pack, so every page an older epoch resolved
into its images is still somewhere: the invariant is that each digest of each kept epoch is
found in a place.  Resolution looks only at newer epochs, so deleting the oldest epoch never
takes a page another kept epoch needs (retention, agent/storage/epochs.py, keeps a plain epoch an
older kept one reads from), and gc keeps every pack a kept epoch's resolution reads.

Digest lists and pack indexes are caches of their pages' digests: a plain image gets its list
only once its whole digest matches its manifest, and an uncompressed pack whose index is damaged
is hashed again.  A rebuilt image is checked against the manifest's digest as before
(agent/storage/chain.py ``stream``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import struct
import zlib
from pathlib import Path

from revenant.agent.storage.imagekeys import PLAIN, Digest, by_extent
from revenant.agent.storage.manifest import CorruptEpoch, EpochStore, Manifest
from revenant.agent.storage.packfile import DIGEST, PAGE, is_compressed, image_ref, pack_path, page_hash, read_idx
from revenant.agent.storage.private import write_atomic

DIGESTS_SUFFIX = ".digests"
_MAGIC = b"rvndig1\0"
_HEAD = struct.Struct(">8sI")  # magic, segment
_CRC = struct.Struct(">I")
PAGES_RE = re.compile(r"^pages-[0-9]+\.img$")
_PACK_RE = re.compile(r"^([0-9]{1,9})-[0-9a-f]{8}\.pack$")
_READ = 2048 * PAGE
_HASHERS = 2  # threads hashing pages (hashlib lets go of the GIL for a page)


def digests_name(image: str) -> str:
    return f"{image}{DIGESTS_SUFFIX}"


def digests_path(files: EpochStore, ref: str) -> Path:
    """The digest list of the image "@<N>/<image>" names."""
    image = pack_path(files, ref)
    return image.with_name(digests_name(image.name))


def digests_bytes(seg: int, digests: bytes | bytearray) -> bytes:
    body = _HEAD.pack(_MAGIC, seg) + bytes(digests)
    return body + _CRC.pack(zlib.crc32(body))


def read_digests(path: Path, what: str) -> tuple[int, bytes]:
    """(segment, page digests) of a digest list (CorruptEpoch, about ``what``, if damaged or missing)."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CorruptEpoch(f"{what} is unreadable: {exc.strerror}") from None
    body, tail = data[:-_CRC.size], data[-_CRC.size:]
    if (len(data) < _HEAD.size + _CRC.size or _CRC.pack(zlib.crc32(body)) != tail or not body.startswith(_MAGIC)
            or (len(body) - _HEAD.size) % DIGEST):
        raise CorruptEpoch(f"{what} fails its checksum")
    return _HEAD.unpack_from(body)[1], body[_HEAD.size:]


def write_digests(path: Path, seg: int, digests: bytes | bytearray) -> None:
    """A digest list at ``path``, whole or not at all."""
    write_atomic(path, digests_bytes(seg, digests))


def is_digests_tmp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp") and DIGESTS_SUFFIX in name


def hash_image(path: Path, digest: Digest, like: tuple[Path, bytes] | None = None,
               extents: bool = False) -> tuple[bytes, int, str]:
    """(page digests, size, ``digest`` of the whole file) of an image, in one read (its last page
    padded with zeros, as a pack stores it).  ``like``: an older image of the job and its digest
    list: where a page is the same, byte for byte at the same offset, its digest is taken from
    the list instead of being computed (an epoch that changed 1 % of its pages is hashed 1 %)."""
    pages, hasher, size = bytearray(), digest.new(extents), 0
    known = memoryview(like[1]) if like is not None else memoryview(b"")
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(open(path, "rb", buffering=0))
        older = stack.enter_context(open(like[0], "rb", buffering=0)) if like is not None else None
        pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(_HASHERS))
        pending: list[concurrent.futures.Future[bytes]] = []
        while data := f.read(_READ):
            hasher.update(data)  # BLAKE3 or CRC-32, beside the pages' SHA-256s (both let go of the GIL)
            first = size // PAGE * DIGEST
            size += len(data)
            if len(data) % PAGE:
                data += bytes(PAGE - len(data) % PAGE)
            same = older.read(_READ) if older is not None else b""
            pending.append(pool.submit(_page_digests, data, same, known[first:]))
            while len(pending) > 2 * _HASHERS:  # a few chunks in memory at most
                pages += pending.pop(0).result()
        for done in pending:
            pages += done.result()
    return bytes(pages), size, hasher.hexdigest()


def _page_digests(data: bytes, same: bytes = b"", known: bytes | memoryview = b"") -> bytes:
    """The digests of ``data``'s pages; those equal to ``same``'s at their offset taken from
    ``known`` (``same``'s digests, from its first page)."""
    view = memoryview(data)
    if same[:len(data)] == data and len(known) >= len(data) // PAGE * DIGEST:
        return bytes(known[:len(data) // PAGE * DIGEST])
    out = bytearray()
    for at in range(0, len(data), PAGE):
        i = at // PAGE * DIGEST
        if same[at:at + PAGE] == data[at:at + PAGE] and len(known) >= i + DIGEST:
            out += known[i:i + DIGEST]
        else:
            out += page_hash(view[at:at + PAGE])
    return bytes(out)


def image_digests(files: EpochStore, n: int, m: Manifest, image: str, seg: int, digest: Digest,
                  like: tuple[Path, bytes] | None = None) -> bytes | None:
    """Plain epoch ``n``'s digest list of ``image`` for segment ``seg``: its file's, else taken now
    (``like``: see :func:`hash_image`) and written, but only from an image that matches its
    manifest (None: it does not; it is no place, and is not converted)."""
    path = files.epoch_dir(n) / digests_name(image)
    try:
        got_seg, pages = read_digests(path, "")
        if got_seg == seg:
            return pages
    except CorruptEpoch:
        pass
    try:
        pages, size, whole = hash_image(files.epoch_dir(n) / image, digest, like, by_extent(m.files, image))
    except OSError:
        return None
    entry = m.files.get(image)
    if entry is None or (size, whole) != (entry.size, entry.checksum):
        return None
    write_digests(path, seg, pages)
    return pages


class Places:
    """Where each page digest of segment ``seg`` is now, for an epoch of that segment older than
    the ``plain`` ones (:func:`plain_places`): see the module's docstring for the order.  ``index``: digest -> place number
    << 32 | page; ``refs``: each place's name ("@<N>/<image>" or "<seg>/<N>-<rnd>")."""

    def __init__(self, files: EpochStore, seg: int, plain: tuple[tuple[int, tuple[str, ...]], ...]) -> None:
        self.refs: list[str] = []
        self.index: dict[bytes, int] = {}
        for k, images in plain:
            for image in images:
                try:
                    got_seg, pages = read_digests(files.epoch_dir(k) / digests_name(image), "")
                except CorruptEpoch:
                    continue
                if got_seg == seg:
                    self.add(image_ref(k, image), pages)
        for ref in packs_of(files, seg):
            pages = _pack_digests(files, ref)
            if pages is not None:
                self.add(ref, pages)

    def add(self, ref: str, pages: bytes | bytearray) -> int:
        """A place, last; a digest an earlier place (or an earlier page) has stays found there."""
        no = len(self.refs)
        self.refs.append(ref)
        count, base = len(pages) // DIGEST, no << 32
        keys = [bytes(pages[i:i + DIGEST]) for i in range((count - 1) * DIGEST, -1, -DIGEST)]  # last first
        mine = dict(zip(keys, range(base + count - 1, base - 1, -1)))  # so the first page of a digest wins
        mine.update(self.index)
        self.index = mine
        return no


def plain_places(files: EpochStore, newer_than: int, committed: list[int]) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """The epochs newer than ``newer_than`` that have plain images with digest lists (the list was
    taken from the whole image: no manifest is needed), newest first, with those images."""
    out = []
    for k in sorted((k for k in committed if k > newer_than), reverse=True):
        try:
            names = sorted(os.listdir(files.epoch_dir(k)))
        except OSError:
            continue
        images = tuple(name for name in names if PAGES_RE.match(name) and digests_name(name) in names)
        if images:
            out.append((k, images))
    return tuple(out)


def packs_of(files: EpochStore, seg: int) -> list[str]:
    """The packs in segment ``seg``'s directory, oldest first (none being written: ``.tmp-``)."""
    try:
        names = os.listdir(files.packs_dir / str(seg))
    except OSError:
        return []
    found = [(int(m.group(1)), name[:-len(".pack")]) for name in names if (m := _PACK_RE.match(name))]
    return [f"{seg}/{stem}" for _, stem in sorted(found)]


def _pack_digests(files: EpochStore, ref: str) -> bytes | None:
    """Pack ``ref``'s page digests: its index's, or (an uncompressed pack whose index is damaged)
    its pages hashed again; None if neither can be had (no index yet: a pack being written)."""
    try:
        return read_idx(files, ref)
    except (CorruptEpoch, OSError):
        pass
    try:
        if not pack_path(files, ref, ".idx").exists() or is_compressed(files, ref):
            return None
    except (CorruptEpoch, OSError):
        return None
    try:
        return hash_image(pack_path(files, ref), PLAIN)[0]
    except OSError:
        return None


def resolve_runs(digests: bytes, places: Places, what: str) -> tuple[list[str], list[int]]:
    """The places and runs (place, first page, count) that rebuild the pages of ``digests``."""
    runs: list[int] = []
    nxt = -1
    index = places.index
    for i in range(0, len(digests), DIGEST):
        loc = index.get(digests[i:i + DIGEST])
        if loc is None:
            raise CorruptEpoch(f"{what}: page {i // DIGEST} is in no pack nor newer image of its segment")
        if loc == nxt:
            runs[-1] += 1
        else:
            runs += (loc >> 32, loc & 0xFFFFFFFF, 1)
        nxt = loc + 1
    used = sorted(set(runs[0::3]))
    renumber = {p: i for i, p in enumerate(used)}
    runs[0::3] = [renumber[p] for p in runs[0::3]]
    return [places.refs[p] for p in used], runs
