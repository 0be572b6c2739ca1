"""Packs and recipes of converted epochs: their formats, rebuilding an image from them, and
verifying it (agent/storage/packs.py converts and collects; agent/storage/epochs.py's verify calls in here).

A pack (``packs/<segment>/<N>-<rnd>.pack``) is a run of 4 KiB pages; its index (``.idx``) holds
the digest of each page (SHA-256 cut to 128 bits), in order, then the CRC-32 of those digests.  A recipe
(``<image stem>.recipe`` in the epoch's directory, msgpack) rebuilds one image: a table of the
packs it reads and runs of (pack, first page, page count) in image order.  A content recipe
(``pages-<id>.img.digests``: agent/storage/contents.py) is resolved into such a recipe when it is
read, its table naming newer epochs' plain images ("@<N>/pages-<id>.img") as well as packs.  The
manifest records the original image's size and digest: a rebuilt image is right if and only if
both match, and when they do not, the page digests (a pack's index, an image's digest list) name
the culprit.

A pack may be compressed (``pack_compression``): its pages in frames (agent/storage/packfile.py).

The digest, per 4 KiB page in this Python, best of 7 here: SHA-256 910 MB/s (the CPU's SHA
instructions), sha1 890, blake2b-128 480, md5 430.  md5 and sha1 have known collisions; of the two
that have none, SHA-256 is twice as fast (cut to 128 bits it is as strong as blake2b-128).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO, Iterator

import msgspec

from revenant.agent.storage.imagekeys import PLAIN, Digest, by_extent
# (CODECS, FRAME_PAGES, read_layout: the chain's names for its callers and tests.)
from revenant.agent.storage.packfile import (CODECS, DIGEST, FRAME_PAGES, PAGE, Layout, _frame,  # noqa: F401
                                             _unreadable, is_compressed, pack_path, page_hash, read_idx, read_layout)
from revenant.agent.storage import contents
from revenant.agent.storage.manifest import MANIFEST, CorruptEpoch, EpochStore, Manifest, WorkdirFile, read_workdir
from revenant.agent.storage.private import trusted

RECIPE_SUFFIX = ".recipe"
# Pages read or written at a time (8 MiB).
BATCH = 2048


class Recipe(msgspec.Struct, array_like=True):
    packs: list[str]
    # Flat (index into packs, first page, page count) triples, in the image's order.
    runs: list[int]


def read_recipe(files: EpochStore, m: Manifest, name: str, cache: dict | None = None) -> Recipe:
    """The recipe of image ``name`` of converted epoch ``m``, checked for consistency: a content
    recipe's resolved where its pages are now (:func:`content_recipe`)."""
    entry = m.recipes[name]
    if entry.recipe.endswith(contents.DIGESTS_SUFFIX):
        return content_recipe(files, m, name, cache)[1]
    try:
        recipe = msgspec.msgpack.decode((files.epoch_dir(m.epoch) / entry.recipe).read_bytes(), type=Recipe)
    except (OSError, msgspec.DecodeError) as exc:
        raise _unreadable(exc, f"epoch {m.epoch}: recipe of {name} is unreadable") from None
    if not set(recipe.packs) <= set(m.packs):
        raise CorruptEpoch(f"epoch {m.epoch}: recipe of {name} reads packs the epoch does not list")
    check_runs(recipe, entry.size, f"epoch {m.epoch}: recipe of {name}")
    return recipe


def content_recipe(files: EpochStore, m: Manifest, name: str, cache: dict | None = None) -> tuple[bytes, Recipe]:
    """Image ``name`` of converted epoch ``m`` as a content recipe (agent/storage/contents.py): its
    digest list (the epoch's digest of each page) and the recipe that reads those pages where they
    are now.  ``cache``: the listings and places found so far, for a caller that reads many while
    nothing changes (every epoch older than the same plain ones has the same places)."""
    what = f"epoch {m.epoch}: {name}"
    seg, digests = contents.read_digests(files.epoch_dir(m.epoch) / m.recipes[name].recipe, f"{what}'s digest list")
    if seg != m.segment or len(digests) // DIGEST != -(-m.recipes[name].size // PAGE):
        raise CorruptEpoch(f"{what}'s digest list does not describe it")
    cache = cache if cache is not None else {}
    if (plain := cache.get(("plain", m.epoch))) is None:
        if "committed" not in cache:
            cache["committed"] = files.committed()
        plain = cache[("plain", m.epoch)] = contents.plain_places(files, m.epoch, cache["committed"])
    if (places := cache.get((seg, plain))) is None:
        places = cache[(seg, plain)] = contents.Places(files, seg, plain)
    refs, runs = contents.resolve_runs(digests, places, what)
    return digests, Recipe(packs=refs, runs=runs)


def runs_of(recipe: Recipe) -> Iterator[tuple[str, int, int]]:
    r = recipe.runs
    for i in range(0, len(r), 3):
        yield recipe.packs[r[i]], r[i + 1], r[i + 2]


class PageReader:
    """Pages of packs and plain images (refs, as recipes name them) read by number: each file
    opened once (an open one stays readable whatever retention deletes meanwhile), a compressed
    pack's last frame kept (runs mostly go on in it).  Close it when done."""

    def __init__(self, files: EpochStore) -> None:
        self.files = files
        self._fds: dict[str, int] = {}
        self._layouts: dict[str, Layout] = {}
        self._frame: tuple[str, int, bytes] = ("", -1, b"")

    def open(self, ref: str) -> int:
        if ref not in self._fds:
            try:
                fd = os.open(pack_path(self.files, ref), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as exc:
                raise _unreadable(exc, f"pack {ref} is unreadable") from None
            self._fds[ref] = fd
            self._layouts[ref] = read_layout(self.files, ref) if is_compressed(self.files, ref) else Layout(b"")
        return self._fds[ref]

    def read(self, ref: str, page: int, count: int) -> bytes:
        """Pages ``page``.. of ``ref``: ``count`` of them, or fewer (at most a batch, or to the end
        of a compressed frame), never none; CorruptEpoch if the file is short."""
        fd = self.open(ref)
        layout = self._layouts[ref]
        if not layout.codec:
            want = min(BATCH, count)
            data = os.pread(fd, want * PAGE, page * PAGE)
            if ref.startswith("@") and len(data) < want * PAGE:  # an image's last page, as packs pad it
                data += bytes(want * PAGE - len(data))
        else:
            no, at = divmod(page, FRAME_PAGES)
            want = min(FRAME_PAGES - at, count)
            if self._frame[:2] != (ref, no):
                self._frame = (ref, no, _frame(fd, layout, no, ref))
            data = self._frame[2][at * PAGE:(at + want) * PAGE]
        if len(data) != want * PAGE:
            raise CorruptEpoch(f"pack {ref} is short: page {page + len(data) // PAGE} is missing")
        return data

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def _pages(files: EpochStore, recipe: Recipe) -> Iterator[tuple[str, int, bytes]]:
    """(pack, first page, data) for every batch of pages the recipe reads, in image order."""
    reader = PageReader(files)
    try:
        for ref, first, count in runs_of(recipe):
            page, end = first, first + count
            while page < end:
                data = reader.read(ref, page, end - page)
                yield ref, page, data
                page += len(data) // PAGE
    finally:
        reader.close()


def _culprit(files: EpochStore, recipe: Recipe) -> str:
    """Which page of which pack no longer matches its digest ("" if every one does)."""
    digests: dict[str, bytes] = {}
    try:
        for ref, first, data in _pages(files, recipe):
            if ref not in digests:  # a pack's index, or an image's digest list
                digests[ref] = read_idx(files, ref) if not ref.startswith("@") else contents.read_digests(
                    contents.digests_path(files, ref), f"the digest list of {ref}")[1]
            idx = digests[ref]
            for i in range(0, len(data), PAGE):
                page = first + i // PAGE
                if page_hash(data[i:i + PAGE]) != idx[page * DIGEST:(page + 1) * DIGEST]:
                    return f"page {page} of {'image' if ref.startswith('@') else 'pack'} {ref} is corrupt"
    except CorruptEpoch as exc:
        return str(exc)
    return ""


def rebuild(files: EpochStore, m: Manifest, name: str, out: BinaryIO | None = None,
            recipe: Recipe | None = None) -> None:
    """Stream image ``name`` of converted epoch ``m`` from its packs (into ``out``, if given),
    checking the size and CRC-32 the original had; CorruptEpoch names the pack and page at fault."""
    entry = m.recipes[name]
    recipe = recipe if recipe is not None else read_recipe(files, m, name)
    stream(files, recipe, entry.size, entry.checksum, f"epoch {m.epoch}: {name}", out, files.digest_of(m),
           by_extent(m.files, name))


def stream(files: EpochStore, recipe: Recipe, size: int, checksum: str, what: str,
           out: BinaryIO | None = None, digest: Digest = PLAIN, extents: bool = False) -> None:
    """Stream the ``size`` bytes ``recipe`` rebuilds (into ``out``, if given), checking their
    CRC-32 (or ``digest``'s) against ``checksum``; CorruptEpoch (about ``what``) names the pack and page at fault."""
    hasher, left = digest.new(extents), size
    try:
        for _, _, data in _pages(files, recipe):
            if len(data) > left:  # the last page of an image whose size is not a multiple of 4 KiB
                data = data[:left]
            hasher.update(data)
            left -= len(data)
            if out is not None:
                out.write(data)
    except CorruptEpoch as exc:
        raise CorruptEpoch(f"{what}: {exc}") from None
    if left or hasher.hexdigest() != checksum:
        why = _culprit(files, recipe) or "its pages match their digests, the whole does not"
        raise CorruptEpoch(f"{what} rebuilt from its packs fails its checksum: {why}")


def check_runs(recipe: Recipe, size: int, what: str) -> None:
    """``recipe`` rebuilds ``size`` bytes from its own table of packs (else CorruptEpoch)."""
    runs = recipe.runs
    if (len(runs) % 3 or sum(runs[2::3]) != -(-size // PAGE) or min(runs, default=0) < 0
            or any(not 0 <= p < len(recipe.packs) for p in runs[0::3])):
        raise CorruptEpoch(f"{what} does not describe a {size}-byte file from its packs")


def workdir_recipe(m: Manifest, rec: WorkdirFile, what: str) -> Recipe:
    """The recipe of packed working-directory file ``rec`` of epoch ``m`` (agent/files/workdir_packs.py)."""
    recipe = Recipe(packs=m.workdir_packs, runs=rec.runs or [])
    check_runs(recipe, rec.size, what)
    return recipe


def verify_workdir(files: EpochStore, m: Manifest, epoch_dir: Path) -> None:
    """Every page of epoch ``m``'s packed working-directory files, read and checked against
    each file's CRC-32 (its snapshot, workdir-files.json, was checked with the epoch's files)."""
    check_trusted(files, m, sorted({ref.partition("/")[0] for ref in m.workdir_packs}))
    seen: set[str] = set()
    for rel, rec in sorted((read_workdir(epoch_dir) or {}).items()):
        if rec.runs is None or rec.copy in seen:
            continue
        seen.add(rec.copy)
        what = f"epoch {m.epoch}: the working directory's {rel}"
        stream(files, workdir_recipe(m, rec, what), rec.size, rec.crc, what)


def check_trusted(files: EpochStore, m: Manifest, segments: list[str] | None = None) -> None:
    """Pages are never read from a directory the job's user could have put there: the packs'
    and each segment's (``segments``; None: the converted epoch's own)."""
    for d in (files.packs_dir, *(files.packs_dir / seg for seg in (segments or [str(m.segment)]))):
        if not trusted(d):
            raise CorruptEpoch(f"epoch {m.epoch}: {d} is not the agent's own directory; its packs are not used")


def verify_recipes(files: EpochStore, m: Manifest) -> None:
    """Every page converted epoch ``m`` needs, read and checked (its recipes were checked by
    EpochStore.verify with the epoch's other files)."""
    check_trusted(files, m)
    for name in m.recipes:
        rebuild(files, m, name)


def read_from(files: EpochStore, kept: list[int]) -> set[int]:
    """The epochs whose plain images epochs ``kept`` read pages from (content recipes); an epoch
    whose recipes cannot be resolved reads from none (it is corrupt already)."""
    found: set[int] = set()
    cache: dict = {}
    for n in kept:
        try:
            m = files.read_manifest(n)
        except CorruptEpoch:
            continue
        for name, entry in m.recipes.items():
            if entry.recipe.endswith(contents.DIGESTS_SUFFIX):
                try:
                    found.update(int(r[1:].split("/")[0]) for r in read_recipe(files, m, name, cache).packs
                                 if r[0] == "@")
                except (CorruptEpoch, OSError):
                    continue
    return found


def converted(m: Manifest) -> bool:
    """Whether epoch ``m`` is stored as recipes (materialize it before a restore) or plain."""
    return bool(m.recipes)


def manifest_tmp(directory: Path) -> Path:
    """A new manifest's temporary name: unique, so that no two writers ever share one."""
    return directory / f".{MANIFEST}.{secrets.token_hex(4)}.tmp"


def is_manifest_tmp(name: str) -> bool:
    return name.startswith(f".{MANIFEST}.") and name.endswith(".tmp")


