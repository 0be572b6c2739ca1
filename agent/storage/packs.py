"""Reverse-incremental epochs: an epoch superseded by a newer one becomes a delta.

Layout, per job, next to ``epochs/`` (agent/storage/epochs.py)::

    epochs/<N>/                  the newest epoch: plain criu images (restores at full speed);
                                 an older one: its pages-*.img replaced by <stem>.recipe files
    packs/<seg>/<N>-<rnd>.pack   the 4 KiB pages first stored when epoch N was converted
    packs/<seg>/<N>-<rnd>.idx    their digests (formats: agent/storage/chain.py)

:func:`convert` cuts each pages-*.img of epoch N into pages, hashes them, and references the
pages the packs of N's segment (``(N-1) // full_every``) already hold, those that the job's
kept epochs reference; the rest go into one new pack.  An epoch reads only packs of its own
segment, so a corrupt page takes at most ``full_every`` epochs with it.  The order makes every
crash harmless: the pack and its index written, fsynced and renamed; the epoch rebuilt from the
packs and checked against the original checksums (a damaged older pack never turns a good
epoch into a bad one: the epoch then stays plain); the recipes written and fsynced; the new
manifest written to a temporary name, fsynced and renamed over the old one (the commit point);
then the plain images unlinked.  :func:`gc` removes what a crash or a prune left behind.

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
from typing import BinaryIO, Callable, Protocol

import msgspec

from revenant.agent.storage.chain import (BATCH, RECIPE_SUFFIX, Recipe, check_trusted, converted, is_manifest_tmp,
                                          manifest_tmp, page_hash, rebuild)
from revenant.agent.storage.packfile import (DIGEST, PAGE, FramedPack, idx_bytes, pack_path, read_idx,
                                             write_private)
from revenant.agent.storage.epochs import MANIFEST, CorruptEpoch, FileEntry, JobFiles, Manifest, RecipeEntry, link_predump
from revenant.agent.storage.fileio import fsync_path
from revenant.agent.storage import imagekeys
from revenant.agent.storage.imagekeys import Digest, Hasher
from revenant.agent.storage.manifest import EpochStore
from revenant.agent.storage.packusage import readable_manifests, usage
from revenant.agent.storage.private import PRIVATE_FILE, private_dir

log = logging.getLogger(__name__)

__all__ = ["STEPS", "ConvertResult", "convert", "converted", "gc", "materialize", "segment_of", "usage"]

# The points of a conversion a crash test stops at (convert's on_step), in order.
STEPS = ("pack", "packed", "recipes", "manifest", "committed", "unlinking")
_PAGES_RE = re.compile(r"^pages-[0-9]+\.img$")
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


def segment_of(n: int, full_every: int) -> int:
    return (n - 1) // max(1, full_every)


def _index(files: JobFiles, n: int, seg: int) -> tuple[list[str], dict[bytes, int]]:
    """The packs of segment ``seg`` that kept epochs reference, oldest first, and their pages by
    digest (as ``pack number << 32 | page``)."""
    refs: set[str] = set()
    for k in files.committed():
        try:
            m = files.read_manifest(k)
        except CorruptEpoch:
            continue
        if k != n and converted(m) and m.segment == seg:
            refs.update(m.packs)
    return index_of(files, sorted(refs, key=lambda r: (len(r), r)))  # "<seg>/<N>-<rnd>", oldest first


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


def _new_manifest(m: Manifest, seg: int, table: list[str], cuts: dict[str, tuple[list[int], int, str]],
                  token: str) -> tuple[Manifest, dict[str, Recipe]]:
    """The converted manifest (its recipe files, named with ``token`` so no two conversions share
    one, not yet in ``files``) and each image's recipe."""
    recipes: dict[str, Recipe] = {}
    entries: dict[str, RecipeEntry] = {}
    for name, (runs, size, crc) in cuts.items():
        used = sorted(set(runs[0::3]))
        renumber = {p: i for i, p in enumerate(used)}
        runs[0::3] = [renumber[p] for p in runs[0::3]]
        recipes[name] = Recipe(packs=[table[p] for p in used], runs=runs)
        entries[name] = RecipeEntry(size=size, checksum=crc,
                                    recipe=f"{Path(name).stem}-{token}{RECIPE_SUFFIX}")
    packs = sorted({ref for r in recipes.values() for ref in r.packs})
    files = {k: v for k, v in m.files.items() if k not in cuts}
    return msgspec.structs.replace(m, files=files, recipes=entries, packs=packs, segment=seg), recipes


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
            codec: str = "") -> ConvertResult:
    """Store epoch ``n``'s pages-*.img as recipes over its segment's packs (see the module's
    docstring for the order), its new pack compressed with ``codec`` (chain.CODECS; "": not).
    ``on_step`` is called at each of STEPS (crash tests)."""
    started = time.monotonic()
    step = on_step or (lambda _: None)
    try:
        m = files.read_manifest(n)
    except CorruptEpoch as exc:
        return _result(files, n, False, 0, started, note=str(exc))
    images = sorted(name for name in m.files if _PAGES_RE.match(name))
    if converted(m) or not images or m.checksum not in ("crc32", imagekeys.KEYED) or m.encryption:
        why = ("already converted" if converted(m) else "no pages to convert" if not images
               else "encrypted: kept whole" if m.encryption else "not CRC-32")
        return _result(files, n, False, 0, started, note=why)
    try:
        digest = files.digest_of(m)
    except CorruptEpoch as exc:
        return _result(files, n, False, 0, started, note=str(exc))
    seg = segment_of(n, full_every)
    table, index = _index(files, n, seg)
    d = pack_dir(files, seg)
    stem = f"{n}-{secrets.token_hex(4)}"
    ref = f"{seg}/{stem}"
    tmp_pack, tmp_idx = d / f".tmp-{stem}.pack", d / f".tmp-{stem}.idx"
    digests = bytearray()
    cuts: dict[str, tuple[list[int], int, str]] = {}
    try:
        with open(os.open(tmp_pack, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE), "wb") as raw:
            pack = FramedPack(raw, codec) if codec else raw
            for name in images:
                hasher = digest.new() if digest.keyed else None
                with open(files.epoch_dir(n) / name, "rb", buffering=0) as image:
                    runs, size, crc = cut(image, index, len(table), digests, pack, hasher)
                cuts[name] = (runs, size, hasher.hexdigest() if hasher is not None else f"{crc:08x}")
                entry = m.files[name]
                if cuts[name][1:] != (entry.size, entry.checksum):
                    return _result(files, n, False, 0, started, note=f"epoch {n}: {name} fails its checksum")
            if isinstance(pack, FramedPack):
                pack.finish()
            raw.flush()
            os.fsync(raw.fileno())
        if digests:
            write_private(tmp_idx, idx_bytes(digests, codec, pack.offsets if isinstance(pack, FramedPack) else ()))
            new_bytes = os.stat(tmp_pack).st_size + os.stat(tmp_idx).st_size
            step("pack")
            os.rename(tmp_idx, pack_path(files, ref, ".idx"))
            os.rename(tmp_pack, pack_path(files, ref))
            fsync_path(d, directory=True)
            step("packed")
    finally:
        for leftover in (tmp_pack, tmp_idx):
            leftover.unlink(missing_ok=True)
    new, recipes = _new_manifest(m, seg, table + [ref], cuts, stem.rsplit("-", 1)[1])
    try:
        check_trusted(files, new)
        for name, recipe in recipes.items():
            rebuild(files, new, name, recipe=recipe)
    except CorruptEpoch as exc:
        for suffix in (".pack", ".idx"):
            pack_path(files, ref, suffix).unlink(missing_ok=True)
        log.warning("job %s: epoch %d stays plain: %s", files.job, n, exc)
        return _result(files, n, False, 0, started, note=str(exc))
    new_pages = len(digests) // DIGEST
    added = _commit(files, n, new, recipes, step, digest) + (new_bytes if new_pages else 0)
    return _result(files, n, True, added, started, pages=sum(-(-r[1] // PAGE) for r in cuts.values()),
                   new_pages=new_pages)


def _commit(files: JobFiles, n: int, new: Manifest, recipes: dict[str, Recipe], step: Callable[[str], None],
            digest: Digest) -> int:
    """Recipes, then the new manifest over the old one, then the plain images go; the recipes' bytes."""
    d = files.epoch_dir(n)
    added = 0
    for name, recipe in recipes.items():
        data = msgspec.msgpack.encode(recipe)
        write_private(d / new.recipes[name].recipe, data)
        hasher = digest.new()
        hasher.update(data)
        new.files[new.recipes[name].recipe] = FileEntry(size=len(data), checksum=hasher.hexdigest())
        added += len(data)
    fsync_path(d, directory=True)
    step("recipes")
    tmp = manifest_tmp(d)
    write_private(tmp, files.manifest_bytes(new))  # signed, where the epoch was
    step("manifest")
    os.rename(tmp, d / MANIFEST)  # the commit point
    fsync_path(d, directory=True)
    step("committed")
    for name in recipes:
        (d / name).unlink(missing_ok=True)
        step("unlinking")
    fsync_path(d, directory=True)
    return added


def _result(files: JobFiles, n: int, done: bool, added: int, started: float, **kw) -> ConvertResult:
    storage, own = usage(files)
    return ConvertResult(epoch=n, converted=done, added_bytes=added, own_bytes=own.get(n, 0), storage_bytes=storage,
                         seconds=time.monotonic() - started, **kw)


# ------------------------------------------------------------------ restore


def materialize(files: JobFiles, m: Manifest, dest: Path) -> None:
    """Rebuild converted epoch ``m`` as plain images in ``dest`` (a private directory on the same
    storage, e.g. ``files.new_tmp(node)``): its other files hardlinked, every image streamed from
    the packs with its size and CRC-32 checked (CorruptEpoch names the pack and page at fault).
    A plain epoch (``not converted(m)``) needs none of this: restore from ``files.epoch_dir(n)``."""
    src = files.epoch_dir(m.epoch)
    check_trusted(files, m)
    private_dir(dest)
    skip = {r.recipe for r in m.recipes.values()}
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
    for name in m.recipes:
        fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, PRIVATE_FILE)
        with open(fd, "wb", buffering=BATCH * PAGE) as out:
            rebuild(files, m, name, out)


# ------------------------------------------------------------------ collection, accounting


def _unlink(path: Path) -> int:
    try:
        size = os.lstat(path).st_size
        path.unlink()
        return size
    except FileNotFoundError:
        return 0


def gc(files: JobFiles) -> int:
    """Delete the packs no committed epoch's manifest lists (none at all while a manifest is
    unreadable), recipes and plain images an epoch's manifest does not list, and what an
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
                _PAGES_RE.match(e.name) or e.name.endswith(RECIPE_SUFFIX) or is_manifest_tmp(e.name))]
        freed += sum(_unlink(d / name) for name in doomed)
    referenced = {ref for m in manifests.values() for ref in (*m.packs, *m.workdir_packs)}
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
