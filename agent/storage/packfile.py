"""A pack's own files: where a pack (or an epoch's plain image a recipe reads) is, its index, and
its frames when compressed.  The formats are chain.py's docstring's; this is the layer below it.

A pack may be compressed (``pack_compression``: zstd or lz4; packs.py writes it): its pages then go
in frames of FRAME_PAGES pages, each compressed alone (or stored as it is where that is no smaller:
random bytes), and its index starts with a header (magic, the codec, the frames' offsets in the
pack) that the CRC-32 covers too.  A recipe still names pages by number; a read decompresses the
frames its runs cover.  An index without the header is an uncompressed pack's.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import struct
import zlib
from pathlib import Path
from typing import BinaryIO, NamedTuple, Sequence

from revenant.agent.storage.manifest import CorruptEpoch, EpochStore
from revenant.agent.storage.private import PRIVATE_FILE

PAGE = 4096
DIGEST = 16
# "<segment>/<N>-<rnd>": a pack as a recipe and a manifest name it.
_REF_RE = re.compile(r"^([0-9]{1,9})/([0-9]{1,9}-[0-9a-f]{8})$")
# "@<N>/pages-<id>.img": epoch N's plain image, as a content recipe's resolution names it.
_IMAGE_REF_RE = re.compile(r"^@([0-9]{1,9})/(pages-[0-9]+\.img)$")
_CRC = struct.Struct(">I")
# A compressed pack's index header: magic, codec (8 bytes, NUL-padded), frames, then frames + 1 offsets.
CODECS = ("zstd", "lz4")
FRAME_PAGES = 64
_IDX2 = b"rvnidx2\0"
_HEAD = struct.Struct(">8s8sI")


def pack_path(files: EpochStore, ref: str, suffix: str = ".pack") -> Path:
    """Where pack ``ref`` is (its index: ``suffix`` ".idx"); or, for "@<N>/pages-<id>.img", that
    plain image of epoch N, whose pages a content recipe reads (agent/storage/contents.py)."""
    if ref.startswith("@"):
        image = _IMAGE_REF_RE.match(ref)
        if image is None or suffix != ".pack":
            raise CorruptEpoch(f"job {files.job}: {ref!r} is not an image a recipe may read")
        return files.epoch_dir(int(image.group(1))) / image.group(2)
    m = _REF_RE.match(ref)
    if m is None:
        raise CorruptEpoch(f"job {files.job}: {ref!r} is not a pack name")
    return files.packs_dir / m.group(1) / f"{m.group(2)}{suffix}"


def page_hash(page: bytes | memoryview) -> bytes:
    return hashlib.sha256(page).digest()[:DIGEST]


def image_ref(n: int, image: str) -> str:
    return f"@{n}/{image}"


def write_private(path: Path, data: bytes) -> None:
    """``data`` as a private (0600) file at ``path``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, PRIVATE_FILE)
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(fd)


class Layout(NamedTuple):
    """A pack's index: its pages' digests; for a compressed pack its codec and frames' offsets."""

    digests: bytes
    codec: str = ""
    offsets: tuple[int, ...] = ()


def idx_bytes(digests: bytes | bytearray, codec: str = "", offsets: Sequence[int] = ()) -> bytes:
    head = b"" if not codec else (_HEAD.pack(_IDX2, codec.encode(), len(offsets) - 1)
                                  + struct.pack(f">{len(offsets)}Q", *offsets))
    body = head + bytes(digests)
    return body + _CRC.pack(zlib.crc32(body))


def read_idx(files: EpochStore, ref: str) -> bytes:
    """The page digests of pack ``ref`` (CorruptEpoch if its index is missing or damaged)."""
    return read_layout(files, ref).digests


def read_layout(files: EpochStore, ref: str) -> Layout:
    """Pack ``ref``'s index (CorruptEpoch if it is missing or damaged)."""
    path = pack_path(files, ref, ".idx")
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            data = f.read()
    except OSError as exc:
        raise _unreadable(exc, f"index of pack {ref} is unreadable") from None
    body, tail = data[:-_CRC.size], data[-_CRC.size:]
    if len(data) < _CRC.size or _CRC.pack(zlib.crc32(body)) != tail:
        raise CorruptEpoch(f"index of pack {ref} fails its checksum")
    codec, offsets = "", ()
    if body.startswith(_IDX2) and len(body) >= _HEAD.size:
        _, raw, frames = _HEAD.unpack_from(body)
        codec, end = raw.rstrip(b"\0").decode(errors="replace"), _HEAD.size + 8 * (frames + 1)
        if codec not in CODECS or len(body) < end:
            raise CorruptEpoch(f"index of pack {ref} names an unknown codec {codec!r}")
        offsets, body = struct.unpack_from(f">{frames + 1}Q", body, _HEAD.size), body[end:]
    if len(body) % DIGEST or (codec and -(-len(body) // DIGEST // FRAME_PAGES) != len(offsets) - 1):
        raise CorruptEpoch(f"index of pack {ref} fails its checksum")
    return Layout(body, codec, offsets)


def compress(codec: str, data: bytes | memoryview) -> bytes:
    if codec == "zstd":
        import zstandard
        return zstandard.ZstdCompressor(level=1).compress(data)
    import lz4.block
    return lz4.block.compress(data, store_size=False)


def _decompress(codec: str, data: bytes, size: int) -> bytes:
    if len(data) == size:  # stored as it was: it did not compress
        return data
    if codec == "zstd":
        import zstandard
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    import lz4.block
    return lz4.block.decompress(data, uncompressed_size=size)


class FramedPack:
    """Writes a compressed pack: pages in, frames of FRAME_PAGES out (each compressed alone, or
    kept as it is where that is no smaller); ``offsets`` for its index once ``finish`` ran."""

    def __init__(self, out: BinaryIO, codec: str) -> None:
        self.out, self.codec = out, codec
        self.offsets = [0]
        self._buf = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data
        frame = FRAME_PAGES * PAGE
        while len(self._buf) >= frame:
            self._frame(bytes(self._buf[:frame]))
            del self._buf[:frame]

    def finish(self) -> None:
        if self._buf:
            self._frame(bytes(self._buf))
            self._buf.clear()

    def _frame(self, raw: bytes) -> None:
        packed = compress(self.codec, raw)
        out = packed if len(packed) < len(raw) else raw
        self.out.write(out)
        self.offsets.append(self.offsets[-1] + len(out))


def is_compressed(files: EpochStore, ref: str) -> bool:
    """Whether pack ``ref``'s index has the compressed header (its first bytes only); a plain image is not."""
    if ref.startswith("@"):
        return False
    try:
        with open(os.open(pack_path(files, ref, ".idx"), os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            return f.read(len(_IDX2)) == _IDX2
    except OSError as exc:
        raise _unreadable(exc, f"index of pack {ref} is unreadable") from None


def _frame(fd: int, layout: Layout, no: int, ref: str) -> bytes:
    """Frame ``no`` of a compressed pack, decompressed (CorruptEpoch if it cannot be)."""
    if no + 1 >= len(layout.offsets):
        raise CorruptEpoch(f"pack {ref} is short: frame {no} is missing")
    start, end = layout.offsets[no], layout.offsets[no + 1]
    size = min(FRAME_PAGES, len(layout.digests) // DIGEST - no * FRAME_PAGES) * PAGE
    data = os.pread(fd, end - start, start)
    try:
        return _decompress(layout.codec, data, size) if len(data) == end - start else b""
    except Exception as exc:  # zstandard.ZstdError, lz4's LZ4BlockError: a damaged frame
        raise CorruptEpoch(f"pack {ref}: frame {no} does not decompress: {exc}") from None


def _unreadable(exc: Exception, what: str) -> Exception:
    """A file that is missing, a link or undecodable makes the epoch corrupt; any other error
    (EIO, ESTALE, EMFILE) proves nothing about it and is raised as it is (retention then deletes
    nothing on its account)."""
    if isinstance(exc, OSError) and exc.errno not in (errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR):
        return exc
    return CorruptEpoch(f"{what}: {exc}")
