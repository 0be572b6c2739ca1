"""What a job's epochs cost: the job's storage, and each kept epoch's own bytes (what deleting
it alone would free), from manifests, recipes and file sizes, never page data (agent/storage/packs.py
stores the pages)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from revenant.agent.storage.chain import (DIGEST, PAGE, Recipe, is_compressed, pack_path, read_layout, read_recipe, runs_of,
                                          workdir_recipe)
from revenant.agent.storage.contents import PAGES_RE, digests_name
from revenant.agent.storage.epochs import FILES_DIR, MANIFEST, CorruptEpoch, JobFiles, Manifest
from revenant.agent.storage.manifest import read_workdir


def readable_manifests(files: JobFiles) -> tuple[dict[int, Manifest], bool]:
    """The readable manifests of the committed epochs; whether every one was."""
    out: dict[int, Manifest] = {}
    complete = True
    for n in files.committed():
        try:
            out[n] = files.read_manifest(n)
        except CorruptEpoch:
            complete = False
    return out, complete


def _own_pages(intervals: list[tuple[int, int, int]]) -> dict[int, int]:
    """Per epoch, the pages of one pack that only it references; ``intervals``: (first, end, epoch)."""
    merged: list[tuple[int, int, int]] = []
    for first, end, n in sorted(intervals, key=lambda iv: (iv[2], iv[0])):
        if merged and merged[-1][2] == n and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]), n)
        else:
            merged.append((first, end, n))
    events = sorted([(f, 1, n) for f, _, n in merged] + [(e, -1, n) for _, e, n in merged])
    own: dict[int, int] = {}
    count = total = last = 0
    for pos, delta, n in events:
        if count == 1:  # exactly one epoch covered [last, pos): total is its number
            own[total] = own.get(total, 0) + pos - last
        count += delta
        total += delta * n
        last = pos
    return own


def usage(files: JobFiles) -> tuple[int, dict[int, int]]:
    """(the job's storage, {epoch: bytes only it holds}): :func:`usage_detail`'s first two."""
    storage, own, _ = usage_detail(files)
    return storage, own


def usage_detail(files: JobFiles) -> tuple[int, dict[int, int], dict[int, list[int]]]:
    """(the job's storage, {epoch: bytes only it holds}, {epoch: [plain, packed, newer] bytes of
    its images' pages: where they are}), from manifests, recipes and file sizes, never page data:
    the kept epochs' files and the packs they reference, a shared page once; an epoch's own bytes
    are its files and the pages (with their digests) no other kept epoch reads."""
    manifests, _ = readable_manifests(files)
    own: dict[int, int] = {}
    where: dict[int, list[int]] = {}
    cache: dict = {}
    intervals: dict[str, list[tuple[int, int, int]]] = {}
    for n, m in manifests.items():
        try:
            own[n] = sum(f.size for f in m.files.values()) + os.stat(files.epoch_dir(n) / MANIFEST).st_size
        except OSError:
            own[n] = sum(f.size for f in m.files.values())
        plain = [f.size for name, f in m.files.items() if PAGES_RE.match(name)]
        where[n] = [sum(plain), 0, 0]
        if not m.recipes:  # a plain epoch's digest lists (agent/storage/contents.py): not in its manifest
            own[n] += sum(_size(files.epoch_dir(n) / digests_name(name)) for name in m.files if PAGES_RE.match(name))
        for image, recipe in _recipes(files, m, cache):
            for ref, first, count in runs_of(recipe):
                if image:
                    where[n][2 if ref.startswith("@") else 1] += count * PAGE
                if not ref.startswith("@"):  # a newer epoch's plain image: that epoch's own files
                    intervals.setdefault(ref, []).append((first, first + count, n))
    storage = sum(own.values())
    for ref in {ref for m in manifests.values() for ref in (*m.packs, *m.workdir_packs)}:
        for suffix in (".pack", ".idx"):
            try:
                storage += os.stat(pack_path(files, ref, suffix)).st_size
            except (OSError, CorruptEpoch):
                pass
    for ref, ivs in intervals.items():
        per_page = _page_bytes(files, ref)
        for n, pages in _own_pages(ivs).items():
            own[n] += round(pages * (per_page + DIGEST))
    return storage - _shared_copies(files, manifests, own), own, where


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _page_bytes(files: JobFiles, ref: str) -> float:
    """What a page of pack ``ref`` takes on the storage: 4 KiB, or a compressed pack's average."""
    try:
        if not is_compressed(files, ref):
            return PAGE
        layout = read_layout(files, ref)
        if layout.codec and layout.digests:
            return os.stat(pack_path(files, ref)).st_size / (len(layout.digests) // DIGEST)
    except (OSError, CorruptEpoch):
        pass
    return PAGE


def _recipes(files: JobFiles, m: Manifest, cache: dict) -> Iterator[tuple[bool, Recipe]]:
    """Every recipe epoch ``m`` reads pages by (whether it is an image's): its images', its working
    directory's packed files' (one per copy); those that cannot be read are left out."""
    for name in m.recipes:
        try:
            yield True, read_recipe(files, m, name, cache)
        except CorruptEpoch:
            continue
    if not m.workdir_packs:
        return
    try:
        snapshot = read_workdir(files.epoch_dir(m.epoch)) or {}
    except CorruptEpoch:
        return
    seen: set[str] = set()
    for rec in snapshot.values():
        if rec.runs is not None and rec.copy not in seen:
            seen.add(rec.copy)
            try:
                yield False, workdir_recipe(m, rec, rec.copy)
            except CorruptEpoch:
                continue


def _shared_copies(files: JobFiles, manifests: dict[int, Manifest], own: dict[int, int]) -> int:
    """Working-directory copies linked from one epoch into the next (agent/files/workdir.py): taken out
    of each sharing epoch's own bytes; the bytes counted more than once in the storage."""
    holders: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for n, m in manifests.items():
        if not m.workdir_files:
            continue
        for name, f in m.files.items():
            if name.startswith(f"{FILES_DIR}/w"):
                try:
                    st = os.stat(files.epoch_dir(n) / name)
                except OSError:
                    continue
                holders.setdefault((st.st_dev, st.st_ino), []).append((n, f.size))
    extra = 0
    for held in holders.values():
        if len(held) > 1:
            extra += held[0][1] * (len(held) - 1)
            for n, size in held:
                own[n] -= size
    return extra

