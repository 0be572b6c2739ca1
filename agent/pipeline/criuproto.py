"""criu's image format, read without criu: a protobuf reader small enough to trust.

A criu image is two 32-bit magics, then its entries, each a 32-bit size (host order) and a
protobuf message (criu's images/*.proto; some images follow an entry with raw data, which the
caller skips).  agent/network/criuimages.py reads a dump's sockets with it and
agent/lazyrestore/deltaserve.py its pagemaps.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

HEADER = 8  # the two magics


def varint(buf: bytes, i: int) -> tuple[int, int]:
    """The base-128 varint at ``buf[i]`` and the index after it; raises IndexError if cut."""
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def fields(msg: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field of a protobuf message: an int for a varint or fixed
    field, the bytes of a length-delimited one; raises IndexError or ValueError if malformed."""
    i = 0
    while i < len(msg):
        key, i = varint(msg, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(msg, i)
            yield number, value
        elif wire == 2:
            size, i = varint(msg, i)
            if i + size > len(msg):
                raise IndexError("field runs past its message")
            yield number, msg[i:i + size]
            i += size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if i + width > len(msg):
                raise IndexError("field runs past its message")
            yield number, int.from_bytes(msg[i:i + width], "little")
            i += width
        else:
            raise ValueError(f"protobuf wire type {wire}")


def entries(data: bytes) -> Iterator[bytes]:
    """Each entry of an image that holds entries only (no raw data after them)."""
    i = HEADER
    while i + 4 <= len(data):
        (size,) = struct.unpack_from("=I", data, i)  # criu writes its sizes in host order
        if i + 4 + size > len(data):
            raise IndexError("the image's last entry is cut short")
        yield data[i + 4:i + 4 + size]
        i += 4 + size
