"""Reverse-incremental epochs: an epoch superseded by a newer one becomes a delta against it.

Layout, per job, next to ``epochs/`` (agent/storage/epochs.py)::

    epochs/<N>/                  the newest epoch: plain criu images (restores at full speed),
                                 with each image's digest list once a conversion took it
    epochs/<N>/pages-<id>.img.digests   an older one: its pages-*.img replaced by their digest
                                 lists (content recipes, agent/storage/contents.py)
    packs/<seg>/<N>-<rnd>.pack   the 4 KiB pages of epoch N that, when it was converted, no newer
                                 plain image and no pack of its segment held
    packs/<seg>/<N>-<rnd>.idx    their digests (formats: agent/storage/chain.py, packfile.py)

(Epochs converted before content recipes keep their ``.recipe`` files: runs over the packs,
read as before.)  :func:`convert` takes epoch N's digest lists (hashing its images if it has
none, only if they match their manifest), and those of the newer plain epochs of N's segment
(``(N-1) // full_every``) that lack one; the pages of N that none of those images and none of
the segment's packs hold go into one new pack.  An epoch reads only its own segment's images
and packs, so a corrupt page takes at most ``full_every`` epochs with it (a page of the newest
image takes every older epoch of its segment that has that page).  The order makes every crash
harmless: the digest lists written (each whole, renamed into place); the pack and its index
written, fsynced and renamed; the epoch rebuilt from its places and checked against its
original digests (a damaged pack or image never turns a good epoch into a bad one: the epoch
then stays plain); the new manifest written to a temporary name, fsynced and renamed over the
old one (the commit point); then the plain images unlinked, once every page an older epoch
read from them is in a newer image or a pack.  :func:`gc` removes what a crash or a prune left.

Blocking file I/O, run after the job resumed and the checkpoint replied; callers serialise
conversion, prune and gc of one job.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Collection, Protocol

import msgspec

from revenant.agent.storage import contents
from revenant.agent.storage.chain import (BATCH, RECIPE_SUFFIX, Recipe, check_trusted, converted, is_manifest_tmp,
                                          manifest_tmp, page_hash, read_recipe, rebuild, stream)
from revenant.agent.storage.packfile import (DIGEST, PAGE, FramedPack, idx_bytes, pack_path, read_idx,
                                             write_private)
from revenant.agent.storage.epochs import MANIFEST, CorruptEpoch, FileEntry, JobFiles, Manifest, RecipeEntry, link_predump
from revenant.agent.storage.fileio import fsync_path
from revenant.agent.storage import imagekeys
from revenant.agent.storage.imagekeys import Digest, Hasher
from revenant.agent.storage.manifest import EpochStore
from revenant.agent.storage.packusage import readable_manifests, usage, usage_detail
from revenant.agent.storage.private import PRIVATE_FILE, private_dir

log = logging.getLogger(__name__)

__all__ = ["STEPS", "ConvertResult", "convert", "converted", "gc", "materialize", "segment_of", "usage", "usage_detail"]

# The points of a conversion a crash test stops at (convert's on_step), in order.
STEPS = ("digests", "pack", "packed", "recipes", "manifest", "committed", "unlinking")
_SEG_RE = re.compile(r"^[0-9]{1,9}$")
_EPOCH_OF = re.compile(r"^[0-9]{1,9}-")


@dataclass(frozen=True)
class ConvertResult:
    epoch: int
    # False: already converted, no pages to convert, or refused (note says why); the epoch stays as it was.
    converted: bool
    added_bytes: int  # the new pack, its index and the recipes
    own_bytes: int  # what only this epoch holds, after the conversion (usage())
    storage_bytes: int  # the job's whole storage, after the conversion (usage())
    pages: int = 0
    new_pages: int = 0
    seconds: float = 0.0
    note: str = ""


def is_pages(name: str) -> bool:
    """Whether an epoch's file is criu's page data (``pages-<id>.img``)."""
    return bool(contents.PAGES_RE.match(name))


def segment_of(n: int, full_every: int) -> int:
    return (n - 1) // max(1, full_every)


def index_of(files: EpochStore, refs: list[str]) -> tuple[list[str], dict[bytes, int]]:
    """Packs ``refs`` that can be read, in that order, and their pages by digest (as ``pack
    number << 32 | page``; a page two packs hold, by the first)."""
    packs: list[str] = []
    index: dict[bytes, int] = {}
    for ref in refs:
        try:
            digests = read_idx(files, ref)
        except CorruptEpoch as exc:
            log.warning("job %s: pack %s not used for deduplication: %s", files.job, ref, exc)
            continue
        base = len(packs) << 32
        packs.append(ref)
        for page in range(len(digests) // DIGEST):
            index.setdefault(digests[page * DIGEST:(page + 1) * DIGEST], base | page)
    return packs, index


def _fill(f: Readable, view: memoryview) -> int:
    got = 0
    while got < len(view) and (k := f.readinto(view[got:])):
        got += k
    return got


class Readable(Protocol):
    def readinto(self, buf: memoryview, /) -> int | None: ...


def cut(f: Readable, index: dict[bytes, int], new_no: int, digests: bytearray,
        pack: BinaryIO | FramedPack, hasher: Hasher | None = None) -> tuple[list[int], int, int]:
    """Hash every page read from ``f`` (to its end): pages ``index`` lacks are appended to ``pack``
    (pack number ``new_no``), their digests to ``digests``, and they go into ``index``.  (runs
    of (pack number, first page, count), size, CRC-32); with ``hasher``, it is fed every byte
    instead, and the CRC-32 returned is 0."""
    runs: list[int] = []
    size = crc = 0
    nxt = -1  # where the current run continues
    get, base = index.get, new_no << 32
    buf = bytearray(BATCH * PAGE)
    view = memoryview(buf)
    while got := _fill(f, view):
        if hasher is not None:  # the caller's digest instead of the CRC-32
            hasher.update(view[:got])
        else:
            crc = zlib.crc32(view[:got], crc)
        size += got
        chunk = view[:got] if got % PAGE == 0 else memoryview(bytes(view[:got]) + bytes(PAGE - got % PAGE))
        out = bytearray()
        for off in range(0, len(chunk), PAGE):
            page = chunk[off:off + PAGE]
            d = page_hash(page)
            loc = get(d)
            if loc is None:  # a page no pack holds yet
                loc = index[d] = base | len(digests) // DIGEST
                digests += d
                out += page
            if loc == nxt:
                runs[-1] += 1
            else:
                runs += (loc >> 32, loc & 0xFFFFFFFF, 1)
            nxt = loc + 1
        pack.write(out)
        if got < len(buf):
            break
    return runs, size, crc


def pack_dir(files: EpochStore, seg: int) -> Path:
    """packs/<seg>/, private (agent/storage/private.py); a new directory's entry durable before a pack in it is."""
    d = files.packs_dir / str(seg)
    for directory in (files.packs_dir, d):
        fresh = not directory.exists()
        private_dir(directory)
        if fresh:
            fsync_path(directory.parent, directory=True)
    return d


def convert(files: JobFiles, n: int, full_every: int, on_step: Callable[[str], None] | None = None,
            codec: str = "", account: bool = True) -> ConvertResult:
    """Store epoch ``n``'s pages-*.img as content recipes (agent/storage/contents.py): their digest
    lists, and the pages no place of their segment holds in one new pack, compressed with
    ``codec`` (packfile.CODECS; "": not).  See the module's docstring for the order; ``on_step``
    is called at each of STEPS (crash tests).  Not ``account``: the result's storage and own
    bytes are left 0, for a caller that takes the job's usage once after its conversions."""
    started = time.monotonic()
    step = on_step or (lambda _: None)
    try:
        m = files.read_manifest(n)
    except CorruptEpoch as exc:
        return _result(files, n, False, 0, started, account, note=str(exc))
    images = sorted(name for name in m.files if is_pages(name))
    if converted(m) or not images or m.checksum not in ("crc32", imagekeys.KEYED) or m.encryption:
        why = ("already converted" if converted(m) else "no pages to convert" if not images
               else "encrypted: kept whole" if m.encryption else "not CRC-32")
        return _result(files, n, False, 0, started, account, note=why)
    seg = segment_of(n, full_every)
    try:
        digest = files.digest_of(m)
        lists = {name: contents.image_digests(files, n, m, name, seg, digest) for name in images}
        manifests, _ = readable_manifests(files)
        committed = files.committed()
        for k in (k for k in committed if k > n and segment_of(k, full_every) == seg):  # newer plain ones: places
            if (mk := manifests.get(k)) is not None and not converted(mk) and not mk.encryption:
                for image in (name for name in mk.files if is_pages(name)):
                    like = (files.epoch_dir(n) / image, lists[image]) if lists.get(image) else None
                    contents.image_digests(files, k, mk, image, seg, files.digest_of(mk), like)
    except CorruptEpoch as exc:
        return _result(files, n, False, 0, started, account, note=str(exc))
    if bad := [name for name, pages in lists.items() if pages is None]:
        return _result(files, n, False, 0, started, account, note=f"epoch {n}: {bad[0]} fails its checksum")
    step("digests")
    places = contents.Places(files, seg, contents.plain_places(files, n, committed))
    d = pack_dir(files, seg)
    stem = f"{n}-{secrets.token_hex(4)}"
    ref = f"{seg}/{stem}"
    tmp_pack, tmp_idx = d / f".tmp-{stem}.pack", d / f".tmp-{stem}.idx"
    try:
        new = _pack_missing(files, n, lists, places, ref, tmp_pack, tmp_idx, codec)
        if isinstance(new, str):
            return _result(files, n, False, 0, started, account, note=new)
        if new:
            step("pack")
            os.rename(tmp_idx, pack_path(files, ref, ".idx"))
            os.rename(tmp_pack, pack_path(files, ref))
            fsync_path(d, directory=True)
            step("packed")
    finally:
        for leftover in (tmp_pack, tmp_idx):
            leftover.unlink(missing_ok=True)
    new_bytes = sum(os.stat(pack_path(files, ref, s)).st_size for s in (".pack", ".idx")) if new else 0
    try:
        converted_m = _content_manifest(files, m, seg, lists, places, digest)
    except CorruptEpoch as exc:  # a place that does not hold what its digests say: the epoch stays plain
        for suffix in (".pack", ".idx"):
            pack_path(files, ref, suffix).unlink(missing_ok=True)
        log.warning("job %s: epoch %d stays plain: %s", files.job, n, exc)
        return _result(files, n, False, 0, started, account, note=str(exc))
    added = _commit(files, n, converted_m, images, step) + new_bytes
    return _result(files, n, True, added, started, account, pages=sum(len(p) // DIGEST for p in lists.values()),
                   new_pages=new)


def _pack_missing(files: JobFiles, n: int, lists: dict[str, bytes], places: contents.Places, ref: str,
                  tmp_pack: Path, tmp_idx: Path, codec: str) -> int | str:
    """Write the pages of epoch ``n`` that no place holds into ``tmp_pack`` (and its index), each
    checked against its digest; they become place ``ref`` in ``places``.  How many pages, or why not."""
    digests = bytearray()
    no = places.add(ref, b"")
    with open(os.open(tmp_pack, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE), "wb") as raw:
        pack = FramedPack(raw, codec) if codec else raw
        for name, pages in lists.items():
            with open(files.epoch_dir(n) / name, "rb", buffering=0) as image:
                for i in range(0, len(pages), DIGEST):
                    d = pages[i:i + DIGEST]
                    if d in places.index:
                        continue
                    page = os.pread(image.fileno(), PAGE, i // DIGEST * PAGE)
                    page += bytes(PAGE - len(page))
                    if page_hash(page) != d:
                        return f"epoch {n}: page {i // DIGEST} of {name} does not match its digest list"
                    places.index[d] = no << 32 | len(digests) // DIGEST
                    digests += d
                    pack.write(page)
        if isinstance(pack, FramedPack):
            pack.finish()
        raw.flush()
        os.fsync(raw.fileno())
    if digests:
        write_private(tmp_idx, idx_bytes(digests, codec, pack.offsets if isinstance(pack, FramedPack) else ()))
    return len(digests) // DIGEST


def _content_manifest(files: JobFiles, m: Manifest, seg: int, lists: dict[str, bytes], places: contents.Places,
                      digest: Digest) -> Manifest:
    """Epoch ``m`` as content recipes, each image rebuilt from its places and checked against its
    digest first (CorruptEpoch if one is not), listing the packs it reads now (for gc)."""
    recipes: dict[str, RecipeEntry] = {}
    files_now = {k: v for k, v in m.files.items() if k not in lists}
    used: set[str] = set()
    for name, pages in lists.items():
        entry = m.files[name]
        refs, runs = contents.resolve_runs(pages, places, f"epoch {m.epoch}: {name}")
        stream(files, Recipe(packs=refs, runs=runs), entry.size, entry.checksum, f"epoch {m.epoch}: {name}",
               None, digest, imagekeys.by_extent(m.files, name))
        used.update(r for r in refs if not r.startswith("@"))
        recipes[name] = RecipeEntry(size=entry.size, checksum=entry.checksum, recipe=contents.digests_name(name))
        listed = files.epoch_dir(m.epoch) / contents.digests_name(name)
        hasher = digest.new()
        hasher.update(listed.read_bytes())
        files_now[contents.digests_name(name)] = FileEntry(size=listed.stat().st_size, checksum=hasher.hexdigest())
    return msgspec.structs.replace(m, files=files_now, recipes=recipes, packs=sorted(used), segment=seg)


def _commit(files: JobFiles, n: int, new: Manifest, images: list[str], step: Callable[[str], None]) -> int:
    """The digest lists made durable, then the new manifest over the old one, then the plain
    images go; the digest lists' bytes."""
    d = files.epoch_dir(n)
    fsync_path(d, directory=True)
    step("recipes")
    tmp = manifest_tmp(d)
    write_private(tmp, files.manifest_bytes(new))  # signed, where the epoch was
    step("manifest")
    os.rename(tmp, d / MANIFEST)  # the commit point
    fsync_path(d, directory=True)
    step("committed")
    for name in images:
        (d / name).unlink(missing_ok=True)
        step("unlinking")
    fsync_path(d, directory=True)
    return sum(new.files[contents.digests_name(name)].size for name in images)


def _result(files: JobFiles, n: int, done: bool, added: int, started: float, account: bool = True,
            **kw) -> ConvertResult:
    seconds = time.monotonic() - started  # the conversion's own, not the accounting's after it
    storage, own = usage(files) if account else (0, {})
    return ConvertResult(epoch=n, converted=done, added_bytes=added, own_bytes=own.get(n, 0), storage_bytes=storage,
                         seconds=seconds, **kw)


# ------------------------------------------------------------------ restore


def materialize(files: JobFiles, m: Manifest, dest: Path) -> None:
    """Rebuild converted epoch ``m`` as plain images in ``dest`` (a private directory on the same
    storage, e.g. ``files.new_tmp(node)``): its other files hardlinked, every image streamed from
    the packs with its size and CRC-32 checked (CorruptEpoch names the pack and page at fault).
    A plain epoch (``not converted(m)``) needs none of this: restore from ``files.epoch_dir(n)``."""
    link_plain(files, m, dest)
    for name in m.recipes:
        fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, PRIVATE_FILE)
        with open(fd, "wb", buffering=BATCH * PAGE) as out:
            rebuild(files, m, name, out)


def link_plain(files: JobFiles, m: Manifest, dest: Path, leave: Collection[str] = ()) -> None:
    """Converted epoch ``m``'s files other than its recipes (and ``leave``), in ``dest`` (made
    private): hardlinked, or copied where the storage cannot link; its pre-dump's ``parent`` link
    made again."""
    src = files.epoch_dir(m.epoch)
    check_trusted(files, m)
    private_dir(dest)
    skip = {r.recipe for r in m.recipes.values()} | set(leave)
    for name in m.files:
        if name in skip:
            continue
        target = dest / name
        if target.parent != dest and not target.parent.exists():
            private_dir(target.parent)
        try:
            os.link(src / name, target)
        except OSError:  # another filesystem, or no hardlinks there: a copy
            shutil.copyfile(src / name, target)
            os.chmod(target, PRIVATE_FILE)
    link_predump(dest, m.files)  # a pre-dumped epoch's pages in parent/ (agent/checkpointing/predump.py)


# ------------------------------------------------------------------ collection, accounting


def _unlink(path: Path) -> int:
    try:
        size = os.lstat(path).st_size
        path.unlink()
        return size
    except FileNotFoundError:
        return 0


def gc(files: JobFiles) -> int:
    """Delete the packs no committed epoch's manifest lists nor its content recipes read (none at
    all while a manifest is unreadable or a content recipe unresolved), recipes and plain images an epoch's manifest does not list, and what an
    interrupted conversion left; returns the bytes freed.  Callers hold the job's lock (no
    conversion is under way, on any node: agent/checkpointing/policy.py).  A checkpoint does not take that
    lock: the pack it writes its working directory's pages into (agent/files/workdir_packs.py) is
    named for an epoch newer than any committed, and such a pack is never deleted here (one a
    failed checkpoint left goes once an epoch of that number or newer commits)."""
    manifests, complete = readable_manifests(files)
    freed = 0
    for n, m in manifests.items():
        d = files.epoch_dir(n)
        with os.scandir(d) as entries:
            doomed = [e.name for e in entries if e.name not in m.files and e.is_file(follow_symlinks=False) and (
                is_pages(e.name) or e.name.endswith(RECIPE_SUFFIX) or is_manifest_tmp(e.name)
                or contents.is_digests_tmp(e.name))]
        freed += sum(_unlink(d / name) for name in doomed)
    referenced = {ref for m in manifests.values() for ref in (*m.packs, *m.workdir_packs)}
    cache: dict = {}
    for m in manifests.values():  # what content recipes read now (agent/storage/contents.py)
        for name, entry in m.recipes.items():
            if entry.recipe.endswith(contents.DIGESTS_SUFFIX):
                try:
                    referenced.update(read_recipe(files, m, name, cache).packs)
                except (CorruptEpoch, OSError):
                    complete = False  # what it would read is not known: no pack goes
    newest = max(manifests, default=0)
    if not files.packs_dir.is_dir():
        return freed
    with os.scandir(files.packs_dir) as entries:
        segments = [e.path for e in entries if _SEG_RE.match(e.name) and e.is_dir(follow_symlinks=False)]
    for seg in map(Path, segments):
        with os.scandir(seg) as entries:
            names = [e.name for e in entries]
        for name in names:
            stem, _, suffix = name.rpartition(".")
            if (name.startswith(".tmp-") or (complete and suffix in ("pack", "idx") and _EPOCH_OF.match(stem)
                                              and int(stem.split("-")[0]) <= newest
                                              and f"{seg.name}/{stem}" not in referenced)):
                freed += _unlink(seg / name)
        try:
            os.rmdir(seg)  # only if empty
        except OSError:
            pass
    return freed
