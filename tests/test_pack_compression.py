"""Compressed packs (``pack_compression``, agent/storage/chain.py FramedPack): an incremental job's
older epochs' pages in frames of 64 pages, each compressed alone (zstd or lz4) or kept as it is
where that is no smaller; rebuilt byte-exact, deduplicated against uncompressed packs of the same
segment, a damaged frame or index named, and each epoch's own bytes what its pages take."""

from __future__ import annotations

import random

import pytest

from revenant.agent.storage import chain, packs
from revenant.agent.storage.epochs import CorruptEpoch, JobFiles
from test_packs import PAGE, commit, epoch, flip, rebuilt

pytestmark = pytest.mark.unit


def compressible(rnd: random.Random, count: int) -> list[bytes]:
    """Pages like a numeric job's: half of each page zeros, the rest random (compresses about 2:1)."""
    return [bytes(PAGE // 2) + rnd.randbytes(PAGE // 2) for _ in range(count)]


@pytest.mark.parametrize("codec", chain.CODECS)
def test_a_compressed_pack_rebuilds_exactly_and_takes_what_its_pages_compress_to(tmp_path, codec):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(5)
    body = compressible(rnd, 300)  # 4 full frames and a partial one
    images, other = {}, rnd.randbytes(10 * PAGE + 100)  # a second image, its last page partial
    for _ in range(3):
        images[commit(files, epoch(body, {"pages-2.img": other})).epoch] = None
        for i in rnd.sample(range(len(body)), 10):
            body[i] = bytes(PAGE // 2) + rnd.randbytes(PAGE // 2)
    want = {n: rebuilt(files, n, tmp_path) for n in images}
    first = packs.convert(files, 1, 10, codec=codec)
    second = packs.convert(files, 2, 10, codec=codec)
    assert first.converted and second.converted and second.new_pages == 10
    ref = files.read_manifest(1).packs[0]
    layout = chain.read_layout(files, ref)
    assert layout.codec == codec and len(layout.offsets) == -(-first.new_pages // chain.FRAME_PAGES) + 1
    stored = chain.pack_path(files, ref).stat().st_size
    assert stored == layout.offsets[-1] and stored < 0.6 * first.new_pages * PAGE  # half of each page was zeros
    for n in images:
        assert rebuilt(files, n, tmp_path) == want[n]  # byte-exact, through the frames
    # The epoch's own bytes: what its pages take in the pack, not 4 KiB each.
    storage, own = packs.usage(files)
    assert own[1] < 0.7 * (first.new_pages * (PAGE + chain.DIGEST))
    assert storage < sum(len(b) for b in want[3].values()) * 2


def test_random_pages_are_kept_as_they_are_and_mixed_packs_dedup(tmp_path):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(6)
    body = [rnd.randbytes(PAGE) for _ in range(130)]
    for _ in range(3):
        commit(files, epoch(body))
        body[rnd.randrange(len(body))] = rnd.randbytes(PAGE)
    want = {n: rebuilt(files, n, tmp_path) for n in (1, 2, 3)}
    packs.convert(files, 1, 10)  # an uncompressed pack (a job whose setting changed, or from before)
    second = packs.convert(files, 2, 10, codec="zstd")
    assert second.new_pages == 1  # the rest found in the uncompressed pack
    ref = next(r for r in files.read_manifest(2).packs if r.split("/")[1].startswith("2-"))
    layout = chain.read_layout(files, ref)
    assert layout.codec == "zstd" and layout.offsets == (0, PAGE)  # random: kept as it is
    assert chain.read_layout(files, files.read_manifest(1).packs[0]).codec == ""
    for n in (1, 2, 3):
        assert rebuilt(files, n, tmp_path) == want[n]


@pytest.mark.parametrize("codec", chain.CODECS)
def test_a_damaged_frame_or_index_is_named_and_the_restore_falls_back(tmp_path, codec):
    files, rnd = JobFiles(tmp_path, "7"), random.Random(7)
    for _ in range(3):  # nothing in common: epoch 1's pages all go into its pack (4 frames)
        commit(files, epoch(compressible(rnd, 200)))
    packs.convert(files, 1, 10, codec=codec)
    packs.convert(files, 2, 10, codec=codec)
    ref = files.read_manifest(1).packs[0]
    layout = chain.read_layout(files, ref)
    flip(chain.pack_path(files, ref), layout.offsets[1] + 50)  # inside frame 1
    with pytest.raises(CorruptEpoch, match=rf"epoch 1: pages-1.img.*pack {ref}"):
        files.verify(1)
    m, notes = files.newest_verified()
    assert m.epoch == 3
    flip(chain.pack_path(files, ref), layout.offsets[1] + 50)  # mended
    assert files.verify(1).epoch == 1
    flip(chain.pack_path(files, ref, ".idx"), 20)  # the header's frame table: caught by the index's CRC
    with pytest.raises(CorruptEpoch, match=f"index of pack {ref} fails its checksum"):
        chain.read_layout(files, ref)
